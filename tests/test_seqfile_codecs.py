"""Snappy and ZStandard SequenceFiles: files Hadoop wrote (tests/data/hadoop_written), round
trips through the writer, corrupt and truncated input, and decompression bombs."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cramjam
import numpy as np
import pytest
from data.hadoop_written import generate as hadoop_written
from helpers.measure import peak_bytes

from cube import seqfile
from cube.codecs import (
    CODECS,
    SNAPPY_CODEC,
    ZSTD_CODEC,
    CodecError,
    codec_by_name,
    snappy_hadoop_compress,
    snappy_hadoop_decompress,
    zstd_compress,
    zstd_decompress,
)
from cube.seqfile import (
    BYTES_WRITABLE,
    HADOOP_SYNC_INTERVAL,
    SYNC_ESCAPE,
    SequenceFileError,
    SequenceFileReader,
    SequenceFileWriter,
    decode_key,
    encode_header,
    encode_vint,
    read_header,
)
from cube.values import ValueColumn

if TYPE_CHECKING:  # pyspark has no type information: SparkSession is Any to mypy
    from pyspark.sql import SparkSession

DATA = Path(__file__).resolve().parent / "data" / "hadoop_written"
MANIFEST = json.loads((DATA / "expected.json").read_text())
FILES = sorted(MANIFEST["files"])
SYNC = b"S" * 16
CODECS_BY_NAME = {"snappy": SNAPPY_CODEC, "zstd": ZSTD_CODEC}


def expected_records() -> tuple[np.ndarray, list[bytes]]:
    with np.load(DATA / MANIFEST["records"]) as saved:
        keys, lengths, blob = saved["keys"], saved["value_lengths"], saved["values"].tobytes()
    ends = np.cumsum(lengths.astype(np.int64)).tolist()
    values = [blob[end - n : end] for end, n in zip(ends, lengths.tolist(), strict=True)]
    assert len(values) == MANIFEST["count"] and keys.dtype == np.uint64
    return keys, values


EXPECTED_KEYS, EXPECTED_VALUES = expected_records()


def read_batches(path: Path, batch_bytes: int) -> tuple[list[int], list[bytes]]:
    with SequenceFileReader(path, batch_bytes=batch_bytes) as reader:
        batches = list(reader.batches())
    return (
        [k for b in batches for k in b.keys.tolist()],
        [v for b in batches for v in b.values.to_list()],
    )


def check_reads_expected(path: Path, spec: dict[str, Any]) -> None:
    start, stop = spec["records"]
    keys, values = EXPECTED_KEYS[start:stop].tolist(), EXPECTED_VALUES[start:stop]
    for batch_bytes in (4096, 1 << 20, 64 << 20):
        assert read_batches(path, batch_bytes) == (keys, values), batch_bytes
    with SequenceFileReader(path) as reader:
        assert reader.key_format == spec["key_format"]
        got = [(decode_key(k, reader.key_format), v) for k, v in reader.records()]
    assert got == list(zip(keys, values, strict=True))


# ------------------------------------------------------------------ committed files


@pytest.mark.parametrize("name", FILES)
def test_committed_file_reads_exactly(name: str) -> None:
    spec = MANIFEST["files"][name]
    header = read_header(DATA / name)
    assert (header.key_class, header.value_class) == (spec["key_class"], spec["value_class"])
    assert (header.compression, header.codec) == (spec["compression"], spec["codec"])
    assert header.metadata == spec.get("metadata", {})
    check_reads_expected(DATA / name, spec)


def test_the_committed_files_cover_what_they_claim() -> None:
    """Hadoop's own files have sync escapes and multi-chunk snappy blocks; both codecs, both
    compressions, with and without Hadoop."""
    layouts = {(spec["codec"], spec["compression"]) for spec in MANIFEST["files"].values()}
    for codec in (SNAPPY_CODEC, ZSTD_CODEC):
        assert {(codec, "record"), (codec, "block")} <= layouts
    for name in ("hadoop_snappy_record.seq", "hadoop_snappy_block.seq"):
        header = read_header(DATA / name)
        assert (DATA / name).read_bytes().count(SYNC_ESCAPE + header.sync) >= 1
    framing = [snappy_framing(value) for value in record_values(DATA / "hadoop_snappy_record.seq")]
    assert max(len(chunks) for blocks in framing for _, chunks in blocks) >= 2
    assert any(block_len == 0 for blocks in framing for block_len, _ in blocks)


def record_values(path: Path) -> list[bytes]:
    """The (compressed) values of a record-compressed file, walked here independently."""
    header = read_header(path)
    data = path.read_bytes()
    pos, values = header.data_offset, []
    while pos < len(data):
        record_len, key_len = struct.unpack_from(">ii", data, pos)
        if record_len == -1:
            pos += 4 + 16
            continue
        values.append(data[pos + 8 + key_len : pos + 8 + record_len])
        pos += 8 + record_len
    return values


def snappy_framing(data: bytes) -> list[tuple[int, list[int]]]:
    """(block length, [chunk lengths]) of Hadoop's block framing."""
    blocks, pos = [], 0
    while pos < len(data):
        (block_len,) = struct.unpack_from(">I", data, pos)
        pos += 4
        chunks, produced = [], 0
        while produced < block_len:
            (chunk_len,) = struct.unpack_from(">I", data, pos)
            produced += cramjam.snappy.decompress_raw_len(data[pos + 4 : pos + 4 + chunk_len])
            chunks.append(chunk_len)
            pos += 4 + chunk_len
        blocks.append((block_len, chunks))
    return blocks


# ------------------------------------------------------------------ round trips


def sample(n: int, seed: int) -> tuple[list[int], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 1 << 64, n, dtype=np.uint64).tolist()
    lengths = rng.integers(0, 300, n)
    values = [bytes(rng.integers(0, 4, int(length), dtype=np.uint8)) for length in lengths]
    values[n // 3] = bytes(300_000)  # past one snappy chunk (218422 bytes) and one zstd block
    values[n // 2] = rng.bytes(250_000)  # incompressible
    return keys, values


@pytest.mark.parametrize("dialect", ["cube", "byteswritable"])
@pytest.mark.parametrize("compression", ["record", "block"])
@pytest.mark.parametrize("codec", ["snappy", "zstd"])
def test_writer_round_trip(tmp_path: Path, dialect: str, compression: str, codec: str) -> None:
    keys, values = sample(3000, seed=11)
    path = tmp_path / "f.seq"
    with SequenceFileWriter(
        path, dialect=dialect, compression=compression, codec=codec, block_bytes=65536
    ) as writer:
        writer.write_batch(
            np.array(keys[:1000], dtype=np.uint64), ValueColumn.from_list(values[:1000])
        )
        for key, value in zip(keys[1000:], values[1000:], strict=True):
            writer.write(key, value)
    header = read_header(path)
    assert header.codec == CODECS[SNAPPY_CODEC if codec == "snappy" else ZSTD_CODEC].class_name
    assert header.compression == compression
    for batch_bytes in (5000, 1 << 20):
        assert read_batches(path, batch_bytes) == (keys, values)
    with SequenceFileReader(path) as reader:
        assert [v for _, v in reader.records()] == values


@pytest.mark.parametrize("name", ["snappy", "zstd"])
def test_codec_stops_at_its_limit_and_takes_concatenations(name: str) -> None:
    codec = codec_by_name(name)
    data = bytes(range(256)) * 4000
    packed = codec.compress(data)
    assert codec.decompress(packed) == data
    assert codec.decompress(packed, limit=len(data)) == data
    with pytest.raises(CodecError, match=f"more than {len(data) - 1} bytes"):
        codec.decompress(packed, limit=len(data) - 1)
    twice = packed + packed  # more blocks (snappy), more frames (zstd)
    assert codec.decompress(twice, limit=2 * len(data)) == data * 2
    with pytest.raises(CodecError, match=f"more than {2 * len(data) - 1} bytes"):
        codec.decompress(twice, limit=2 * len(data) - 1)
    assert codec.decompress(b"", limit=0) == b""
    assert codec.decompress(codec.compress(b""), limit=0) == b""


def test_snappy_framing_matches_hadoop_chunk_size() -> None:
    data = np.random.default_rng(1).integers(0, 4, 700_000, dtype=np.uint8).tobytes()
    packed = snappy_hadoop_compress(data)
    blocks = snappy_framing(packed)
    max_input = 256 * 1024 - (256 * 1024 // 6 + 32)  # Hadoop's buffer less snappy's overhead
    assert [block_len for block_len, _ in blocks] == [max_input] * 3 + [700_000 - 3 * max_input]
    assert snappy_hadoop_decompress(packed) == data


def zstd_frames_without_size(*parts: bytes) -> bytes:
    frames = []
    for part in parts:
        stream = cramjam.zstd.Compressor(level=3)
        stream.compress(part)
        frames.append(bytes(stream.finish()))
    return b"".join(frames)


def test_zstd_frames_as_hadoop_writes_them() -> None:
    """No content size, several frames, skippable frames, checksums: all decode, bounded."""
    a, b = b"alpha" * 1000, bytes(range(256)) * 700
    packed = zstd_frames_without_size(a, b)
    assert packed[4] & 0xE0 == 0  # no content size, not single-segment
    skippable = struct.pack("<II", 0x184D2A5E, 3) + b"xyz"
    assert zstd_decompress(skippable + packed + skippable, limit=len(a + b)) == a + b
    with pytest.raises(CodecError, match=f"more than {len(a + b) - 1} bytes"):
        zstd_decompress(packed, limit=len(a + b) - 1)
    assert zstd_decompress(skippable) == b""


# ------------------------------------------------------------------ corrupt and truncated


def read_all(path: Path, batch_bytes: int = 64 << 20) -> None:  # the reader's default
    with SequenceFileReader(path, batch_bytes=batch_bytes) as reader:
        for _ in reader.batches():
            pass


def one_record_file(path: Path, codec_class: str, packed_value: bytes) -> int:
    """A record-compressed file with one record whose compressed value is `packed_value`;
    returns the record's offset."""
    head = encode_header(BYTES_WRITABLE, BYTES_WRITABLE, "record", codec_class, sync=SYNC)
    key = struct.pack(">IQ", 8, 42)
    body = struct.pack(">ii", len(key) + len(packed_value), len(key)) + key + packed_value
    path.write_bytes(head + body)
    return len(head)


def one_block_file(path: Path, codec_class: str, sections: list[bytes]) -> tuple[int, int]:
    """A block-compressed file holding one block of one record (key 42, value b"v") with the
    given compressed sections; returns the block's offset and its values section's offset."""
    head = encode_header(BYTES_WRITABLE, BYTES_WRITABLE, "block", codec_class, sync=SYNC)
    block = SYNC_ESCAPE + SYNC + encode_vint(1)
    for section in sections[:3]:
        block += encode_vint(len(section)) + section
    values_at = len(head) + len(block)
    path.write_bytes(head + block + encode_vint(len(sections[3])) + sections[3])
    return len(head), values_at


def good_sections(codec: str) -> list[bytes]:
    compress = codec_by_name(codec).compress
    parts = [b"\x0c", struct.pack(">IQ", 8, 42), b"\x05", struct.pack(">I", 1) + b"v"]
    return [compress(part) for part in parts]


@pytest.mark.parametrize(
    ("codec", "damage", "problem"),
    [
        ("snappy", lambda v: v[:-3], r"value: snappy: chunk of \d+ bytes at byte 8 is truncated"),
        ("snappy", lambda v: v[:6], r"value: snappy: truncated chunk header at byte 4"),
        (
            "snappy",
            lambda v: v[:8] + b"\xff\xff\xff\x7f" + v[12:],
            r"value: snappy: bad chunk at byte 8: it states 268435455 bytes, more than the",
        ),
        ("zstd", lambda v: v[:-2], r"value: zstd: block of \d+ bytes at byte \d+ is truncated"),
        ("zstd", lambda v: b"\x00" + v[1:], r"value: zstd: no zstd frame at byte 0"),
        ("zstd", lambda v: v + v[:7], r"value: zstd: truncated (frame header|block header)"),
    ],
)
def test_corrupt_record_value_names_file_and_offset(
    tmp_path: Path, codec: str, damage: Callable[[bytes], bytes], problem: str
) -> None:
    packed = codec_by_name(codec).compress(struct.pack(">I", 500) + bytes(range(250)) * 2)
    path = tmp_path / "f.seq"
    offset = one_record_file(path, CODECS_BY_NAME[codec], damage(packed))
    with pytest.raises(SequenceFileError, match=problem) as caught:
        read_all(path)
    assert caught.value.path == str(path) and caught.value.offset == offset
    assert f"{path} at offset {offset}: " in str(caught.value)


@pytest.mark.parametrize("codec", ["snappy", "zstd"])
def test_corrupt_block_section_names_file_and_offset(tmp_path: Path, codec: str) -> None:
    sections = good_sections(codec)
    path = tmp_path / "f.seq"
    one_block_file(path, CODECS_BY_NAME[codec], sections)
    assert read_batches(path, 1 << 20) == ([42], [b"v"])
    sections[3] = sections[3][:-1]  # the values section cut short
    _, values_at = one_block_file(path, CODECS_BY_NAME[codec], sections)
    with pytest.raises(SequenceFileError, match=f"block values: {codec}") as caught:
        read_all(path)
    assert caught.value.offset == values_at and caught.value.path == str(path)


def test_snappy_bytes_that_do_not_decode(tmp_path: Path) -> None:
    # A raw snappy block stating 10 bytes whose one element copies from before the start.
    chunk = b"\x0a" + b"\x01\x10"
    framed = struct.pack(">II", 10, len(chunk)) + chunk
    with pytest.raises(CodecError, match=r"snappy: bad chunk at byte 8: .*corrupt"):
        snappy_hadoop_decompress(framed, limit=100)


@pytest.mark.parametrize("name", [n for n in FILES if "snappy" in n or "zstd" in n])
def test_every_truncation_of_a_committed_file_is_a_located_error(tmp_path: Path, name: str) -> None:
    data = (DATA / name).read_bytes()
    start = read_header(DATA / name).data_offset
    path = tmp_path / name
    cuts = sorted({*np.linspace(start + 1, len(data) - 1, 60).astype(int).tolist(), len(data) - 1})
    first, stop = MANIFEST["files"][name]["records"]
    expected_keys = EXPECTED_KEYS[first:stop].tolist()
    errors = 0
    for cut in cuts:
        path.write_bytes(data[:cut])
        try:
            keys, values = read_batches(path, 8192)
            assert values == EXPECTED_VALUES[first : first + len(values)]
        except SequenceFileError as exc:
            assert exc.path == str(path) and start <= exc.offset <= cut, (cut, exc)
            errors += 1
        else:  # cut right after a whole record or block: a shorter, valid file
            assert keys == expected_keys[: len(keys)] and len(keys) < len(expected_keys)
    assert errors >= len(cuts) // 2


@pytest.mark.parametrize("name", [n for n in FILES if "snappy" in n or "zstd" in n])
def test_flipped_bytes_give_data_or_located_errors(tmp_path: Path, name: str) -> None:
    """Snappy and zstd (without checksums) cannot catch every flipped byte, but no flip may
    surface as anything but a SequenceFileError."""
    data = (DATA / name).read_bytes()
    start = read_header(DATA / name).data_offset
    rng = np.random.default_rng(5)
    path = tmp_path / name
    for at in rng.integers(start, len(data), 40).tolist():
        damaged = bytearray(data)
        damaged[at] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(bytes(damaged))
        try:
            read_all(path, batch_bytes=8192)
        except SequenceFileError as exc:
            assert exc.path == str(path)


# ------------------------------------------------------------------ bombs


def test_zstd_stated_content_size_is_refused_before_decoding(tmp_path: Path) -> None:
    packed = zstd_compress(bytes(64 << 20))  # states 64 MiB in its header
    with pytest.raises(CodecError, match=r"more than 1000 bytes \(frame at byte 0 states 67108864"):
        zstd_decompress(packed, limit=1000)
    sections = good_sections("zstd")
    sections[3] = packed
    _, values_at = one_block_file(tmp_path / "f", ZSTD_CODEC, sections)

    def read() -> None:
        with pytest.raises(
            SequenceFileError, match="block values: zstd data decompresses to more than 5"
        ) as caught:
            read_all(tmp_path / "f")
        assert caught.value.offset == values_at

    read()  # (what it costs is bounded by the limit anyway: the next test measures that)


@pytest.mark.parametrize("codec", ["snappy", "zstd"])
def test_record_value_bomb_costs_at_most_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    monkeypatch.setattr(seqfile.limits, "MAX_RECORD_BYTES", 1 << 20)
    value = bytes(8 << 20)
    if codec == "zstd":  # no content size, as Hadoop writes it: found out only by decoding
        packed = zstd_frames_without_size(struct.pack(">I", len(value)) + value)
    else:
        packed = snappy_hadoop_compress(struct.pack(">I", len(value)) + value)
    path = tmp_path / "f"
    offset = one_record_file(path, CODECS_BY_NAME[codec], packed)

    def read() -> None:
        with pytest.raises(SequenceFileError) as caught:
            read_all(path)
        assert caught.value.offset == offset
        assert f"value: {codec} data decompresses to more than 1048576 bytes" in str(caught.value)

    assert peak_bytes(read) < 3 << 20  # not the 8 MiB the value holds


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_zstd_bomb_without_content_size_stays_within_the_limit_in_memory(tmp_path: Path) -> None:
    """The decoder's own (untraced) buffers too: a 1 GiB frame without content size, limited
    to 16 MiB, decoded in a fresh process whose peak RSS is measured."""
    stream = cramjam.zstd.Compressor(level=1)
    for _ in range(64):
        stream.compress(bytes(16 << 20))
    bomb = bytes(stream.finish())
    assert bomb[4] & 0xE0 == 0 and len(bomb) < 1 << 20
    (tmp_path / "bomb.zst").write_bytes(bomb)
    script = textwrap.dedent(
        """
        import sys
        from cube.codecs import CodecError, zstd_decompress

        def peak_rss():  # this process's own peak (ru_maxrss would include pytest's)
            with open("/proc/self/status") as status:
                line = next(line for line in status if line.startswith("VmHWM:"))
            return int(line.split()[1]) * 1024

        bomb = open(sys.argv[1], "rb").read()
        before = peak_rss()
        try:
            zstd_decompress(bomb, limit=16 << 20)
        except CodecError as exc:
            assert "more than 16777216 bytes" in str(exc), exc
        else:
            raise AssertionError("no error")
        print(peak_rss() - before)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "bomb.zst")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    grown = int(out.stdout.strip())
    assert 16 << 20 <= grown < 40 << 20, grown  # the 16 MiB buffer and a window, not 1 GiB


def test_snappy_claims_are_checked_before_allocating() -> None:
    claim = struct.pack(">II", 0xFFFFFFF0, 6) + b"\xff\xff\xff\xff\x0f\x00"
    with pytest.raises(CodecError, match=r"snappy data decompresses to more than 100 bytes"):
        snappy_hadoop_decompress(claim, limit=100)
    within = struct.pack(">II", 50, 6) + b"\xff\xff\xff\xff\x0f\x00"
    with pytest.raises(CodecError, match="it states 4294967295 bytes, more than the 50 left"):
        snappy_hadoop_decompress(within, limit=100)


# ------------------------------------------------------------------ sync intervals


def test_byteswritable_sync_escapes_follow_hadoop_3(tmp_path: Path) -> None:
    """Before the first record that starts HADOOP_SYNC_INTERVAL (102400) bytes or more past
    the last escape (or the start of the file: Hadoop 3's Writer counts the header in), as
    Hadoop 3's Writer does (the slow test below compares with Hadoop's own bytes)."""
    assert HADOOP_SYNC_INTERVAL == 102400
    path = tmp_path / "f"
    n, width = 10_000, 40
    with SequenceFileWriter(path, dialect="byteswritable", sync=SYNC) as writer:
        writer.write_batch(
            np.arange(n, dtype=np.uint64), ValueColumn.fixed(np.zeros(n * width, np.uint8), width)
        )
    data = path.read_bytes()
    escapes, at = [], data.find(SYNC_ESCAPE + SYNC, read_header(path).data_offset)
    while at >= 0:
        escapes.append(at)
        at = data.find(SYNC_ESCAPE + SYNC, at + 20)
    stride = 8 + 12 + 4 + width
    last = 0
    for escape in escapes:
        assert last + HADOOP_SYNC_INTERVAL <= escape < last + HADOOP_SYNC_INTERVAL + stride
        last = escape + 20
    assert escapes[0] < read_header(path).data_offset + HADOOP_SYNC_INTERVAL
    assert len(escapes) == len(data) // (102400 + 20)


def test_hadoop_counts_the_header_before_its_first_sync_escape() -> None:
    """The fact the rule above rests on, in a file Hadoop wrote: its first escape comes before
    header + 102400, at the first record boundary past 102400 from the start of the file."""
    path = DATA / "hadoop_snappy_record.seq"
    header = read_header(path)
    data = path.read_bytes()
    first = data.find(SYNC_ESCAPE + header.sync, header.data_offset)
    assert HADOOP_SYNC_INTERVAL <= first < header.data_offset + HADOOP_SYNC_INTERVAL


# ------------------------------------------------------------------ Hadoop at test time


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """Hadoop through PySpark, which `make test` installs (as tests/test_spark_build.py, no
    skip: a missing Spark fails rather than passes quietly)."""
    session = hadoop_written.spark_session(tmp_path_factory.mktemp("spark-local"))
    yield session
    session.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hadoop_writes_snappy_files_that_read_as_expected(
    spark: SparkSession, tmp_path: Path
) -> None:
    names = [name for name in hadoop_written.HADOOP_FILES if "snappy" in name]
    assert hadoop_written.write_hadoop_files(spark, tmp_path, names) == names
    assert len(names) == 2
    for name in names:
        header = read_header(tmp_path / name)
        assert (header.key_class, header.codec) == (
            "org.apache.hadoop.io.LongWritable",
            SNAPPY_CODEC,
        )
        check_reads_expected(tmp_path / name, MANIFEST["files"][name])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_byteswritable_writer_is_byte_identical_to_hadoop(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Hadoop's uncompressed BytesWritable/BytesWritable file, sync escapes included, is what
    SequenceFileWriter(dialect="byteswritable") writes given the same sync marker."""
    session = spark
    keys, _ = sample(12000, seed=9)
    # 40-byte values: 64-byte records, so an escape placed a header's length (> 64) off
    # Hadoop's shows
    values = [struct.pack(">Q", k) * 5 for k in keys]
    rdd = session.sparkContext.parallelize(
        [
            (bytearray(struct.pack(">Q", k)), bytearray(v))
            for k, v in zip(keys, values, strict=True)
        ],
        1,
    )
    job = tmp_path / "job"
    rdd.saveAsNewAPIHadoopFile(
        str(job),
        "org.apache.hadoop.mapreduce.lib.output.SequenceFileOutputFormat",
        keyClass=BYTES_WRITABLE,
        valueClass=BYTES_WRITABLE,
    )
    (hadoop,) = job.glob("part-*[0-9]")
    header = read_header(hadoop)
    assert hadoop.read_bytes().count(SYNC_ESCAPE + header.sync) >= 5
    ours = tmp_path / "ours.seq"
    with SequenceFileWriter(ours, dialect="byteswritable", sync=header.sync) as writer:
        writer.write_batch(np.array(keys, dtype=np.uint64), ValueColumn.from_list(values))
    assert ours.read_bytes() == hadoop.read_bytes()


@pytest.mark.slow
def test_without_cramjam_snappy_and_zstd_name_the_extra(tmp_path: Path) -> None:
    """cramjam is imported on first use: the formats import without it, and a Snappy or
    ZStandard file then says which extra to install."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cramjam"] = None  # import fails
        import cube.codecs, cube.seqfile
        for name, data in (("snappy", b"\\0\\0\\0\\1\\0\\0\\0\\1x"), ("zstd", b"(\\xb5/\\xfd")):
            for call in (lambda: cube.codecs.codec_by_name(name).decompress(data, 100),
                         lambda: cube.codecs.codec_by_name(name).compress(b"x")):
                try:
                    call()
                except cube.codecs.CodecError as exc:
                    assert "cramjam" in str(exc) and "cube-py[builder]" in str(exc), exc
                else:
                    raise AssertionError(name)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
