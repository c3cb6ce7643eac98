"""Shard files: round trip, base + delta + delete stacks, empty shards, refusal of bad files."""

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from cube.format import HEADER_SIZE, ShardFormatError
from cube.index import build_table
from cube.shard import (
    DATA_FILE,
    INDEX_FILE,
    Shard,
    ShardStack,
    write_shard,
)
from cube.values import ValueColumn


def make_shard(
    path: Path,
    keys: npt.ArrayLike,
    values: ValueColumn,
    deleted: npt.ArrayLike | None = None,
    **meta: Any,
) -> Shard:
    keys = np.asarray(keys, dtype=np.uint64)
    deleted = None if deleted is None else np.asarray(deleted, dtype=np.uint64)
    write_shard(path, build_table(keys, deleted), values, meta)
    return Shard.open(path, verify=True)


def fixed_values(n: int, width: int, seed: int = 0) -> ValueColumn:
    blob = np.random.default_rng(seed).integers(0, 256, n * width, dtype=np.uint8)
    return ValueColumn.fixed(blob, width)


def test_fixed_width_round_trip(tmp_path: Path) -> None:
    keys = np.random.default_rng(5).integers(0, 2**64 - 1, 5000, dtype=np.uint64)
    values = fixed_values(5000, 40)
    shard = make_shard(tmp_path / "s", keys, values, dict_name="d", version="100")
    assert shard.meta["dict_name"] == "d" and shard.record_count == 5000
    stack = ShardStack([shard])
    query = np.concatenate([keys[::7], np.array([12345], dtype=np.uint64)])
    result = stack.lookup(query)
    got = stack.gather_fixed(result)
    expected = values.as_rows()[::7]
    assert result.found[:-1].all() and not result.found[-1]
    assert (got[:-1] == expected).all() and (got[-1] == 0).all()
    column = stack.gather(result)
    assert column.get(0) == values.get(0) and column.get(len(query) - 1) == b""


def test_variable_width_round_trip(tmp_path: Path) -> None:
    values = [b"", b"a", b"bc" * 600, bytes(range(256)) * 5000]  # up to 1.28 MB, no 1024 cap
    shard = make_shard(tmp_path / "v", [10, 11, 12, 13], ValueColumn.from_list(values))
    assert shard.value_width == 0
    stack = ShardStack([shard])
    result = stack.lookup(np.array([13, 99, 12, 10, 11], dtype=np.uint64))
    assert result.found.tolist() == [True, False, True, True, True]
    assert stack.gather(result).to_list() == [values[3], b"", values[2], b"", b"a"]


def test_base_delta_delete_stack(tmp_path: Path) -> None:
    base_values = fixed_values(4, 8, seed=1)
    base = make_shard(tmp_path / "base", [1, 2, 3, 4], base_values)
    delta1_values = ValueColumn.fixed(np.full(16, 7, dtype=np.uint8), 8)
    delta1 = make_shard(tmp_path / "d1", [2, 5], delta1_values, deleted=[3])
    delta2_values = ValueColumn.fixed(np.full(8, 9, dtype=np.uint8), 8)
    delta2 = make_shard(tmp_path / "d2", [3], delta2_values, deleted=[1])
    stack = ShardStack([base, delta1, delta2])
    query = np.array([1, 2, 3, 4, 5, 6], dtype=np.uint64)
    result = stack.lookup(query)
    assert result.found.tolist() == [False, True, True, True, True, False]
    assert result.layer.tolist() == [-1, 1, 2, 0, 1, -1]
    got = stack.gather_fixed(result)
    assert got[1].tolist() == [7] * 8 and got[2].tolist() == [9] * 8
    assert got[3].tolist() == base_values.as_rows()[3].tolist()  # rows follow the input
    assert (got[0] == 0).all() and (got[5] == 0).all()
    assert stack.gather(result).to_list()[:3] == [b"", bytes([7] * 8), bytes([9] * 8)]
    # the base alone is untouched
    assert ShardStack([base]).lookup(query).found.tolist() == [True] * 4 + [False] * 2


def test_delta_with_another_width_serves_variable(tmp_path: Path) -> None:
    base_values = fixed_values(2, 4)
    base = make_shard(tmp_path / "base", [1, 2], base_values)
    delta = make_shard(tmp_path / "d", [2], ValueColumn.from_list([b"longer value"]))
    stack = ShardStack([base, delta])
    assert stack.value_width == 0
    values = stack.gather(stack.lookup(np.array([1, 2], dtype=np.uint64))).to_list()
    assert values == [base_values.get(0), b"longer value"]


def test_empty_and_tombstone_only_shards(tmp_path: Path) -> None:
    empty = make_shard(tmp_path / "e", [], ValueColumn.empty())
    assert empty.record_count == 0
    result = ShardStack([empty]).lookup(np.array([0, 1], dtype=np.uint64))
    assert not result.found.any()
    base = make_shard(tmp_path / "b", [1, 2], fixed_values(2, 4))
    deletes = make_shard(tmp_path / "t", [], ValueColumn.empty(), deleted=[2])
    stack = ShardStack([base, deletes])
    assert stack.value_width == 4
    assert stack.lookup(np.array([1, 2], dtype=np.uint64)).found.tolist() == [True, False]


def corrupt(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def good_shard(tmp_path: Path) -> Path:
    make_shard(tmp_path / "good", np.arange(1000), fixed_values(1000, 16)).close()
    return tmp_path / "good"


@pytest.mark.parametrize(
    ("name", "mutate", "message"),
    [
        ("truncated data", lambda p: truncate(p / DATA_FILE, 100), "truncated"),
        ("truncated index", lambda p: truncate(p / INDEX_FILE, 1), "truncated"),
        ("short file", lambda p: truncate(p / INDEX_FILE, 10**9), "too short"),
        ("bad magic", lambda p: corrupt(p / INDEX_FILE, 0), "bad magic"),
        ("bad header", lambda p: corrupt(p / DATA_FILE, 30), "header checksum"),
        ("missing data", lambda p: (p / DATA_FILE).unlink(), "missing"),
        ("older format", lambda p: set_format(p / INDEX_FILE, 1), "older than this reader's"),
        ("newer format", lambda p: set_format(p / DATA_FILE, 99), "newer than this reader's"),
    ],
)
def test_bad_files_are_refused_at_open(
    good_shard: Path, name: str, mutate: Callable[[Path], object], message: str
) -> None:
    mutate(good_shard)
    with pytest.raises(ShardFormatError, match=message) as info:
        Shard.open(good_shard)
    assert str(good_shard) in str(info.value)


def set_format(path: Path, version: int) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = version.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def truncate(path: Path, drop: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: max(0, len(data) - drop)])


def test_corrupted_section_is_refused_by_verify(good_shard: Path) -> None:
    corrupt(good_shard / DATA_FILE, HEADER_SIZE + 5)
    Shard.open(good_shard).close()  # constant-time open does not read the sections
    with pytest.raises(ShardFormatError, match="values checksum mismatch"):
        Shard.open(good_shard, verify=True)


def test_files_from_different_builds_are_refused(tmp_path: Path, good_shard: Path) -> None:
    make_shard(tmp_path / "other", np.arange(1000), fixed_values(1000, 16, seed=9)).close()
    shutil.copy(tmp_path / "other" / DATA_FILE, good_shard / DATA_FILE)
    with pytest.raises(ShardFormatError, match="different builds"):
        Shard.open(good_shard)


def test_no_temp_files_left_behind(good_shard: Path) -> None:
    assert sorted(p.name for p in good_shard.iterdir()) == [DATA_FILE, INDEX_FILE]


def _thp_enabled() -> bool:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


def test_huge_pages_map_the_shard_on_2mib_pages_and_answer_the_same(tmp_path: Path) -> None:
    """`huge_pages` re-reads a shard's page cache in 2 MiB pieces and maps them so (on this
    kind of machine: ext4 with large folios; elsewhere only the answers are checked)."""
    n, width = 400_000, 64  # 25.6 MB of values: several 2 MiB pages
    keys = np.random.default_rng(9).integers(0, 2**64 - 1, n, dtype=np.uint64)
    values = fixed_values(n, width, seed=2)
    write_shard(tmp_path / "s", build_table(keys), values, {})
    plain = Shard.open(tmp_path / "s", verify=True, populate=True)
    query = keys[np.random.default_rng(3).integers(0, n, 5000)]
    expected = ShardStack([plain]).gather_fixed(ShardStack([plain]).lookup(query))
    plain.close()
    huge = Shard.open(tmp_path / "s", verify=True, populate=True, huge_pages=True)
    try:
        stack = ShardStack([huge])
        result = stack.lookup(query)
        assert result.found.all()
        assert (stack.gather_fixed(result) == expected).all()
        if _thp_enabled():
            on_2mib = huge.pmd_mapped_bytes()
            size = sum(f.size for f in huge.files)
            # all but each file's partial first and last 2 MiB (without: about half, as the
            # writes left the page cache)
            assert on_2mib >= 0.7 * size, f"{on_2mib} of {size} bytes on 2 MiB mappings"
    finally:
        huge.close()
