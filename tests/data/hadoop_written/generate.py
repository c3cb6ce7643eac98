"""Write the SequenceFiles in this folder, and their expected records.

    .venv/bin/python tests/data/hadoop_written/generate.py [--out DIR]

Snappy, Gzip and Deflate files are written by Hadoop itself: PySpark (`local[1]`, one partition)
ships Hadoop's SequenceFile writer and snappy-java, and saveAsNewAPIHadoopFile drives it through
SequenceFileOutputFormat with the mapreduce.output.fileoutputformat.compress* keys. Hadoop cannot
write ZStandard here (its ZStandardCodec needs the native libhadoop, which PySpark does not ship:
"native zStandard library not available"), so the zstd files are written twice over without it:
once by the project's own SequenceFileWriter and once by hand below, straight from the format
(header bytes, vints and sync escapes spelled out here, zstd frames from cramjam), including
what Hadoop's zstd writer produces (frames without a content size) and what a reader must also
take (concatenated frames, a skippable frame).

The records are derived from SHA-256 alone (no RNG whose stream could change between versions),
so a rerun writes the same records; the files differ only in their random sync markers. The
expected records go to expected.npz (uint64 keys and the values) and what each file is to
expected.json; tests/test_seqfile_codecs.py reads every file against them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pyspark has no type information: SparkSession is Any to mypy
    from pyspark.sql import SparkSession

HERE = Path(__file__).resolve().parent
COUNT = 2700  # enough for a sync escape in the record-compressed file (every 102400 bytes)
BIG = 1234, 230_000  # one value longer than a Hadoop snappy chunk (218422 bytes of input)
EMPTY = {2, 3, 1500}

LONG = "org.apache.hadoop.io.LongWritable"
BYTES = "org.apache.hadoop.io.BytesWritable"
CODEC = "org.apache.hadoop.io.compress."
OUTPUT_FORMAT = "org.apache.hadoop.mapreduce.lib.output.SequenceFileOutputFormat"
COMPRESS = "mapreduce.output.fileoutputformat.compress"

# name -> (records [start, stop), compression, codec class, io.seqfile.compress.blocksize)
HADOOP_FILES = {
    "hadoop_snappy_record.seq": ((0, COUNT), "RECORD", CODEC + "SnappyCodec", None),
    "hadoop_snappy_block.seq": ((0, COUNT), "BLOCK", CODEC + "SnappyCodec", 16384),
    "hadoop_gzip_block.seq": ((0, 1000), "BLOCK", CODEC + "GzipCodec", 16384),
    "hadoop_deflate_record.seq": ((0, 200), "RECORD", CODEC + "DefaultCodec", None),
}


# ------------------------------------------------------------------ the records


def records() -> list[tuple[int, bytes]]:
    """(key, value) pairs: LongWritable keys past 2**31 (so PySpark hands Hadoop a Long, not an
    Integer) in no order, with adjacent and distant duplicates, the largest long and a negative
    one (read as uint64 2**64 - 2**40); values of 0 to 48 bytes, every 50th of 200 to 1200, one
    of 230000. Most repeat one of 64 four-byte patterns, so they compress alone and together
    (which keeps the files small); one in 23 comes from a hash chain and does not."""
    out: list[tuple[int, bytes]] = []
    for i in range(COUNT):
        digest = hashlib.sha256(b"cube-seqfile-%d" % i).digest()
        key = (1 << 32) + (i * 7919 % 65536) * 256 + digest[0]
        if i == 0:
            key = (1 << 63) - 1
        elif i == 1:
            key = -(1 << 40)
        elif i % 97 == 5:
            key = out[i - 1][0]
        elif i % 211 == 7 and i >= 100:
            key = out[i - 100][0]
        length = digest[3] % 49 if i % 50 else 200 + int.from_bytes(digest[4:6], "big") % 1000
        length = 0 if i in EMPTY else BIG[1] if i == BIG[0] else length
        if i % 23 == 3:
            chain = b"".join(
                hashlib.sha256(digest + bytes([n])).digest() for n in range(-(-length // 32))
            )
            value = chain[:length]
        else:
            pattern = hashlib.sha256(b"pattern-%d" % (digest[6] % 64)).digest()[:4]
            value = (pattern * (length // 4 + 1))[:length]
        out.append((key, value))
    return out


def expected_arrays(pairs: list[tuple[int, bytes]]) -> dict[str, np.ndarray]:
    """What expected.npz holds: the uint64 keys, and the values themselves (lengths and one
    blob; they compress to less than their MD5s would take)."""
    return {
        "keys": np.array([key % (1 << 64) for key, _ in pairs], dtype=np.uint64),
        "value_lengths": np.array([len(value) for _, value in pairs], dtype=np.uint32),
        "values": np.frombuffer(b"".join(value for _, value in pairs), dtype=np.uint8),
    }


# ------------------------------------------------------------------ Hadoop (PySpark)


def spark_session(local_dir: Path | None = None) -> SparkSession:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[1]")
        .appName("cube-seqfile-testdata")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "512m")
    )
    if local_dir is not None:
        builder = builder.config("spark.local.dir", str(local_dir))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def write_hadoop_files(
    spark: SparkSession, out_dir: Path, names: Iterable[str] | None = None
) -> list[str]:
    """Each of HADOOP_FILES (or `names`) through Hadoop's SequenceFile writer: the records as
    (LongWritable, BytesWritable) in one partition, so one part file, copied to out_dir."""
    pairs = records()
    written = []
    for name in names or HADOOP_FILES:
        (start, stop), kind, codec, block_bytes = HADOOP_FILES[name]
        conf = {COMPRESS: "true", f"{COMPRESS}.type": kind, f"{COMPRESS}.codec": codec}
        if block_bytes:
            conf["io.seqfile.compress.blocksize"] = str(block_bytes)
        rdd = spark.sparkContext.parallelize(
            [(key, bytearray(value)) for key, value in pairs[start:stop]], 1
        )
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            job_dir = Path(tmp) / "job"
            rdd.saveAsNewAPIHadoopFile(
                str(job_dir), OUTPUT_FORMAT, keyClass=LONG, valueClass=BYTES, conf=conf
            )
            (part,) = job_dir.glob("part-*[0-9]")
            shutil.copyfile(part, out_dir / name)
        written.append(name)
    return written


# ------------------------------------------------------------------ zstd, without Hadoop


def write_with_project_writer(out_dir: Path) -> dict[str, dict[str, Any]]:
    """ZStandard through the project's SequenceFileWriter (genuine BytesWritable dialect)."""
    sys.path.insert(0, str(HERE.parents[2]))
    from cube.seqfile import SequenceFileWriter
    from cube.values import ValueColumn

    pairs = records()
    files = {}
    for name, compression, (start, stop) in (
        ("writer_zstd_block.seq", "block", (0, 1500)),
        ("writer_zstd_record.seq", "record", (0, 200)),
    ):
        keys = np.array([key % (1 << 64) for key, _ in pairs[start:stop]], dtype=np.uint64)
        values = ValueColumn.from_list([value for _, value in pairs[start:stop]])
        with SequenceFileWriter(
            out_dir / name,
            dialect="byteswritable",
            compression=compression,
            codec="zstd",
            block_bytes=32768,
        ) as writer:
            writer.write_batch(keys, values)
        files[name] = {
            "writer": "cube.seqfile.SequenceFileWriter(dialect='byteswritable')",
            "key_class": BYTES,
            "value_class": BYTES,
            "compression": compression,
            "codec": CODEC + "ZStandardCodec",
            "key_format": "bytes_be",
            "records": [start, stop],
        }
    return files


def vint(value: int) -> bytes:
    """Hadoop's WritableUtils.writeVLong, for the hand-written files (non-negative values)."""
    if value <= 127:
        return bytes([value])
    size = (value.bit_length() + 7) // 8
    return bytes([256 - 112 - size]) + value.to_bytes(size, "big")


def text(value: str) -> bytes:
    data = value.encode()
    return vint(len(data)) + data


def hand_header(compression: str, sync: bytes, metadata: dict[str, str]) -> bytes:
    """SEQ, version 6, key and value class (Text), compressed and block flags, codec class,
    metadata (int32 count, Text pairs), sync marker."""
    head = b"SEQ\x06" + text(LONG) + text(BYTES)
    head += bytes([1, compression == "block"]) + text(CODEC + "ZStandardCodec")
    head += struct.pack(">i", len(metadata))
    for name, value in sorted(metadata.items()):
        head += text(name) + text(value)
    return head + sync


def zstd_frame(data: bytes, content_size: bool) -> bytes:
    """One zstd frame; without content size it is what Hadoop's streaming writer produces."""
    import cramjam

    if content_size:
        frame = bytes(cramjam.zstd.compress(data, level=3))
        assert frame[4] & 0xC0 or frame[4] & 0x20, "expected a content size (cramjam >= 2.14)"
        return frame
    stream = cramjam.zstd.Compressor(level=3)
    stream.compress(data)
    frame = bytes(stream.finish())
    assert frame[4] & 0xC0 == 0 and not frame[4] & 0x20, "expected no content size"
    return frame


def skippable_frame(payload: bytes) -> bytes:
    return struct.pack("<II", 0x184D2A53, len(payload)) + payload


def split_frames(data: bytes, parts: int, content_size: bool) -> bytes:
    step = -(-len(data) // parts) or 1
    return b"".join(
        zstd_frame(data[at : at + step], content_size) for at in range(0, len(data) or 1, step)
    )


def long_key(key: int) -> bytes:
    return struct.pack(">q", key)


def bytes_writable(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


def write_by_hand(out_dir: Path) -> dict[str, dict[str, Any]]:
    pairs = records()
    sync = hashlib.md5(b"hand-written sync").digest()
    escape = b"\xff\xff\xff\xff" + sync
    meta = {"written.by": "tests/data/hadoop_written/generate.py"}
    files = {}

    # Block-compressed, 500 records a block; each section framed differently.
    stop = 1500
    out = bytearray(hand_header("block", sync, meta))
    for at in range(0, stop, 500):
        block = pairs[at : at + 500]
        keys = [long_key(key) for key, _ in block]
        values = [bytes_writable(value) for _, value in block]
        key_lens = b"".join(vint(len(k)) for k in keys)
        value_lens = b"".join(vint(len(v)) for v in values)
        keys_blob, values_blob = b"".join(keys), b"".join(values)
        sections = [
            zstd_frame(key_lens, content_size=True),
            zstd_frame(keys_blob[: len(keys_blob) // 2], content_size=True)
            + skippable_frame(b"skip me")
            + zstd_frame(keys_blob[len(keys_blob) // 2 :], content_size=True),
            zstd_frame(value_lens, content_size=False),
            split_frames(values_blob, 3, content_size=False),
        ]
        out += escape + vint(len(block))
        for section in sections:
            out += vint(len(section)) + section
    (out_dir / "hand_zstd_block.seq").write_bytes(bytes(out))
    files["hand_zstd_block.seq"] = {
        "writer": "by hand (generate.py write_by_hand)",
        "key_class": LONG,
        "value_class": BYTES,
        "compression": "block",
        "codec": CODEC + "ZStandardCodec",
        "key_format": "long",
        "records": [0, stop],
        "metadata": meta,
    }

    # Record-compressed: each value one frame without content size (as Hadoop writes it),
    # every fifth value split over two frames, a sync escape after every 50 records.
    stop = 200
    out = bytearray(hand_header("record", sync, {}))
    for i, (key, value) in enumerate(pairs[:stop]):
        raw = bytes_writable(value)
        packed = split_frames(raw, 2 if i % 5 == 4 else 1, content_size=False)
        key_bytes = long_key(key)
        out += struct.pack(">ii", len(key_bytes) + len(packed), len(key_bytes))
        out += key_bytes + packed
        if i % 50 == 49:
            out += escape
    (out_dir / "hand_zstd_record.seq").write_bytes(bytes(out))
    files["hand_zstd_record.seq"] = {
        "writer": "by hand (generate.py write_by_hand)",
        "key_class": LONG,
        "value_class": BYTES,
        "compression": "record",
        "codec": CODEC + "ZStandardCodec",
        "key_format": "long",
        "records": [0, stop],
    }
    return files


# ------------------------------------------------------------------ main


def hadoop_manifest() -> dict[str, dict[str, Any]]:
    return {
        name: {
            "writer": "Hadoop SequenceFile.Writer via PySpark saveAsNewAPIHadoopFile",
            "key_class": LONG,
            "value_class": BYTES,
            "compression": kind.lower(),
            "codec": codec,
            "key_format": "long",
            "records": list(span),
            **({"io.seqfile.compress.blocksize": block_bytes} if block_bytes else {}),
        }
        for name, (span, kind, codec, block_bytes) in HADOOP_FILES.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    spark = spark_session()
    try:
        write_hadoop_files(spark, out_dir)
    finally:
        spark.stop()
    files = hadoop_manifest()
    files.update(write_with_project_writer(out_dir))
    files.update(write_by_hand(out_dir))
    # numpy's stub: a **dict of arrays could fill its allow_pickle flag
    np.savez_compressed(out_dir / "expected.npz", **expected_arrays(records()))  # type: ignore[arg-type]
    manifest = {"records": "expected.npz", "count": COUNT, "files": files}
    (out_dir / "expected.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    for name in sorted(files):
        print(f"{name}: {(out_dir / name).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
