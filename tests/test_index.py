"""The index: every key found with its row, misses missed, tombstones, hard key sets, its size."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cube.hashing import fmix64, fmix64_inverse
from cube.index import (
    TOMBSTONE,
    bits_for,
    build_table,
    is_tombstone,
    keys_at,
    lookup,
    remainder_bytes,
)

U64 = st.integers(min_value=0, max_value=2**64 - 1)


def check_table(
    keys: np.ndarray, deleted: np.ndarray | None = None, bits: int | None = None
) -> None:
    built = build_table(keys, deleted, bits)
    table = built.table
    deleted_set = set(deleted.tolist()) if deleted is not None else set()
    last_index = {int(k): i for i, k in enumerate(keys)}
    live = {k: i for k, i in last_index.items() if k not in deleted_set}
    assert built.live_order.shape[0] == len(live)
    assert built.tombstone_count == len(deleted_set)

    rows, found = lookup(table, keys)
    for key, row, hit in zip(keys.tolist(), rows.tolist(), found.tolist(), strict=True):
        assert hit
        if key in deleted_set:
            assert row == TOMBSTONE
        else:
            assert built.live_order[row] == live[key]  # last record wins


def test_random_keys_found_with_their_rows() -> None:
    keys = np.random.default_rng(1).integers(0, 2**64 - 1, 50_000, dtype=np.uint64)
    check_table(keys)


def test_absent_keys_are_missed() -> None:
    rng = np.random.default_rng(2)
    keys = rng.integers(0, 2**63, 20_000, dtype=np.uint64)
    table = build_table(keys).table
    absent = rng.integers(2**63, 2**64 - 1, 20_000, dtype=np.uint64)
    _rows, found = lookup(table, absent)
    assert not found.any()


def test_duplicates_last_record_wins() -> None:
    keys = np.array([5, 7, 5, 9, 7, 5], dtype=np.uint64)
    built = build_table(keys)
    rows, found = lookup(built.table, np.array([5, 7, 9], dtype=np.uint64))
    assert found.all()
    assert built.live_order[rows].tolist() == [5, 4, 3]


def test_tombstones_win_over_records() -> None:
    keys = np.arange(100, dtype=np.uint64)
    check_table(keys, deleted=np.array([3, 50, 1000], dtype=np.uint64))
    built = build_table(keys, np.array([3], dtype=np.uint64))
    rows, found = lookup(built.table, np.array([3, 4], dtype=np.uint64))
    assert found.all() and is_tombstone(rows).tolist() == [True, False]


def test_sequential_and_strided_keys_spread() -> None:
    """Structured ids (all keys of a `mod` shard share a residue) must not crowd buckets."""
    for keys in (np.arange(100_000, dtype=np.uint64), np.arange(100_000, dtype=np.uint64) * 64):
        table = build_table(keys).table
        assert table.max_bucket <= 20
        check_table(keys[:5000])


def test_extreme_keys() -> None:
    keys = np.array([0, 1, 2**64 - 1, 2**64 - 2, 2**63], dtype=np.uint64)
    check_table(keys)
    _rows, found = lookup(build_table(keys).table, np.array([2, 3, 2**64 - 3], dtype=np.uint64))
    assert not found.any()


def test_empty_table_misses_everything() -> None:
    table = build_table(np.empty(0, dtype=np.uint64)).table
    assert table.row_count == 0 and table.bucket_starts[-1] == 0
    _rows, found = lookup(table, np.array([0, 1, 2**64 - 1], dtype=np.uint64))
    assert not found.any()
    _rows, found = lookup(table, np.empty(0, dtype=np.uint64))
    assert found.shape == (0,)


def test_one_record() -> None:
    built = build_table(np.array([42], dtype=np.uint64))
    rows, found = lookup(built.table, np.array([42, 43, 0], dtype=np.uint64))
    assert found.tolist() == [True, False, False] and rows[0] == 0


@pytest.mark.parametrize("bits", [1, 2, 5])
def test_crowded_buckets(bits: int) -> None:
    """Few bucket bits: buckets of hundreds of rows, scanned past the numpy lookup's window."""
    keys = np.random.default_rng(bits).integers(0, 2**64 - 1, 3000, dtype=np.uint64)
    built = build_table(keys, bits=bits)
    assert built.table.max_bucket >= 3000 >> (bits + 1)
    check_table(keys, bits=bits)
    absent = np.random.default_rng(99).integers(0, 2**64 - 1, 3000, dtype=np.uint64)
    assert not lookup(built.table, absent[~np.isin(absent, keys)])[1].any()


def test_hashes_sharing_their_top_bits() -> None:
    """Keys whose hashes share the bucket bits and most of the remainder (crafted through the
    inverse hash): one bucket, remainders differing in their last bits only, and neighbours
    of them absent."""
    n = 1000
    bits = bits_for(n)
    base = np.uint64(0x5A5A5A5A5A5A5A5A) & ~np.uint64((1 << (64 - bits)) - 1)
    hashes = base | (np.arange(0, 64, 2, dtype=np.uint64) << np.uint64(3))
    crowd = fmix64_inverse(hashes)
    others = np.random.default_rng(5).integers(0, 2**64 - 1, n - crowd.shape[0], dtype=np.uint64)
    keys = np.concatenate([others, crowd])
    built = build_table(keys)
    assert built.table.max_bucket >= crowd.shape[0]
    check_table(keys)
    near = fmix64_inverse(hashes + np.uint64(8))  # between two of them, and one past the last
    near = near[~np.isin(near, keys)]
    assert not lookup(built.table, near)[1].any()


def test_keys_at_gives_back_the_keys() -> None:
    keys = np.random.default_rng(6).integers(0, 2**64 - 1, 5000, dtype=np.uint64)
    built = build_table(keys)
    rows = np.arange(built.table.row_count)
    np.testing.assert_array_equal(keys_at(built.table, rows), keys[built.live_order])
    np.testing.assert_array_equal(fmix64_inverse(fmix64(keys)), keys)


def test_bits_keep_buckets_small() -> None:
    for n in (10, 1000, 10**6, 10**7, 10**8, 2**32 - 2):
        bits = bits_for(n)
        assert 1 <= bits <= 32
        if n >= 1000:
            assert 2.5 <= n / 2**bits <= 5, n


def test_index_overhead_is_within_budget() -> None:
    """Issue 37: at most 8 bytes a key at 1M keys (a real build), and the formula's figure at
    100M (remainder bytes + 4 bytes a bucket)."""
    n = 1_000_000
    keys = np.random.default_rng(7).integers(0, 2**64 - 1, n, dtype=np.uint64)
    table = build_table(keys).table
    assert table.nbytes == n * table.remainder_bytes + 4 * (2**table.bits + 1)
    assert table.nbytes / n <= 8
    bits = bits_for(10**8)
    assert remainder_bytes(bits) + 4 * (2**bits + 1) / 10**8 <= 7


@settings(max_examples=60, deadline=None)
@given(st.lists(U64, max_size=300), st.lists(U64, max_size=30), st.lists(U64, max_size=50))
def test_property_lookup_agrees_with_a_dict(
    records: list[int], deletes: list[int], probes: list[int]
) -> None:
    keys = np.array(records, dtype=np.uint64)
    deleted = np.array(deletes, dtype=np.uint64)
    built = build_table(keys, deleted)
    expected = {k: i for i, k in enumerate(records)}
    query = np.array(records + deletes + probes, dtype=np.uint64)
    rows, found = lookup(built.table, query)
    for key, row, hit in zip(query.tolist(), rows.tolist(), found.tolist(), strict=True):
        if key in set(deletes):
            assert hit and row == TOMBSTONE
        elif key in expected:
            assert hit and built.live_order[row] == expected[key]
        else:
            assert not hit


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000])
def test_small_tables(n: int) -> None:
    check_table(np.arange(n, dtype=np.uint64) * 3 + 1)
