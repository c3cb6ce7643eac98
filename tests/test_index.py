"""The hash table: every key found with its row, misses missed, tombstones, hard key sets."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cube.index import TOMBSTONE, WINDOW, build_table, is_tombstone, lookup

U64 = st.integers(min_value=0, max_value=2**64 - 1)


def check_table(keys: np.ndarray, deleted: np.ndarray | None = None) -> None:
    built = build_table(keys, deleted)
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


def test_sequential_and_strided_keys_stay_short() -> None:
    """Structured ids (all keys of a `mod` shard share a residue) must not cluster."""
    for keys in (np.arange(100_000, dtype=np.uint64), np.arange(100_000, dtype=np.uint64) * 64):
        table = build_table(keys).table
        assert table.max_probe <= 4
        check_table(keys[:5000])


def test_extreme_keys_and_the_empty_key() -> None:
    keys = np.array([0, 1, 2**64 - 1, 2**64 - 2, 2**63], dtype=np.uint64)
    built = build_table(keys)
    assert built.table.empty_key not in keys.tolist()
    check_table(keys)
    _rows, found = lookup(built.table, np.array([built.table.empty_key], dtype=np.uint64))
    assert not found.any()


def test_empty_table_misses_everything() -> None:
    table = build_table(np.empty(0, dtype=np.uint64)).table
    _rows, found = lookup(table, np.array([0, 1, 2**64 - 1], dtype=np.uint64))
    assert not found.any()
    _rows, found = lookup(table, np.empty(0, dtype=np.uint64))
    assert found.shape == (0,)


def test_long_probe_chains_are_followed() -> None:
    """Force displacement past one bucket: a high load factor makes long runs."""
    keys = np.random.default_rng(3).integers(0, 2**64 - 1, 20_000, dtype=np.uint64)
    built = build_table(keys, load_factor=0.97)
    assert built.table.max_probe >= 2
    rows, found = lookup(built.table, keys)
    assert found.all()
    assert (keys[built.live_order[rows]] == keys).all()
    absent = np.random.default_rng(4).integers(0, 2**64 - 1, 20_000, dtype=np.uint64)
    absent = absent[~np.isin(absent, keys)]
    assert not lookup(built.table, absent)[1].any()


def test_index_overhead_is_within_budget() -> None:
    n = 100_000
    table = build_table(np.arange(n, dtype=np.uint64)).table
    per_key = (table.slot_keys.nbytes + table.bucket_rows.nbytes) / n
    assert per_key <= 15
    assert table.slot_count % WINDOW == 0


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
