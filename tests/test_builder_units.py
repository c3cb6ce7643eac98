"""cube-builder pieces: the table sort, delete lists, input listing, spills and their merge."""

from __future__ import annotations

import os

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
from cube.builder.spill import Spiller, merge_parts, open_spill, remove_part
from cube.index import build_table, stable_hash_order
from cube.routing import shard_of
from cube.values import ValueColumn

# --- cube.index.stable_hash_order: must equal a stable argsort ------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 1000, 70_000])
@pytest.mark.parametrize("mask", [0xFFFFFFFFFFFFFFFF, 0xFFFF000000000000, 0xFFFFFFFFFF00000F])
def test_stable_hash_order_is_a_stable_argsort(n, mask):
    rng = np.random.default_rng(n)
    hashes = rng.integers(0, 2**64 - 1, n, dtype=np.uint64) & np.uint64(mask)
    order, sorted_hashes = stable_hash_order(hashes)
    expected = np.argsort(hashes, kind="stable")
    assert (order == expected).all()
    assert (sorted_hashes == hashes[expected]).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=300), st.integers(0, 3))
def test_stable_hash_order_property(values, repeat):
    # duplicates (repeat) and values sharing long prefixes stress the fix-up of tied runs
    base = np.array(values, dtype=np.uint64)
    hashes = np.concatenate([base, base >> np.uint64(1) << np.uint64(1)] * (repeat + 1))
    order, sorted_hashes = stable_hash_order(hashes)
    expected = np.argsort(hashes, kind="stable")
    assert (order == expected).all() and (sorted_hashes == hashes[expected]).all()


def test_build_table_last_record_wins_with_many_duplicates():
    keys = np.array([7, 3, 7, 9, 3, 7] * 1000, dtype=np.uint64)
    built = build_table(keys)
    assert sorted(built.live_order.tolist()) == [5997, 5998, 5999]  # the last 9, 3 and 7


# --- delete lists ---------------------------------------------------------------------------


def test_delete_keys_fast_path():
    data = b"1\n18446744073709551615\r\n  42 \n\n7"
    assert parse_delete_keys(data, "x").tolist() == [1, 2**64 - 1, 42, 7]
    assert parse_delete_keys(b"", "x").tolist() == []


def test_delete_keys_with_comments():
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
def test_delete_keys_errors_name_the_line(data, line):
    with pytest.raises(DeleteListError, match=f"^f.txt line {line}: "):
        parse_delete_keys(data, "f.txt")


# --- input listing and work split -----------------------------------------------------------


def test_list_input_files_rules(tmp_path):
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
def test_split_runs_cover_everything_in_order(sizes, groups):
    runs = split_runs(sizes, groups)
    assert len(runs) <= max(1, groups)
    flat = [i for lo, hi in runs for i in range(lo, hi)]
    assert flat == list(range(len(sizes)))
    assert all(hi > lo for lo, hi in runs)


def test_split_runs_balance():
    assert split_runs([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]


def test_route_keys():
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


def read_back(part) -> list[tuple[int, bytes]]:
    with open_spill(part) as (keys, values):
        return list(zip(keys.tolist(), values.to_list(), strict=True))


@pytest.mark.parametrize("max_open_shards", [0, 256])
def test_spiller_keeps_order_and_switches_to_lengths(tmp_path, max_open_shards):
    spiller = Spiller(tmp_path, 2, "mod", max_open_shards)
    spiller.add(np.array([0, 1, 2, 3], np.uint64), fixed([b"aa", b"bb", b"cc", b"dd"]))
    spiller.add(np.array([4, 6], np.uint64), fixed([b"eeee", b"gggg"]))  # width changes
    spiller.add(np.array([8, 9], np.uint64), ValueColumn.from_list([b"", b"x" * 1000]))
    parts = spiller.finish()
    assert [p.width for p in parts] == [0, 0]  # both saw more than one width
    assert read_back(parts[0]) == [(0, b"aa"), (2, b"cc"), (4, b"eeee"), (6, b"gggg"), (8, b"")]
    assert read_back(parts[1]) == [(1, b"bb"), (3, b"dd"), (9, b"x" * 1000)]


def test_spiller_fixed_width_needs_no_lengths(tmp_path):
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


def test_merge_parts_in_reader_order(tmp_path):
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
    merged = merge_parts(readers)
    assert merged.count == 6 and merged.width == 0
    assert read_back(merged) == [kv for records in contents for kv in records]
    for part in readers[1:]:
        assert not any(part.path(k).exists() for k in ("keys", "values", "lengths"))
    remove_part(merged)
    assert not any(merged.path(k).exists() for k in ("keys", "values", "lengths"))


def test_merge_parts_fixed_stays_fixed(tmp_path):
    parts = []
    for number in range(3):
        spiller = Spiller(tmp_path / f"r{number}", 1, "mod")
        keys = np.arange(number * 10, number * 10 + 10, dtype=np.uint64)
        spiller.add(keys, ValueColumn.fixed(np.full(30, number, np.uint8), 3))
        parts.append(spiller.finish()[0])
    merged = merge_parts(parts)
    assert merged.width == 3 and merged.count == 30
    records = read_back(merged)
    assert [k for k, _ in records] == list(range(30))
    assert [v for _, v in records] == [bytes([k // 10] * 3) for k in range(30)]


def test_finish_task_is_picklable():
    import pickle

    task = FinishTask((), np.array([1], np.uint64), "d", "t", {"shard": 0})
    assert pickle.loads(pickle.dumps(task)).deleted.tolist() == [1]
