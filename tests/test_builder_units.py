"""cube-builder pieces: the table sort, delete lists, input listing, spills and their merge."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cube.builder.build import (
    DeleteListError,
    FinishTask,
    list_input_files,
    parse_delete_keys,
    route_keys,
    split_runs,
)
from cube.builder.spill import (
    SourceFile,
    Spiller,
    SpillPart,
    open_parts,
    open_spill,
    remove_part,
)
from cube.hashing import fmix64_inverse
from cube.index import build_table, stable_hash_order
from cube.routing import shard_of
from cube.seqfile import ValueLocations
from cube.values import ValueColumn

# --- cube.index.stable_hash_order: must equal a stable argsort ------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 1000, 70_000])
@pytest.mark.parametrize("mask", [0xFFFFFFFFFFFFFFFF, 0xFFFF000000000000, 0xFFFFFFFFFF00000F])
def test_stable_hash_order_is_a_stable_argsort(n: int, mask: int) -> None:
    rng = np.random.default_rng(n)
    hashes = rng.integers(0, 2**64 - 1, n, dtype=np.uint64) & np.uint64(mask)
    order, sorted_hashes = stable_hash_order(hashes)
    expected = np.argsort(hashes, kind="stable")
    assert (order == expected).all()
    assert (sorted_hashes == hashes[expected]).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=300), st.integers(0, 3))
def test_stable_hash_order_property(values: list[int], repeat: int) -> None:
    # duplicates (repeat) and values sharing long prefixes stress the fix-up of tied runs
    base = np.array(values, dtype=np.uint64)
    hashes = np.concatenate([base, base >> np.uint64(1) << np.uint64(1)] * (repeat + 1))
    order, sorted_hashes = stable_hash_order(hashes)
    expected = np.argsort(hashes, kind="stable")
    assert (order == expected).all() and (sorted_hashes == hashes[expected]).all()


def test_build_table_last_record_wins_with_many_duplicates() -> None:
    keys = np.array([7, 3, 7, 9, 3, 7] * 1000, dtype=np.uint64)
    built = build_table(keys)
    assert sorted(built.live_order.tolist()) == [5997, 5998, 5999]  # the last 9, 3 and 7


# --- delete lists ---------------------------------------------------------------------------


def test_delete_keys_fast_path() -> None:
    data = b"1\n18446744073709551615\r\n  42 \n\n7"
    assert parse_delete_keys(data, "x").tolist() == [1, 2**64 - 1, 42, 7]
    assert parse_delete_keys(b"", "x").tolist() == []


def test_delete_keys_with_comments() -> None:
    data = b"# header\n5\n   # indented comment\n6\n"
    assert parse_delete_keys(data, "x").tolist() == [5, 6]


@pytest.mark.parametrize(
    ("data", "line"),
    [
        (b"1\n2\n3 4\n", 3),  # two keys on one line
        (b"1\n-2\n", 2),
        (b"1\n\n0x10\n", 3),
        (b"18446744073709551616\n", 1),  # 2**64
        (b"99999999999999999999999\n", 1),
        (b"1\n1_000\n", 2),
        (b"# c\n+5\n", 2),
    ],
)
def test_delete_keys_errors_name_the_line(data: bytes, line: int) -> None:
    with pytest.raises(DeleteListError, match=f"^f.txt line {line}: "):
        parse_delete_keys(data, "f.txt")


# --- input listing and work split -----------------------------------------------------------


def test_list_input_files_rules(tmp_path: Path) -> None:
    for name in ["b", "a/z", "a/b/c", "a-b", ".hidden", ".dir/x", "_SUCCESS_empty"]:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"" if name.startswith("_") else b"data")
    os.symlink(tmp_path / "b", tmp_path / "link")
    found = [p.relative_to(tmp_path).as_posix() for p in list_input_files(tmp_path)]
    assert found == ["a/b/c", "a/z", "a-b", "b"]  # depth first, names in byte order
    assert list_input_files(tmp_path / "b") == [tmp_path / "b"]


@pytest.mark.parametrize(
    ("sizes", "groups"),
    [([], 2), ([5], 2), ([1, 1, 1, 1], 2), ([100, 1, 1, 1], 2), ([1, 1, 1, 100], 3), ([3] * 9, 4)],
)
def test_split_runs_cover_everything_in_order(sizes: list[int], groups: int) -> None:
    runs = split_runs(sizes, groups)
    assert len(runs) <= max(1, groups)
    flat = [i for lo, hi in runs for i in range(lo, hi)]
    assert flat == list(range(len(sizes)))
    assert all(hi > lo for lo, hi in runs)


def test_split_runs_balance() -> None:
    assert split_runs([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]


def test_route_keys() -> None:
    keys = np.arange(20, dtype=np.uint64)
    routed = route_keys(keys, 3, "murmur3")
    owners = shard_of(keys, 3, "murmur3")
    for shard, part in enumerate(routed):
        assert part.tolist() == keys[owners == shard].tolist()


# --- spills ---------------------------------------------------------------------------------


def fixed(values: list[bytes]) -> ValueColumn:
    column = ValueColumn.from_list(values)
    assert column.width
    return column


def read_back(part: SpillPart) -> list[tuple[int, bytes]]:
    with open_spill(part) as (keys, values):
        return list(zip(keys.tolist(), values.to_list(), strict=True))


@pytest.mark.parametrize("max_open_shards", [0, 256])
def test_spiller_keeps_order_and_switches_to_lengths(tmp_path: Path, max_open_shards: int) -> None:
    spiller = Spiller(tmp_path, 2, "mod", max_open_shards)
    spiller.add(np.array([0, 1, 2, 3], np.uint64), fixed([b"aa", b"bb", b"cc", b"dd"]))
    spiller.add(np.array([4, 6], np.uint64), fixed([b"eeee", b"gggg"]))  # width changes
    spiller.add(np.array([8, 9], np.uint64), ValueColumn.from_list([b"", b"x" * 1000]))
    parts = spiller.finish()
    assert [p.width for p in parts] == [0, 0]  # both saw more than one width
    assert read_back(parts[0]) == [(0, b"aa"), (2, b"cc"), (4, b"eeee"), (6, b"gggg"), (8, b"")]
    assert read_back(parts[1]) == [(1, b"bb"), (3, b"dd"), (9, b"x" * 1000)]


def test_spiller_fixed_width_needs_no_lengths(tmp_path: Path) -> None:
    spiller = Spiller(tmp_path, 3, "murmur3")
    keys = np.arange(300, dtype=np.uint64)
    for start in range(0, 300, 50):
        blob = np.repeat(keys[start : start + 50].astype(np.uint8), 5)
        spiller.add(keys[start : start + 50], ValueColumn.fixed(blob, 5))
    parts = spiller.finish()
    assert all(p.width == 5 for p in parts) and sum(p.count for p in parts) == 300
    assert not any(p.path("lengths").exists() for p in parts)
    owners = shard_of(keys, 3, "murmur3")
    for shard, part in enumerate(parts):
        expected = [(k, bytes([k % 256]) * 5) for k in keys[owners == shard].tolist()]
        assert read_back(part) == expected


def read_parts(parts: list[SpillPart]) -> list[tuple[int, bytes]]:
    with open_parts(parts) as (keys, values):
        return list(zip(keys.tolist(), values.to_list(), strict=True))


def test_open_parts_in_reader_order(tmp_path: Path) -> None:
    readers = []
    contents = [
        [(10, b"r0-a"), (12, b"r0-b")],  # fixed 4
        [],  # this reader saw nothing for the shard
        [(14, b"r2-aaaa"), (16, b"r2-bbbb")],  # fixed 7
        [(18, b"r3"), (20, b"r3-long")],  # variable
    ]
    for number, records in enumerate(contents):
        spiller = Spiller(tmp_path / f"r{number}", 1, "mod")
        if records:
            keys = np.array([k for k, _ in records], np.uint64)
            spiller.add(keys, ValueColumn.from_list([v for _, v in records]))
        readers.append(spiller.finish()[0])
    assert read_parts(readers) == [kv for records in contents for kv in records]
    for part in readers:
        remove_part(part)
        assert not any(part.path(k).exists() for k in ("keys", "locs", "lengths", "values"))


def test_open_parts_fixed_stays_fixed(tmp_path: Path) -> None:
    parts = []
    for number in range(3):
        spiller = Spiller(tmp_path / f"r{number}", 1, "mod")
        keys = np.arange(number * 10, number * 10 + 10, dtype=np.uint64)
        spiller.add(keys, ValueColumn.fixed(np.full(30, number, np.uint8), 3))
        parts.append(spiller.finish()[0])
    with open_parts(parts) as (keys, values):
        assert values.width == 3 and keys.shape[0] == 30
        assert keys.tolist() == list(range(30))
        assert values.to_list() == [bytes([k // 10] * 3) for k in range(30)]


def write_source(path: Path, records: list[tuple[int, bytes]]) -> tuple[SourceFile, list[int]]:
    """A file of the values back to back with junk between them; their offsets."""
    blob, offsets = bytearray(b"head"), []
    for _, value in records:
        offsets.append(len(blob))
        blob += value + b"~junk~"
    path.write_bytes(bytes(blob))
    return SourceFile.of(str(path), os.stat(path)), offsets


@pytest.mark.parametrize("width", [0, 5])
def test_located_values_mixed_with_copied_ones(tmp_path: Path, width: int) -> None:
    """Values left in input files (two readers, two files each) and values copied into the
    spill (a compressed input) come back in record order, per shard."""
    expected: dict[int, list[tuple[int, bytes]]] = {0: [], 1: []}
    readers = []
    key = 0
    for reader in range(2):
        spiller = Spiller(tmp_path / f"r{reader}", 2, "mod")
        for number in range(3):
            records = []
            for _ in range(7):
                value = bytes([65 + key % 26]) * (width or 1 + key % 4)
                records.append((key, value))
                key += 1
            keys = np.array([k for k, _ in records], np.uint64)
            if number == 1:  # values copied (what a compressed file's records get)
                column = ValueColumn.from_list([v for _, v in records])
                spiller.add(keys, column)
            else:
                source, offsets = write_source(tmp_path / f"in-{reader}-{number}", records)
                lengths = np.array([len(v) for _, v in records], np.int64)
                located = ValueLocations(
                    np.array(offsets, np.int64), width, None if width else lengths
                )
                spiller.add_located(keys, spiller.add_source(source), located)
            for k, v in records:
                expected[k % 2].append((k, v))
        readers.append(spiller.finish())
    for shard in (0, 1):
        assert read_parts([parts[shard] for parts in readers]) == expected[shard]


def test_a_changed_input_fails_the_finish(tmp_path: Path) -> None:
    spiller = Spiller(tmp_path / "r", 1, "mod")
    source, offsets = write_source(tmp_path / "in", [(1, b"abc"), (2, b"def")])
    located = ValueLocations(np.array(offsets, np.int64), 3)
    spiller.add_located(np.array([1, 2], np.uint64), spiller.add_source(source), located)
    parts = spiller.finish()
    (tmp_path / "in").write_bytes(b"another file of another size")
    with pytest.raises(ValueError, match="changed during the build"), open_parts(parts):
        pass


def test_finish_task_is_picklable() -> None:
    import pickle

    task = FinishTask((), np.array([1], np.uint64), "d", "t", {"shard": 0})
    assert pickle.loads(pickle.dumps(task)).deleted.tolist() == [1]


# --- compiled build loops (cube.build_kernels) against the numpy code ------------------------

kernels = pytest.importorskip("cube.build_kernels")
compiled = pytest.mark.skipif(not kernels.COMPILED, reason="numba missing or CUBE_KERNEL=numpy")


def unmix64(hashes: np.ndarray) -> np.ndarray:
    """The keys whose fmix64 are `hashes` (fmix64 is a bijection): crafts hash collisions."""
    return fmix64_inverse(hashes.astype(np.uint64))


def assert_same_tables(
    keys: np.ndarray,
    deleted: np.ndarray | None,
    bits: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cube.index as index

    monkeypatch.setattr(index, "COMPILED_MIN_KEYS", 2)
    fast = build_table(keys, deleted, bits)
    with monkeypatch.context() as numpy_only:
        numpy_only.setattr(index, "compiled_kernels", lambda count: None)
        slow = build_table(keys, deleted, bits)
    for name in ("bucket_starts", "remainders", "deleted_keys"):
        assert np.array_equal(getattr(fast.table, name), getattr(slow.table, name)), name
        assert getattr(fast.table, name).dtype == getattr(slow.table, name).dtype, name
    for name in ("bits", "max_bucket"):
        assert getattr(fast.table, name) == getattr(slow.table, name), name
    assert np.array_equal(fast.live_order, slow.live_order)
    assert fast.tombstone_count == slow.tombstone_count


@compiled
@given(
    n=st.integers(2, 2000),
    space=st.sampled_from([3, 50, 1 << 64]),
    collisions=st.booleans(),
    deletes=st.integers(0, 3),
    top_keys=st.booleans(),
    bits=st.sampled_from([None, 1, 4, 12]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=80, deadline=None)
def test_compiled_build_table_is_the_numpy_one(
    n: int,
    space: int,
    collisions: bool,
    deletes: int,
    top_keys: bool,
    bits: int | None,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, space - 1, n, dtype=np.uint64, endpoint=True)
    if collisions:  # hashes equal but for their low bits: the prefix sort's tie runs
        hashes = rng.integers(0, 1 << 64, n // 3 + 1, dtype=np.uint64)
        twins = hashes ^ rng.integers(0, 64, hashes.shape[0], dtype=np.uint64)
        keys = np.concatenate([keys, unmix64(hashes), unmix64(twins)])
        rng.shuffle(keys)
    if top_keys:  # the largest keys
        keys = np.concatenate([keys, np.array([2**64 - 1, 2**64 - 2], np.uint64)])
    deleted = None
    if deletes:
        deleted = np.concatenate(
            [
                rng.choice(keys, min(keys.shape[0], 5 * deletes)),
                rng.integers(0, 1 << 64, deletes, dtype=np.uint64),
                np.array([2**64 - 1][: deletes % 2], np.uint64),
            ]
        )
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert_same_tables(keys, deleted, bits, monkeypatch)


@compiled
def test_compiled_build_table_edge_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_same_tables(np.full(1000, 7, np.uint64), None, None, monkeypatch)
    top = np.full(10, 2**64 - 1, np.uint64)
    assert_same_tables(top, np.array([2**64 - 1], np.uint64), None, monkeypatch)
    assert_same_tables(np.array([5, 6], np.uint64), np.array([5, 6], np.uint64), None, monkeypatch)
    # every key in the last bucket, and the first: the bucket starts' ends
    hashes = np.full(1000, 0xFFFFFFFF00000000, np.uint64) + np.arange(1000, dtype=np.uint64)
    assert_same_tables(unmix64(hashes), None, None, monkeypatch)
    assert_same_tables(unmix64(np.arange(1000, dtype=np.uint64)), None, None, monkeypatch)


@compiled
@pytest.mark.parametrize("width", [1, 5, 64])
def test_compiled_gather_is_the_numpy_one(
    tmp_path: Path, width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cube.builder.spill as spill

    spiller = Spiller(tmp_path / "r", 1, "mod")
    rng = np.random.default_rng(width)
    expected = []
    for number in range(3):
        records = [(k, bytes(rng.integers(0, 256, width, np.uint8))) for k in range(50)]
        source, offsets = write_source(tmp_path / f"in{number}", records)
        located = ValueLocations(np.array(offsets, np.int64), width)
        spiller.add_located(np.arange(50, dtype=np.uint64), spiller.add_source(source), located)
        expected += [v for _, v in records]
    column = ValueColumn.from_list([bytes([k % 256]) * width for k in range(40)])
    spiller.add(np.arange(40, dtype=np.uint64), column)
    expected += column.to_list()
    parts = spiller.finish()
    rows = rng.permutation(len(expected))
    monkeypatch.setattr(spill, "compiled_kernels", lambda count: kernels)
    with open_parts(parts) as (_keys, values):
        assert values.take(rows).to_list() == [expected[r] for r in rows]
    monkeypatch.setattr(spill, "compiled_kernels", lambda count: None)
    with open_parts(parts) as (_keys, values):
        assert values.take(rows).to_list() == [expected[r] for r in rows]


# --- the tar sink ------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    "sizes", [[1000], [5, 3 << 20, 7 << 20, 512, 1], [8 << 20, 8 << 20], [512, 9 << 20, 1024]]
)
def test_tar_sink_writes_every_byte_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, sizes: list[int]
) -> None:
    """Direct writes of whole buffers, a tail that is not whole blocks (1000 bytes: EINVAL
    under O_DIRECT, written through the cache instead), and the buffered fallback."""
    import cube.builder.tarball as tarball

    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    rng = np.random.default_rng(len(sizes))
    pieces = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]
    path = tmp_path / "out"
    for in_place in (False, True):
        maps = []
        with tarball._TarSink(path) as sink:
            for piece in pieces:
                if in_place:  # whole blocks straight from a page-aligned piece, the rest copied
                    maps.append(mmap.mmap(-1, len(piece)))
                    maps[-1][:] = piece
                    sink.write_in_place(memoryview(maps[-1]))
                else:
                    sink.write(piece)
            sink.wait()
            sink.flush()
        assert path.read_bytes() == b"".join(pieces)


def test_the_spark_worker_environment_is_restored_after_the_session_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Spark build started from a process leaves that process's environment as it found it:
    PYTHONSAFEPATH left set broke every later `python -m` of a module in the working directory
    (found as the CTR demo test failing after a Spark test in the same pytest worker)."""
    from cube.builder.spark_build import worker_environment

    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/their/python")
    with worker_environment():
        assert os.environ["PYTHONSAFEPATH"] == "1"
        assert os.environ["PYSPARK_PYTHON"] == "/opt/their/python"  # theirs is kept
    assert "PYTHONSAFEPATH" not in os.environ
    assert os.environ["PYSPARK_PYTHON"] == "/opt/their/python"
