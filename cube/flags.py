"""gflags-style command lines, as the original's C++ tools take them.

Accepted forms: `-flag value`, `--flag value`, `-flag=value`, `--flag=value`; booleans also as a
bare `--flag`, `--noflag`, or with `true/false/1/0/yes/no`; `--flagfile FILE` reads one flag per
line (`--port=8000`, blank lines and `#` comments skipped), as the original's conf/gflags.conf.
Later flags override earlier ones, so command-line flags after `--flagfile` win.

One parser for every command of the project (builder, server, cli, agent, transfer, kvtool,
cube-local's subcommands): flags marked `required`, positional arguments declared with
`positional`, an unknown flag answered with the closest known one ("did you mean"), and a
`CommandSet` for tools with subcommands.

Typed: a command declares its flags as a frozen dataclass whose fields are `flag(default,
help, ...)` (the annotation gives the parser: int, float, str, bool, Path, or `parse=`), and
`FlagSet(program, description, spec=ServerFlags).parse(argv)` returns a `ServerFlags`. The
untyped `FlagSet(program).add(...)` (parse returns `Flags`, a dict) stays for small scripts.
Every FlagSet answers `--help` and `--version` (a command with a `version` flag of its own,
cube-import and `cube-local wait`, prints the package version only for a bare `--version` last).

Migration aids: `ignore(...)` declares flags of the original's runtime (brpc, glog) that mean
nothing here; they are accepted and ignored with a warning on stderr instead of refused, so an
original command line or conf/gflags.conf still starts. `default_flagfile` is read first when
it exists (cube-server's `conf/gflags.conf`, which the original always reads); flags given on
the command line win over it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Generic, TypeVar, cast, overload

T = TypeVar("T")
V = TypeVar("V")

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}
_HELP = ("-h", "--help", "-help")
_VERSION = ("--version", "-version")


class FlagError(ValueError):
    """A bad command line; the message names the flag (and the flagfile line it came from)."""


class MissingFlagsError(FlagError):
    """Required flags not given: `missing` their names, `values` what the others parsed to
    (so a command can say more: kv_to_seqfile names the formats its --input fits)."""

    def __init__(self, message: str, missing: list[str], values: dict[str, Any]) -> None:
        super().__init__(message)
        self.missing = missing
        self.values = values


def parse_bool(text: str, name: str = "value") -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise FlagError(f"--{name}: expected true or false, got {text!r}")


def package_version() -> str:
    """The installed cube-py's version (what every command's --version prints)."""
    try:
        return metadata.version("cube-py")
    except metadata.PackageNotFoundError:  # run from a tree that was never installed
        return "unknown"


@dataclass
class Flag:
    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Sequence[str] | None = None
    aliases: Sequence[str] = ()
    required: bool = False
    metavar: str | None = None  # what the value is, as the usage shows it (default: by name)

    @property
    def is_bool(self) -> bool:
        return self.type is bool

    @property
    def called(self) -> str:
        """How an error names it: `--port`, or `-P/--port` when it has a short alias."""
        short = [f"-{a}" for a in self.aliases if len(a) == 1]
        return "/".join([*short, f"--{self.name}"])

    @property
    def spelled(self) -> str:
        """`--name, -a` as the usage shows it, with a placeholder for the value."""
        names = ", ".join(f"-{n}" if len(n) == 1 else f"--{n}" for n in (self.name, *self.aliases))
        if self.is_bool:
            return names
        if self.choices:
            return f"{names} {'|'.join(self.choices)}"
        return f"{names} {self.metavar or self._placeholder()}"

    def _placeholder(self) -> str:
        """What the value is, from the flag's name, else its type."""
        if self.type is str or self.type is Path:
            if self.name in _PATH_FLAGS or self.name.endswith(("_path", "_file")):
                return "PATH"
            if self.name.endswith("_dir"):
                return "DIR"
            if self.name == "host" or self.name.endswith("_host"):
                return "HOST"
            if self.name.endswith("_ports"):
                return "PORT,..."
            if self.name == "log_level":
                return "LEVEL"
            if self.name.endswith("_address"):
                return "HOST:PORT"
        if self.name.endswith("_port") and self.type is int:
            return "PORT"
        return _PLACEHOLDERS.get(self.type, "VALUE")

    def described(self) -> str:
        """The help text and its default, written one way: "(default: X)". A text that says
        its default itself ("(default: the conf's)") keeps its words; a required flag has none."""
        text = self.help
        if self.required or "(default: " in text:
            return text
        return f"{text} (default: {shown_default(self.default)})".lstrip()


def shown_default(value: object) -> str:
    """A default as the usage writes it: none, true/false, or the value."""
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    return str(value)


_PLACEHOLDERS: dict[Any, str] = {int: "N", float: "X", str: "TEXT", Path: "PATH"}
_PATH_FLAGS = {
    "input",
    "config",
    "keys",
    "file",
    "donefile",
    "tls_cert",
    "tls_key",
    "tls_ca",
}


# Flags of the original C++ tools' runtime (brpc, bvar, glog) that an original command line or
# conf/gflags.conf may carry; they mean nothing here (FlagSet.ignore_original_runtime).
ORIGINAL_RUNTIME_SWITCHES = (
    "bvar_dump", "usercode_in_pthread", "enable_rpcz", "rpcz_save_span", "log_connected",
    "log_error_text", "graceful_quit_on_sigterm", "reuse_port", "logtostderr",
    "alsologtostderr", "stop_logging_if_full_disk", "colorlogtostderr",
)  # fmt: skip
ORIGINAL_RUNTIME_VALUES = (
    "bvar_dump_interval", "bvar_dump_file", "bvar_dump_include", "bvar_dump_exclude",
    "bvar_dump_prefix", "bvar_dump_tabs", "idle_timeout_second", "max_body_size",
    "max_connection_pool_size", "socket_max_unwritten_bytes", "health_check_interval",
    "event_dispatcher_num", "bthread_concurrency", "defer_close_second", "logbufsecs",
    "logbuflevel", "v", "minloglevel", "stderrthreshold", "max_log_size",
)  # fmt: skip


@dataclass(frozen=True)
class _Declared:
    """What `flag()` records on a dataclass field for the FlagSet built from it."""

    help: str
    parse: Callable[[str], Any] | None
    choices: Sequence[str] | None
    aliases: Sequence[str]
    required: bool
    metavar: str | None


def flag(
    default: V,
    help: str,
    *,
    parse: Callable[[str], V] | None = None,
    choices: Sequence[str] | None = None,
    aliases: Sequence[str] = (),
    required: bool = False,
    metavar: str | None = None,
) -> V:
    """A field of a command's flags dataclass: its default and help, and how its text is read
    (`parse`; by default from the field's annotation: int, float, str, bool or Path)."""
    declared = _Declared(help, parse, choices, tuple(aliases), required, metavar)
    return field(default=default, metadata={"flag": declared})


_PARSERS: dict[object, Callable[[str], Any]] = {
    int: int, float: float, str: str, bool: bool, Path: Path,
}  # fmt: skip


def _parser_of(owner: type, name: str, annotation: object) -> Callable[[str], Any]:
    """int, float, str, bool or Path, also as `X | None`; anything else needs `parse=`."""
    if isinstance(annotation, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = kinds[0] if len(kinds) == 1 else annotation
    try:
        return _PARSERS[annotation]
    except (KeyError, TypeError):
        raise TypeError(
            f"{owner.__name__}.{name}: {annotation!r} needs flag(..., parse=)"
        ) from None


@dataclass
class Positional:
    name: str  # as the usage shows it: FILE
    help: str
    flag: str | None = None  # a flag that may name it instead (kvtool's --file)


class Flags(dict[str, Any]):
    """Parsed flag values of an untyped FlagSet; attribute access for convenience."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class FlagSet(Generic[T]):
    """A command's flags: declared by a frozen dataclass (`spec=`, parse returns one) or one
    `add` at a time (parse returns `Flags`), then `parse(argv)`."""

    @overload
    def __init__(
        self: FlagSet[Flags],
        program: str,
        description: str = "",
        *,
        default_flagfile: str | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self: FlagSet[T],
        program: str,
        description: str = "",
        *,
        spec: type[T],
        default_flagfile: str | None = None,
    ) -> None: ...

    def __init__(
        self,
        program: str,
        description: str = "",
        *,
        spec: type[Any] | None = None,
        default_flagfile: str | None = None,
    ) -> None:
        self.program = program
        self.description = description
        self.default_flagfile = default_flagfile  # read first when it exists (from the cwd)
        self.flags: dict[str, Flag] = {}
        self.positionals: list[Positional] = []
        self.ignored: dict[str, tuple[bool, str]] = {}  # name: (takes a value?, why)
        self._names: dict[str, str] = {}
        # the overloads tie T to `spec` (or to Flags without one)
        self._make = cast("Callable[..., T]", spec if spec is not None else Flags)
        if spec is not None:
            self._declare(spec)

    def _declare(self, spec: type[Any]) -> None:
        hints = typing.get_type_hints(spec)
        for item in dataclasses.fields(spec):
            declared = item.metadata.get("flag")
            if not isinstance(declared, _Declared):
                raise TypeError(f"{spec.__name__}.{item.name}: declare it with flag(...)")
            parse = declared.parse or _parser_of(spec, item.name, hints[item.name])
            self.add(
                item.name, parse, item.default, declared.help, declared.choices,
                declared.aliases, declared.required, declared.metavar,
            )  # fmt: skip

    def add(
        self,
        name: str,
        type: Callable[[str], Any] = str,
        default: Any = None,
        help: str = "",
        choices: Sequence[str] | None = None,
        aliases: Sequence[str] = (),
        required: bool = False,
        metavar: str | None = None,
    ) -> FlagSet[T]:
        flag = Flag(name, type, default, help, choices, aliases, required, metavar)
        self.flags[name] = flag
        for alias in (name, *aliases):
            self._names[alias] = name
        return self

    def ignore(self, names: Sequence[str], takes_value: bool, why: str) -> FlagSet[T]:
        """Accept these flags (`--name value` when `takes_value`, else `--name` or
        `--name=value`) and ignore them with a warning that says `why`."""
        for name in names:
            self.ignored[name] = (takes_value, why)
        return self

    def ignore_original_runtime(self) -> FlagSet[T]:
        """Accept (and ignore, warning) the brpc/bvar/glog flags of the original's C++ tools."""
        why = "a brpc/glog flag of the original; this implementation does not use it"
        self.ignore([n for n in ORIGINAL_RUNTIME_SWITCHES if n not in self.flags], False, why)
        return self.ignore([n for n in ORIGINAL_RUNTIME_VALUES if n not in self.flags], True, why)

    def positional(self, name: str, help: str, flag: str | None = None) -> FlagSet[T]:
        """A required positional argument (`kvtool FILE`); `flag` names a flag that may give it
        instead. Positionals may come anywhere among the flags."""
        self.positionals.append(Positional(name, help, flag))
        return self

    def usage(self) -> str:
        shape = " ".join([self.program, *(p.name for p in self.positionals), "[flags]"])
        lines = [f"usage: {shape}"]
        if self.description:
            lines += [self.description]
        rows = [(p.name, p.help) for p in self.positionals]
        required = [f for f in self.flags.values() if f.required]
        optional = [f for f in self.flags.values() if not f.required]
        sections = [
            ("arguments", rows),
            ("required flags", [(f.spelled, f.described()) for f in required]),
        ]
        sections.append(("flags", [(f.spelled, f.described()) for f in optional]))
        sections[-1][1].append(("--flagfile FILE", "read flags from FILE, one per line"))
        own = "version" in self.flags  # then a bare --version, last, is the package's
        sections[-1][1].append(
            ("--version" + (" (last, alone)" if own else ""), "print the version and exit")
        )
        sections[-1][1].append(("-h, --help", "print this help and exit"))
        width = min(28, max(len(name) for _title, rows in sections for name, _text in rows) + 2)
        for title, section in sections:
            if not section:
                continue
            lines += ["", f"{title}:"]
            for name, text in section:
                lines += _row(name, text, width)
        lines += [
            "",
            "Flags take gflags forms: -flag value, --flag=value, --flag / --noflag for booleans.",
        ]
        return "\n".join(lines)

    def parse(self, argv: Sequence[str]) -> T:
        """The flags of `argv` (after `default_flagfile`'s, when it exists), checked."""
        values = {name: flag.default for name, flag in self.flags.items()}
        given: set[str] = set()
        positional: list[str] = []
        args = list(argv)
        if self.default_flagfile and Path(self.default_flagfile).is_file():
            args = ["--flagfile", self.default_flagfile, *args]
        self._parse_into(args, values, given, positional, depth=0)
        self._take_positionals(positional, values, given)
        missing = [f for f in self.flags.values() if f.required and f.name not in given]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            called = ", ".join(f.called for f in missing)
            message = f"{called} {verb} required (see {self.program} --help)"
            raise MissingFlagsError(message, [f.name for f in missing], values)
        return self._make(**values)

    def _take_positionals(self, args: list[str], values: dict[str, Any], given: set[str]) -> None:
        declared = self.positionals
        if not declared:
            if args:
                raise FlagError(f"unexpected argument {args[0]!r} (flags look like --name value)")
            return
        if len(declared) != 1:
            raise NotImplementedError("one positional argument per command")
        only = declared[0]
        if only.flag and only.flag in given:
            args = [*args, values[only.flag]]
        if not args:
            raise FlagError(f"{only.name} is required (see {self.program} --help)")
        if len(args) > 1:
            raise FlagError(f"one {only.name} only, got {len(args)}: {', '.join(map(repr, args))}")
        values[only.flag or only.name.lower()] = args[0]

    def _unknown(self, arg: str, name: str) -> FlagError:
        """The error for an unknown flag, with the closest known one."""
        spelled = name.replace("-", "_")
        names = [*self._names, "flagfile"]
        if spelled != name and spelled in names:
            hint = f"; did you mean --{spelled}? (flags use underscores)"
        else:
            close = difflib.get_close_matches(spelled, names, n=1, cutoff=0.6)
            hint = (
                f"; did you mean {'-' if len(close[0]) == 1 else '--'}{close[0]}?" if close else ""
            )
        return FlagError(f"unknown flag {arg!r}{hint} (see {self.program} --help)")

    def _parse_into(
        self,
        args: list[str],
        values: dict[str, Any],
        given: set[str],
        positional: list[str],
        depth: int,
        lines: Sequence[str] | None = None,
    ) -> None:
        """Parse `args` into `values`; `lines` says where each came from ("FILE:LINE", for a
        flagfile's), and an error there names it."""
        i = 0
        while i < len(args):
            start = i
            try:
                i = self._parse_one(args, i, values, given, positional, depth)
            except FlagError as exc:
                if lines is None:
                    raise
                raise FlagError(f"{lines[start]}: {exc}") from None

    def _parse_one(
        self,
        args: list[str],
        i: int,
        values: dict[str, Any],
        given: set[str],
        positional: list[str],
        depth: int,
    ) -> int:
        """Parse the flag at args[i] (and its value); return where the next one starts."""
        arg = args[i]
        i += 1
        if arg in _HELP:
            print(self.usage())
            raise SystemExit(0)
        if arg in _VERSION and ("version" not in self.flags or i == len(args)):
            # (a command with a -version flag of its own, cube-import's, takes it when a value
            # follows)
            print(f"{self.program} {package_version()}")
            raise SystemExit(0)
        if not arg.startswith("-") or arg == "-":
            positional.append(arg)
            return i
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
            read, where = _read_flagfile(text)
            self._parse_into(read, values, given, positional, depth + 1, where)
            return i
        key = self._names.get(name)
        negated = False
        if key is None and name.startswith("no") and self._names.get(name[2:]):
            key, negated = self._names[name[2:]], True
        if key is None and name in self.ignored:
            takes_value, why = self.ignored[name]
            if takes_value and not has_value:
                if i >= len(args):
                    raise FlagError(f"--{name} needs a value")
                i += 1
            print(f"warning: {arg.partition('=')[0]} ignored: {why}", file=sys.stderr)
            return i
        if key is None:
            raise self._unknown(arg, name)
        flag = self.flags[key]
        given.add(key)
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
            return i
        if not has_value:
            if i >= len(args):
                raise FlagError(f"--{key} needs a value")
            text = args[i]
            i += 1
        values[key] = self._convert(flag, text)
        return i

    def _convert(self, flag: Flag, text: str) -> Any:
        if flag.choices is not None and text not in flag.choices:
            raise FlagError(f"--{flag.name}: {text!r} is not one of {', '.join(flag.choices)}")
        try:
            return flag.type(text)
        except (TypeError, ValueError) as exc:
            raise FlagError(f"--{flag.name}: bad value {text!r}: {exc}") from exc


def _row(name: str, text: str, width: int) -> list[str]:
    """One usage row: the flag, then its help wrapped under a column (on the next line when
    the flag is wider than the column)."""
    indent = " " * (2 + width)
    glued = text.replace("(default: ", "(default:\0")  # kept on one line with its value
    lines = textwrap.wrap(glued, 100 - len(indent), break_on_hyphens=False)
    wrapped = [line.replace("\0", " ") for line in lines] or [""]
    if len(name) > width - 2:  # two spaces at least between a flag and its help
        return [f"  {name}", *(indent + line for line in wrapped)]
    return [f"  {name.ljust(width)}{wrapped[0]}", *(indent + line for line in wrapped[1:])]


def _read_flagfile(path: str) -> tuple[list[str], list[str]]:
    """A flagfile's flags, one a line (blank lines and # comments skipped), and where each is
    ("FILE:LINE")."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise FlagError(f"--flagfile {path}: {exc.strerror}") from exc
    args, where = [], []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if line and not line.startswith("#"):
            args.append(line)
            where.append(f"{path}:{number}")
    return args, where


@dataclass
class Command:
    flags: FlagSet[Any]
    run: Callable[[Sequence[str]], int]  # parses its flags, then runs


@dataclass
class CommandSet:
    """A tool with subcommands (`cube-local up|status|...`): each a FlagSet (its program is
    `<tool> <name>`, its description the first line of the tool's usage) and a function."""

    program: str
    description: str = ""
    commands: dict[str, Command] = field(default_factory=dict)

    def add(self, name: str, flags: FlagSet[T], run: Callable[[T], int]) -> CommandSet:
        self.commands[name] = Command(flags, lambda argv: run(flags.parse(argv)))
        return self

    def usage(self) -> str:
        lines = [f"usage: {self.program} COMMAND [flags]   ({self.program} COMMAND --help)"]
        if self.description:
            lines.append(self.description)
        lines += ["", "commands:"]
        width = max(len(name) for name in self.commands) + 4
        for name, command in self.commands.items():
            lines += _row(name, command.flags.description.split("\n")[0], width)
        lines += ["", "--version prints the version."]
        return "\n".join(lines)

    def run(self, argv: Sequence[str]) -> int:
        if not argv or argv[0] in (*_HELP, "help"):
            print(self.usage(), file=sys.stdout if argv else sys.stderr)
            return 0 if argv else 2
        if argv[0] in _VERSION:
            print(f"{self.program} {package_version()}")
            return 0
        name, rest = argv[0], argv[1:]
        command = self.commands.get(name)
        if command is None:
            close = difflib.get_close_matches(name, list(self.commands), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            known = "|".join(self.commands)
            raise FlagError(f"unknown command {name!r}{hint} ({self.program} {known})")
        return command.run(rest)


def one_line(exc: BaseException) -> str:
    """An exception as one line for a CLI's `error: ...` (its text, whitespace collapsed)."""
    return " ".join((str(exc) or type(exc).__name__).split())


def run_cli(main: Callable[[Sequence[str]], int], argv: Sequence[str] | None = None) -> int:
    """Run a CLI body: FlagError and other user errors print one line to stderr, exit 2; a
    closed stdout (`tool | head`) ends it quietly, with no traceback at exit either."""
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except FlagError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at /dev/null so that flush is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
