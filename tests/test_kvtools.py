"""kvtool and kv_to_seqfile, run as the installed console scripts (real processes, real files)."""

from __future__ import annotations

import json
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from builder.seqfile import SequenceFileReader, SequenceFileWriter, read_header
from cube.values import ValueColumn

BIN = Path(__file__).resolve().parent.parent / ".venv" / "bin"
DATA = Path(__file__).parent / "data" / "seqfiles"


def run(tool: str, *args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / tool), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def read_all(path: Path, **kwargs) -> tuple[list[int], list[bytes]]:
    with SequenceFileReader(path, **kwargs) as reader:
        batches = list(reader.batches())
    return (
        [k for b in batches for k in b.keys.tolist()],
        [v for b in batches for v in b.values.to_list()],
    )


# ------------------------------------------------------------------ kv_to_seqfile


def test_kv_lines_to_base(tmp_path: Path) -> None:
    source = tmp_path / "file.txt"
    source.write_bytes(b"48241:37064\t1\t0.5\n\n7:a:b:c\n18446744073709551615:\n3:  spaced \r\n")
    out = tmp_path / "data"
    result = run("kv_to_seqfile", "--input", source, "--output_dir", out, "--id", "1700000000")
    assert result.returncode == 0, result.stderr
    feature = out / "1700000000" / "base" / "feature"
    assert read_all(feature) == (
        [48241, 7, (1 << 64) - 1, 3],
        [b"37064\t1\t0.5", b"a:b:c", b"", b"  spaced "],
    )
    with SequenceFileReader(feature) as reader:
        assert reader.key_format == "cube"
    donefile = (out / "donefile" / "base.txt").read_text()
    expected = {"id": "1700000000", "key": "1700000000", "input": str(feature.parent.resolve())}
    assert donefile == json.dumps(expected) + "\n"
    assert list(json.loads(donefile)) == ["id", "key", "input"]
    assert sorted(p.name for p in feature.parent.iterdir()) == ["feature"]


def test_float_lines_to_patch_with_donefile_dir(tmp_path: Path) -> None:
    source = tmp_path / "emb.txt"
    source.write_text("5 10 1 0.5 1.25 -2\n6\t3\t0\t1e3 2 3\n")
    out, done = tmp_path / "data", tmp_path / "done"
    args = ["--input", source, "--output_dir", out, "--donefile_dir", done, "--id", "p1"]
    result = run("kv_to_seqfile", *args, "--patch", "--base_id", "b0")
    assert result.returncode == 0, result.stderr
    feature = out / "p1" / "patch" / "feature"
    keys, values = read_all(feature)
    assert keys == [5, 6]
    assert [np.frombuffer(v, "<f4").tolist() for v in values] == [[0.5, 1.25, -2.0], [1000, 2, 3]]
    line = json.loads((done / "patch.txt").read_text())
    assert line == {"id": "p1", "key": "b0", "input": str(feature.parent.resolve())}
    assert not (done / "base.txt").exists()


def test_donefile_lines_are_appended(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("1:x\n")
    out = tmp_path / "data"
    for version in ("10", "11"):
        assert run("kv_to_seqfile", "--input", source, "--output_dir", out, "--id", version)
    lines = (out / "donefile" / "base.txt").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["10", "11"]


def test_id_defaults_to_unix_time(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("1:x\n")
    before = int(time.time())
    result = run("kv_to_seqfile", "--input", source, "--output_dir", tmp_path / "d")
    after = int(time.time())
    assert result.returncode == 0, result.stderr
    entry = json.loads((tmp_path / "d" / "donefile" / "base.txt").read_text())
    assert before <= int(entry["id"]) <= after and entry["key"] == entry["id"]
    assert (tmp_path / "d" / entry["id"] / "base" / "feature").is_file()


def test_bytes_be_output_is_genuine_byteswritable(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("258:v\n")
    out = tmp_path / "d"
    args = ["--input", source, "--output_dir", out, "--id", "1", "--key_format", "bytes_be"]
    assert run("kv_to_seqfile", *args).returncode == 0
    feature = out / "1" / "base" / "feature"
    start = read_header(feature).data_offset
    record = feature.read_bytes()[start:]
    assert record == struct.pack(">iiIQI", 17, 12, 8, 258, 1) + b"v"
    assert read_all(feature) == ([258], [b"v"])


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ("1:a\n2 0 0 1.0\n", 2, "expected 'key:value'"),
        ("1 0 0 1.0\n2:b\n", 2, "expected 'key show click"),
        ("1 0 0 1.0\n2 0 0 x\n", 2, "must be numbers"),
        ("\n\n1:a\n-4:b\n", 4, "expected 'key:value'"),
        ("1 0 0 1\nabc 0 0 1\n", 2, "not a decimal"),
        ("18446744073709551616:x\n", 1, "does not fit in a uint64"),
    ],
)
def test_bad_lines_name_the_line_and_leave_no_output(tmp_path, text, line, problem) -> None:
    source = tmp_path / "in.txt"
    source.write_text(text)
    out = tmp_path / "d"
    result = run("kv_to_seqfile", "--input", source, "--output_dir", out, "--id", "9")
    assert result.returncode == 1
    assert f"{source} line {line}: " in result.stderr and problem in result.stderr
    assert not (out / "9").exists()
    assert not (out / "donefile").exists()


def test_kv_to_seqfile_flag_errors(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("1:a\n")
    assert run("kv_to_seqfile", "--output_dir", tmp_path).returncode == 2
    patch = run("kv_to_seqfile", "--input", source, "--output_dir", tmp_path, "--patch")
    assert patch.returncode == 2 and "--base_id" in patch.stderr
    missing = run("kv_to_seqfile", "--input", tmp_path / "nope", "--output_dir", tmp_path)
    assert missing.returncode == 1 and "no such file" in missing.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    result = run("kv_to_seqfile", "--input", empty, "--output_dir", tmp_path / "d", "--id", "3")
    assert result.returncode == 1 and "no records" in result.stderr
    assert not (tmp_path / "d" / "3").exists()


def test_existing_version_is_not_overwritten(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("1:a\n")
    args = ["--input", source, "--output_dir", tmp_path / "d", "--id", "5"]
    assert run("kv_to_seqfile", *args).returncode == 0
    before = (tmp_path / "d" / "5" / "base" / "feature").read_bytes()
    again = run("kv_to_seqfile", *args)
    assert again.returncode == 1 and "already exists" in again.stderr
    assert (tmp_path / "d" / "5" / "base" / "feature").read_bytes() == before
    assert len((tmp_path / "d" / "donefile" / "base.txt").read_text().splitlines()) == 1


# ------------------------------------------------------------------ kvtool


def test_kvtool_prints_header_and_records(tmp_path: Path) -> None:
    path = tmp_path / "feature"
    with SequenceFileWriter(path, sync=b"\x01" * 16) as writer:
        writer.write_batch(
            np.array([1, (1 << 64) - 1], dtype=np.uint64),
            ValueColumn.from_list([b"\x00\xff", b"ab"]),
        )
    result = run("kvtool", path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"# file: {path}"
    assert "key format: cube" in result.stdout and "01" * 16 in result.stdout
    assert [line for line in lines if not line.startswith("#")] == [
        "1\t00ff",
        "18446744073709551615\t6162",
    ]
    assert lines[-1] == "# 2 records shown"


def test_kvtool_float_and_limit(tmp_path: Path) -> None:
    path = tmp_path / "feature"
    floats = np.array([[0.5, -1.0], [3.25, 1e-3], [7, 8]], dtype="<f4")
    with SequenceFileWriter(path) as writer:
        writer.write_batch(
            np.array([10, 11, 12], dtype=np.uint64), ValueColumn.fixed(floats.view(np.uint8), 8)
        )
    result = run("kvtool", path, "--float", "--limit", "2")
    assert result.returncode == 0, result.stderr
    records = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert records == ["10\t[0.5, -1]", "11\t[3.25, 0.001]"]


@pytest.mark.parametrize(
    ("name", "first"),
    [
        ("colinmarc_uncompressed_byteswritable.seq", "raw:416c696365\t5072616374696365"),
        ("colinmarc_record_compressed_zlib_byteswritable.seq", "raw:416c696365\t5072616374696365"),
        ("colinmarc_block_compressed_bzip2_byteswritable.seq", "raw:416c696365\t5072616374696365"),
        ("xorlev_abc_long_text_none.seq", "0\t0041"),
        ("xorlev_metadata_bzip2_block.seq", "0\t0041"),
        (
            "xorlev_simple_text_synced.seq",
            "raw:706962676c796e686e6c696b78647962656d6f66\t251bd763ab822fc3",
        ),
    ],
)
def test_kvtool_reads_every_hadoop_file(name: str, first: str) -> None:
    result = run("kvtool", DATA / name)
    assert result.returncode == 0, result.stderr
    records = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert records[0] == first
    with SequenceFileReader(DATA / name) as reader:
        assert len(records) == sum(1 for _ in reader.records())


def test_kvtool_explicit_key_format_misfit_is_an_error() -> None:
    path = DATA / "colinmarc_uncompressed_byteswritable.seq"
    result = run("kvtool", path, "--key_format", "cube")
    assert result.returncode == 1
    assert f"{path} at offset 96: key is 9 bytes" in result.stderr


def test_kvtool_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "junk"
    path.write_bytes(b"SEQ\x06\x05")
    result = run("kvtool", path)
    assert result.returncode == 1 and f"{path} at offset" in result.stderr
    assert run("kvtool").returncode == 2  # FILE is required
