"""The compiled lookup kernel against the numpy path (the oracle): same rows, same found flags,
same gathered bytes, on random tables with hits, misses, deleted keys, crowded buckets and
delta stacks; and the numpy fallback when the kernel is switched off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cube import kernel
from cube.index import TOMBSTONE, build_table
from cube.index import lookup as numpy_lookup
from cube.shard import Shard, ShardStack, write_shard
from cube.values import ValueColumn

pytestmark = pytest.mark.skipif(not kernel.COMPILED, reason="numba not installed")


def _query(rng: np.random.Generator, keys: np.ndarray, deleted: np.ndarray, n: int) -> np.ndarray:
    """Present keys, deleted keys and absent keys, shuffled."""
    parts = [rng.integers(0, 2**64 - 1, n, dtype=np.uint64)]
    if keys.shape[0]:
        parts.append(rng.choice(keys, n))
    if deleted.shape[0]:
        parts.append(rng.choice(deleted, max(1, n // 4)))
    query = np.concatenate(parts)
    rng.shuffle(query)
    return query


def _assert_same(prepared: kernel.KernelTable, query: np.ndarray) -> None:
    want_rows, want_found = numpy_lookup(prepared.table, query)
    rows, found = kernel.lookup(prepared, query)
    np.testing.assert_array_equal(found, want_found)
    np.testing.assert_array_equal(rows[found], want_rows[want_found])
    codes = kernel.lookup_rows(prepared, query)
    np.testing.assert_array_equal(codes[~found], np.uint32(kernel.MISS))


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(0, 3000),
    deleted=st.integers(0, 200),
    bits=st.sampled_from([None, 1, 3, 8]),
    small_keys=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_lookup_matches_numpy(
    count: int, deleted: int, bits: int | None, small_keys: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    high = 5000 if small_keys else 2**64 - 1  # small keys: duplicates and dense ranges
    keys = rng.integers(0, high, count, dtype=np.uint64)
    gone = rng.integers(0, high, deleted, dtype=np.uint64)
    built = build_table(keys, gone, bits=bits)
    prepared = kernel.prepare(built.table)
    _assert_same(prepared, _query(rng, keys, built.table.deleted_keys, 500))


def test_crowded_buckets_are_scanned_past_the_window() -> None:
    """Buckets of more rows than the probe reads without a branch (few bucket bits), and
    buckets at the end of the remainders (whose words would run past the array), both
    answered as numpy does."""
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64)
    for bits in (6, 11, 12):
        built = build_table(keys, bits=bits)
        assert built.table.max_bucket > 8
        query = _query(rng, keys, np.empty(0, np.uint64), 5000)
        last = np.arange(built.table.row_count - 20, built.table.row_count)
        query = np.concatenate([query, keys[built.live_order[last]]])
        _assert_same(kernel.prepare(built.table), query)


def test_edges() -> None:
    """0 and 2**64-1 are absent keys like any other; one of them deleted is a tombstone."""
    built = build_table(np.array([1, 2, 3], dtype=np.uint64))
    prepared = kernel.prepare(built.table)
    edges = np.array([0, 2**64 - 1, 2], dtype=np.uint64)
    _assert_same(prepared, edges)
    assert kernel.lookup(prepared, edges)[1].tolist() == [False, False, True]
    deleted = build_table(np.array([5], np.uint64), np.array([2**64 - 1], np.uint64))
    prepared = kernel.prepare(deleted.table)
    rows, found = kernel.lookup(prepared, np.array([2**64 - 1, 5, 6], np.uint64))
    assert found.tolist() == [True, True, False] and rows[0] == TOMBSTONE
    assert kernel.lookup(prepared, np.empty(0, np.uint64))[0].shape == (0,)


def test_keys_of_any_layout() -> None:
    """Strided, writable or read-only, signed: all normalised, same answers."""
    keys = np.arange(1, 2001, dtype=np.uint64)
    prepared = kernel.prepare(build_table(keys).table)
    strided = np.arange(1, 4001, dtype=np.uint64)[::2]
    assert kernel.lookup(prepared, strided)[1].sum() == 1000
    readonly = keys.copy()
    readonly.flags.writeable = False
    assert kernel.lookup(prepared, readonly)[1].all()


@pytest.mark.parametrize("width", [1, 2, 3, 4, 6, 8, 12, 40, 64])
def test_seek_fixed_gathers_values(width: int) -> None:
    rng = np.random.default_rng(width)
    keys = rng.integers(0, 2**64 - 1, 5000, dtype=np.uint64)
    gone = rng.choice(keys, 100)
    built = build_table(keys, gone)
    values = rng.integers(0, 256, (keys.shape[0], width), dtype=np.uint8)
    rows_by_row = values[built.live_order]  # row r holds record live_order[r]
    prepared = kernel.prepare(built.table)
    query = _query(rng, keys, built.table.deleted_keys, 2000)
    found, out, misses = kernel.seek_fixed(prepared, kernel.value_words(rows_by_row), query, width)
    want_rows, want_found = numpy_lookup(built.table, query)
    want_found &= want_rows != np.uint32(TOMBSTONE)  # deleted keys are not served
    np.testing.assert_array_equal(found, want_found)
    assert misses == int((~want_found).sum())
    np.testing.assert_array_equal(out[found], rows_by_row[want_rows[want_found]])
    assert not out[~found].any()
    # the fallback (what runs without numba) gives the same bytes
    kernel.COMPILED = False
    try:
        found_np, out_np, misses_np = kernel.seek_fixed(
            prepared, kernel.value_words(rows_by_row), query, width
        )
    finally:
        kernel.COMPILED = True
    np.testing.assert_array_equal(found_np, found)
    np.testing.assert_array_equal(out_np, out)
    assert misses_np == misses


def test_stack_of_deltas_matches_numpy(tmp_path: Path) -> None:
    """A base and two deltas (updates, inserts, deletes, a re-insert after a delete) mapped
    from disk: the stack answers the same with the compiled kernel and the numpy one."""
    rng = np.random.default_rng(9)
    width = 16

    def write(name: str, keys: np.ndarray, deleted: np.ndarray | None = None) -> Shard:
        values = ValueColumn.fixed(
            rng.integers(0, 256, keys.shape[0] * width, dtype=np.uint8), width
        )
        write_shard(tmp_path / name, build_table(keys, deleted), values, {"version": name})
        return Shard.open(tmp_path / name)

    base_keys = rng.integers(0, 2**64 - 1, 20_000, dtype=np.uint64)
    delta1_deleted = base_keys[:500]
    delta1 = rng.choice(base_keys, 2000)
    delta2 = np.concatenate([delta1_deleted[:100], rng.integers(0, 2**64 - 1, 300, np.uint64)])
    layers = [
        write("base", base_keys),
        write("d1", delta1, delta1_deleted),
        write("d2", delta2, rng.choice(delta1, 50)),
    ]
    stack = ShardStack(layers)
    query = _query(rng, base_keys, delta1_deleted, 4000)
    compiled = stack.lookup(query)
    values = stack.gather_fixed(compiled)
    kernel.COMPILED = False
    try:
        oracle = stack.lookup(query)
        oracle_values = stack.gather_fixed(oracle)
    finally:
        kernel.COMPILED = True
    np.testing.assert_array_equal(compiled.found, oracle.found)
    np.testing.assert_array_equal(compiled.layer, oracle.layer)
    np.testing.assert_array_equal(compiled.rows[compiled.found], oracle.rows[oracle.found])
    np.testing.assert_array_equal(values, oracle_values)
    assert not compiled.found[np.isin(query, delta1_deleted[100:500])].any()
    assert compiled.found[np.isin(query, delta1_deleted[:100])].all()  # re-inserted by d2
    stack.close()


@pytest.mark.slow
def test_numpy_fallback_when_switched_off(tmp_path: Path) -> None:
    """CUBE_KERNEL=numpy (or no numba) runs the numpy path and says so."""
    code = (
        "import numpy as np; from cube import kernel; from cube.index import build_table;"
        "p = kernel.prepare(build_table(np.arange(1, 100, dtype=np.uint64)).table);"
        "print(kernel.describe(), kernel.COMPILED, int(kernel.lookup(p, np.arange(0, 200,"
        " dtype=np.uint64))[1].sum()), kernel.warm() < 1)"
    )
    env = {**os.environ, "CUBE_KERNEL": "numpy"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["numpy", "(CUBE_KERNEL=numpy)", "False", "99", "True"]


def test_warm_in_background_then_compiled() -> None:
    """A server warms the kernel in a thread; lookups answer (numpy path) meanwhile and use
    the compiled loops once it is done."""
    prepared = kernel.prepare(build_table(np.arange(1, 100, dtype=np.uint64)).table)
    done = kernel.warm_in_background()
    assert kernel.lookup(prepared, np.arange(0, 200, dtype=np.uint64))[1].sum() == 99
    assert done.result(timeout=120) >= 0
    assert kernel.describe().startswith("compiled") and kernel._use_compiled()


def test_a_failed_warm_stays_on_numpy_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "_warming", False)  # restored after the test
    monkeypatch.setattr(kernel, "_warm_failed", "")

    def broken() -> float:
        raise RuntimeError("LLVM ERROR: no such target\nmore lines")

    monkeypatch.setattr(kernel, "warm", broken)
    done = kernel.warm_in_background()
    with pytest.raises(RuntimeError):
        done.result(timeout=60)
    assert not kernel._use_compiled()
    assert "failed to compile: RuntimeError: LLVM ERROR: no such target)" in kernel.describe()
    prepared = kernel.prepare(build_table(np.arange(1, 10, dtype=np.uint64)).table)
    assert kernel.lookup(prepared, np.arange(0, 20, dtype=np.uint64))[1].sum() == 9


SEALED_SCRIPT = r"""
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from helpers.procs import fixed_values, write_version
from cube import kernel
from cube.pb import cube_fast_pb2
from cube.server.service import SeekService
from cube.server.versions import LoadOptions, VersionSlots, load_base, split_dirs

kernel.warm()
kernel.seal()
root = sys.argv[2]
rng = np.random.default_rng(3)
keys = np.arange(1, 3001, dtype=np.uint64)
for width in (1, 2, 3, 4, 5, 8, 12, 16, 32, 40, 64, 0):
    data = f"{root}/w{width}"
    values = fixed_values(keys, width) if width else [bytes(int(k) % 7) for k in keys]
    write_version(data, "1", keys, values)
    write_version(data, "2", keys, fixed_values(keys, width, tag=1) if width else values)
    write_version(data, "2_3", keys[:50], fixed_values(keys[:50], width, 2) if width
                  else values[:50], deleted=keys[100:120])
    for name in ("1", "2_3"):
        slots = VersionSlots()
        slots.install(load_base(split_dirs(data, 1), name, LoadOptions()))
        service = SeekService(slots, max_batch=5000)
        for n in (0, 1, 2, 7, 1000):
            query = rng.integers(0, 3500, n).astype(np.uint64)
            raw = cube_fast_pb2.SeekRequest(keys=query.astype("<u8").tobytes()).SerializeToString()
            service.seek(raw)
            service.answer_seeks([service.parse_seek(raw)], frames=True)
            service.answer_original(query, "original")
        slots.close()
print(sorted(kernel.unwarmed))
"""


@pytest.mark.slow
def test_every_server_lookup_runs_a_signature_warm_compiled(tmp_path: Path) -> None:
    """A server seals its kernel after warm(): no lookup may need a signature warm() did not
    compile (it would compile for a second or more inside a request, on every replica at
    once: the stall of issue 24). Every width, n = 0..1000, base and delta, gRPC, lane and the
    original's face, in a fresh process with the sealed kernel: none falls back."""
    tests_dir = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", SEALED_SCRIPT, tests_dir, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
