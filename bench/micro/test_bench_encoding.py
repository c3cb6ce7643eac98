"""Request/response encoding: the fast API (packed bytes) against the original's messages
(`repeated uint64 keys`, one `DictValue` per key), for a 1000-key batch of 40-byte values.

Each step of a lookup's life on the wire, client and server side:
request build (client), request parse (server), response build (server), response parse
(client, into a (batch, width) matrix as an application wants it).
Run: make bench   (or .venv/bin/pytest bench/micro/test_bench_encoding.py --benchmark-enable)
"""

from __future__ import annotations

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from cube.pb import cube_fast_pb2 as fast
from cube.pb import cube_pb2 as original

BATCH = 1000
WIDTH = 40
MISS = 0xFFFFFFFF


@pytest.fixture(scope="module")
def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 2**64 - 1, BATCH, dtype=np.uint64)
    values = rng.integers(0, 256, (BATCH, WIDTH), dtype=np.uint8)
    return keys, values


# --- request build (client) -----------------------------------------------------------------


def test_request_build_fast(
    benchmark: BenchmarkFixture, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    keys, _ = batch
    wire = benchmark(
        lambda: fast.SeekRequest(keys=keys.astype("<u8").tobytes()).SerializeToString()
    )
    assert len(wire) > BATCH * 8


def test_request_build_original(
    benchmark: BenchmarkFixture, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    keys, _ = batch
    wire = benchmark(lambda: original.DictRequest(keys=keys.tolist()).SerializeToString())
    assert original.DictRequest.FromString(wire).keys[0] == int(keys[0])


# --- request parse (server) -----------------------------------------------------------------


def _fast_request_keys(wire: bytes) -> np.ndarray:
    return np.frombuffer(fast.SeekRequest.FromString(wire).keys, dtype="<u8")


def _original_request_keys(wire: bytes) -> np.ndarray:
    return np.array(original.DictRequest.FromString(wire).keys, dtype=np.uint64)


def test_request_parse_fast(
    benchmark: BenchmarkFixture, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    keys, _ = batch
    wire = fast.SeekRequest(keys=keys.astype("<u8").tobytes()).SerializeToString()
    parsed = benchmark(_fast_request_keys, wire)
    np.testing.assert_array_equal(parsed, keys)


def test_request_parse_original(
    benchmark: BenchmarkFixture, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    keys, _ = batch
    wire = original.DictRequest(keys=keys.tolist()).SerializeToString()
    parsed = benchmark(_original_request_keys, wire)
    np.testing.assert_array_equal(parsed, keys)


# --- response build (server) ----------------------------------------------------------------


def _fast_response(values: np.ndarray, found: np.ndarray) -> bytes:
    return fast.SeekResponse(
        found=found.view(np.uint8).tobytes(),
        values=values.tobytes(),
        value_width=WIDTH,
        version="1700000000",
    ).SerializeToString()


def _original_response(values: np.ndarray, found: np.ndarray) -> bytes:
    # What a handler must do for the original API: one DictValue per key, status per key.
    rows = values.view(f"V{WIDTH}").ravel().tolist()
    response = original.DictResponse(version="1700000000")
    add = response.values.add
    for value, hit in zip(rows, found.tolist(), strict=True):
        if hit:
            add(status=0, value=value)
        else:
            add(status=MISS, value=b"")
    return response.SerializeToString()


def test_response_build_fast(
    benchmark: BenchmarkFixture, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    _, values = batch
    found = np.ones(BATCH, dtype=bool)
    wire = benchmark(_fast_response, values, found)
    assert len(wire) > BATCH * WIDTH


def test_response_build_original(
    benchmark: BenchmarkFixture, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    _, values = batch
    found = np.ones(BATCH, dtype=bool)
    wire = benchmark(_original_response, values, found)
    assert len(original.DictResponse.FromString(wire).values) == BATCH


# --- response parse (client, to a matrix) ---------------------------------------------------


def _fast_matrix(wire: bytes) -> tuple[np.ndarray, np.ndarray]:
    response = fast.SeekResponse.FromString(wire)
    found = np.frombuffer(response.found, dtype=np.bool_)
    width = response.value_width
    return np.frombuffer(response.values, dtype=np.uint8).reshape(-1, width), found


def _original_matrix(wire: bytes) -> tuple[np.ndarray, np.ndarray]:
    response = original.DictResponse.FromString(wire)
    statuses = np.fromiter((v.status for v in response.values), np.uint32, len(response.values))
    found = statuses == 0
    blobs = [v.value if v.status == 0 else bytes(WIDTH) for v in response.values]
    return np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(-1, WIDTH), found


def _with_misses(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every 10th key missing (zero row), so both parsers handle misses."""
    found = np.ones(BATCH, dtype=bool)
    found[::10] = False
    return np.where(found[:, None], values, 0).astype(np.uint8), found


def test_response_parse_fast(
    benchmark: BenchmarkFixture, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    values, found = _with_misses(batch[1])
    wire = _fast_response(values, found)
    matrix, parsed_found = benchmark(_fast_matrix, wire)
    np.testing.assert_array_equal(parsed_found, found)
    np.testing.assert_array_equal(matrix, values)


def test_response_parse_original(
    benchmark: BenchmarkFixture, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    values, found = _with_misses(batch[1])
    wire = _original_response(values, found)
    matrix, parsed_found = benchmark(_original_matrix, wire)
    np.testing.assert_array_equal(parsed_found, found)
    np.testing.assert_array_equal(matrix[found], values[found])
    assert not matrix[~found].any()
