"""Shard files: round trip, base + delta + delete stacks, empty shards, refusal of bad files."""

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from cube import format as fmt
from cube.format import HEADER_SIZE, ShardFormatError
from cube.index import build_table, keys_at
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


# --- index format 3: its sections checked at open; format 2 converted ----------------------


def rewrite_index_header(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Re-encode index.cube's header with `change` applied to its fields (a consistent header
    describing an inconsistent file, as a bad writer or a bit flip before the crc would)."""
    data = bytearray(path.read_bytes())
    fields = fmt.decode_header("index", bytes(data[:HEADER_SIZE]), str(path), len(data))
    change(fields)
    data[:HEADER_SIZE] = fmt.encode_header("index", fields)
    path.write_bytes(bytes(data))


def shrink_section(name: str, by: int) -> Callable[[dict[str, Any]], None]:
    def change(fields: dict[str, Any]) -> None:
        fields["sections"][name][1] -= by

    return change


def drop_section(name: str) -> Callable[[dict[str, Any]], None]:
    def change(fields: dict[str, Any]) -> None:
        del fields["sections"][name]

    return change


def set_field(name: str, value: object) -> Callable[[dict[str, Any]], None]:
    def change(fields: dict[str, Any]) -> None:
        fields[name] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (shrink_section("remainders", 6), "section remainders is 6994 bytes, 7000 expected"),
        (shrink_section("bucket_starts", 4), "section bucket_starts is"),
        (shrink_section("deleted_keys", -3), "section deleted_keys .*out of bounds"),
        (drop_section("remainders"), "section remainders missing"),
        (set_field("bucket_bits", 0), "bucket_bits 0 outside"),
        (set_field("bucket_bits", 40), "bucket_bits 40 outside"),
        (set_field("remainder_bytes", 8), "remainder_bytes 8, 7 expected"),
        (set_field("max_bucket", -1), "max_bucket -1 out of range"),
    ],
)
def test_inconsistent_index_sections_are_refused_at_open(
    good_shard: Path, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    rewrite_index_header(good_shard / INDEX_FILE, change)
    with pytest.raises(ShardFormatError, match=message) as info:
        Shard.open(good_shard)
    assert str(good_shard / INDEX_FILE) in str(info.value)


def test_bucket_starts_not_ending_at_the_row_count_is_refused(good_shard: Path) -> None:
    path = good_shard / INDEX_FILE
    shard = Shard.open(good_shard)
    offset, length, _crc = shard.meta["sections"]["bucket_starts"]
    shard.close()
    data = bytearray(path.read_bytes())
    data[offset + length - 4 : offset + length] = (999).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="bucket_starts ends at row 999, not 1000"):
        Shard.open(good_shard)


def test_corrupted_remainders_are_refused_by_verify(good_shard: Path) -> None:
    shard = Shard.open(good_shard)
    offset = shard.meta["sections"]["remainders"][0]
    shard.close()
    corrupt(good_shard / INDEX_FILE, offset + 7)
    with pytest.raises(ShardFormatError, match="section remainders checksum mismatch") as info:
        Shard.open(good_shard, verify=True)
    assert str(good_shard / INDEX_FILE) in str(info.value)


FORMAT2 = Path(__file__).parent / "data" / "format2"


def _format2_module() -> Any:
    """tests/data/format2/generate.py's functions (the shards' contents)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("format2_generate", FORMAT2 / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("compiled", [True, False])
def test_format2_shards_are_converted_and_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    compiled: bool,
) -> None:  # fmt: skip
    """Shards written by the release before format 3 (tests/data/format2) still open, are
    converted in memory with one line in the log, and answer what was written."""
    from cube import kernel

    if compiled and not kernel.COMPILED:
        pytest.skip("numba not installed")
    monkeypatch.setattr(kernel, "COMPILED", compiled)
    generate = _format2_module()
    shutil.copytree(FORMAT2, tmp_path / "v2")  # (the reader opens files; keep the data clean)
    with caplog.at_level("WARNING", logger="cube.shard"):
        base = Shard.open(tmp_path / "v2" / "base", verify=True)
        delta = Shard.open(tmp_path / "v2" / "delta", verify=True)
    converted = [r.getMessage() for r in caplog.records if "converted" in r.getMessage()]
    assert len(converted) == 2 and "format 2 converted to format 3" in converted[0]
    assert base.files[0].format == 2 and base.converted_s is not None
    keys = generate.base_keys()
    written, deleted = generate.delta_parts()
    assert base.table.row_count == keys.shape[0] and delta.table.row_count == written.shape[0]
    np.testing.assert_array_equal(np.sort(keys_at(base.table, np.arange(602))), np.sort(keys))

    stack = ShardStack([base, delta])
    absent = np.array([3, 5, 2**63 + 1], dtype=np.uint64)
    query = np.concatenate([keys, written, deleted, absent])
    result = stack.lookup(query)
    dead = set(deleted.tolist())
    newer = set(written.tolist())
    expect_found = [
        k not in dead and (k in newer or k in set(keys.tolist())) for k in query.tolist()
    ]
    assert result.found.tolist() == expect_found
    got = stack.gather_fixed(result).view("<u8").reshape(-1)
    with np.errstate(over="ignore"):
        want = np.where(np.isin(query, written), query + np.uint64(1), query)
    np.testing.assert_array_equal(got[result.found], want[result.found])
    base_only = ShardStack([base]).lookup(keys)
    assert base_only.found.all()
    stack.close()
