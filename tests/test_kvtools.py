"""kvtool and kv_to_seqfile, run as the installed console scripts (real processes, real files)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from cube.seqfile import SequenceFileReader, SequenceFileWriter, read_header
from cube.values import ValueColumn

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

BIN = Path(__file__).resolve().parent.parent / ".venv" / "bin"
DATA = Path(__file__).parent / "data" / "seqfiles"
Args = list[str | Path]  # a command line as `run` takes it


def run(tool: str, *args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / tool), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def read_all(path: Path, key_format: str = "auto") -> tuple[list[int], list[bytes]]:
    with SequenceFileReader(path, key_format) as reader:
        batches = list(reader.batches())
    return (
        [k for b in batches for k in b.keys.tolist()],
        [v for b in batches for v in b.values.to_list()],
    )


# ------------------------------------------------------------------ kv_to_seqfile


def convert(where: Path, text: str | bytes, *flags: str | Path) -> subprocess.CompletedProcess[str]:
    """kv_to_seqfile on `text` (written to where/in.txt) into where/d, version id 9."""
    where.mkdir(parents=True, exist_ok=True)
    source = where / "in.txt"
    source.write_bytes(text.encode() if isinstance(text, str) else text)
    out = where / "d"
    return run("kv_to_seqfile", "--input", source, "--output_dir", out, "--id", "9", *flags)


def floats_of(where: Path) -> tuple[list[int], list[list[float]]]:
    keys, values = read_all(where / "d" / "9" / "base" / "feature")
    return keys, [np.frombuffer(v, "<f4").tolist() for v in values]


def assert_nothing_written(where: Path) -> None:
    """No version directory, no donefile, no temp file: the output root is empty or absent."""
    out = where / "d"
    assert not out.exists() or list(out.rglob("*")) == []


def test_kv_lines_to_base(tmp_path: Path) -> None:
    source = tmp_path / "file.txt"
    source.write_bytes(b"48241:37064\t1\t0.5\n\n7:a b c\n18446744073709551615:\n3:  spaced \r\n")
    out = tmp_path / "data"
    args: Args = ["--input", source, "--output_dir", out, "--id", "1700000000"]
    result = run("kv_to_seqfile", *args, "--input_format", "colon_text")
    assert result.returncode == 0, result.stderr
    feature = out / "1700000000" / "base" / "feature"
    assert read_all(feature) == (
        [48241, 7, (1 << 64) - 1, 3],
        [b"37064\t1\t0.5", b"a b c", b"", b"  spaced "],
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
    args: Args = ["--input", source, "--output_dir", out, "--donefile_dir", done]
    args += ["--id", "1700000100", "--input_format", "show_click_floats"]
    result = run("kv_to_seqfile", *args, "--patch", "--base_id", "1700000000")
    assert result.returncode == 0, result.stderr
    feature = out / "1700000100" / "patch" / "feature"
    keys, values = read_all(feature)
    assert keys == [5, 6]
    assert [np.frombuffer(v, "<f4").tolist() for v in values] == [[0.5, 1.25, -2.0], [1000, 2, 3]]
    line = json.loads((done / "patch.txt").read_text())
    assert line == {
        "id": "1700000100",
        "key": "1700000000",
        "input": str(feature.parent.resolve()),
    }
    assert not (done / "base.txt").exists()


def test_donefile_lines_are_appended(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("1:x\n")
    out = tmp_path / "data"
    for version in ("10", "11"):
        args: Args = ["--input", source, "--output_dir", out, "--id", version]
        assert run("kv_to_seqfile", *args, "-input_format=colon_text").returncode == 0
    lines = (out / "donefile" / "base.txt").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["10", "11"]


def test_id_defaults_to_unix_time(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("1:x\n")
    before = int(time.time())
    args: Args = ["--input", source, "--output_dir", tmp_path / "d", "--input_format", "colon_text"]
    result = run("kv_to_seqfile", *args)
    after = int(time.time())
    assert result.returncode == 0, result.stderr
    entry = json.loads((tmp_path / "d" / "donefile" / "base.txt").read_text())
    assert before <= int(entry["id"]) <= after and entry["key"] == entry["id"]
    assert (tmp_path / "d" / entry["id"] / "base" / "feature").is_file()


def test_bytes_be_output_is_genuine_byteswritable(tmp_path: Path) -> None:
    result = convert(
        tmp_path, "258:v\n", "--input_format", "colon_text", "--key_format", "bytes_be"
    )
    assert result.returncode == 0, result.stderr
    feature = tmp_path / "d" / "9" / "base" / "feature"
    start = read_header(feature).data_offset
    record = feature.read_bytes()[start:]
    assert record == struct.pack(">iiIQI", 17, 12, 8, 258, 1) + b"v"
    assert read_all(feature) == ([258], [b"v"])


def test_input_format_is_required_and_the_hint_names_what_the_line_fits(tmp_path: Path) -> None:
    # The defect: with no way to say which format, `21 0.1 0.2 0.3 0.4` silently became
    # [0.3, 0.4] (0.1 and 0.2 taken for show and click).
    result = convert(tmp_path, "\n21 0.1 0.2 0.3 0.4\n")
    assert result.returncode == 2
    assert "--input_format is required" in result.stderr
    assert "line 2 fits: floats" in result.stderr  # not show_click_floats: show is not a count
    assert_nothing_written(tmp_path)
    both = convert(tmp_path / "b", "21 3 1 0.3 0.4\n")
    assert both.returncode == 2 and "line 1 fits: floats, show_click_floats" in both.stderr
    colon = convert(tmp_path / "c", "21:0.3 0.4\n")
    assert colon.returncode == 2 and "line 1 fits: colon_floats, colon_text" in colon.stderr


def test_floats_format_keeps_every_number(tmp_path: Path) -> None:
    text = "21 0.1 0.2 0.3 0.4\n22\t1e3 -2 +.5 7.\r\n23 0 -0 1E-3 2.5e+2\n"
    result = convert(tmp_path, text, "--input_format", "floats")
    assert result.returncode == 0, result.stderr
    keys, vectors = floats_of(tmp_path)
    assert keys == [21, 22, 23]
    assert vectors == [
        np.array([0.1, 0.2, 0.3, 0.4], "<f4").tolist(),
        [1000.0, -2.0, 0.5, 7.0],
        [0.0, -0.0, np.float32(1e-3).item(), 250.0],
    ]


def test_show_click_floats_drops_show_and_click_only(tmp_path: Path) -> None:
    result = convert(tmp_path, "21 120 3 0.5 -1.25\n", "--input_format", "show_click_floats")
    assert result.returncode == 0, result.stderr
    assert floats_of(tmp_path) == ([21], [[0.5, -1.25]])


def test_show_click_floats_refuses_a_floats_line(tmp_path: Path) -> None:
    result = convert(tmp_path, "21 0.1 0.2 0.3 0.4\n", "--input_format", "show_click_floats")
    assert result.returncode == 1
    assert f"{tmp_path / 'in.txt'} line 1, field 2 (show): '0.1'" in result.stderr
    assert "--input_format floats" in result.stderr  # the hint for the likely mistake
    assert_nothing_written(tmp_path)


def test_colon_floats_format(tmp_path: Path) -> None:
    text = "1676869128226002114:48241  37064\t91 -539\n5:1 2 3 4\n"
    result = convert(tmp_path, text, "--input_format", "colon_floats")
    assert result.returncode == 0, result.stderr
    assert floats_of(tmp_path) == (
        [1676869128226002114, 5],
        [[48241.0, 37064.0, 91.0, -539.0], [1.0, 2.0, 3.0, 4.0]],
    )


def test_colon_text_format_stores_the_text_bytes(tmp_path: Path) -> None:
    text = b"48241:37064\t1\t0.5\n\n18446744073709551615:\n3:  spaced \r\n4:\xff\xfe\n"
    result = convert(tmp_path, text, "--input_format", "colon_text")
    assert result.returncode == 0, result.stderr
    assert read_all(tmp_path / "d" / "9" / "base" / "feature") == (
        [48241, (1 << 64) - 1, 3, 4],
        [b"37064\t1\t0.5", b"", b"  spaced ", b"\xff\xfe"],
    )


def test_dim_flag_fixes_the_vector_width(tmp_path: Path) -> None:
    ok = convert(tmp_path / "ok", "1 0.5 1\n2 3 4\n", "--input_format", "floats", "--dim", "2")
    assert ok.returncode == 0, ok.stderr
    assert floats_of(tmp_path / "ok") == ([1, 2], [[0.5, 1.0], [3.0, 4.0]])
    bad = convert(tmp_path / "bad", "1 0.5 1 2\n", "--input_format", "floats", "--dim", "2")
    assert bad.returncode == 1 and "line 1: 3 floats, --dim is 2" in bad.stderr
    assert_nothing_written(tmp_path / "bad")
    text = convert(tmp_path / "text", "1:a\n", "--input_format", "colon_text", "--dim", "2")
    assert text.returncode == 2 and "--dim" in text.stderr
    negative = convert(tmp_path / "neg", "1 2\n", "--input_format", "floats", "--dim", "-1")
    assert negative.returncode == 2 and "--dim" in negative.stderr


BAD_LINES = [
    # (format, text, line, field, problem)
    ("floats", "1 0.5\n1.5 0.5\n", 2, "field 1 (key): '1.5'", "not an unsigned decimal integer"),
    ("floats", "-4 0.5\n", 1, "field 1 (key): '-4'", "not an unsigned decimal integer"),
    ("floats", "1e3 0.5\n", 1, "field 1 (key): '1e3'", "not an unsigned decimal integer"),
    ("floats", "18446744073709551616 0.5\n", 1, "field 1 (key)", "does not fit in a uint64"),
    ("floats", "9" * 5000 + " 0.5\n", 1, "field 1 (key)", "does not fit in a uint64"),
    ("floats", "1 0.5 nan\n", 1, "field 3 (f2): 'nan'", "not a finite decimal number"),
    ("floats", "1 inf 0.5\n", 1, "field 2 (f1): 'inf'", "not a finite decimal number"),
    ("floats", "1 0.5 1_0\n", 1, "field 3 (f2): '1_0'", "not a finite decimal number"),
    ("floats", "1 0.5 0x10\n", 1, "field 3 (f2): '0x10'", "not a finite decimal number"),
    ("floats", "1 0.5 1e39\n", 1, "field 3 (f2): '1e39'", "outside the float32 range"),
    ("floats", "1 0.5 -4e38\n", 1, "field 3 (f2): '-4e38'", "outside the float32 range"),
    ("floats", "1 0.5 2\n2 0.5\n", 2, "1 floats, line 1 has 2", "one width per file"),
    ("floats", "7\n", 1, "no floats after the key", "floats lines are"),
    ("floats", "1:0.5 2\n", 1, "field 1 (key): '1:0.5'", "--input_format colon_floats"),
    ("show_click_floats", "1 10 2\n", 1, "no floats after show and click", "lines are"),
    ("show_click_floats", "1 10\n", 1, "field 3 (click): missing", "lines are"),
    ("show_click_floats", "1 -3 0 0.5\n", 1, "field 2 (show): '-3'", "not an unsigned"),
    ("show_click_floats", "1 3 0 x\n", 1, "field 4 (f1): 'x'", "not a finite decimal number"),
    ("colon_floats", "1 0.5 2\n", 1, "no ':' after the key", "colon_floats lines are"),
    ("colon_floats", "1:\n", 1, "no floats after the ':'", "colon_floats lines are"),
    ("colon_floats", "1:0.5 x\n", 1, "field 3 (f2): 'x'", "not a finite decimal number"),
    ("colon_text", "1 abc\n", 1, "no ':' after the key", "colon_text lines are"),
    ("colon_text", "7:a:b:c\n", 1, "field 2 (value): a second ':'", "ambiguous"),
    ("colon_text", "\n\n1:a\n-4:b\n", 4, "field 1 (key): '-4'", "not an unsigned decimal integer"),
    ("colon_text", " 1:a\n", 1, "field 1 (key): ' 1'", "not an unsigned decimal integer"),
]


@pytest.mark.parametrize(("fmt", "text", "line", "field", "problem"), BAD_LINES)
def test_bad_lines_name_file_line_and_field_and_leave_no_output(
    tmp_path: Path, fmt: str, text: str, line: int, field: str, problem: str
) -> None:
    result = convert(tmp_path, text, "--input_format", fmt)
    assert result.returncode == 1, result.stderr
    assert f"error: {tmp_path / 'in.txt'} line {line}" in result.stderr
    assert field in result.stderr and problem in result.stderr
    assert "Traceback" not in result.stderr
    assert_nothing_written(tmp_path)


def test_a_bad_line_after_a_full_batch_leaves_no_output(tmp_path: Path) -> None:
    lines = [f"{i} {i}.5 1" for i in range(70_000)] + ["70000 0.5 nan"]
    result = convert(tmp_path, "\n".join(lines) + "\n", "--input_format", "floats")
    assert result.returncode == 1 and "line 70001, field 3 (f2): 'nan'" in result.stderr
    assert_nothing_written(tmp_path)


def test_overlong_line_is_refused_without_reading_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cube.builder import kv_to_seqfile

    monkeypatch.setattr(kv_to_seqfile, "MAX_LINE_BYTES", 64)
    source = tmp_path / "in.txt"
    source.write_text("1:" + "x" * 62 + "\n2:" + "y" * 63 + "\n")
    args = ["--input", str(source), "--output_dir", str(tmp_path / "d"), "--id", "9"]
    assert kv_to_seqfile.main([*args, "--input_format", "colon_text"]) == 1
    assert f"{source} line 2: longer than 64 bytes" in capsys.readouterr().err
    assert_nothing_written(tmp_path)


def test_donefile_failure_leaves_no_feature_behind(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where the donefile directory should be")
    donefile_dir = tmp_path / "blocker" / "done"
    result = convert(
        tmp_path, "1:a\n", "--input_format", "colon_text", "--donefile_dir", donefile_dir
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error:" in result.stderr and "blocker" in result.stderr
    assert_nothing_written(tmp_path)


def test_duplicate_keys_are_refused_with_both_lines(tmp_path: Path) -> None:
    # Cube keeps only the last record of a key, so a repeated key would drop a line silently.
    result = convert(tmp_path, "1 0.5\n2 0.5\n\n1 0.7\n", "--input_format", "floats")
    assert result.returncode == 1
    assert f"{tmp_path / 'in.txt'} line 4: key 1 repeats line 1" in result.stderr
    assert_nothing_written(tmp_path)
    text = convert(tmp_path / "t", "7:a\n7:a\n", "--input_format", "colon_text")
    assert text.returncode == 1 and "line 2: key 7 repeats line 1" in text.stderr


def test_duplicate_keys_are_found_across_batches(tmp_path: Path) -> None:
    lines = [f"{i} 1" for i in range(70_000)] + ["5 2"]
    result = convert(tmp_path, "\n".join(lines) + "\n", "--input_format", "floats")
    assert result.returncode == 1 and "line 70001: key 5 repeats line 6" in result.stderr
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--id", "p1"], "--id 'p1' must be a decimal integer"),
        (["--id", "007"], "--id '007' must be a decimal integer"),
        (["--id", "1" * 21], "must be a decimal integer"),
        (["--id", "5", "--patch", "--base_id", "b0"], "--base_id 'b0' must be a decimal integer"),
    ],
)
def test_ids_are_what_cube_transfer_accepts(tmp_path: Path, flags: list[str], problem: str) -> None:
    # cube-transfer refuses donefile lines whose id or key is not a decimal integer.
    source = tmp_path / "in.txt"
    source.write_text("1:a\n")
    args: Args = ["--input", source, "--input_format", "colon_text", "--output_dir", tmp_path / "d"]
    result = run("kv_to_seqfile", *args, *flags)
    assert result.returncode == 2 and problem in result.stderr
    assert not (tmp_path / "d").exists()


def test_a_fifo_input_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out: Args = ["--output_dir", tmp_path / "d"]
    no_format = run("kv_to_seqfile", "--input", fifo, *out)  # the hint must not open it
    assert no_format.returncode == 2 and "--input_format is required" in no_format.stderr
    result = run("kv_to_seqfile", "--input", fifo, "--input_format", "floats", *out)
    assert result.returncode == 1 and "not a regular file" in result.stderr
    assert_nothing_written(tmp_path)


def test_kv_to_seqfile_help_documents_every_format(tmp_path: Path) -> None:
    result = run("kv_to_seqfile", "-help")
    assert result.returncode == 0, result.stderr
    for example in ("21 120 3 0.1 0.2 0.3", "21 0.1 0.2 0.3", "21:0.1 0.2 0.3", "21:any text"):
        assert example in result.stdout
    for name in ("show_click_floats", "floats", "colon_floats", "colon_text", "--dim"):
        assert name in result.stdout
    assert '{"id": "<id>", "key": "<key>", "input": "<absolute feature dir>"}' in result.stdout


def test_kv_to_seqfile_flag_errors(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("1:a\n")
    fmt = ["--input_format", "colon_text"]
    assert run("kv_to_seqfile", "--output_dir", tmp_path, *fmt).returncode == 2
    patch = run("kv_to_seqfile", "--input", source, "--output_dir", tmp_path, "--patch", *fmt)
    assert patch.returncode == 2 and "--base_id" in patch.stderr
    unknown = run("kv_to_seqfile", "--input", source, "--input_format", "kv")
    assert unknown.returncode == 2 and "colon_text" in unknown.stderr
    missing = run("kv_to_seqfile", "--input", tmp_path / "nope", "--output_dir", tmp_path, *fmt)
    assert missing.returncode == 1 and "no such file" in missing.stderr
    directory = run("kv_to_seqfile", "--input", tmp_path, "--output_dir", tmp_path / "o", *fmt)
    assert directory.returncode == 1 and "not a regular file" in directory.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    args: Args = ["--input", empty, "--output_dir", tmp_path / "d", "--id", "3", *fmt]
    result = run("kv_to_seqfile", *args)
    assert result.returncode == 1 and "no records" in result.stderr
    assert not (tmp_path / "d" / "3").exists()


def test_existing_version_is_not_overwritten(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("1:a\n")
    args: Args = ["--input", source, "--output_dir", tmp_path / "d", "--id", "5"]
    args += ["--input_format", "colon_text"]
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


@pytest.mark.parametrize("compression", ["none", "block"])
def test_kvtool_prints_the_records_before_a_damaged_tail(tmp_path: Path, compression: str) -> None:
    """A file cut short in its last record (or block): the records before it are printed,
    then the error naming the offset, exit 1."""
    path = tmp_path / "whole"
    keys = np.arange(1, 301, dtype=np.uint64)
    values = ValueColumn.fixed(np.arange(300 * 8, dtype=np.uint64).astype(np.uint8), 8)
    with SequenceFileWriter(path, compression=compression, block_bytes=800) as writer:
        writer.write_batch(keys, values)
    with SequenceFileReader(path) as reader:
        offsets = [offset for offset, _key, _value in reader.records_with_offsets()]
    expected = sum(offset < offsets[-1] for offset in offsets)  # before the last record/block
    assert 100 < expected < 300
    cut = tmp_path / "cut"
    cut.write_bytes(path.read_bytes()[:-5])
    result = run("kvtool", cut)
    assert result.returncode == 1 and f"{cut} at offset" in result.stderr
    shown = [line.split("\t")[0] for line in result.stdout.splitlines() if "\t" in line]
    assert shown == [str(k) for k in range(1, expected + 1)], result.stdout[-300:]
    assert f"# {expected} records shown, then the damage at offset" in result.stdout


def float_file(tmp_path: Path) -> Path:
    path = tmp_path / "feature"
    floats = np.array([[0.5, -1.0], [3.25, 1e-3]], dtype="<f4")
    with SequenceFileWriter(path) as writer:
        writer.write_batch(
            np.array([10, 11], dtype=np.uint64), ValueColumn.fixed(floats.view(np.uint8), 8)
        )
    return path


def test_kvtool_help_is_gflags_style() -> None:
    for spelling in ("-help", "--help", "-h"):
        result = run("kvtool", spelling)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: kvtool FILE")
        for flag in ("--float", "--limit", "--key_format", "--file", "--flagfile"):
            assert flag in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["{f}", "--float", "--limit", "1"],
        ["-float", "-limit=1", "{f}"],
        ["--limit=1", "{f}", "--float=true"],
        ["--file={f}", "-float", "-limit", "1", "-key_format", "cube"],
        ["--flagfile", "{flagfile}", "{f}"],
    ],
)
def test_kvtool_takes_gflags_forms_and_the_positional_file(tmp_path: Path, args: list[str]) -> None:
    path = float_file(tmp_path)
    flagfile = tmp_path / "kvtool.flags"
    flagfile.write_text("# one flag a line\n--float\n--limit=1\n")
    argv = [a.format(f=path, flagfile=flagfile) for a in args]
    result = run("kvtool", *argv)
    assert result.returncode == 0, result.stderr
    records = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert records == ["10\t[0.5, -1]"]


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ([], "FILE is required"),
        (["{f}", "{f}"], "one FILE only"),
        (["{f}", "--file", "{f}"], "one FILE only"),
        (["{f}", "--limit", "-1"], "--limit must be >= 0"),
        (["{f}", "--limit", "x"], "--limit: bad value 'x'"),
        (["{f}", "--key_format", "le"], "--key_format: 'le' is not one of"),
        (["{f}", "--bogus"], "unknown flag '--bogus'"),
    ],
)
def test_kvtool_command_line_errors(tmp_path: Path, args: list[str], problem: str) -> None:
    path = float_file(tmp_path)
    result = run("kvtool", *[a.format(f=path) for a in args])
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and problem in result.stderr
    assert result.stdout == ""
