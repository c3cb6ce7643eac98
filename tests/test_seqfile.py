"""SequenceFile reader against genuine Hadoop files (tests/data/seqfiles) and against bad input."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cube.codecs import DEFAULT_CODEC
from cube.seqfile import (
    BYTES_WRITABLE,
    LONG_WRITABLE,
    SYNC_ESCAPE,
    TEXT,
    SequenceFileError,
    SequenceFileReader,
    SequenceFileWriter,
    decode_key,
    decode_vint,
    encode_header,
    encode_text,
    encode_vint,
    read_header,
)
from cube.values import ValueColumn

DATA = Path(__file__).parent / "data" / "seqfiles"
ALICE_BOB = [(b"Alice", b"Practice"), (b"Bob", b"Hope")]
ABC = [(struct.pack(">q", i), b"\x00" + bytes([65 + i])) for i in range(26)]
COLINMARC = {
    "colinmarc_uncompressed_byteswritable.seq": ("none", None),
    "colinmarc_record_compressed_zlib_byteswritable.seq": ("record", DEFAULT_CODEC),
    "colinmarc_block_compressed_bzip2_byteswritable.seq": (
        "block",
        "org.apache.hadoop.io.compress.BZip2Codec",
    ),
}


def all_records(path: Path, **kwargs: Any) -> list[tuple[bytes, bytes]]:
    with SequenceFileReader(path, **kwargs) as reader:
        return list(reader.records())


def all_batches(path: Path, **kwargs: Any) -> tuple[np.ndarray, list[bytes], np.ndarray]:
    with SequenceFileReader(path, **kwargs) as reader:
        batches = list(reader.batches())
    keys = np.concatenate([b.keys for b in batches]) if batches else np.empty(0, np.uint64)
    values = [v for b in batches for v in b.values.to_list()]
    offsets = np.concatenate([b.offsets for b in batches]) if batches else np.empty(0, np.int64)
    return keys, values, offsets


# ------------------------------------------------------------------ genuine Hadoop files


@pytest.mark.parametrize("name", sorted(COLINMARC))
def test_colinmarc_byteswritable_files(name: str) -> None:
    path = DATA / name
    compression, codec = COLINMARC[name]
    header = read_header(path)
    assert (header.version, header.key_class, header.value_class) == (
        6,
        BYTES_WRITABLE,
        BYTES_WRITABLE,
    )
    assert (header.compression, header.codec, header.metadata) == (compression, codec, {})
    assert len(header.sync) == 16
    assert all_records(path) == ALICE_BOB
    assert all_records(path, batch_bytes=64) == ALICE_BOB


@pytest.mark.parametrize("name", sorted(COLINMARC))
@pytest.mark.parametrize("key_format", ["auto", "cube", "bytes_be", "bytes_le"])
def test_colinmarc_keys_are_not_8_bytes_so_batches_fail_clearly(name: str, key_format: str) -> None:
    path = DATA / name
    with SequenceFileReader(path, key_format=key_format) as reader:
        if key_format == "auto":
            assert reader.key_format == "bytes_be"  # genuine BytesWritable, key_len 9
        with pytest.raises(SequenceFileError) as caught:
            list(reader.batches())
    err = caught.value
    assert err.path == str(path)
    assert err.offset >= read_header(path).data_offset
    assert str(err).startswith(f"{path} at offset {err.offset}: ")
    assert "key is" in str(err) and "needs" in str(err)


def test_colinmarc_uncompressed_error_points_at_first_record() -> None:
    path = DATA / "colinmarc_uncompressed_byteswritable.seq"
    with pytest.raises(SequenceFileError, match=r"at offset 96: key is 9 bytes, cube format"):
        all_batches(path, key_format="cube")


@pytest.mark.parametrize(
    "name", ["xorlev_abc_long_text_none.seq", "xorlev_metadata_bzip2_block.seq"]
)
@pytest.mark.parametrize("key_format", ["auto", "long"])
def test_xorlev_long_text_files(name: str, key_format: str) -> None:
    path = DATA / name
    header = read_header(path)
    assert (header.key_class, header.value_class) == (LONG_WRITABLE, TEXT)
    assert all_records(path) == ABC
    with SequenceFileReader(path, key_format=key_format) as reader:
        assert reader.key_format == "long"
    keys, values, offsets = all_batches(path, key_format=key_format, batch_bytes=64)
    assert keys.dtype == np.uint64
    assert keys.tolist() == list(range(26))
    assert values == [v for _, v in ABC]
    assert (offsets >= header.data_offset).all() and (np.diff(offsets) >= 0).all()


def test_xorlev_headers() -> None:
    plain = read_header(DATA / "xorlev_abc_long_text_none.seq")
    assert (plain.compression, plain.codec, plain.metadata) == ("none", None, {})
    meta = read_header(DATA / "xorlev_metadata_bzip2_block.seq")
    assert meta.compression == "block"
    assert meta.codec == "org.apache.hadoop.io.compress.BZip2Codec"
    assert meta.metadata == {"a": "b", "y": "z"}


def test_xorlev_uncompressed_record_offsets_are_exact() -> None:
    path = DATA / "xorlev_abc_long_text_none.seq"
    _, _, offsets = all_batches(path)
    # Every record is 8 + 8 (LongWritable) + 3 (Text "\x00X") bytes, no sync escapes.
    assert offsets.tolist() == [86 + 19 * i for i in range(26)]


@pytest.mark.parametrize("batch_bytes", [64, 1000, 64 << 20])
def test_xorlev_simple_synced_text_keys(batch_bytes: int) -> None:
    path = DATA / "xorlev_simple_text_synced.seq"
    header = read_header(path)
    assert (header.key_class, header.value_class) == (TEXT, "com.example.Simple")
    assert path.read_bytes().count(SYNC_ESCAPE + header.sync) == 18
    records = all_records(path, batch_bytes=batch_bytes)
    assert len(records) == 1000
    assert records[0][0] == b"pibglynhnlikxdybemof"
    assert records[-1][0] == b"uufsjicobjpwfdprzhom"
    assert all(len(v) == 8 for _, v in records)
    assert records[0][1] == bytes.fromhex("251bd763ab822fc3")


def test_xorlev_simple_text_keys_are_not_decimal_ids() -> None:
    path = DATA / "xorlev_simple_text_synced.seq"
    with SequenceFileReader(path) as reader:
        assert reader.key_format == "text"
        with pytest.raises(SequenceFileError) as caught:
            list(reader.batches())
    assert caught.value.offset == 71  # the first record, right after the header
    assert "pibglynhnlikxdybemof" in str(caught.value)
    assert "not a decimal" in str(caught.value)


def test_cube_header_is_byte_identical_to_hadoop(tmp_path: Path) -> None:
    genuine = (DATA / "colinmarc_uncompressed_byteswritable.seq").read_bytes()
    sync = read_header(DATA / "colinmarc_uncompressed_byteswritable.seq").sync
    out = tmp_path / "feature"
    with SequenceFileWriter(out, sync=sync) as writer:
        writer.write(1, b"x")
    assert out.read_bytes()[:96] == genuine[:96]
    assert encode_header(BYTES_WRITABLE, BYTES_WRITABLE, sync=sync) == genuine[:96]


def test_genuine_byteswritable_writer_matches_hadoop_records(tmp_path: Path) -> None:
    """Our BytesWritable record framing, fed Hadoop's own bytes, reproduces Hadoop's file."""
    genuine = (DATA / "colinmarc_uncompressed_byteswritable.seq").read_bytes()
    sync = genuine[80:96]
    records = b""
    for key, value in ALICE_BOB:
        key_w = struct.pack(">I", len(key)) + key
        value_w = struct.pack(">I", len(value)) + value
        records += struct.pack(">ii", len(key_w) + len(value_w), len(key_w)) + key_w + value_w
    assert encode_header(BYTES_WRITABLE, BYTES_WRITABLE, sync=sync) + records == genuine
    assert sync == read_header(DATA / "colinmarc_uncompressed_byteswritable.seq").sync


# ------------------------------------------------------------------ vints and keys


@pytest.mark.parametrize(
    "value", [0, 1, -1, 127, 128, -112, -113, 255, 256, 1 << 31, -(1 << 40), (1 << 63) - 1]
)
def test_vint_round_trip(value: int) -> None:
    data = encode_vint(value)
    assert decode_vint(data, 0) == (value, len(data))


def test_vint_known_encodings() -> None:
    assert encode_vint(34) == b'"'  # the BytesWritable class name length
    assert encode_vint(200) == b"\x8f\xc8"
    assert encode_vint(-200) == b"\x87\xc7"
    assert encode_text("a" * 300)[:3] == b"\x8e\x01\x2c"


def test_decode_key_formats() -> None:
    assert decode_key(struct.pack("<Q", 7), "cube") == 7
    assert decode_key(struct.pack(">Q", 7), "bytes_be") == 7
    assert decode_key(struct.pack(">q", -1), "long") == (1 << 64) - 1
    assert decode_key(b"18446744073709551615", "text") == (1 << 64) - 1
    with pytest.raises(ValueError, match="not a decimal"):
        decode_key(b"18446744073709551616", "text")
    with pytest.raises(ValueError, match="5 bytes"):
        decode_key(b"Alice", "cube")


# ------------------------------------------------------------------ bad input


def write_cube(path: Path, n: int = 300, width: int = 40, sync: bytes | None = None) -> Path:
    rng = np.random.default_rng(n)
    keys = rng.integers(0, 1 << 63, n, dtype=np.uint64)
    values = ValueColumn.fixed(rng.integers(0, 256, n * width, dtype=np.uint8), width)
    with SequenceFileWriter(path, sync=sync) as writer:
        writer.write_batch(keys, values)
    return path


def record_boundaries(data: bytes | bytearray, start: int) -> set[int]:
    """Offsets where a record or sync escape starts (a file cut there is still whole)."""
    bounds, pos = {start}, start
    while pos < len(data):
        record_len, _ = struct.unpack_from(">ii", data, pos)
        pos += 20 if record_len == -1 else 8 + record_len
        bounds.add(pos)
    return bounds


def test_wrong_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 200)
    with pytest.raises(SequenceFileError, match=r"bad at offset 0: not a SequenceFile"):
        SequenceFileReader(path)


def test_missing_file_is_a_sequence_file_error(tmp_path: Path) -> None:
    with pytest.raises(SequenceFileError, match="cannot open"):
        SequenceFileReader(tmp_path / "nope")


def test_unsupported_version(tmp_path: Path) -> None:
    path = tmp_path / "v7"
    path.write_bytes(b"SEQ\x07" + b"\x00" * 100)
    with pytest.raises(SequenceFileError, match="at offset 3: unsupported SequenceFile version 7"):
        read_header(path)


@pytest.mark.parametrize("name", [p.name for p in sorted(DATA.glob("*.seq"))] + ["cube"])
def test_truncated_inside_header(tmp_path: Path, name: str) -> None:
    source = write_cube(tmp_path / "cube") if name == "cube" else DATA / name
    data = source.read_bytes()
    end = read_header(source).data_offset
    for cut in range(end):
        path = tmp_path / "cut"
        path.write_bytes(data[:cut])
        with pytest.raises(
            SequenceFileError, match=r"file ends inside|bytes left in the file"
        ) as caught:
            SequenceFileReader(path)
        assert caught.value.offset <= cut


def test_truncated_inside_records(tmp_path: Path) -> None:
    source = write_cube(tmp_path / "cube", n=120)
    data = source.read_bytes()
    start = read_header(source).data_offset
    rng = np.random.default_rng(0)
    cuts = {start + 1, start + 7, start + 8, len(data) - 1, *rng.integers(start, len(data), 60)}
    for cut in sorted(int(c) for c in cuts - record_boundaries(data, start)):
        path = tmp_path / "cut"
        path.write_bytes(data[:cut])
        for batch_bytes in (64, 1 << 20):
            reader = SequenceFileReader(path, key_format="cube", batch_bytes=batch_bytes)
            with reader, pytest.raises(SequenceFileError, match=r"truncated|ends inside") as caught:
                list(reader.batches())
            assert start <= caught.value.offset < cut


def test_truncated_after_a_sync_escape(tmp_path: Path) -> None:
    source = write_cube(tmp_path / "cube", n=200)
    data = source.read_bytes()
    header = read_header(source)
    escape = data.index(SYNC_ESCAPE + header.sync)
    for cut in (escape + 4, escape + 10):
        path = tmp_path / "cut"
        path.write_bytes(data[:cut])
        with pytest.raises(SequenceFileError, match="truncated") as caught:
            all_batches(path)
        assert caught.value.offset == escape


@pytest.mark.parametrize("name", ["xorlev_simple_text_synced.seq", "cube"])
def test_bad_sync_marker_after_escape(tmp_path: Path, name: str) -> None:
    source = write_cube(tmp_path / "cube") if name == "cube" else DATA / name
    data = bytearray(source.read_bytes())
    header = read_header(source)
    escape = data.index(SYNC_ESCAPE + header.sync, header.data_offset)
    data[escape + 9] ^= 0x55
    path = tmp_path / "badsync"
    path.write_bytes(bytes(data))
    for batch_bytes in (64, 1 << 20):
        reader = SequenceFileReader(path, key_format="cube", batch_bytes=batch_bytes)
        with reader, pytest.raises(SequenceFileError, match="sync marker") as caught:
            list(reader.records())
        assert caught.value.offset == escape


def test_bad_sync_marker_in_block_file(tmp_path: Path) -> None:
    source = DATA / "xorlev_metadata_bzip2_block.seq"
    data = bytearray(source.read_bytes())
    start = read_header(source).data_offset
    data[start + 6] ^= 0x01
    path = tmp_path / "badsync"
    path.write_bytes(bytes(data))
    with pytest.raises(SequenceFileError, match=f"at offset {start}: sync marker"):
        all_records(path)


def test_unknown_codec_names_codec_and_file(tmp_path: Path) -> None:
    path = tmp_path / "lzo.seq"
    codec = "com.hadoop.compression.lzo.LzoCodec"  # GPL, outside Hadoop: not supported
    path.write_bytes(encode_header(BYTES_WRITABLE, BYTES_WRITABLE, "block", codec, sync=b"s" * 16))
    with pytest.raises(SequenceFileError) as caught:
        SequenceFileReader(path)
    assert str(path) in str(caught.value) and codec in str(caught.value)


def test_corrupt_compressed_value(tmp_path: Path) -> None:
    source = DATA / "colinmarc_record_compressed_zlib_byteswritable.seq"
    data = bytearray(source.read_bytes())
    first_record = read_header(source).data_offset
    data[first_record + 8 + 9 + 4] ^= 0xFF  # inside Alice's compressed value
    path = tmp_path / "corrupt"
    path.write_bytes(bytes(data))
    with pytest.raises(SequenceFileError, match=f"at offset {first_record}: value: bad zlib"):
        all_records(path)


def test_corrupt_block_buffer(tmp_path: Path) -> None:
    source = DATA / "xorlev_metadata_bzip2_block.seq"
    data = bytearray(source.read_bytes())
    data[-10] ^= 0xFF
    path = tmp_path / "corrupt"
    path.write_bytes(bytes(data))
    with pytest.raises(SequenceFileError, match="bzip2"):
        all_records(path)


def test_bad_record_lengths(tmp_path: Path) -> None:
    source = write_cube(tmp_path / "cube", n=10)
    data = bytearray(source.read_bytes())
    start = read_header(source).data_offset
    second = start + 56
    data[second : second + 8] = struct.pack(">ii", 40, 48)  # key longer than the record
    path = tmp_path / "bad"
    path.write_bytes(bytes(data))
    with pytest.raises(SequenceFileError, match=f"at offset {second}: bad record lengths"):
        all_batches(path)


def test_wrong_key_width_for_the_chosen_format(tmp_path: Path) -> None:
    path = write_cube(tmp_path / "cube", n=50)
    start = read_header(path).data_offset
    with pytest.raises(SequenceFileError, match=f"at offset {start}: key is 8 bytes, bytes_be"):
        all_batches(path, key_format="bytes_be")
    with pytest.raises(SequenceFileError, match="key BytesWritable length"):
        all_batches(path, key_format="text")


def test_key_width_checked_on_every_record_not_only_the_first(tmp_path: Path) -> None:
    """auto decides once; a later record that does not fit is an error at its offset."""
    path = tmp_path / "mixed"
    with SequenceFileWriter(path, dialect="cube") as writer:
        for key in range(30):
            writer.write(key, b"v" * 10)
    data = bytearray(path.read_bytes())
    header = read_header(path)
    # Re-frame record 20 with a 5-byte key by hand (same record length).
    positions = [
        p
        for p in sorted(record_boundaries(data, header.data_offset))
        if p < len(data) and data[p : p + 4] != SYNC_ESCAPE
    ]
    bad = positions[20]
    data[bad + 4 : bad + 8] = struct.pack(">i", 5)
    path.write_bytes(bytes(data))
    for batch_bytes in (64, 1 << 20):
        with SequenceFileReader(path, batch_bytes=batch_bytes) as reader:
            assert reader.key_format == "cube"
            with pytest.raises(SequenceFileError, match=f"at offset {bad}: key is 5 bytes, cube"):
                list(reader.batches())


def test_byteswritable_value_length_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "bw"
    with SequenceFileWriter(path, dialect="byteswritable") as writer:
        for key in range(5):
            writer.write(key, b"abcd")
    data = bytearray(path.read_bytes())
    start = read_header(path).data_offset
    third = start + 2 * (8 + 12 + 8)
    data[third + 20 : third + 24] = struct.pack(">I", 3)
    path.write_bytes(bytes(data))
    with pytest.raises(SequenceFileError, match=f"at offset {third}: value BytesWritable length 3"):
        all_batches(path)


def test_unknown_key_class_needs_an_explicit_key_format(tmp_path: Path) -> None:
    path = tmp_path / "custom"
    sync = b"q" * 16
    body = struct.pack(">ii", 16, 8) + struct.pack("<Q", 5) + b"payload!"
    path.write_bytes(encode_header("com.example.Key", "com.example.Value", sync=sync) + body)
    with SequenceFileReader(path) as reader:
        assert reader.key_format == "auto"
        assert list(reader.records()) == [(struct.pack("<Q", 5), b"payload!")]
        with pytest.raises(SequenceFileError, match="cannot choose a key format"):
            list(reader.batches())
    keys, values, _ = all_batches(path, key_format="cube")
    assert keys.tolist() == [5] and values == [b"payload!"]


# ------------------------------------------------------------------ older header versions


def old_header(version: int, key_class: str, value_class: str, compressed: bool = False) -> bytes:
    def utf8(name: str) -> bytes:
        return struct.pack(">H", len(name)) + name.encode()

    names = (
        utf8(key_class) + utf8(value_class)
        if version < 4
        else encode_text(key_class) + encode_text(value_class)
    )
    flags = b""
    if version > 2:
        flags += bytes([compressed])
    if version >= 4:
        flags += b"\x00"
    if version >= 5 and compressed:
        flags += encode_text(DEFAULT_CODEC)
    sync = b"Z" * 16 if version > 1 else b""
    return b"SEQ" + bytes([version]) + names + flags + sync


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_older_versions(tmp_path: Path, version: int) -> None:
    body = b""
    for key in (3, 4):
        body += struct.pack(">ii", 16, 8) + struct.pack(">q", key) + b"8 bytes!"
        if version > 1:
            body += SYNC_ESCAPE + b"Z" * 16
    path = tmp_path / f"v{version}"
    path.write_bytes(old_header(version, LONG_WRITABLE, "com.example.V") + body)
    header = read_header(path)
    assert (header.version, header.key_class, header.metadata) == (version, LONG_WRITABLE, {})
    assert header.sync == (b"Z" * 16 if version > 1 else b"")
    keys, values, _ = all_batches(path)
    assert keys.tolist() == [3, 4] and values == [b"8 bytes!"] * 2


def test_version_3_record_compression_defaults_to_zlib(tmp_path: Path) -> None:
    value = zlib.compress(b"old value")
    key = struct.pack(">q", 9)
    body = struct.pack(">ii", len(key) + len(value), len(key)) + key + value
    path = tmp_path / "v3z"
    path.write_bytes(old_header(3, LONG_WRITABLE, "x.V", compressed=True) + body)
    assert read_header(path).codec == DEFAULT_CODEC
    assert all_records(path) == [(key, b"old value")]


def test_version_1_has_no_sync_escapes(tmp_path: Path) -> None:
    path = tmp_path / "v1"
    body = struct.pack(">ii", 16, 8) + struct.pack(">q", 1) + b"12345678"
    path.write_bytes(old_header(1, LONG_WRITABLE, "x.V") + body + SYNC_ESCAPE + b"Z" * 16)
    with pytest.raises(SequenceFileError, match="sync escape in a file without sync"):
        all_records(path)


def test_deflate_codec_is_read_as_zlib(tmp_path: Path) -> None:
    """Hadoop's DeflateCodec writes the same zlib streams as DefaultCodec."""
    source = DATA / "colinmarc_record_compressed_zlib_byteswritable.seq"
    data = source.read_bytes()
    renamed = data.replace(
        encode_text(DEFAULT_CODEC), encode_text(DEFAULT_CODEC[:-12] + "DeflateCodec")
    )
    path = tmp_path / "deflate"
    path.write_bytes(renamed)
    assert (read_header(path).codec or "").endswith("DeflateCodec")
    assert all_records(path) == ALICE_BOB


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.seq")))
def test_encode_header_reproduces_every_hadoop_header(name: str) -> None:
    path = DATA / name
    header = read_header(path)
    encoded = encode_header(
        header.key_class,
        header.value_class,
        header.compression,
        header.codec,
        header.metadata,
        header.sync,
    )
    assert encoded == path.read_bytes()[: header.data_offset]
