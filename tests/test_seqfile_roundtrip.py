"""SequenceFile writer -> reader round trips, every dialect x compression x codec."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cube.codecs import CODECS, lz4_hadoop_compress, lz4_hadoop_decompress
from cube.seqfile import (
    BYTES_WRITABLE,
    SYNC_ESCAPE,
    SequenceFileReader,
    SequenceFileWriter,
    concat_columns,
    encode_header,
    read_header,
)
from cube.seqfile.decode import _column
from cube.values import ValueColumn

LAYOUTS = [("none", None)] + [
    (compression, name)
    for compression in ("record", "block")
    for name in sorted({codec.name for codec in CODECS.values()})
]
EXPECTED_KEY_FORMAT = {"cube": "cube", "byteswritable": "bytes_be"}


def write_file(
    path: Path,
    keys: list[int],
    values: list[bytes],
    dialect: str = "cube",
    compression: str = "none",
    codec: str | None = None,
    batch: bool = True,
    block_bytes: int = 4096,
) -> Path:
    with SequenceFileWriter(
        path, dialect=dialect, compression=compression, codec=codec, block_bytes=block_bytes
    ) as writer:
        if batch:
            writer.write_batch(np.array(keys, dtype=np.uint64), ValueColumn.from_list(values))
        else:
            for key, value in zip(keys, values, strict=True):
                writer.write(key, value)
    return path


def read_back(
    path: Path, batch_bytes: int = 1 << 20, key_format: str = "auto"
) -> tuple[list[int], list[bytes]]:
    with SequenceFileReader(path, key_format, batch_bytes) as reader:
        batches = list(reader.batches())
    for batch in batches:
        assert batch.keys.dtype == np.uint64
        assert batch.offsets.dtype == np.int64 and len(batch.offsets) == len(batch.keys)
        assert batch.path == str(path)
    keys = [k for b in batches for k in b.keys.tolist()]
    values = [v for b in batches for v in b.values.to_list()]
    return keys, values


def sample(n: int, width: int | None = 40, seed: int = 0) -> tuple[list[int], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 1 << 64, n, dtype=np.uint64).tolist()
    if width is None:
        lengths = rng.integers(0, 200, n)
        values = [rng.bytes(int(length)) for length in lengths]
    else:
        values = [rng.bytes(width) for _ in range(n)]
    return keys, values


@pytest.mark.parametrize("dialect", ["cube", "byteswritable"])
@pytest.mark.parametrize(("compression", "codec"), LAYOUTS)
@pytest.mark.parametrize("width", [40, None, 0])
def test_round_trip_every_combination(
    tmp_path: Path, dialect: str, compression: str, codec: str | None, width: int | None
) -> None:
    keys, values = sample(700, width)
    keys[0], keys[1] = 0, (1 << 64) - 1
    path = write_file(tmp_path / "f.seq", keys, values, dialect, compression, codec)
    header = read_header(path)
    assert header.compression == compression
    assert (header.codec is None) == (compression == "none")
    with SequenceFileReader(path) as reader:
        assert reader.key_format == EXPECTED_KEY_FORMAT[dialect]
        raw = list(reader.records())
    for batch_bytes in (100, 5000, 1 << 20):
        assert read_back(path, batch_bytes) == (keys, values)
    key_order = "<Q" if dialect == "cube" else ">Q"
    assert raw == [(struct.pack(key_order, k), v) for k, v in zip(keys, values, strict=True)]


def test_byteswritable_le_payloads(tmp_path: Path) -> None:
    keys, values = sample(50)
    path = write_file(tmp_path / "f.seq", keys, values, "byteswritable")
    swapped = [int.from_bytes(struct.pack(">Q", k), "little") for k in keys]
    assert read_back(path, key_format="bytes_le") == (swapped, values)


@pytest.mark.parametrize("dialect", ["cube", "byteswritable"])
@pytest.mark.parametrize("width", [40, 7, None])
def test_write_batch_is_byte_identical_to_single_writes(
    tmp_path: Path, dialect: str, width: int | None
) -> None:
    """The vectorized writer places sync escapes exactly where the per-record one does."""
    n = 3000 if dialect == "cube" else 40_000  # Hadoop's sync interval is 50 times the Cube one
    keys, values = sample(n, width, seed=3)
    sync = bytes(range(16))
    single, batched = tmp_path / "single", tmp_path / "batched"
    with SequenceFileWriter(single, dialect=dialect, sync=sync) as writer:
        for key, value in zip(keys, values, strict=True):
            writer.write(key, value)
    column = ValueColumn.from_list(values)
    cuts = [0, 1, 2, 37, 38, 500, 1999, 2000, 2950, n]
    if dialect == "byteswritable":
        cuts = [0, 1, 2, 1599, 1600, 1601, 3500, 3501, 20_000, n]
    with SequenceFileWriter(batched, dialect=dialect, sync=sync) as writer:
        for lo, hi in itertools.pairwise(cuts):
            writer.write_batch(
                np.array(keys[lo:hi], dtype=np.uint64), column.take(np.arange(lo, hi))
            )
    assert batched.read_bytes() == single.read_bytes()
    assert single.read_bytes().count(SYNC_ESCAPE + sync) > 10


def test_cube_sync_escape_after_2000_bytes_of_records(tmp_path: Path) -> None:
    """The Cube tools' rule: an escape once the record lengths since the last reach 2000."""
    sync = b"S" * 16
    path = tmp_path / "f"
    with SequenceFileWriter(path, sync=sync) as writer:
        for key in range(100):
            writer.write(key, b"v" * 92)  # record_len 100
    data = path.read_bytes()
    start = read_header(path).data_offset
    first = data.index(SYNC_ESCAPE + sync, start)
    assert first == start + 20 * 108  # after 20 records of 100 bytes (+ 8 framing each)
    assert data.count(SYNC_ESCAPE + sync) == 5
    assert data.endswith(SYNC_ESCAPE + sync)  # the 100th record reaches the threshold


def test_records_straddling_chunk_boundaries(tmp_path: Path) -> None:
    keys, values = sample(400, None, seed=5)
    path = write_file(tmp_path / "f", keys, values)
    size = path.stat().st_size
    for batch_bytes in (64, 65, 97, 1000, 4093, size - 1, size, size + 1):
        assert read_back(path, batch_bytes) == (keys, values)


def test_fixed_stride_file_with_one_odd_record_falls_back(tmp_path: Path) -> None:
    keys, values = sample(1000, 40, seed=6)
    values[517] = b"longer value here" * 5
    path = write_file(tmp_path / "f", keys, values, batch=False)
    for batch_bytes in (3000, 1 << 20):
        assert read_back(path, batch_bytes) == (keys, values)


def test_large_values(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    values = [rng.bytes(1_500_000), b"", rng.bytes(3), rng.bytes(2_100_000)]
    keys = [1, 2, 3, 4]
    for dialect in ("cube", "byteswritable"):
        for compression, codec in (("none", None), ("record", "default"), ("block", "lz4")):
            path = write_file(tmp_path / "f", keys, values, dialect, compression, codec)
            assert read_back(path, batch_bytes=4096) == (keys, values)


def test_empty_file(tmp_path: Path) -> None:
    for dialect in ("cube", "byteswritable"):
        for compression, codec in LAYOUTS:
            path = write_file(tmp_path / "f", [], [], dialect, compression, codec)
            with SequenceFileReader(path) as reader:
                assert reader.key_format == "cube"  # nothing to tell the dialect by
                assert list(reader.batches()) == []
                assert list(reader.records()) == []


def test_metadata_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "f"
    metadata = {"z": "last", "a": "first", "ü": "x" * 300}
    with SequenceFileWriter(path, metadata=metadata, compression="block") as writer:
        writer.write(7, b"seven")
    assert read_header(path).metadata == metadata
    assert read_back(path) == ([7], [b"seven"])


def test_writer_renames_on_close_and_leaves_nothing_on_error(tmp_path: Path) -> None:
    path = tmp_path / "feature"
    writer = SequenceFileWriter(path)
    writer.write(1, b"a")
    assert not path.exists()
    assert [p.name.startswith(".") for p in tmp_path.iterdir()] == [True]
    writer.close()
    assert path.exists() and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(RuntimeError), SequenceFileWriter(tmp_path / "other") as writer:
        writer.write(2, b"b")
        raise RuntimeError("producer failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["feature"]


def test_writer_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dialect"):
        SequenceFileWriter(tmp_path / "f", dialect="text")
    with pytest.raises(ValueError, match="codec"):
        SequenceFileWriter(tmp_path / "f", compression="block", codec="lzo")
    with pytest.raises(ValueError, match="sync"):
        SequenceFileWriter(tmp_path / "f", sync=b"short")
    with SequenceFileWriter(tmp_path / "f") as writer:
        with pytest.raises(ValueError, match="uint64"):
            writer.write(-1, b"")
        with pytest.raises(ValueError, match="keys but"):
            writer.write_batch(np.arange(3, dtype=np.uint64), ValueColumn.from_list([b"a"]))
    assert list(tmp_path.iterdir()) == [tmp_path / "f"]


def test_lz4_hadoop_framing_with_several_blocks() -> None:
    data = np.random.default_rng(1).integers(0, 4, 700_000, dtype=np.uint8).tobytes()
    packed = lz4_hadoop_compress(data)
    (first_block,) = struct.unpack_from(">I", packed, 0)
    assert first_block == 256 * 1024 - (256 * 1024 // 255 + 16)
    assert lz4_hadoop_decompress(packed) == data
    assert lz4_hadoop_decompress(b"") == b""


def test_concat_columns() -> None:
    a = ValueColumn.from_list([b"ab", b"cd"])
    b = ValueColumn.from_list([b"e", b"", b"fgh"])
    assert concat_columns([a, b]).to_list() == [b"ab", b"cd", b"e", b"", b"fgh"]
    assert concat_columns([a, a]).width == 2
    assert concat_columns([]).count == 0


# ------------------------------------------------------------------ property tests

key_lists = st.lists(st.integers(0, (1 << 64) - 1), max_size=60)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    dialect=st.sampled_from(["cube", "byteswritable"]),
    layout=st.sampled_from(LAYOUTS),
    batch_bytes=st.integers(64, 3000),
)
def test_property_random_records(
    tmp_path: Path,
    data: st.DataObject,
    dialect: str,
    layout: tuple[str, str | None],
    batch_bytes: int,
) -> None:
    keys = data.draw(key_lists)
    values = data.draw(st.lists(st.binary(max_size=300), min_size=len(keys), max_size=len(keys)))
    compression, codec = layout
    path = write_file(
        tmp_path / "p.seq", keys, values, dialect, compression, codec, block_bytes=900
    )
    expected_format = "bytes_be" if keys and dialect == "byteswritable" else "cube"
    assert read_back(path, batch_bytes, key_format=expected_format) == (keys, values)
    with SequenceFileReader(path, batch_bytes=batch_bytes) as reader:
        assert reader.key_format == expected_format
        assert [v for _, v in reader.records()] == values


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    keys=st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=400),
    width=st.integers(1, 64),
    batch_bytes=st.integers(64, 5000),
    seed=st.integers(0, 1000),
)
def test_property_fixed_width_fast_path(
    tmp_path: Path, keys: list[int], width: int, batch_bytes: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    values = [rng.bytes(width) for _ in keys]
    path = write_file(tmp_path / "fixed.seq", keys, values)
    assert read_back(path, batch_bytes) == (keys, values)


# ------------------------------------------------------------------ fast-path layouts


def hand_made_file(
    path: Path, keys: list[int], values: list[bytes], escape_after: set[int]
) -> list[int]:
    """A Cube-dialect file with sync escapes exactly after the given record indices; returns
    the true file offset of every record."""
    sync = bytes(range(100, 116))
    out = bytearray(encode_header(BYTES_WRITABLE, BYTES_WRITABLE, sync=sync))
    offsets = []
    for i, (key, value) in enumerate(zip(keys, values, strict=True)):
        offsets.append(len(out))
        out += struct.pack(">ii", 8 + len(value), 8) + struct.pack("<Q", key) + value
        if i in escape_after:
            out += SYNC_ESCAPE + sync
    path.write_bytes(bytes(out))
    return offsets


def read_offsets(path: Path, batch_bytes: int) -> tuple[list[int], list[bytes], list[int]]:
    with SequenceFileReader(path, batch_bytes=batch_bytes) as reader:
        batches = list(reader.batches())
    return (
        [k for b in batches for k in b.keys.tolist()],
        [v for b in batches for v in b.values.to_list()],
        [o for b in batches for o in b.offsets.tolist()],
    )


@pytest.mark.parametrize("spacing", ["regular", "irregular", "leading", "none"])
def test_fixed_stride_offsets_are_exact(tmp_path: Path, spacing: str) -> None:
    n = 2000
    keys, values = sample(n, 24, seed=11)
    rng = np.random.default_rng(12)
    escape_after = {
        "regular": set(range(40, n, 41)),
        "irregular": {int(i) for i in np.cumsum(rng.integers(1, 90, n)) if i < n},
        "leading": {0, 1, 2, 500, 501, n - 1},
        "none": set(),
    }[spacing]
    path = tmp_path / "f"
    offsets = hand_made_file(path, keys, values, escape_after)
    for batch_bytes in (64, 700, 4096, 50_000, 1 << 20):
        assert read_offsets(path, batch_bytes) == (keys, values, offsets)


def test_double_escapes_and_escape_at_end(tmp_path: Path) -> None:
    keys, values = sample(300, 16, seed=13)
    path = tmp_path / "f"
    offsets = hand_made_file(path, keys, values, {5, 6, 100, 299})
    data = bytearray(path.read_bytes())
    sync = read_header(path).sync
    # Two escapes in a row between records 10 and 11 are legal too.
    at = offsets[11]
    data[at:at] = SYNC_ESCAPE + sync
    path.write_bytes(bytes(data))
    shifted = offsets[:11] + [o + 20 for o in offsets[11:]]
    for batch_bytes in (64, 1000, 1 << 20):
        assert read_offsets(path, batch_bytes) == (keys, values, shifted)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=30))
def test_ordered_range_gather_matches_the_general_one(
    gaps_and_lengths: list[tuple[int, int]],
) -> None:
    """The mask-based gather used for a chunk's values equals cube.values.gather_ranges."""
    starts, lengths, at = [], [], 0
    for gap, length in gaps_and_lengths:
        at += gap
        starts.append(at)
        lengths.append(length)
        at += length
    buf = np.arange(at + 3, dtype=np.int64).astype(np.uint8)
    starts_a, lengths_a = np.array(starts, np.int64), np.array(lengths, np.int64)
    expected = [buf[s : s + n].tobytes() for s, n in zip(starts, lengths, strict=True)]
    assert _column(buf, starts_a, lengths_a).to_list() == expected
