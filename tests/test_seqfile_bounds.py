"""Every length a SequenceFile states is checked before it is believed: hostile or truncated
files get a SequenceFileError naming file, offset and field, never a huge allocation, a hang or
a traceback. The files are crafted byte by byte here."""

from __future__ import annotations

import bz2
import os
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from helpers.measure import peak_bytes

from cube import seqfile
from cube.codecs import (
    BZIP2_CODEC,
    CODECS,
    DEFAULT_CODEC,
    LZ4_CODEC,
    CodecError,
    codec_by_name,
    lz4_hadoop_decompress,
)
from cube.seqfile import (
    BYTES_WRITABLE,
    SYNC_ESCAPE,
    SequenceFileError,
    SequenceFileReader,
    SequenceFileWriter,
    encode_header,
    encode_text,
    encode_vint,
    read_header,
)
from cube.values import ValueColumn

SYNC = b"S" * 16
HUGE = 1 << 40
BIN = Path(__file__).resolve().parent.parent / ".venv" / "bin"


def read_everything(path: Path, **kwargs: Any) -> None:
    with SequenceFileReader(path, **kwargs) as reader:
        for _ in reader.records():
            pass


# ------------------------------------------------------------------ header


def header_up_to(field: str) -> bytes:
    """Header bytes up to where `field`'s Text length vint goes (compressed, one metadata)."""
    parts = [b"SEQ\x06"]
    if field == "the key class name":
        return b"".join(parts)
    parts.append(encode_text(BYTES_WRITABLE))
    if field == "the value class name":
        return b"".join(parts)
    parts += [encode_text(BYTES_WRITABLE), b"\x01\x00"]
    if field == "the codec class name":
        return b"".join(parts)
    parts += [encode_text(DEFAULT_CODEC), struct.pack(">i", 1)]
    if field == "metadata key 0":
        return b"".join(parts)
    return b"".join([*parts, encode_text("k")])  # metadata value 0


HEADER_TEXTS = [
    "the key class name",
    "the value class name",
    "the codec class name",
    "metadata key 0",
    "metadata value 0",
]


@pytest.mark.parametrize("field", HEADER_TEXTS)
def test_header_string_longer_than_the_file(tmp_path: Path, field: str) -> None:
    # The defect: a Text length of 2**40 was read as such, and kvtool died with MemoryError.
    path = tmp_path / "huge"
    at = len(header_up_to(field))
    length = encode_vint(HUGE)
    path.write_bytes(header_up_to(field) + length + b"x" * 10)

    def parse() -> None:
        with pytest.raises(SequenceFileError) as caught:
            read_header(path)
        assert caught.value.offset == at
        assert caught.value.problem == (
            f"{field} length {HUGE} exceeds the 10 bytes left in the file"
        )
        assert str(caught.value).startswith(f"{path} at offset {at}: ")

    assert peak_bytes(parse) < 1 << 20


def test_header_string_longer_than_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seqfile.limits, "MAX_HEADER_TEXT_BYTES", 40)
    ok, long = tmp_path / "ok", tmp_path / "long"
    ok.write_bytes(
        encode_header(BYTES_WRITABLE, BYTES_WRITABLE, metadata={"k": "v" * 40}, sync=SYNC)
    )
    assert read_header(ok).metadata == {"k": "v" * 40}
    long.write_bytes(
        encode_header(BYTES_WRITABLE, BYTES_WRITABLE, metadata={"k": "v" * 41}, sync=SYNC)
    )
    head = b"SEQ\x06" + encode_text(BYTES_WRITABLE) * 2 + b"\x00\x00" + struct.pack(">i", 1)
    at = len(head + encode_text("k"))
    with pytest.raises(SequenceFileError) as caught:
        read_header(long)
    assert caught.value.offset == at
    assert caught.value.problem == "metadata value 0 length 41 exceeds the limit of 40 bytes"


def test_metadata_count_beyond_the_file(tmp_path: Path) -> None:
    path = tmp_path / "count"
    head = b"SEQ\x06" + encode_text(BYTES_WRITABLE) * 2 + b"\x00\x00"
    path.write_bytes(head + struct.pack(">i", 2**31 - 1) + SYNC)
    with pytest.raises(SequenceFileError) as caught:
        read_header(path)
    assert caught.value.offset == len(head)
    assert caught.value.problem == (
        "metadata count 2147483647 needs at least 4294967294 bytes, more than the 16 bytes left "
        "in the file"
    )


def test_metadata_count_beyond_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seqfile.limits, "MAX_METADATA_ENTRIES", 2)
    path = tmp_path / "count"
    path.write_bytes(
        encode_header(BYTES_WRITABLE, BYTES_WRITABLE, metadata={"a": "1", "b": "2"}, sync=SYNC)
    )
    assert read_header(path).metadata == {"a": "1", "b": "2"}
    three = {"a": "1", "b": "2", "c": "3"}
    path.write_bytes(encode_header(BYTES_WRITABLE, BYTES_WRITABLE, metadata=three, sync=SYNC))
    with pytest.raises(SequenceFileError, match="metadata count 3 exceeds the limit of 2"):
        read_header(path)


@pytest.mark.slow
def test_kvtool_on_a_huge_header_string(tmp_path: Path) -> None:
    path = tmp_path / "huge.seq"
    path.write_bytes(b"SEQ\x06" + encode_vint(HUGE) + b"x" * 10)
    result = subprocess.run(
        [str(BIN / "kvtool"), str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stderr == (
        f"error: {path} at offset 4: the key class name length {HUGE} exceeds the 10 bytes "
        "left in the file\n"
    )


@pytest.mark.slow
def test_a_fifo_is_refused_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = subprocess.run(
        [str(BIN / "kvtool"), str(fifo)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    assert result.stderr == f"error: {fifo} at offset 0: not a regular file\n"
    with pytest.raises(SequenceFileError, match="not a regular file"):
        SequenceFileReader(tmp_path)


# ------------------------------------------------------------------ records


def record_offsets(path: Path) -> list[int]:
    """Where each record of an uncompressed or record-compressed file starts."""
    data, pos = path.read_bytes(), read_header(path).data_offset
    offsets = []
    while pos < len(data):
        (record_len,) = struct.unpack_from(">i", data, pos)
        if record_len != -1:
            offsets.append(pos)
        pos += 20 if record_len == -1 else 8 + record_len
    return offsets


def cube_file(path: Path, values: list[bytes]) -> tuple[Path, list[int]]:
    """A Cube-dialect file; returns it and each record's offset."""
    with SequenceFileWriter(path, sync=SYNC) as writer:
        for key, value in enumerate(values):
            writer.write(key, value)
    return path, record_offsets(path)


@pytest.mark.parametrize("batch_bytes", [64, 1 << 20])
def test_record_length_beyond_the_file(tmp_path: Path, batch_bytes: int) -> None:
    path, offsets = cube_file(tmp_path / "f", [b"v" * 40, b"w" * 40])
    data = bytearray(path.read_bytes())
    second = offsets[1]
    data[second : second + 4] = struct.pack(">i", 2**31 - 1)
    path.write_bytes(bytes(data))
    left = len(data) - second - 8
    with pytest.raises(SequenceFileError) as caught:
        read_everything(path, batch_bytes=batch_bytes)
    assert caught.value.offset == second
    assert caught.value.problem == (
        f"truncated file: record length 2147483647 exceeds the {left} bytes left in the file"
    )


@pytest.mark.parametrize("fixed", [True, False])
def test_record_length_beyond_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed: bool
) -> None:
    monkeypatch.setattr(seqfile.limits, "MAX_RECORD_BYTES", 100)
    values = [b"v" * 93] * 3 if fixed else [b"v" * 92, b"w" * 93, b"x"]
    path, offsets = cube_file(tmp_path / "f", values)
    bad = offsets[0] if fixed else offsets[1]
    record_len = 8 + len(values[0] if fixed else values[1])
    for batch_bytes in (64, 1 << 20):
        with pytest.raises(SequenceFileError) as caught:
            read_everything(path, batch_bytes=batch_bytes)
        assert caught.value.offset == bad
        assert caught.value.problem == f"record length {record_len} exceeds the limit of 100 bytes"
    monkeypatch.setattr(seqfile.limits, "MAX_RECORD_BYTES", record_len)
    read_everything(path)


def record_compressed(path: Path, values: list[bytes], codec: str = "default") -> Path:
    with SequenceFileWriter(path, compression="record", codec=codec, sync=SYNC) as writer:
        for key, value in enumerate(values):
            writer.write(key, value)
    return path


@pytest.mark.parametrize("codec", ["default", "gzip", "bzip2", "lz4", "snappy", "zstd"])
def test_record_compressed_value_bomb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    monkeypatch.setattr(seqfile.limits, "MAX_RECORD_BYTES", 1 << 20)
    path = record_compressed(tmp_path / "f", [b"ok", bytes(8 << 20)], codec)
    second = record_offsets(path)[1]

    def read() -> None:
        with pytest.raises(SequenceFileError) as caught:
            read_everything(path)
        assert caught.value.offset == second
        assert caught.value.problem.startswith("value: ")
        assert "more than 1048576 bytes" in caught.value.problem

    assert peak_bytes(read) < 4 << 20  # not the 8 MiB the value holds


def test_record_compressed_chunks_stay_within_batch_bytes(tmp_path: Path) -> None:
    # 64 values of 1 MiB that compress to ~1 KiB each: one 4 MiB read holds them all, but
    # the reader decompresses only about batch_bytes of them at a time.
    values = [bytes([i]) * (1 << 20) for i in range(64)]
    path = record_compressed(tmp_path / "f", values)
    seen: list[int] = []

    def read() -> None:
        with SequenceFileReader(path, batch_bytes=4 << 20) as reader:
            for batch in reader.batches():
                assert batch.values.nbytes <= 6 << 20
                seen.extend(batch.keys.tolist())
                assert all(
                    v == bytes([k]) * (1 << 20)
                    for k, v in zip(batch.keys.tolist(), batch.values.to_list(), strict=True)
                )

    assert peak_bytes(read) < 40 << 20  # all at once would be 64 MiB, twice over
    assert seen == list(range(64))


# ------------------------------------------------------------------ block-compressed


def block_file(path: Path, count: int, sections: list[bytes], codec: str = DEFAULT_CODEC) -> int:
    """A block-compressed file with one block of raw section bytes; returns the block start."""
    head = encode_header(BYTES_WRITABLE, BYTES_WRITABLE, "block", codec, sync=SYNC)
    block = SYNC_ESCAPE + SYNC + encode_vint(count)
    for section in sections:
        block += encode_vint(len(section)) + section
    path.write_bytes(head + block)
    return len(head)


def zsections(key_lens: bytes, keys: bytes, value_lens: bytes, values: bytes) -> list[bytes]:
    return [zlib.compress(part) for part in (key_lens, keys, value_lens, values)]


def test_block_record_count_beyond_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "f"
    start = block_file(path, HUGE, zsections(b"\x08", bytes(8), b"\x01", b"v"))
    with pytest.raises(SequenceFileError) as caught:
        read_everything(path)
    assert caught.value.offset == start + 20
    assert caught.value.problem == (
        f"a block's record count {HUGE} exceeds the limit of {seqfile.limits.MAX_BLOCK_RECORDS}"
    )


def test_block_record_count_beyond_its_key_lengths(tmp_path: Path) -> None:
    path = tmp_path / "f"
    start = block_file(path, 1000, zsections(b"\x08\x08", bytes(16), b"\x01\x01", b"vw"))
    with pytest.raises(SequenceFileError) as caught:
        read_everything(path)
    assert caught.value.offset == start
    assert "block key lengths: 2 bytes cannot hold 1000 lengths" in caught.value.problem


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_block_section_size_beyond_the_file(tmp_path: Path, index: int) -> None:
    what = ("key lengths", "keys", "value lengths", "values")[index]
    sections = zsections(b"\x08", bytes(8), b"\x01", b"v")
    head = encode_header(BYTES_WRITABLE, BYTES_WRITABLE, "block", DEFAULT_CODEC, sync=SYNC)
    block = SYNC_ESCAPE + SYNC + encode_vint(1)
    for section in sections[:index]:
        block += encode_vint(len(section)) + section
    at = len(head) + len(block)
    path = tmp_path / "f"
    path.write_bytes(head + block + encode_vint(HUGE) + sections[index])
    with pytest.raises(SequenceFileError) as caught:
        read_everything(path)
    assert caught.value.offset == at
    assert caught.value.problem == (
        f"truncated file: block {what} of {HUGE} bytes run past the end"
    )


@pytest.mark.parametrize(
    ("what", "limit"), [("key lengths", 9), ("keys", 8), ("value lengths", 9), ("values", 1)]
)
def test_block_section_decompression_bomb(tmp_path: Path, what: str, limit: int) -> None:
    parts = {"key lengths": b"\x08", "keys": bytes(8), "value lengths": b"\x01", "values": b"v"}
    parts[what] = bytes(16 << 20)  # 16 MiB of zeros, ~16 KiB compressed
    path = tmp_path / "f"
    start = block_file(path, 1, zsections(*parts.values()))

    def read() -> None:
        with pytest.raises(SequenceFileError) as caught:
            read_everything(path)
        assert caught.value.offset >= start
        assert caught.value.problem.startswith(f"block {what}: ")
        assert f"more than {limit} bytes" in caught.value.problem

    assert peak_bytes(read) < 4 << 20


def test_block_lengths_beyond_the_block_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seqfile.limits, "MAX_BLOCK_BYTES", 1000)
    path = tmp_path / "f"
    block_file(path, 1, zsections(b"\x08", bytes(8), encode_vint(5000), bytes(5000)))
    with pytest.raises(SequenceFileError, match="block values: their lengths add up to 5000"):
        read_everything(path)


def test_block_compressed_section_beyond_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seqfile.limits, "MAX_BLOCK_BYTES", 100)
    path = tmp_path / "f"
    noise = np.random.default_rng(1).bytes(300)
    start = block_file(path, 1, [*zsections(b"\x08", bytes(8), b"\x01", b"v")[:3], noise])
    with pytest.raises(SequenceFileError) as caught:
        read_everything(path)
    assert caught.value.offset > start
    assert caught.value.problem == (
        "block values of 300 compressed bytes exceed the limit of 200 bytes"
    )


def test_lz4_block_length_claim_is_checked_before_allocating(tmp_path: Path) -> None:
    claim = struct.pack(">II", 0xFFFFFFF0, 4) + b"\x10\x00\x00\x00"
    with pytest.raises(
        CodecError, match=r"more than 100 bytes \(block of 4294967280 bytes at byte 0\)"
    ):
        lz4_hadoop_decompress(claim, limit=100)
    path = tmp_path / "f"
    lz4 = CODECS[LZ4_CODEC]
    sections = [lz4.compress(b"\x08"), lz4.compress(bytes(8)), lz4.compress(b"\x01"), claim]
    block_file(path, 1, sections, LZ4_CODEC)
    with pytest.raises(
        SequenceFileError,
        match=r"block values: lz4 data decompresses to more than 1 bytes \(block of 4294967280",
    ):
        read_everything(path)


# ------------------------------------------------------------------ codecs


@pytest.mark.parametrize("name", ["default", "gzip", "bzip2", "lz4", "snappy", "zstd"])
def test_every_codec_stops_at_its_limit(name: str) -> None:
    codec = codec_by_name(name)
    data = bytes(range(256)) * 40
    packed = codec.compress(data)
    assert codec.decompress(packed) == data
    assert codec.decompress(packed, limit=len(data)) == data
    with pytest.raises(CodecError, match=f"more than {len(data) - 1} bytes"):
        codec.decompress(packed, limit=len(data) - 1)
    twice = packed + packed  # Hadoop's streams may be concatenated (blocks, members, frames)
    assert codec.decompress(twice, limit=2 * len(data)) == data * 2
    with pytest.raises(CodecError, match=f"more than {2 * len(data) - 1} bytes"):
        codec.decompress(twice, limit=2 * len(data) - 1)


def test_truncated_streams_are_still_errors() -> None:
    for name, packed in (
        ("default", zlib.compress(b"x" * 1000)),
        ("bzip2", bz2.compress(b"x" * 1000)),
    ):
        with pytest.raises(CodecError, match="truncated"):
            codec_by_name(name).decompress(packed[:-4], limit=10_000)
    with pytest.raises(CodecError):
        CODECS[BZIP2_CODEC].decompress(b"BZh9garbage", limit=100)


def test_reader_still_reads_every_layout(tmp_path: Path) -> None:
    """The checks above cost nothing on good files: every codec, both dialects, large values."""
    rng = np.random.default_rng(3)
    values = [rng.bytes(n) for n in (0, 1, 300, 70_000)]
    for dialect in ("cube", "byteswritable"):
        for compression in ("none", "record", "block"):
            codecs = ("default", "bzip2", "lz4", "snappy", "zstd")
            for codec in (None,) if compression == "none" else codecs:
                path = tmp_path / f"{dialect}-{compression}-{codec}"
                with SequenceFileWriter(
                    path, dialect=dialect, compression=compression, codec=codec
                ) as writer:
                    writer.write_batch(np.arange(4, dtype=np.uint64), ValueColumn.from_list(values))
                with SequenceFileReader(path, batch_bytes=64) as reader:
                    got = [v for b in reader.batches() for v in b.values.to_list()]
                assert got == values, path.name


# ------------------------------------------------------------------ writer


@pytest.mark.parametrize(
    "keys",
    [np.array([1.5, 2.0]), np.array([2.0**60 + 1, 3.0]), np.array([True, False]), ["1", "2"]],
)
def test_writer_refuses_keys_that_are_not_integers(tmp_path: Path, keys: npt.ArrayLike) -> None:
    # float64 keys were cast to uint64 silently: 1.5 became 1, and 2**60 + 1 is not even a
    # float64, so two distinct ids could collide.
    path = tmp_path / "f"
    with (
        pytest.raises(ValueError, match="keys must be an integer array"),
        SequenceFileWriter(path) as writer,
    ):
        writer.write_batch(np.asarray(keys), ValueColumn.from_list([b"a", b"b"]))
    assert list(tmp_path.iterdir()) == []
    with SequenceFileWriter(path) as writer:  # integers of any width are fine
        writer.write_batch(np.array([1, 2], dtype=np.int32), ValueColumn.from_list([b"a", b"b"]))
    with SequenceFileReader(path) as reader:
        assert [k for b in reader.batches() for k in b.keys.tolist()] == [1, 2]
