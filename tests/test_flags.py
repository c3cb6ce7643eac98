"""gflags-style command lines."""

import pytest

from cube.flags import FlagError, FlagSet


def flagset() -> FlagSet:
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
def test_all_forms(argv):
    assert flagset().parse(argv).port == 9


def test_booleans():
    fs = flagset()
    assert fs.parse(["--in_mem", "false"]).in_mem is False
    assert fs.parse(["--in_mem=0"]).in_mem is False
    assert fs.parse(["--noin_mem"]).in_mem is False
    assert fs.parse(["--in_mem"]).in_mem is True
    with pytest.raises(FlagError, match="in_mem"):
        fs.parse(["--in_mem=maybe"])


def test_flagfile_and_override(tmp_path):
    conf = tmp_path / "gflags.conf"
    conf.write_text("# comment\n--port=8027\n\n--in_mem=false\n")
    flags = flagset().parse(["--flagfile", str(conf), "--port", "1"])
    assert flags.port == 1 and flags.in_mem is False


def test_errors_name_the_flag(tmp_path):
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


def test_alias():
    assert flagset().parse(["-P", "8001"]).port_alias_target == 8001
