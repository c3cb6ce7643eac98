"""Every command's surface: `--version` prints the package's version and exits 0, and `--help`
states every flag's default one way, "(default: X)", lists required flags as required and
says what each flag's value is."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

import cube.entry
from cube.flags import package_version

REPO = Path(__file__).resolve().parent.parent
SCRIPTS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
# cube-local's subcommands have flags of their own
COMMANDS = [[name] for name in SCRIPTS] + [
    ["cube-local", sub] for sub in ("up", "status", "wait", "restart", "down")
]
BUILT_IN = ("--flagfile", "--version", "-h, --help")


def run_command(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """Run a console script in this process, as its entry point does; (exit code, stdout)."""
    entry = getattr(cube.entry, SCRIPTS[argv[0]].split(":")[1])
    monkeypatch.setattr(sys, "argv", argv)
    try:
        code = entry()
    except SystemExit as exc:
        code = exc.code
    assert isinstance(code, int)
    return code, capsys.readouterr().out


def flag_rows(text: str, section: str) -> dict[str, str]:
    """A usage section's rows: the flag as spelled (`--port N`) -> its help, lines joined."""
    body = text.split(f"\n{section}:\n", 1)[1].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    name = ""
    for line in body.splitlines():
        if line.startswith("  -"):
            name, _, help_text = line[2:].partition("  ")
            rows[name] = help_text.strip()
        else:
            rows[name] = f"{rows[name]} {line.strip()}".strip()
    return rows


@pytest.mark.parametrize("argv", [c[:1] for c in COMMANDS[: len(SCRIPTS)]], ids=" ".join)
def test_every_command_prints_its_version(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_command([*argv, "--version"], monkeypatch, capsys)
    assert (code, out) == (0, f"{argv[0]} {package_version()}\n")
    assert package_version() != "unknown"  # the installed package's


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_help_states_every_default_one_way(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_command([*argv, "--help"], monkeypatch, capsys)
    assert code == 0
    if argv == ["cube-local"]:
        assert "--version" in out
        return
    rows = flag_rows(out, "flags")
    assert len(rows) > len(BUILT_IN)
    for name, text in rows.items():
        if name.startswith(BUILT_IN):
            continue
        assert "(default: " in text, f"{argv}: {name} does not state its default: {text!r}"
        others = re.sub(r"\(default: ", "", text)
        assert "default" not in others.lower(), f"{argv}: {name} says its default twice: {text!r}"
        assert not re.search(r"\[[^\]]*\]$", text), f"{argv}: {name}: [default] form: {text!r}"
    if "\nrequired flags:\n" in out:
        for name, text in flag_rows(out, "required flags").items():
            assert "default" not in text, f"{argv}: required {name} has a default: {text!r}"


def test_required_flags_and_placeholders_say_what_they_are(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _code, out = run_command(["kv_to_seqfile", "--help"], monkeypatch, capsys)
    required = flag_rows(out, "required flags")
    assert any(name.startswith("--input_format ") for name in required)
    assert any(name.startswith("--input ") for name in required)
    _code, out = run_command(["cube-builder", "--help"], monkeypatch, capsys)
    assert "--master_address HOST:PORT" in flag_rows(out, "flags")
    assert "--output_path DIR" in flag_rows(out, "required flags")
    _code, out = run_command(["cube-bench", "--help"], monkeypatch, capsys)
    assert "--out DIR" in flag_rows(out, "flags")
    assert flag_rows(out, "flags")["--threads N,..."].endswith("(default: 1,4,8,16,24,32)")


def test_transfer_dead_timeout_help_reads_as_a_sentence(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _code, out = run_command(["cube-transfer", "--help"], monkeypatch, capsys)
    text = flag_rows(out, "flags")["--dead_timeout X"]
    assert text.startswith("seconds ") and "after s" not in text, text


def test_a_command_with_a_version_flag_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """cube-import's -version takes a value; only a bare --version, last, prints ours."""
    from cube.builder.import_original.command import flag_set

    flags = flag_set().parse(
        ["-input_path", "x", "-dict_name", "d", "-shard_num", "1", "-version", "1700000000"]
    )
    assert flags.version == "1700000000"
