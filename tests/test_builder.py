"""cube-builder end to end: real SequenceFiles in, the CLI as a subprocess, shards read back."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import mmh3
import numpy as np
import numpy.typing as npt
import pytest
from helpers.build_inputs import output_digests, write_mixed_input

from cube.index import keys_at
from cube.routing import shard_of
from cube.seqfile import SYNC_ESCAPE, SequenceFileWriter, encode_header
from cube.shard import Shard, ShardStack
from cube.values import ValueColumn

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".venv" / "bin" / "cube-builder"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cube.builder.cli"]
BASE, DELTA = 1_700_000_000, 1_700_000_100


def run_builder(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def build_args(
    input_path: Path, output: Path, shards: int, *extra: str, **flags: object
) -> list[str]:
    """Flags for a reproducible base build (versions from the command line)."""
    args = {
        "dict_name": "dict",
        "input_path": str(input_path),
        "output_path": str(output),
        "shard_num": str(shards),
        "only_build": "false",
        "cur_version": str(BASE),
        "depend_version": str(BASE),
        "quiet": "true",
    }
    args.update({k: str(v) for k, v in flags.items()})
    return [f"-{k}={v}" for k, v in args.items()] + list(extra)


def write_seqfile(path: Path, keys: npt.ArrayLike, values: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with SequenceFileWriter(path) as writer:
        writer.write_batch(np.asarray(keys, dtype=np.uint64), ValueColumn.from_list(values))
    return path


def value_of(key: int, tag: bytes = b"v", width: int = 12) -> bytes:
    return (tag + str(key).encode()).ljust(width, b".")[:width]


def open_shards(version_dir: Path, shards: int, dict_name: str = "dict") -> list[Shard]:
    return [Shard.open(version_dir / f"{dict_name}_part{i}", verify=True) for i in range(shards)]


def shard_contents(shard: Shard) -> dict[int, bytes]:
    """Every live key of a shard and its value (the index's keys: cube.index.keys_at)."""
    keys = keys_at(shard.table, np.arange(shard.table.row_count))
    result = ShardStack([shard]).lookup(keys)
    values = ShardStack([shard]).gather(result).to_list()
    return {int(k): v for k, v, f in zip(keys.tolist(), values, result.found, strict=True) if f}


def assert_no_leftovers(output: Path) -> None:
    if output.exists():
        names = os.listdir(output)
        assert not [n for n in names if n.startswith(".tmp-")], names
        assert not [n for n in names if n[:1].isdigit()], names  # no version directory


# ---------------------------------------------------------------------------------------------


def test_base_build_multi_shard_record_by_record(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    keys_a = rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64)
    keys_b = rng.integers(0, 2**64 - 1, 2000, dtype=np.uint64)
    inputs = tmp_path / "in"
    write_seqfile(inputs / "part-0", keys_a, [value_of(k) for k in keys_a.tolist()])
    write_seqfile(inputs / "sub" / "part-1", keys_b, [value_of(k) for k in keys_b.tolist()])
    # skipped: a dot file, a dot directory, a symlink, an empty marker
    write_seqfile(inputs / ".hidden", [1], [b"hidden"])
    write_seqfile(inputs / ".dir" / "x", [2], [b"hidden"])
    (inputs / "link").symlink_to(inputs / "part-0")
    (inputs / "_SUCCESS").write_bytes(b"")
    output = tmp_path / "out"
    done = run_builder(*build_args(inputs, output, 3))
    assert done.returncode == 0, done.stderr
    version_dir = output / f"{BASE}_{BASE}"
    expected = {int(k): value_of(int(k)) for k in np.concatenate([keys_a, keys_b]).tolist()}
    shards = open_shards(version_dir, 3)
    seen: dict[int, bytes] = {}
    for index, shard in enumerate(shards):
        contents = shard_contents(shard)
        owners = shard_of(np.array(list(contents), dtype=np.uint64), 3, "mod")
        assert (owners == index).all()
        assert shard.meta["dict_name"] == "dict" and shard.meta["shard"] == index
        assert shard.meta["version"] == str(BASE) and shard.meta["mode"] == "base"
        assert shard.meta["shard_num"] == 3 and shard.meta["partitioner"] == "mod"
        seen.update(contents)
    assert seen == expected
    # and through the normal lookup path, keys in request order
    query = np.concatenate([keys_b[:50], np.array([1, 2], dtype=np.uint64)])
    for index, shard in enumerate(shards):
        mine = query[shard_of(query, 3) == index]
        got = ShardStack([shard]).gather(ShardStack([shard]).lookup(mine)).to_list()
        assert got == [expected.get(int(k), b"") for k in mine.tolist()]
    assert sorted(os.listdir(output)) == [f"{BASE}_{BASE}", "meta_info"]


def test_duplicates_last_record_wins_across_files(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    write_seqfile(inputs / "a", [5, 6, 5, 7], [b"a5-first", b"a6", b"a5-last!", b"a7"])
    write_seqfile(inputs / "b" / "c", [6, 8], [b"bc6", b"bc8"])  # "b/c" sorts after "a"
    write_seqfile(inputs / "c", [7, 6], [b"c7", b"c6-final"])
    output = tmp_path / "out"
    done = run_builder(*build_args(inputs, output, 2, workers=2))
    assert done.returncode == 0, done.stderr
    shards = open_shards(output / f"{BASE}_{BASE}", 2)
    merged = {**shard_contents(shards[0]), **shard_contents(shards[1])}
    assert merged == {5: b"a5-last!", 6: b"c6-final", 7: b"c7", 8: b"bc8"}


def test_murmur3_partitioner_matches_routing(tmp_path: Path) -> None:
    keys = np.arange(1000, 1400, dtype=np.uint64) * 4  # all even: `mod 4` would leave gaps
    inputs = tmp_path / "in"
    write_seqfile(inputs / "p", keys, [value_of(k) for k in keys.tolist()])
    output = tmp_path / "out"
    done = run_builder(*build_args(inputs, output, 4, partitioner="murmur3"))
    assert done.returncode == 0, done.stderr
    total = 0
    for index, shard in enumerate(open_shards(output / f"{BASE}_{BASE}", 4)):
        assert shard.meta["partitioner"] == "murmur3"
        contents = shard_contents(shard)
        assert contents, "murmur3 spreads these keys over every shard"
        for key in contents:
            assert mmh3.hash(key.to_bytes(8, "little"), 0, signed=False) % 4 == index
        assert (shard_of(np.array(list(contents), np.uint64), 4, "murmur3") == index).all()
        total += len(contents)
    assert total == 400


def test_delta_with_deletions_layers_over_base(tmp_path: Path) -> None:
    base_in, delta_in = tmp_path / "base", tmp_path / "delta"
    base_keys = list(range(100, 160))
    write_seqfile(base_in / "p", base_keys, [value_of(k, b"base") for k in base_keys])
    # delta: update 100..109, add 200..204, delete 110..114 and 105 (also updated: delete wins)
    delta_keys = list(range(100, 110)) + list(range(200, 205))
    write_seqfile(delta_in / "p", delta_keys, [value_of(k, b"new") for k in delta_keys])
    deletes = tmp_path / "deletes"
    deletes.mkdir()
    (deletes / "a.txt").write_text("# keys gone\n110\n111\n\n112\r\n")
    (deletes / "b.txt").write_text("113\n 114 \n105\n999999\n")
    output = tmp_path / "out"
    done = run_builder(*build_args(base_in, output, 2))
    assert done.returncode == 0, done.stderr
    delta_args = build_args(
        delta_in,
        output,
        2,
        job_mode="delta",
        cur_version=DELTA,
        delete_path=deletes,
        last_version=BASE,
    )
    done = run_builder(*delta_args)
    assert done.returncode == 0, done.stderr
    bases = open_shards(output / f"{BASE}_{BASE}", 2)
    deltas = open_shards(output / f"{BASE}_{DELTA}", 2)
    deleted = {110, 111, 112, 113, 114, 105}
    expected = {k: value_of(k, b"base") for k in base_keys}
    expected.update({k: value_of(k, b"new") for k in delta_keys})
    for k in deleted:
        expected.pop(k, None)
    query = np.array(sorted(set(base_keys) | set(delta_keys) | {999999, 7}), dtype=np.uint64)
    for index in range(2):
        delta = deltas[index]
        assert delta.meta["version"] == f"{BASE}_{DELTA}" and delta.meta["depend"] == str(BASE)
        assert delta.meta["mode"] == "delta"
        stack = ShardStack([bases[index], delta])
        mine = query[shard_of(query, 2) == index]
        result = stack.lookup(mine)
        got = stack.gather(result).to_list()
        assert got == [expected.get(int(k), b"") for k in mine.tolist()]
        assert result.found.tolist() == [int(k) in expected for k in mine.tolist()]
    tombstones = sum(int(d.meta["tombstone_count"]) for d in deltas)
    assert tombstones == 7  # 6 deleted keys + 999999 (unknown to the base: still a tombstone)
    meta = json.loads((output / "meta_info" / f"{DELTA}_{BASE}_0_0.json").read_text())
    assert meta["mode"] == "delta" and meta["version"] == f"{BASE}_{DELTA}"


def test_empty_shards_are_valid(tmp_path: Path) -> None:
    keys = [0, 4, 8, 12]  # all in shard 0 of 4
    inputs = tmp_path / "in"
    write_seqfile(inputs / "p", keys, [b"x" * 4] * 4)
    output = tmp_path / "out"
    done = run_builder(*build_args(inputs, output, 4))
    assert done.returncode == 0, done.stderr
    version_dir = output / f"{BASE}_{BASE}"
    shards = open_shards(version_dir, 4)
    assert [s.record_count for s in shards] == [4, 0, 0, 0]
    for index, shard in enumerate(shards[1:], 1):
        assert not ShardStack([shard]).lookup(np.array([index], np.uint64)).found.any()
        with tarfile.open(version_dir / f"dict_part{index}.tar") as tar:
            assert tar.getnames() == ["./index.cube", "./data.cube"]


def test_variable_width_values_and_width_changes(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    # file a: fixed 8 bytes; file b: fixed 16; file c: mixed including empty and large values
    write_seqfile(inputs / "a", range(0, 40), [b"%08d" % k for k in range(0, 40)])
    write_seqfile(inputs / "b", range(40, 80), [b"%016d" % k for k in range(40, 80)])
    mixed = {k: b"z" * (k % 7) * (300 if k % 5 == 0 else 1) for k in range(80, 120)}
    write_seqfile(inputs / "c", list(mixed), list(mixed.values()))
    expected = {k: b"%08d" % k for k in range(40)}
    expected.update({k: b"%016d" % k for k in range(40, 80)})
    expected.update(mixed)
    for workers, memory in ((1, 1024), (2, 1)):
        output = tmp_path / f"out{workers}"
        args = build_args(inputs, output, 3, workers=workers, memory_mb=memory)
        done = run_builder(*args)
        assert done.returncode == 0, done.stderr
        merged = {}
        for shard in open_shards(output / f"{BASE}_{BASE}", 3):
            assert shard.value_width == 0
            merged.update(shard_contents(shard))
        assert merged == expected


def test_fixed_width_through_small_spill_buffer_and_tmp_dir(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    inputs = tmp_path / "in"
    inputs.mkdir()
    expected = {}
    for number in range(3):
        keys = rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64)
        blob = rng.integers(0, 256, keys.shape[0] * 24, dtype=np.uint8)
        with SequenceFileWriter(inputs / f"part-{number}") as writer:
            writer.write_batch(keys, ValueColumn.fixed(blob, 24))
        rows = blob.reshape(-1, 24)
        expected.update({int(k): rows[i].tobytes() for i, k in enumerate(keys.tolist())})
    output, spill = tmp_path / "out", tmp_path / "spill"
    done = run_builder(*build_args(inputs, output, 5, memory_mb=1, tmp_dir=spill, workers=2))
    assert done.returncode == 0, done.stderr
    assert list(spill.iterdir()) == []  # the spill directory is gone
    merged = {}
    for shard in open_shards(output / f"{BASE}_{BASE}", 5):
        assert shard.value_width == 24
        merged.update(shard_contents(shard))
    assert merged == expected


def test_tar_md5_and_meta_info(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    write_seqfile(inputs / "p", range(50), [value_of(k) for k in range(50)])
    output = tmp_path / "out"
    done = run_builder(*build_args(inputs, output, 2, key_format="cube"))
    assert done.returncode == 0, done.stderr
    version_dir = output / f"{BASE}_{BASE}"
    for index in range(2):
        name = f"dict_part{index}"
        tar_bytes = (version_dir / f"{name}.tar").read_bytes()
        digest = hashlib.md5(tar_bytes).hexdigest()
        assert (version_dir / f"{name}.tar.md5").read_text() == f"{digest}  {name}.tar\n"
        with tarfile.open(version_dir / f"{name}.tar") as tar:
            members = tar.getmembers()
            assert [m.name for m in members] == ["./index.cube", "./data.cube"]
            for member in members:
                assert member.isfile()
                extracted = tar.extractfile(member)
                assert extracted is not None
                inside = extracted.read()
                assert inside == (version_dir / name / member.name[2:]).read_bytes()
        meta = json.loads((output / "meta_info" / f"{BASE}_{BASE}_{index}_0.json").read_text())
        shard = Shard.open(version_dir / name)
        count = shard.record_count
        assert meta["index_total_count"] == str(count)
        assert meta["data_len_list"] == [str((version_dir / name / "data.cube").stat().st_size)]
        assert meta["index_len_list"] == [str((version_dir / name / "index.cube").stat().st_size)]
        assert meta["record_count"] == count == 25
        assert meta["tombstone_count"] == 0 and meta["value_width"] == 12
        assert meta["build_id"] == shard.meta["build_id"]
        assert meta["md5"] == digest and meta["tar_size"] == len(tar_bytes)
        assert meta["partitioner"] == "mod" and meta["shard_num"] == 2
        assert meta["key_format"] == "cube" and meta["mode"] == "base"
        assert meta["shard"] == index and meta["version"] == str(BASE)


def test_genuine_byteswritable_input_is_detected(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    keys = [3, 2**64 - 1, 70000]
    with SequenceFileWriter(inputs / "p", dialect="byteswritable") as writer:
        for key in keys:
            writer.write(key, value_of(key))
    output = tmp_path / "out"
    done = run_builder(*build_args(inputs, output, 1))
    assert done.returncode == 0, done.stderr
    (shard,) = open_shards(output / f"{BASE}_{BASE}", 1)
    assert shard_contents(shard) == {k: value_of(k) for k in keys}
    meta = json.loads((output / "meta_info" / f"{BASE}_{BASE}_0_0.json").read_text())
    assert meta["key_format"] == shard.meta["key_format"] == "bytes_be"


def test_only_build_uses_the_current_time(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    write_seqfile(inputs / "p", [1, 2], [b"a", b"b"])
    output = tmp_path / "out"
    args = ["-dict_name=d", f"--input_path={inputs}", "-output_path", str(output)]
    done = run_builder(*args, "-shard_num", "1")
    assert done.returncode == 0, done.stderr
    assert "built" in done.stdout
    (version,) = [p.name for p in output.iterdir() if p.name != "meta_info"]
    depend, cur = version.split("_")
    assert depend == cur and int(cur) > 1_600_000_000  # now
    assert (output / version / "d_part0.tar").exists()


@pytest.mark.parametrize(
    ("versions", "named"),
    [
        (["-cur_version", "5"], "-cur_version 5"),
        (["-cur_version=5", "-depend_version=5"], "-cur_version 5 and -depend_version 5"),
        (["-depend_version", "7"], "-depend_version 7"),
        (["-only_build=true", "-cur_version", "0"], "-cur_version 0"),
    ],
)
def test_versions_only_build_would_ignore_are_refused(
    tmp_path: Path, versions: list[str], named: str
) -> None:
    """The original ignores -cur_version (and a base's -depend_version) unless
    -only_build=false; here they are refused, nothing built, rather than silently ignored."""
    inputs = tmp_path / "in"
    write_seqfile(inputs / "p", [1, 2], [b"a", b"b"])
    output = tmp_path / "out"
    args = ["-dict_name=d", f"--input_path={inputs}", "-output_path", str(output)]
    done = run_builder(*args, "-shard_num", "1", *versions)
    assert done.returncode == 2, done.stderr
    assert f"{named} would be ignored" in done.stderr and "-only_build=false" in done.stderr
    assert done.stdout == "" and not output.exists()
    # a delta's -depend_version is its base, used with -only_build=true too
    delta = run_builder(*args, "-shard_num", "1", "-job_mode", "delta", "-depend_version", "7")
    assert delta.returncode == 0 and "would be ignored" not in delta.stderr, delta.stderr


def test_existing_version_directory_is_refused(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    write_seqfile(inputs / "p", [1, 2], [b"a", b"b"])
    output = tmp_path / "out"
    existing = output / f"{BASE}_{BASE}"
    existing.mkdir(parents=True)
    (existing / "keep").write_text("mine")
    done = run_builder(*build_args(inputs, output, 1))
    assert done.returncode == 1
    assert "already exists" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert os.listdir(existing) == ["keep"] and (existing / "keep").read_text() == "mine"
    assert sorted(os.listdir(output)) == [existing.name]  # no meta_info, no staging


def test_sigterm_mid_build_leaves_nothing(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    rng = np.random.default_rng(4)
    for number in range(2):
        keys = rng.integers(0, 2**64 - 1, 400_000, dtype=np.uint64)
        blob = rng.integers(0, 256, keys.shape[0] * 40, dtype=np.uint8)
        with SequenceFileWriter(inputs / f"part-{number}") as writer:
            writer.write_batch(keys, ValueColumn.fixed(blob, 40))
    output = tmp_path / "out"
    process = subprocess.Popen(
        [*COMMAND, *build_args(inputs, output, 2, memory_mb=4)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            if output.exists() and any(p.name.startswith(".tmp-") for p in output.iterdir()):
                break
            time.sleep(0.01)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    if process.returncode == 0:  # finished before the signal: then it must be complete
        assert (output / f"{BASE}_{BASE}" / "dict_part1.tar.md5").exists()
    else:
        assert process.returncode == 128 + signal.SIGTERM, err
        assert_no_leftovers(output)
    assert processes_mentioning(str(output), within=10) == []  # no orphaned worker


def processes_mentioning(text: str, within: float) -> list[int]:
    """PIDs whose command line contains `text`, waiting up to `within` s for them to go."""
    deadline = time.monotonic() + within
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if text.encode() in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


# --- bad input: exit 1, one line naming the file and offset, nothing published -------------


def good_file(path: Path, count: int = 500) -> bytes:
    write_seqfile(path, range(count), [value_of(k, width=40) for k in range(count)])
    return path.read_bytes()


def corrupt_truncated(path: Path) -> None:
    data = good_file(path)
    path.write_bytes(data[:-17])


def corrupt_magic(path: Path) -> None:
    data = good_file(path)
    path.write_bytes(b"XYZ" + data[3:])


def corrupt_sync(path: Path) -> None:
    data = good_file(path)
    sync = data[80:96]  # this header is 80 bytes before the sync marker
    at = data.index(SYNC_ESCAPE + sync, 96)
    broken = bytearray(data)
    broken[at + 4] ^= 0xFF
    path.write_bytes(bytes(broken))


def corrupt_codec(path: Path) -> None:
    cls = "org.apache.hadoop.io.BytesWritable"
    path.write_bytes(encode_header(cls, cls, "record", "com.example.NoSuchCodec", None, b"s" * 16))


def corrupt_key_width(path: Path) -> None:
    cls = "org.apache.hadoop.io.BytesWritable"
    record = (12).to_bytes(4, "big") + (4).to_bytes(4, "big") + b"kkkk" + b"valueval"
    path.write_bytes(encode_header(cls, cls, sync=b"s" * 16) + record)


@pytest.mark.parametrize(
    ("corrupt", "extra"),
    [
        (corrupt_truncated, []),
        (corrupt_magic, []),
        (corrupt_sync, []),
        (corrupt_codec, []),
        (corrupt_key_width, ["-key_format", "cube"]),
    ],
    ids=["truncated", "magic", "sync", "codec", "key_width"],
)
def test_bad_input_fails_cleanly(
    tmp_path: Path, corrupt: Callable[[Path], None], extra: list[str]
) -> None:
    inputs = tmp_path / "in"
    good_file(inputs / "a-good")
    bad = inputs / "b-bad"
    corrupt(bad)
    good_file(inputs / "c-good")
    output = tmp_path / "out"
    spill = tmp_path / "spill"
    done = run_builder(*build_args(inputs, output, 2, tmp_dir=spill), *extra)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert str(bad) in lines[0] and " at offset " in lines[0], lines[0]
    assert_no_leftovers(output)
    assert not (output / "meta_info").exists()
    assert list(spill.iterdir()) == []


def test_bad_delete_list_names_file_and_line(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    good_file(inputs / "p", 10)
    deletes = tmp_path / "deletes.txt"
    deletes.write_text("1\n2\n# fine\nthree\n")
    output = tmp_path / "out"
    args = build_args(inputs, output, 1, job_mode="delta", cur_version=DELTA, delete_path=deletes)
    done = run_builder(*args)
    assert done.returncode == 1
    assert f"{deletes} line 4" in done.stderr
    assert_no_leftovers(output)
    deletes.write_text("18446744073709551616\n")
    done = run_builder(*args)
    assert done.returncode == 1 and f"{deletes} line 1" in done.stderr


def test_an_empty_input_is_refused_unless_allow_empty(tmp_path: Path) -> None:
    """An empty input directory (a failed upstream job, a typo) would build an empty version
    that looks like a success: refused, naming the input, nothing published."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "_SUCCESS").write_bytes(b"")  # skipped: it holds no record
    output = tmp_path / "out"
    done = run_builder(*build_args(empty, output, 2))
    assert done.returncode == 1, done.stdout
    assert f"{empty}: no input files" in done.stderr and "-allow_empty" in done.stderr
    assert_no_leftovers(output)
    headers_only = tmp_path / "headers"
    write_seqfile(headers_only / "part-0", [], [])
    done = run_builder(*build_args(headers_only, output, 2))
    assert done.returncode == 1
    assert f"{headers_only}: 1 input files hold no record" in done.stderr
    assert_no_leftovers(output)
    done = run_builder(*build_args(empty, output, 2, "-allow_empty"), "-quiet=false")
    assert done.returncode == 0, done.stderr
    assert "0 records from 0 files" in done.stdout
    assert [s.record_count for s in open_shards(output / f"{BASE}_{BASE}", 2)] == [0, 0]
    # a delta that only deletes keys is not empty
    deletes = tmp_path / "deletes.txt"
    deletes.write_text("7\n")
    args = build_args(empty, output, 2, job_mode="delta", cur_version=DELTA, delete_path=deletes)
    done = run_builder(*args)
    assert done.returncode == 0, done.stderr
    assert sum(s.meta["tombstone_count"] for s in open_shards(output / f"{BASE}_{DELTA}", 2)) == 1


def test_a_delta_of_another_value_width_than_its_base_is_refused(tmp_path: Path) -> None:
    """A fixed-width base (12-byte values) and a delta of 8-byte values would be served as
    variable-width: every get_embeddings would fail. Refused, naming both widths and versions,
    unless -variable_width; a delta without values, or over a base of varying widths, passes."""
    base_in, narrow = tmp_path / "base", tmp_path / "narrow"
    write_seqfile(base_in / "p", range(100, 160), [value_of(k) for k in range(100, 160)])
    write_seqfile(narrow / "p", range(100, 110), [value_of(k, width=8) for k in range(100, 110)])
    output = tmp_path / "out"
    assert run_builder(*build_args(base_in, output, 2)).returncode == 0
    delta = build_args(narrow, output, 2, job_mode="delta", cur_version=DELTA)
    done = run_builder(*delta)
    assert done.returncode == 1, done.stdout
    assert f"delta {BASE}_{DELTA} has 8-byte values, its base {BASE} 12-byte values" in done.stderr
    assert "-variable_width" in done.stderr
    assert not (output / f"{BASE}_{DELTA}").exists()
    assert not list((output / "meta_info").glob(f"{DELTA}_*"))
    same = tmp_path / "same"
    write_seqfile(same / "p", [7], [value_of(7)])
    done = run_builder(*build_args(same, output, 2, job_mode="delta", cur_version=DELTA))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    done = run_builder(*build_args(narrow, output, 2, "-variable_width", job_mode="delta",
                                   cur_version=DELTA + 1))  # fmt: skip
    assert done.returncode == 0, done.stderr
    # deletions only: no width to compare
    deletes = tmp_path / "deletes.txt"
    deletes.write_text("100\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_builder(*build_args(empty, output, 2, job_mode="delta", cur_version=DELTA + 2,
                                   delete_path=deletes))  # fmt: skip
    assert done.returncode == 0, done.stderr
    # a base whose values vary in width takes deltas of any width
    mixed = tmp_path / "mixed"
    write_seqfile(mixed / "p", [1, 2], [b"a", b"bcd"])
    other = tmp_path / "other"
    assert run_builder(*build_args(mixed, other, 1)).returncode == 0
    done = run_builder(*build_args(narrow, other, 1, job_mode="delta", cur_version=DELTA))
    assert done.returncode == 0, done.stderr
    # a base the builder cannot see: built, with a warning
    elsewhere = tmp_path / "elsewhere"
    done = run_builder(*build_args(narrow, elsewhere, 1, job_mode="delta", cur_version=DELTA))
    assert done.returncode == 0, done.stderr
    assert f"not checked against its base {BASE}" in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        [],  # nothing given
        ["-dict_name", "d", "-input_path", "i", "-output_path", "o"],  # no shard_num
        ["-dict_name", "d", "-input_path", "i", "-output_path", "o", "-shard_num", "0"],
        ["-dict_name=d", "-input_path=i", "-output_path=o", "-shard_num=1", "-job_mode=full"],
        ["-dict_name=d", "-input_path=i", "-output_path=o", "-shard_num=1", "-job_mode=delta"],
        ["-dict_name=d", "-input_path=i", "-output_path=o", "-shard_num=1", "-delete_path=x"],
        ["-dict_name=d", "-input_path=i", "-output_path=o", "-shard_num=1", "-partitioner=x"],
        ["-dict_name=d/e", "-input_path=i", "-output_path=o", "-shard_num=1"],
        ["-dict_name=d", "-input_path=i", "-output_path=o", "-shard_num=1", "-bogus=1"],
    ],
)
def test_bad_flags_exit_2(tmp_path: Path, args: list[str]) -> None:
    done = run_builder(*args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1


def test_help_explains_delete_path() -> None:
    done = run_builder("--help")
    assert done.returncode == 0
    assert "-delete_path" in done.stdout and "one decimal key" in done.stdout


# --- -master_address ------------------------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, dict[str, str]]]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        fields = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode()))
        type(self).received.append((self.path, fields))
        body = json.dumps({"success": "0", "message": "ok", "data": None}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[tuple[str, dict[str, str]]]]]:
    _Recorder.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", _Recorder.received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_master_address_registers_each_shard(
    tmp_path: Path, recorder: tuple[str, list[tuple[str, dict[str, str]]]]
) -> None:
    address, received = recorder
    inputs = tmp_path / "in"
    write_seqfile(inputs / "p", range(10), [b"v"] * 10)
    output = tmp_path / "out"
    done = run_builder(*build_args(inputs, output, 2, master_address=address))
    assert done.returncode == 0, done.stderr
    assert sorted(f["shard"] for _, f in received) == ["0", "1"]
    for path, fields in received:
        assert path == "/dict/meta_info/register"
        assert fields["name"] == "dict" and fields["split"] == "0"
        assert fields["version"] == str(BASE) and fields["depend"] == str(BASE)
        local = output / "meta_info" / f"{BASE}_{BASE}_{fields['shard']}_0.json"
        assert json.loads(fields["meta"]) == json.loads(local.read_text())


def test_master_unreachable_exits_3_and_keeps_output(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    write_seqfile(inputs / "p", range(10), [b"v"] * 10)
    output = tmp_path / "out"
    with __import__("socket").socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = run_builder(*build_args(inputs, output, 1, master_address=f"127.0.0.1:{port}"))
    assert done.returncode == 3
    assert "registering" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert (output / f"{BASE}_{BASE}" / "dict_part0.tar").exists()
    assert (output / "meta_info" / f"{BASE}_{BASE}_0_0.json").exists()


def test_the_same_input_builds_the_same_bytes(tmp_path: Path) -> None:
    """A build is a function of its input and flags: two builds with different batching and
    worker counts, seconds apart, write byte-identical shards, tars, md5s and meta_info (build
    ids come from the content, tar times from the version)."""
    inputs, deleted = write_mixed_input(tmp_path)
    digests = []
    for run, (memory, workers) in enumerate([(1024, 2), (1, 1)]):
        output = tmp_path / f"out{run}"
        base = run_builder(*build_args(inputs, output, 3, memory_mb=memory, workers=workers))
        assert base.returncode == 0, base.stderr
        delta = run_builder(
            *build_args(
                inputs / "sub",
                output,
                3,
                job_mode="delta",
                cur_version=DELTA,
                depend_version=BASE,
                delete_path=deleted,
                memory_mb=memory,
                workers=workers,
            )
        )
        assert delta.returncode == 0, delta.stderr
        digests.append(output_digests(output))
        if run == 0:
            time.sleep(1.1)  # a tar stamped with the clock would now differ
    assert digests[0] == digests[1]
    assert len(digests[0]) == 2 * 3 * 4 + 2 * 3  # per shard: 2 files, tar, md5; meta_info


def test_the_summary_counts_distinct_keys_as_well_as_records_read(tmp_path: Path) -> None:
    """Records of one key in two files are two records read and one key built (the last
    wins), and the summary says both."""
    write_seqfile(tmp_path / "in" / "part-0", [1, 2, 3], [value_of(k) for k in (1, 2, 3)])
    write_seqfile(tmp_path / "in" / "part-1", [3, 4], [value_of(k, b"w") for k in (3, 4)])
    output = tmp_path / "out"
    done = run_builder(*build_args(tmp_path / "in", output, 2), "-quiet=false")
    assert done.returncode == 0, done.stderr
    assert "5 records from 2 files" in done.stdout and "4 distinct keys" in done.stdout
    shards = open_shards(output / f"{BASE}_{BASE}", 2)
    assert sum(s.record_count for s in shards) == 4
