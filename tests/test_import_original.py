"""cube-import end to end: tables in the original Cube's format (written byte by byte by
tests/helpers/original_cube.py from the original's sources), the real command as a subprocess, the
output opened with cube.shard and every key and value checked, base and patches."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
from helpers.original_cube import OriginalBuilder, deploy

from cube.agent.unpack import extract_shard_tar
from cube.processes import poll_until
from cube.seqfile import SequenceFileWriter
from cube.shard import Shard, ShardStack
from cube.transfer.build import check_outputs
from cube.values import ValueColumn

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".venv" / "bin" / "cube-import"
COMMAND = (
    [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cube.builder.import_original"]
)
BUILDER_SCRIPT = ROOT / ".venv" / "bin" / "cube-builder"
BUILDER = (
    [str(BUILDER_SCRIPT)] if BUILDER_SCRIPT.exists() else [sys.executable, "-m", "cube.builder.cli"]
)
BASE, PATCH1, PATCH2, PATCH3 = 1_700_000_000, 1_700_000_100, 1_700_000_200, 1_700_000_300
SHARDS = 4
DICT = "emb"


def run_import(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def to_output(source: Path, output: Path, shards: int = SHARDS) -> list[str]:
    """The flags of an import of `source` into build output `output`."""
    return [
        *("-input_path", str(source), "-output_path", str(output)),
        *("-dict_name", DICT, "-shard_num", str(shards)),
    ]


def imported(*args: str) -> subprocess.CompletedProcess[str]:
    done = run_import(*args)
    assert done.returncode == 0, done.stderr
    return done


def failed(*args: str) -> str:
    done = run_import(*args)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines: list[str] = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------
# the original table: a base and three patches over four shards


def value_for(key: int, tag: str, rng: random.Random) -> bytes:
    return f"{tag}:{key}:".encode() + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 24)))


def make_versions(seed: int = 7) -> list[list[tuple[int, bytes]]]:
    """Records of the base and three patches: unsigned keys up to 2^64 - 1, duplicates inside
    a version (the last wins), empty values, updates and new keys in the patches, and a last
    patch touching shard 0 only (the other shards get a patch without records)."""
    rng = random.Random(seed)
    base = [(k, value_for(k, "b", rng)) for k in range(3000)]
    base += [(2**64 - 1 - k, value_for(k, "hi", rng)) for k in range(40)]
    base += [(17, b"first duplicate"), (42, b""), (17, b"last duplicate")]
    patch1 = [(k, value_for(k, "p1", rng)) for k in range(0, 6000, 7)]
    patch2 = [(k, value_for(k, "p2", rng)) for k in range(1, 9000, 11)] + [(2**64 - 1, b"top")]
    patch3 = [(k, value_for(k, "p3", rng)) for k in range(0, 400, 4)]  # shard 0 only
    return [base, patch1, patch2, patch3]


VERSIONS = [(BASE, True), (PATCH1, False), (PATCH2, False), (PATCH3, False)]


def build_original(
    root: Path,
    versions: list[list[tuple[int, bytes]]] | None = None,
    shards: int = SHARDS,
    limit: int = 4096,
) -> list[Path]:
    """The original builder's output under `root` (small data files: several per version)."""
    builder = OriginalBuilder(root, DICT, shards, data_file_limit=limit)
    records = versions or make_versions()
    return [
        builder.build(recs, cur, base) for recs, (cur, base) in zip(records, VERSIONS, strict=False)
    ]


def expected_states(versions: list[list[tuple[int, bytes]]]) -> list[dict[int, bytes]]:
    """The table after each version: the last record of a key wins."""
    state: dict[int, bytes] = {}
    states = []
    for records in versions:
        for key, value in records:
            state[key] = value
        states.append(dict(state))
    return states


def check_stack(layers: list[Path], shard: int, shards: int, expected: dict[int, bytes]) -> None:
    """Every key of the shard (and some absent ones) looked up through the layers."""
    opened = [Shard.open(path, verify=True) for path in layers]
    try:
        stack = ShardStack(opened)
        mine = sorted(k for k in expected if k % shards == shard)
        absent = [k for k in range(shard, 20_000, shards) if k not in expected][:200]
        keys = np.array(mine + absent, dtype=np.uint64)
        result = stack.lookup(keys)
        values = stack.gather(result).to_list()
        assert result.found.tolist() == [True] * len(mine) + [False] * len(absent)
        got = dict(zip(mine, values[: len(mine)], strict=True))
        assert got == {k: expected[k] for k in mine}
    finally:
        for shard_file in opened:
            shard_file.close()


def version_dirs(output: Path) -> list[str]:
    return sorted(p.name for p in output.iterdir() if p.is_dir() and p.name[0].isdigit())


def assert_nothing_published(output: Path) -> None:
    if output.exists():
        names = os.listdir(output)
        assert not [n for n in names if n.startswith(".tmp-")], names
        assert not [n for n in names if n[:1].isdigit()], names
        assert "VERSION" not in names


@pytest.fixture
def original(tmp_path: Path) -> tuple[Path, list[Path]]:
    root = tmp_path / "original"
    return root, build_original(root)


# ---------------------------------------------------------------------------------------------
# build output


def test_build_output_base_and_patches_every_key(
    original: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    root, dirs = original
    assert len(list((dirs[0] / f"{DICT}_part0").glob("data.*"))) > 3  # several data files
    assert not (dirs[3] / f"{DICT}_part1" / "index.3").exists()  # a patch without records
    out = tmp_path / "out"
    done = imported(*to_output(root, out))
    assert "records/s" in done.stdout
    names = [f"{BASE}_{cur}" for cur, _ in VERSIONS]
    assert version_dirs(out) == names
    states = expected_states(make_versions())
    for shard in range(SHARDS):
        for upto in range(len(VERSIONS)):
            layers = [out / name / f"{DICT}_part{shard}" for name in names[: upto + 1]]
            check_stack(layers, shard, SHARDS, states[upto])
    # the headers say what the builder's would
    base = Shard.open(out / names[0] / f"{DICT}_part1")
    delta = Shard.open(out / names[2] / f"{DICT}_part1")
    described = ("dict_name", "shard", "shard_num", "partitioner", "mode")
    assert {k: base.meta[k] for k in described} == {
        "dict_name": DICT,
        "shard": 1,
        "shard_num": SHARDS,
        "partitioner": "mod",
        "mode": "base",
    }
    assert base.meta["version"] == str(BASE)
    assert delta.meta["version"] == f"{BASE}_{PATCH2}" and delta.meta["mode"] == "delta"
    assert base.record_count == sum(1 for k in states[0] if k % SHARDS == 1)
    base.close()
    delta.close()
    # cube-transfer checks it as a build of its own; cube-agent places its tars
    for name in names:
        shards = check_outputs(out / name, DICT, SHARDS, verify=True)
        assert [s.shard for s in shards] == list(range(SHARDS))
    assert len(list((out / "meta_info").glob("*.json"))) == SHARDS * len(names)
    placed = extract_shard_tar(out / names[1] / f"{DICT}_part3.tar", tmp_path / "placed")
    assert placed == ["data.cube", "index.cube"]


def test_tars_only_give_the_same_bytes(original: tuple[Path, list[Path]], tmp_path: Path) -> None:
    """The builder leaves both the shard directories and their tars; the tars alone (md5
    checked) import to the same bytes, and so do several inputs given one by one."""
    root, dirs = original
    tars = tmp_path / "tars"
    shutil.copytree(root, tars)
    for part in tars.glob(f"*/{DICT}_part*"):
        if part.is_dir():
            shutil.rmtree(part)
    flags = ["-dict_name", DICT, "-shard_num", str(SHARDS)]
    imported("-input_path", str(root), "-output_path", str(tmp_path / "a"), *flags)
    listed = ",".join(str(tars / d.name) for d in reversed(dirs))
    imported("-input_path", listed, "-output_path", str(tmp_path / "b"), *flags)
    files = sorted(
        p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file()
    )
    assert len(files) > 40
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_the_same_bytes_as_cube_builder_from_the_same_records(
    original: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    """What the original built from some SequenceFiles imports to exactly what cube-builder
    builds from them (same partitioning, last record wins, same writer), base and patches."""
    root, _ = original
    imported(
        "-input_path",
        str(root),
        "-output_path",
        str(tmp_path / "imported"),
        "-dict_name",
        DICT,
        "-shard_num",
        str(SHARDS),
    )
    built = tmp_path / "built"
    for number, (records, (cur, base)) in enumerate(zip(make_versions(), VERSIONS, strict=True)):
        seqfile = tmp_path / "input" / str(cur) / "part-00000"
        seqfile.parent.mkdir(parents=True)
        keys = np.array([k for k, _ in records], dtype=np.uint64)
        with SequenceFileWriter(seqfile) as writer:
            writer.write_batch(keys, ValueColumn.from_list([v for _, v in records]))
        mode = ["-job_mode", "base"] if base else ["-job_mode", "delta"]
        done = subprocess.run(
            [
                *BUILDER,
                "-dict_name",
                DICT,
                "-input_path",
                str(seqfile.parent),
                "-output_path",
                str(built),
                "-shard_num",
                str(SHARDS),
                "-only_build=false",
                "-cur_version",
                str(cur),
                "-depend_version",
                str(BASE),
                "-quiet",
                *mode,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode == 0, (number, done.stderr)
    files = sorted(p.relative_to(built) for p in built.rglob("*") if p.is_file())
    assert len(files) == len(VERSIONS) * (SHARDS * 4 + SHARDS)
    for name in files:
        assert (tmp_path / "imported" / name).read_bytes() == (built / name).read_bytes(), name


def test_fixed_width_values(tmp_path: Path) -> None:
    """Embeddings (one value length): the shards are fixed width, like a build's."""
    rng = np.random.default_rng(3)
    base = [(int(k), rng.bytes(16)) for k in rng.integers(0, 2**64 - 1, 2000, dtype=np.uint64)]
    patch = [(k, bytes(16)) for k, _ in base[::5]]
    build_original(tmp_path / "orig", [base, patch], shards=2, limit=5000)
    out = tmp_path / "out"
    imported(
        "-input_path",
        str(tmp_path / "orig"),
        "-output_path",
        str(out),
        "-dict_name",
        DICT,
        "-shard_num",
        "2",
    )
    states = expected_states([base, patch])
    for shard in range(2):
        layers = [out / f"{BASE}_{cur}" / f"{DICT}_part{shard}" for cur in (BASE, PATCH1)]
        assert Shard.open(layers[0]).value_width == 16
        check_stack(layers, shard, 2, states[1])


def test_empty_base_shard(tmp_path: Path) -> None:
    """A shard that got no record: the original leaves an empty directory and a tar of ./;
    it imports as an empty shard."""
    records = [[(k, b"v%d" % k) for k in range(0, 300, 3)]]  # shard_num 3: all in shard 0
    dirs = build_original(tmp_path / "orig", records, shards=3)
    assert not os.listdir(dirs[0] / f"{DICT}_part1")
    out = tmp_path / "out"
    imported(
        "-input_path", str(dirs[0]), "-output_path", str(out), "-dict_name", DICT, "-shard_num", "3"
    )
    for shard in range(3):
        check_stack(
            [out / f"{BASE}_{BASE}" / f"{DICT}_part{shard}"], shard, 3, expected_states(records)[0]
        )


def test_an_existing_version_is_not_replaced(
    original: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    root, _ = original
    out = tmp_path / "out"
    flags = to_output(root, out)
    imported(*flags)
    before = (out / f"{BASE}_{PATCH1}" / f"{DICT}_part0.tar").read_bytes()
    assert "already exists" in failed(*flags)
    assert (out / f"{BASE}_{PATCH1}" / f"{DICT}_part0.tar").read_bytes() == before
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]


def test_a_later_target_that_exists_stops_the_import_before_anything_is_written(
    original: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    """Every target is checked before any version is converted: with patch 2's directory
    already there, the base and patch 1 are not published either."""
    root, _ = original
    out = tmp_path / "out"
    (out / f"{BASE}_{PATCH2}").mkdir(parents=True)
    message = failed(*to_output(root, out))
    assert f"{BASE}_{PATCH2} already exists" in message
    assert sorted(os.listdir(out)) == [f"{BASE}_{PATCH2}"]  # nothing else, no staging


def test_files_of_another_format_are_not_an_empty_shard(tmp_path: Path) -> None:
    """A shard directory holding files, none of them the original's (here this project's
    own shard files), is refused; only a directory with no files is an empty shard."""
    records = [[(k, b"v%d" % k) for k in range(0, 300, 2)]]
    dirs = build_original(tmp_path / "orig", records, shards=2)
    part = dirs[0] / f"{DICT}_part1"
    shutil.rmtree(part)
    part.mkdir()
    (part / "index.cube").write_bytes(b"not the original's")
    (part / "data.cube").write_bytes(b"")
    (dirs[0] / f"{DICT}_part1.tar").unlink()
    out = tmp_path / "out"
    message = failed(*to_output(dirs[0], out, shards=2))
    assert f"{DICT}_part1: holds data.cube, index.cube: not the original's format" in message
    assert_nothing_published(out)


def test_a_directory_name_that_is_no_version_is_blamed_not_the_flag(tmp_path: Path) -> None:
    """A version's name comes from its directory: the error names the directory and asks for
    -version, which was not given."""
    records = [[(k, b"v%d" % k) for k in range(0, 30)]]
    dirs = build_original(tmp_path / "orig", records, shards=1)
    renamed = dirs[0].rename(dirs[0].with_name("latest"))
    message = failed(*to_output(renamed, tmp_path / "out", shards=1))
    assert "latest: its directory name 'latest', not a version of the original" in message
    assert "give -version" in message


# ---------------------------------------------------------------------------------------------
# a deployment of the original, adopted into a server's data directory


@pytest.mark.parametrize("where", ["deploy", "data", "cube_data"])
def test_deployment_adopted_into_a_data_dir(
    original: tuple[Path, list[Path]], tmp_path: Path, where: str
) -> None:
    _root, dirs = original
    deploy_path = deploy(dirs[:3], DICT, 2, tmp_path / "deploy")  # serving patch 2
    source = deploy_path if where == "deploy" else deploy_path / where
    target = tmp_path / "ours"
    done = imported(
        "-input_path",
        str(source),
        "-data_dir",
        str(target),
        "-dict_name",
        DICT,
        "-shard_num",
        str(SHARDS),
    )
    names = [str(BASE), f"{BASE}_{PATCH1}", f"{BASE}_{PATCH2}"]
    assert f"VERSION names {names[2]}" in done.stdout
    assert (target / "VERSION").read_text() == f"{names[2]}\n"
    assert version_dirs(target) == names
    assert (target / names[2] / "CHAIN").read_text().split() == names
    assert not (target / names[0] / "CHAIN").exists()
    states = expected_states(make_versions())
    for upto in range(3):
        check_stack([target / n for n in names[: upto + 1]], 2, SHARDS, states[upto])
    header = Shard.open(target / names[1])
    assert (header.meta["shard"], header.meta["shard_num"]) == (2, SHARDS)
    header.close()


def test_copied_deployment_files_cannot_be_attributed(
    original: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    """data/<version>/ holding copies (not the agent's links) of the base's and patches' files:
    which version brought which record is lost, so it is refused, not served as a base."""
    _root, dirs = original
    deploy_path = deploy(dirs[:2], DICT, 0, tmp_path / "deploy")
    served = deploy_path / "data" / f"{BASE}_{PATCH1}"
    for link in served.iterdir():
        target = link.resolve()
        link.unlink()
        shutil.copy(target, link)
    message = failed(
        "-input_path",
        str(deploy_path / "data"),
        "-data_dir",
        str(tmp_path / "x"),
        "-dict_name",
        DICT,
        "-shard_num",
        str(SHARDS),
        "-shard",
        "0",
    )
    assert f"version {BASE}_{PATCH1}: its name says patch, but it holds a base's files" in message
    assert_nothing_published(tmp_path / "x")


def test_data_dir_from_build_output_picks_a_shard(
    original: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    root, _ = original
    flags = ["-input_path", str(root), "-dict_name", DICT, "-shard_num", str(SHARDS)]
    assert "give -shard" in failed(*flags, "-data_dir", str(tmp_path / "x"))
    assert_nothing_published(tmp_path / "x")
    imported(*flags, "-data_dir", str(tmp_path / "d3"), "-shard", "3")
    names = [str(BASE)] + [f"{BASE}_{cur}" for cur, _ in VERSIONS[1:]]
    assert (tmp_path / "d3" / "VERSION").read_text() == f"{names[-1]}\n"
    check_stack(
        [tmp_path / "d3" / n for n in names], 3, SHARDS, expected_states(make_versions())[-1]
    )
    # a VERSION naming another version is not changed
    (tmp_path / "d0").mkdir()
    (tmp_path / "d0" / "VERSION").write_text("1600000000\n")
    assert "refusing to change" in failed(*flags, "-data_dir", str(tmp_path / "d0"), "-shard", "0")
    assert version_dirs(tmp_path / "d0") == []


def test_local_mode_data_needs_a_version(tmp_path: Path) -> None:
    """The original's local mode: a `0_0` build's shard files moved into ./data (no VERSION)."""
    builder = OriginalBuilder(tmp_path / "orig", DICT, 1)
    records = [(k, b"x" * (k % 9)) for k in range(500)]
    version_dir = builder.build(records, 0, base=True)
    data = tmp_path / "data"
    shutil.copytree(version_dir / f"{DICT}_part0", data)
    flags = ["-input_path", str(data), "-dict_name", DICT, "-shard_num", "1"]
    assert "give -version" in failed(*flags, "-data_dir", str(tmp_path / "ours"))
    imported(*flags, "-data_dir", str(tmp_path / "ours"), "-version", str(BASE), "-shard", "0")
    assert (tmp_path / "ours" / "VERSION").read_text() == f"{BASE}\n"
    check_stack([tmp_path / "ours" / str(BASE)], 0, 1, expected_states([records])[0])


# ---------------------------------------------------------------------------------------------
# refused


def test_a_wrong_shard_num_is_refused(original: tuple[Path, list[Path]], tmp_path: Path) -> None:
    root, _ = original
    out = tmp_path / "out"
    message = failed(
        "-input_path", str(root), "-output_path", str(out), "-dict_name", DICT, "-shard_num", "2"
    )
    assert "is shard 2, but -shard_num is 2" in message
    # a count that does not route the parts' keys (one shard into a data directory)
    message = failed(
        "-input_path",
        str(root),
        "-data_dir",
        str(out),
        "-dict_name",
        DICT,
        "-shard_num",
        "8",
        "-shard",
        "1",
    )
    assert "key % shard_num" in message and "_part1/index.0 at offset" in message
    assert "belongs to shard 5 of 8" in message and "not the original build's" in message
    assert_nothing_published(out)


def _corrupt_file(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _part(root: Path, cur: int, shard: int = 1) -> Path:
    return root / f"{BASE}_{cur}" / f"{DICT}_part{shard}"


def truncate_data(root: Path) -> None:
    path = _part(root, BASE) / "data.1"
    os.truncate(path, path.stat().st_size - 5)


def truncate_index_list(root: Path) -> None:
    path = _part(root, PATCH1) / "index.n"
    os.truncate(path, 15)


def bad_length_field(root: Path) -> None:
    path = _part(root, BASE) / "data.0"
    first = int.from_bytes(path.read_bytes()[:4], "little")
    _corrupt_file(path, first, (10**6).to_bytes(4, "little"))


def short_length_field(root: Path) -> None:
    _corrupt_file(_first_data(root, PATCH2), 0, b"\2\0\0\0")


def _first_data(root: Path, cur: int) -> Path:
    return sorted(_part(root, cur).glob("data.[0-9]*"), key=lambda p: int(p.suffix[1:]))[0]


def bad_address(root: Path) -> None:
    _corrupt_file(_part(root, PATCH1) / "index.1", 8 + 16 * 3, (0 << 32).to_bytes(8, "little"))


def index_list_of_another_version(root: Path) -> None:
    shutil.copy(_part(root, BASE) / "index.n", _part(root, PATCH2) / "index.n")


def lost_index_file(root: Path) -> None:
    (_part(root, PATCH1) / "index.1").unlink()


@pytest.mark.parametrize(
    ("corrupt", "expected"),
    [
        (truncate_data, ["_part1/data.1", "data.n says", "truncated"]),
        (truncate_index_list, ["_part1/index.n at offset 8", "truncated"]),
        (bad_length_field, ["_part1/data.0 at offset", "length field 1000000", "past the end"]),
        (short_length_field, ["_part1/data.", "at offset 0", "length field 2"]),
        (bad_address, ["_part1/index.1 at offset 56", "points at data.0"]),
        (index_list_of_another_version, ["_part1", "index.n", "index.2 is here"]),
        (lost_index_file, ["_part1", "holds data files but no index file"]),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_corrupt_original_files_are_located(
    original: tuple[Path, list[Path]],
    tmp_path: Path,
    corrupt: Callable[[Path], object],
    expected: list[str],
) -> None:
    root, _ = original
    corrupt(root)
    out = tmp_path / "out"
    message = failed(*to_output(root, out))
    for text in expected:
        assert text in message, message
    assert_nothing_published(out)


def test_a_late_failure_leaves_a_data_dir_untouched(
    original: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    """The base and patch 1 are written (aside) before patch 2's damage is found: none of
    them, nor VERSION, appears."""
    root, _ = original
    path = _part(root, PATCH2) / sorted(os.listdir(_part(root, PATCH2)))[0]
    assert path.name.startswith("data.")
    _corrupt_file(path, 0, b"\xff\xff\0\0")
    target = tmp_path / "ours"
    message = failed(
        "-input_path",
        str(root),
        "-data_dir",
        str(target),
        "-dict_name",
        DICT,
        "-shard_num",
        str(SHARDS),
        "-shard",
        "1",
    )
    assert f"{BASE}_{PATCH2}/{DICT}_part1/{path.name} at offset 0: length field 65535" in message
    assert_nothing_published(target)


# A cube-import whose conversion (in its worker, after the layer was mapped, read and checked
# by size: build_table runs next) is interfered with, deterministically, by a hook.
HOOKED = """
import os, signal, sys, time
from pathlib import Path
import cube.builder.import_original as cube_import
from cube.builder.import_original import write as converter
action, target, pid_file = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
importer = os.getpid()
real_build_table = converter.build_table

def build_table(keys):
    pid_file.write_text(str(os.getpid()))
    if action == "truncate":  # a deployment rewriting the file in place
        os.truncate(target, 4096)
    else:  # stop the import while a shard is being converted
        os.kill(importer, getattr(signal, action))
        time.sleep(60)
    return real_build_table(keys)

converter.build_table = build_table
sys.exit(cube_import.main(sys.argv[4:]))
"""


def run_hooked(
    action: str, target: Path, pid_file: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", HOOKED, action, str(target), str(pid_file), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("kind", ["dir", "tar"])
def test_an_input_cut_short_while_it_is_read_is_named_and_nothing_is_left(
    tmp_path: Path, kind: str
) -> None:
    """The original's data file (or tar) is cut to 4096 bytes after it was mapped and checked,
    before its values are read: the reader gets SIGBUS at the first missing page. cube-import
    exits 1 naming the file and the offset where it now ends, and leaves no staging folder
    (it was killed by SIGBUS, its .tmp-* folder left in the output)."""
    rng = random.Random(5)
    records = [[(k, bytes(rng.randrange(256) for _ in range(60))) for k in range(4000)]]
    (version,) = build_original(tmp_path / "orig", records, shards=1, limit=1 << 20)
    part = version / f"{DICT}_part0"
    if kind == "dir":
        target, source = part / "data.0", part
    else:
        shutil.rmtree(part)
        target = source = version / f"{DICT}_part0.tar"
    size = target.stat().st_size
    assert size > 4 * 4096
    with tarfile.open(version / f"{DICT}_part0.tar") as tar:  # the members past the cut
        lost = sorted(m.name[2:] for m in tar if m.isreg() and m.offset_data + m.size > 4096)
    out = tmp_path / "out"
    done = run_hooked("truncate", target, tmp_path / "pid", *to_output(source, out, shards=1))
    assert done.returncode == 1, (done.returncode, done.stderr)
    message = f"{target} at offset 4096: cut short while cube-import read it ({size} bytes when "
    message += "checked, 4096 now"
    if kind == "tar":
        message += f"; it held {', '.join(lost)}"
    assert done.stderr == f"error: {message}); nothing was published\n"
    assert_nothing_published(out)


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_during_a_conversion_leaves_nothing(
    original: tuple[Path, list[Path]], tmp_path: Path, signum: str
) -> None:
    """Stopped while a shard is being converted: the worker process that reads the original's
    files is gone with the import, and so is every staging folder."""
    root, _ = original
    out = tmp_path / "out"
    done = run_hooked(signum, root, tmp_path / "pid", *to_output(root, out))
    number = getattr(signal, signum)
    assert done.returncode == 128 + number, done.stderr
    assert f"stopped by signal {number}; nothing was published" in done.stderr
    assert_nothing_published(out)
    worker = int((tmp_path / "pid").read_text())
    assert poll_until(lambda: not psutil.pid_exists(worker), 10, 0.05)


def test_damaged_tars_are_refused(original: tuple[Path, list[Path]], tmp_path: Path) -> None:
    root, dirs = original
    tar = dirs[1] / f"{DICT}_part2.tar"
    shutil.rmtree(dirs[1] / f"{DICT}_part2")
    size = tar.stat().st_size
    with tarfile.open(tar) as archive:
        member = archive.getmember("./index.1")
    os.truncate(tar, member.offset_data + 10)
    out = tmp_path / "out"
    flags = to_output(root, out)
    message = failed(*flags)
    assert f"{tar}: md5 " in message and "does not match" in message
    message = failed(*flags, "-check_md5=false")
    assert str(tar) in message and "truncated" in message, (message, size)
    assert_nothing_published(out)


def test_versions_must_follow_each_other(original: tuple[Path, list[Path]], tmp_path: Path) -> None:
    _root, dirs = original
    out = tmp_path / "out"
    flags = ["-output_path", str(out), "-dict_name", DICT, "-shard_num", str(SHARDS)]
    # patch 1 left out: patch 2's files do not follow the base's
    message = failed("-input_path", f"{dirs[0]},{dirs[2]},{dirs[3]}", *flags)
    assert "missing" in message and f"{BASE}_{PATCH2}" in message
    # patches without their base
    assert "no base" in failed("-input_path", f"{dirs[1]},{dirs[2]}", *flags)
    assert_nothing_published(out)


@pytest.mark.parametrize(
    "args",
    [
        ["-dict_name", DICT, "-shard_num", "2", "-input_path", "x"],  # no output
        [
            "-dict_name",
            DICT,
            "-shard_num",
            "2",
            "-input_path",
            "x",
            "-output_path",
            "a",
            "-data_dir",
            "b",
        ],
        ["-dict_name", DICT, "-shard_num", "0", "-input_path", "x", "-output_path", "a"],
        ["-dict_name", "../x", "-shard_num", "2", "-input_path", "x", "-output_path", "a"],
        [
            "-dict_name",
            DICT,
            "-shard_num",
            "2",
            "-input_path",
            "x",
            "-output_path",
            "a",
            "-version",
            "v1",
        ],
        ["-dict_name", DICT, "-input_path", "x", "-output_path", "a"],
    ],
)
def test_bad_flags_exit_2(args: list[str], tmp_path: Path) -> None:
    done = run_import(*args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ")
    assert re.search(r"(^|\s)-{1,2}[a-z_]+", done.stderr), done.stderr  # names the flag


def test_help_names_the_layouts() -> None:
    done = run_import("--help")
    assert done.returncode == 0
    for text in ("cube_data/", "data/", "key % shard_num", "-data_dir", "-output_path"):
        assert text in done.stdout


# ---------------------------------------------------------------------------------------------
# served


@pytest.mark.slow
def test_imported_versions_are_served(original: tuple[Path, list[Path]], tmp_path: Path) -> None:
    """Each shard's chain imported into a data directory, served by a real cube-server,
    looked up through the SDK."""
    from helpers.procs import start_server

    from cube.client import CubeClient

    root, _ = original
    servers = []
    try:
        for shard in range(SHARDS):
            data_dir = tmp_path / f"srv{shard}" / "data"
            imported(
                "-input_path",
                str(root),
                "-data_dir",
                str(data_dir),
                "-dict_name",
                DICT,
                "-shard_num",
                str(SHARDS),
                "-shard",
                str(shard),
            )
            servers.append(
                start_server(data_dir, "--dict_name", DICT, "--shard", str(shard), "--verify")
            )
        expected = expected_states(make_versions())[-1]
        keys = [*sorted(expected), 5_000_001, 5_000_003]
        shards = [[server.address] for server in servers]
        with CubeClient(shards=shards, dict_name=DICT) as client:
            assert client.wait_ready() == []
            result = client.seek(keys)
        assert result.version == f"{BASE}_{PATCH3}"
        assert result.values == [expected[k] for k in keys[:-2]] + [None, None]
    finally:
        for server in servers:
            server.stop()
