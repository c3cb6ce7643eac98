"""SequenceFileReader.located_batches: the same records as batches(), values by file offset."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cube.seqfile import (
    KEY_FORMATS,
    SYNC_ESCAPE,
    SequenceFileError,
    SequenceFileReader,
    SequenceFileWriter,
)
from cube.values import ValueColumn

TESTDATA = Path("/work/shared/testdata/seqfiles")


def located_records(path: Path, key_format: str, batch_bytes: int) -> list[tuple[int, bytes]]:
    data = path.read_bytes()
    out = []
    with SequenceFileReader(path, key_format, batch_bytes) as reader:
        for batch in reader.located_batches():
            located = batch.locations
            assert located.starts.dtype == np.int64 and len(located) == len(batch)
            if located.width:
                assert located.lengths is None
                lengths = [located.width] * len(located)
            else:
                assert located.lengths is not None
                lengths = located.lengths.tolist()
            for key, start, length in zip(
                batch.keys.tolist(), located.starts.tolist(), lengths, strict=True
            ):
                out.append((key, data[start : start + length]))
    return out


def copied_records(path: Path, key_format: str, batch_bytes: int) -> list[tuple[int, bytes]]:
    with SequenceFileReader(path, key_format, batch_bytes) as reader:
        return [
            (key, value)
            for batch in reader.batches()
            for key, value in zip(batch.keys.tolist(), batch.values.to_list(), strict=True)
        ]


def outcome(
    read: Callable[[Path, str, int], list[tuple[int, bytes]]],
    path: Path,
    key_format: str,
    batch_bytes: int,
) -> list[tuple[int, bytes]] | tuple[str, str]:
    try:
        return read(path, key_format, batch_bytes)
    except SequenceFileError as exc:
        return ("error", str(exc))


@given(
    count=st.integers(0, 300),
    widths=st.sampled_from(["fixed", "fixed0", "mixed"]),
    dialect=st.sampled_from(["cube", "byteswritable"]),
    batch=st.booleans(),
    batch_bytes=st.sampled_from([64, 1000, 1 << 20]),
    seed=st.integers(0, 2**16),
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_located_batches_match_batches(
    tmp_path: Path,
    count: int,
    widths: str,
    dialect: str,
    batch: bool,
    batch_bytes: int,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 1 << 64, count, dtype=np.uint64)
    if widths == "fixed":
        values = [bytes(rng.integers(0, 256, 40, dtype=np.uint8)) for _ in range(count)]
    elif widths == "fixed0":
        values = [b""] * count
    else:
        values = [bytes(rng.integers(0, 256, int(rng.integers(0, 90)), np.uint8)) for _ in keys]
    path = tmp_path / f"f-{seed}-{count}"
    with SequenceFileWriter(path, dialect=dialect) as writer:
        if batch:
            writer.write_batch(keys, ValueColumn.from_list(values))
        else:
            for key, value in zip(keys.tolist(), values, strict=True):
                writer.write(key, value)
    expected = copied_records(path, "auto", batch_bytes)
    assert [v for _, v in expected] == values
    assert located_records(path, "auto", batch_bytes) == expected


@pytest.mark.parametrize("name", sorted(p.name for p in TESTDATA.glob("*.seq")))
@pytest.mark.parametrize("key_format", KEY_FORMATS)
def test_located_batches_of_real_files(name: str, key_format: str) -> None:
    path = TESTDATA / name
    with SequenceFileReader(path, key_format) as reader:
        in_place = reader.values_in_place
    expected = outcome(copied_records, path, key_format, 4096)
    if in_place:
        assert outcome(located_records, path, key_format, 4096) == expected
    else:
        with pytest.raises(ValueError, match="not in place"):
            located_records(path, key_format, 4096)


def test_located_batches_report_bad_records_like_batches(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    n = 4000  # 32-byte records: Hadoop's sync interval (102400 bytes) comes after ~3200
    keys = np.arange(n, dtype=np.uint64)
    with SequenceFileWriter(path, dialect="byteswritable") as writer:
        writer.write_batch(keys, ValueColumn.fixed(np.zeros(n * 8, np.uint8), 8))
    data = bytearray(path.read_bytes())
    at = data.rindex(SYNC_ESCAPE) - 12  # a value's BytesWritable length, before the last sync
    data[at : at + 4] = b"\x00\x00\x00\x07"
    path.write_bytes(bytes(data))
    expected = outcome(copied_records, path, "bytes_be", 1 << 20)
    assert expected[0] == "error" and " at offset " in expected[1]
    assert outcome(located_records, path, "bytes_be", 1 << 20) == expected
