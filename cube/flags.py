"""gflags-style command lines, as the original's C++ tools take them.

Accepted forms: `-flag value`, `--flag value`, `-flag=value`, `--flag=value`; booleans also as a
bare `--flag`, `--noflag`, or with `true/false/1/0/yes/no`; `--flagfile FILE` reads one flag per
line (`--port=8000`, blank lines and `#` comments skipped), as the original's conf/gflags.conf.
Later flags override earlier ones, so command-line flags after `--flagfile` win.

One parser for every command of the project (builder, server, cli, agent, transfer).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


class FlagError(ValueError):
    """A bad command line; the message names the flag."""


def parse_bool(text: str, name: str = "value") -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise FlagError(f"--{name}: expected true or false, got {text!r}")


@dataclass
class Flag:
    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Sequence[str] | None = None
    aliases: Sequence[str] = ()

    @property
    def is_bool(self) -> bool:
        return self.type is bool


@dataclass
class FlagSet:
    """Declare flags, then `parse(argv)` into a namespace-like dict object."""

    program: str
    description: str = ""
    flags: dict[str, Flag] = field(default_factory=dict)
    _names: dict[str, str] = field(default_factory=dict)

    def add(
        self,
        name: str,
        type: Callable[[str], Any] = str,
        default: Any = None,
        help: str = "",
        choices: Sequence[str] | None = None,
        aliases: Sequence[str] = (),
    ) -> FlagSet:
        flag = Flag(name, type, default, help, choices, aliases)
        self.flags[name] = flag
        for alias in (name, *aliases):
            self._names[alias] = name
        return self

    def usage(self) -> str:
        lines = [f"usage: {self.program} [--flag value ...]", self.description, "", "flags:"]
        for flag in self.flags.values():
            names = ", ".join(
                f"-{n}" if len(n) == 1 else f"--{n}" for n in (flag.name, *flag.aliases)
            )
            choice = f" ({'|'.join(flag.choices)})" if flag.choices else ""
            lines.append(f"  {names}{choice}  {flag.help} [default: {flag.default}]")
        lines.append("  --flagfile FILE  read flags from FILE, one per line")
        return "\n".join(lines)

    def parse(self, argv: Sequence[str]) -> Flags:
        values = {name: flag.default for name, flag in self.flags.items()}
        positional: list[str] = []
        self._parse_into(list(argv), values, positional, depth=0)
        if positional:
            raise FlagError(f"unexpected argument {positional[0]!r} (flags look like --name value)")
        return Flags(values)

    def _parse_into(
        self, args: list[str], values: dict[str, Any], positional: list[str], depth: int
    ) -> None:
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if arg in ("-h", "--help", "-help"):
                print(self.usage())
                raise SystemExit(0)
            if not arg.startswith("-") or arg == "-":
                positional.append(arg)
                continue
            body = arg.lstrip("-")
            name, has_value, text = body.partition("=")
            if name == "flagfile":
                if not has_value:
                    if i >= len(args):
                        raise FlagError("--flagfile needs a file name")
                    text = args[i]
                    i += 1
                if depth > 8:
                    raise FlagError(f"--flagfile {text}: nested too deeply")
                self._parse_into(_read_flagfile(text), values, positional, depth + 1)
                continue
            key = self._names.get(name)
            negated = False
            if key is None and name.startswith("no") and self._names.get(name[2:]):
                key, negated = self._names[name[2:]], True
            if key is None:
                raise FlagError(f"unknown flag {arg!r}; see --help")
            flag = self.flags[key]
            if flag.is_bool:
                if negated:
                    values[key] = False
                elif has_value:
                    values[key] = parse_bool(text, key)
                elif i < len(args) and args[i].lower() in _TRUE | _FALSE:
                    values[key] = parse_bool(args[i], key)
                    i += 1
                else:
                    values[key] = True
                continue
            if not has_value:
                if i >= len(args):
                    raise FlagError(f"--{key} needs a value")
                text = args[i]
                i += 1
            values[key] = self._convert(flag, text)

    def _convert(self, flag: Flag, text: str) -> Any:
        if flag.choices is not None and text not in flag.choices:
            raise FlagError(f"--{flag.name}: {text!r} is not one of {', '.join(flag.choices)}")
        try:
            return flag.type(text)
        except (TypeError, ValueError) as exc:
            raise FlagError(f"--{flag.name}: bad value {text!r}: {exc}") from exc


def _read_flagfile(path: str) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise FlagError(f"--flagfile {path}: {exc.strerror}") from exc
    args = []
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            args.append(line)
    return args


class Flags(dict[str, Any]):
    """Parsed flag values; attribute access for convenience (`flags.port`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def run_cli(main: Callable[[Sequence[str]], int], argv: Sequence[str] | None = None) -> int:
    """Run a CLI body: FlagError and other user errors print one line to stderr, exit 2."""
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except FlagError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
