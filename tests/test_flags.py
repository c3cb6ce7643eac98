"""gflags-style command lines."""

from collections.abc import Callable
from pathlib import Path

import pytest

from cube.flags import FlagError, Flags, FlagSet


def flagset() -> FlagSet[Flags]:
    return (
        FlagSet("prog")
        .add("port", int, 8000)
        .add("in_mem", bool, True)
        .add("job_mode", str, "base", choices=("base", "delta"))
        .add("port_alias_target", int, 0, aliases=("P",))
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["-port", "9"],
        ["--port", "9"],
        ["-port=9"],
        ["--port=9"],
    ],
)
def test_all_forms(argv: list[str]) -> None:
    assert flagset().parse(argv).port == 9


def test_booleans() -> None:
    fs = flagset()
    assert fs.parse(["--in_mem", "false"]).in_mem is False
    assert fs.parse(["--in_mem=0"]).in_mem is False
    assert fs.parse(["--noin_mem"]).in_mem is False
    assert fs.parse(["--in_mem"]).in_mem is True
    with pytest.raises(FlagError, match="in_mem"):
        fs.parse(["--in_mem=maybe"])


def test_flagfile_and_override(tmp_path: Path) -> None:
    conf = tmp_path / "gflags.conf"
    conf.write_text("# comment\n--port=8027\n\n--in_mem=false\n")
    flags = flagset().parse(["--flagfile", str(conf), "--port", "1"])
    assert flags.port == 1 and flags.in_mem is False


def test_errors_name_the_flag(tmp_path: Path) -> None:
    fs = flagset()
    with pytest.raises(FlagError, match="unknown flag '--nope'"):
        fs.parse(["--nope", "1"])
    with pytest.raises(FlagError, match="--port: bad value 'x'"):
        fs.parse(["--port", "x"])
    with pytest.raises(FlagError, match="job_mode"):
        fs.parse(["--job_mode", "full"])
    with pytest.raises(FlagError, match="needs a value"):
        fs.parse(["--port"])
    with pytest.raises(FlagError, match="flagfile"):
        fs.parse(["--flagfile", str(tmp_path / "missing.conf")])


def test_alias() -> None:
    assert flagset().parse(["-P", "8001"]).port_alias_target == 8001


def test_unknown_flags_get_the_closest_known_one() -> None:
    fs = flagset()
    with pytest.raises(FlagError, match=r"did you mean --in_mem\? \(flags use underscores\)"):
        fs.parse(["--in-mem"])
    with pytest.raises(FlagError, match=r"did you mean --port\?"):
        fs.parse(["--prot", "1"])
    with pytest.raises(FlagError) as far:
        fs.parse(["--zzzz"])
    assert "did you mean" not in str(far.value)


def test_required_flags_and_positionals(tmp_path: Path) -> None:
    fs = FlagSet("tool").positional("FILE", "input", flag="file").add("file", str, None)
    fs.add("shards", int, 0, "shards", required=True).add("dim", int, 8, "width")
    with pytest.raises(FlagError, match=r"--shards is required \(see tool --help\)"):
        fs.parse(["a.seq"])
    with pytest.raises(FlagError, match="FILE is required"):
        fs.parse(["--shards", "2"])
    with pytest.raises(FlagError, match="one FILE only, got 2"):
        fs.parse(["a", "--shards", "2", "b"])
    assert fs.parse(["--shards", "2", "a"]).file == "a"
    assert fs.parse(["--file=b", "--shards", "2"]).file == "b"
    conf = tmp_path / "flags"
    conf.write_text("--shards=3\n")
    assert fs.parse(["--flagfile", str(conf), "a"]).shards == 3  # given in a flagfile counts


def test_usage_lists_required_flags_and_each_default_once() -> None:
    fs = FlagSet("tool", "Does things.").add("shards", int, 0, "shards", required=True)
    fs.add("port", int, 8000, "the port").add("host", str, "", "address (default: loopback)")
    fs.add("in_mem", bool, True, "map in memory").add("verbose", bool, False, "talk more")
    text = fs.usage()
    required, optional = text.split("required flags:")[1].split("\nflags:")
    assert "--shards N" in required and "default" not in required
    assert "--port N" in optional and "the port (default: 8000)" in optional
    assert "(default: loopback)" in optional and optional.count("(default: ") == 4
    assert "map in memory (default: true)" in optional  # every flag says its default
    assert "talk more (default: false)" in optional


def test_command_set_dispatches_and_describes(capsys: pytest.CaptureFixture[str]) -> None:
    from cube.flags import CommandSet

    ran: list[str] = []

    def runs(name: str, code: int) -> Callable[[Flags], int]:
        def run(_flags: Flags) -> int:
            ran.append(name)
            return code

        return run

    tool = CommandSet("tool", "Several things.")
    tool.add("up", FlagSet("tool up", "Start it.\nMore."), runs("up", 0))
    tool.add("down", FlagSet("tool down", "Stop it."), runs("down", 3))
    assert tool.run(["down"]) == 3 and ran == ["down"]
    assert tool.run(["--help"]) == 0
    out = capsys.readouterr().out
    assert "  up      Start it.\n  down    Stop it.\n" in out and "More" not in out
    with pytest.raises(FlagError, match="unknown command 'dwon'; did you mean 'down'"):
        tool.run(["dwon"])
    assert tool.run([]) == 2  # no command: the usage on stderr


def test_an_unknown_flag_in_a_flagfile_names_the_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "gflags.conf").write_text("# the original's\n--port=8000\n\n--prot=1\n")
    fs = FlagSet("t", default_flagfile="conf/gflags.conf").add("port", int, 0)
    with pytest.raises(FlagError, match=r"^conf/gflags.conf:4: unknown flag '--prot=1'; did you"):
        fs.parse([])
    other = tmp_path / "more.conf"
    other.write_text("--port=x\n")
    with pytest.raises(FlagError, match=rf"^{other}:1: --port: bad value 'x'"):
        FlagSet("t").add("port", int, 0).parse(["--flagfile", str(other)])


def test_typed_flags_come_back_as_their_dataclass() -> None:
    from dataclasses import FrozenInstanceError, dataclass

    from cube.flags import flag

    @dataclass(frozen=True)
    class Spec:
        port: int = flag(8000, "the port")
        ratio: float = flag(0.5, "a ratio")
        name: str | None = flag(None, "a name")
        on: bool = flag(True, "a switch")

    parsed = FlagSet("t", spec=Spec).parse(["-port", "9", "--name=n", "--noon"])
    assert parsed == Spec(port=9, ratio=0.5, name="n", on=False)
    with pytest.raises(FrozenInstanceError):
        parsed.port = 1  # type: ignore[misc]  # (what the test checks)
    with pytest.raises(FlagError, match="--ratio: bad value"):
        FlagSet("t", spec=Spec).parse(["--ratio", "half"])

    @dataclass(frozen=True)
    class Unparsable:
        pair: tuple[int, int] = flag((1, 2), "no parser for this type")

    with pytest.raises(TypeError, match=r"Unparsable.pair: .* needs flag\(..., parse=\)"):
        FlagSet("t", spec=Unparsable)
