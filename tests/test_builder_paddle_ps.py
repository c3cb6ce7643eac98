"""cube-builder -input_format paddle_ps: saves the real trainer wrote (tests/data/paddle_ps)
built into shards byte-identical to SequenceFile builds of the same rows, the sparse table
found among a save's folders, and bad saves refused by file and line with nothing published."""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers.build_inputs import output_digests
from test_builder import assert_no_leftovers, build_args, run_builder

from cube.builder import paddle_ps as shell
from cube.builder.build import BuildConfig, BuildError, build, refuse_paddle_save
from cube.kernel import COMPILED
from cube.paddle_ps import PaddleSource, ValueSpec, parse_fleet_desc
from cube.seqfile import SequenceFileWriter
from cube.shard import Shard, ShardStack
from cube.values import ValueColumn

DATA = Path(__file__).resolve().parent / "data" / "paddle_ps"
BASE, DELTA = 1_700_000_000, 1_700_000_100
# Where each served field sits in a row's numbers (after the key), from Paddle's
# ctr_accessor.h / sparse_accessor.h and sparse_sgd_rule.h, written out by hand here:
# slot unseen_days delta_score show click embed_w [embed state] embedx_w... [embedx state]
COLUMNS = {
    # scenario: (flags, show, click, embed_w, first embedx_w, embedx_dim)
    "ctr_common_adagrad": (("ctr_common", 8, "adagrad"), 3, 4, 5, 7, 5),  # embed_g2sum at 6
    "sparse_adam": (("sparse", 8, "adam"), 3, 4, 5, 10, 7),  # gsum g2sum beta1 beta2 at 6-9
    "sparse_naive_2tables": (("sparse", 4, "naive"), 3, 4, 5, 6, 3),  # emb_a, D=4
}


def reference_rows(
    folder: Path, scenario: str, fields: tuple[str, ...], dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """The (key, value) rows a converter must produce, by Python's int and float per line."""
    _, show, click, embed_w, embedx, embedx_dim = COLUMNS[scenario]
    keys, rows = [], []
    for part in sorted(folder.iterdir()):
        data = part.read_bytes()
        data = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        for line in data.decode().splitlines():
            numbers = line.split()
            keys.append(int(numbers[0]))
            floats = [float(n) for n in numbers[1:]]
            columns = {"show": [show], "click": [click], "embed_w": [embed_w]}
            columns["embedx_w"] = list(range(embedx, embedx + embedx_dim))
            row = []
            for field in fields:
                row += [floats[c] if c < len(floats) else 0.0 for c in columns[field]]
            rows.append(row)
    values = np.array(rows, dtype=np.float64).astype(np.dtype(dtype).newbyteorder("<"))
    return np.array(keys, dtype=np.uint64), values


def write_reference_seqfile(path: Path, keys: np.ndarray, values: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with SequenceFileWriter(path) as writer:
        if keys.size:
            blob = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
            writer.write_batch(keys, ValueColumn.fixed(blob, values.shape[1] * values.itemsize))
    return path


def source_for(scenario: str, value: ValueSpec | None = None, table: str = "") -> PaddleSource:
    accessor, dim, optimizer = COLUMNS[scenario][0]
    value = ValueSpec() if value is None else value
    return PaddleSource(accessor=accessor, dim=dim, optimizer=optimizer, table=table, value=value)


def config(
    root: Path,
    shards: int = 3,
    mode: str = "base",
    *,
    input_format: str = "seqfile",
    paddle: PaddleSource | None = None,
    workers: int = 2,
    allow_empty: bool = False,
) -> BuildConfig:
    """A build of the `emb` dict (BuildConfig's defaults for what is not given)."""
    cur = BASE if mode == "base" else DELTA
    return BuildConfig(
        "emb", root, shards, mode, cur, BASE, workers=workers, allow_empty=allow_empty,
        input_format=input_format, paddle=paddle,
    )  # fmt: skip


CASES = [
    (scenario, save)
    for scenario in COLUMNS
    for save in json.loads((DATA / scenario / "expected.json").read_text())["saves"]
]
VALUES = [(("embed_w", "embedx_w"), "float32"), (("show", "click", "embed_w", "embedx_w"),
          "float16"), (("embedx_w", "embed_w"), "float64")]  # fmt: skip


@pytest.mark.parametrize(("fields", "dtype"), VALUES, ids=["default", "cvm-float16", "f64"])
@pytest.mark.parametrize(("scenario", "save"), CASES)
def test_a_save_builds_the_bytes_of_a_sequencefile_of_its_rows(
    tmp_path: Path, scenario: str, save: str, fields: tuple[str, ...], dtype: str
) -> None:
    """Every real save (every mode, both accessors, plain, gzip and empty parts): the shards,
    tars, md5s and meta_info are byte for byte those of a SequenceFile build of the rows a
    line-by-line Python reading gives."""
    save_dir = DATA / scenario / save
    table = "000"  # for the two-table save: -paddle_table picks emb_a
    keys, values = reference_rows(save_dir / table, scenario, fields, dtype)
    reference = write_reference_seqfile(tmp_path / "seq" / "part-00000", keys, values)
    value = ValueSpec(fields, dtype)
    paddle = source_for(scenario, value=value, table=table)
    build(config(tmp_path / "from_seqfile", allow_empty=True, workers=1), reference.parent)
    build(config(tmp_path / "from_save", input_format="paddle_ps", paddle=paddle,
                 allow_empty=True, workers=1), save_dir)  # fmt: skip
    built = output_digests(tmp_path / "from_save")
    assert built == output_digests(tmp_path / "from_seqfile")
    assert len(built) == 3 * 4 + 3  # 3 shards: index, data, tar, md5 each; 3 meta_info


@pytest.mark.slow
def test_served_values_are_the_trainers_lookups(tmp_path: Path) -> None:
    """Build, open the shards as a server does, look every key up: the value is what the
    trainer's own lookup returned for it (show, click, embed_w, embedx_w: the cvm input)."""
    scenario, save = "ctr_common_adagrad", "base"
    info = json.loads((DATA / scenario / "expected.json").read_text())
    record = info["saves"][save]["tables"]["emb"]
    paddle = source_for(scenario, value=ValueSpec(("show", "click", "embed_w", "embedx_w")))
    result = build(
        config(tmp_path / "out", 2, input_format="paddle_ps", paddle=paddle), DATA / scenario / save
    )
    keys = np.array(record["keys"], dtype=np.uint64)
    lookup = np.frombuffer(bytes.fromhex("".join(record["lookup_f32le_hex"])), "<f4")
    lookup = lookup.reshape(len(keys), 8)
    stack_values = np.empty_like(lookup)
    for shard in range(2):
        stack = ShardStack([Shard.open(result.version_dir / f"emb_part{shard}", verify=True)])
        mine = np.flatnonzero(keys % np.uint64(2) == np.uint64(shard))
        found = stack.lookup(keys[mine])
        assert found.found.all()
        blob = np.frombuffer(b"".join(stack.gather(found).to_list()), "<f4")
        stack_values[mine] = blob.reshape(-1, 8)
    assert np.all(np.abs(stack_values - lookup) <= 5e-6 * np.abs(lookup))
    assert result.metas[0]["value_width"] == 32 and result.key_formats == ("cube",)


def test_read_table_gives_a_saves_values_as_arrays() -> None:
    """The reader API other tools call (the transfer, a trainer's check): a save's rows as
    arrays, the trainer's lookups; an empty save as empty arrays of the value's shape."""
    from cube.builder.paddle_ps import read_table

    info = json.loads((DATA / "sparse_adam" / "expected.json").read_text())
    record = info["saves"]["base"]["tables"]["emb"]
    keys, values = read_table(str(DATA / "sparse_adam" / "base"), source_for("sparse_adam"))
    assert keys.tolist() == record["keys"] and values.shape == (len(keys), 8)
    lookup = np.frombuffer(bytes.fromhex("".join(record["lookup_f32le_hex"])), "<f4")
    assert np.all(np.abs(values - lookup.reshape(values.shape)) <= 5e-6 * np.abs(values))
    empty = DATA / "ctr_common_adagrad" / "delta_empty"
    keys, values = read_table(str(empty), source_for("ctr_common_adagrad", value=ValueSpec(
        ("show", "embed_w"), "float16")))  # fmt: skip
    assert keys.shape == (0,) and values.shape == (0, 2) and values.dtype == np.float16


@pytest.mark.slow
@pytest.mark.skipif(not COMPILED, reason="numba is not installed (or CUBE_KERNEL=numpy)")
def test_the_compiled_parser_builds_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = DATA / "sparse_adam" / "checkpoint"
    paddle = source_for("sparse_adam")
    build(config(tmp_path / "numpy", input_format="paddle_ps", paddle=paddle, workers=1), save)
    monkeypatch.setattr(shell, "COMPILED_FROM_BYTES", 0)
    build(config(tmp_path / "compiled", input_format="paddle_ps", paddle=paddle, workers=2), save)
    assert output_digests(tmp_path / "numpy") == output_digests(tmp_path / "compiled")


def test_gzip_parts_of_several_members_and_small_batches_read_the_same(tmp_path: Path) -> None:
    """A part written as several gzip members (as appending writers do), and batches that
    cut a member and a line anywhere: the same rows."""
    save = tmp_path / "save"
    shutil.copytree(DATA / "ctr_common_adagrad" / "batch_model", save)
    part = save / "000" / "part-000-00001.gz"
    text = gzip.decompress(part.read_bytes())
    thirds = [
        text[: len(text) // 3],
        text[len(text) // 3 : 2 * len(text) // 3],
        text[2 * len(text) // 3 :],
    ]
    part.write_bytes(b"".join(gzip.compress(piece) for piece in thirds))
    layout = source_for("ctr_common_adagrad").layout_for(None)
    original = DATA / "ctr_common_adagrad" / "batch_model" / "000" / "part-000-00001.gz"
    for batch_bytes in (64, 1000, 1 << 20):
        got = list(shell.table_batches(str(part), layout, ValueSpec(), batch_bytes))
        want = list(shell.table_batches(str(original), layout, ValueSpec(), 1 << 20))
        got_keys = np.concatenate([keys for keys, _, _ in got])
        assert got_keys.tolist() == np.concatenate([keys for keys, _, _ in want]).tolist()
        values = b"".join(v.blob.tobytes() for _, v, _ in got)
        assert values == b"".join(v.blob.tobytes() for _, v, _ in want)
        assert got[-1][2] == part.stat().st_size  # progress ends at the file's size


# ---------------------------------------------------------------------------------------------
# Finding the table


@pytest.mark.slow
def test_the_sparse_table_is_found_by_content_whatever_its_number(tmp_path: Path) -> None:
    """The dense part is 001 in this save and 000 in another job's (and 002 with two sparse
    tables): swap the folders, the same table is found."""
    save = tmp_path / "save"
    shutil.copytree(DATA / "ctr_common_adagrad" / "delta", save)
    (save / "000").rename(save / "tmp")
    (save / "001").rename(save / "000")
    (save / "tmp").rename(save / "001")
    (save / "notes").mkdir()  # not numbered: not a table
    (save / "notes" / "part-000-00000").write_text("anything\n")
    table = shell.find_table(str(save), source_for("ctr_common_adagrad"))
    assert table.folder.endswith("save/001") and len(table.files) == 4
    paddle = source_for("ctr_common_adagrad")
    result = build(config(tmp_path / "out", input_format="paddle_ps", paddle=paddle), save)
    assert result.records_read == 228 and result.input_files == 4


def test_a_table_folder_or_one_part_file_is_an_input_too(tmp_path: Path) -> None:
    folder = DATA / "sparse_adam" / "batch_model" / "000"
    paddle = source_for("sparse_adam")
    assert len(shell.find_table(str(folder), paddle).files) == 4
    one = shell.find_table(str(folder / "part-000-00002.gz"), paddle)
    assert [f.url for f in one.files] == [str(folder / "part-000-00002.gz")]


def test_two_sparse_tables_are_refused_unless_one_is_named(tmp_path: Path) -> None:
    save = DATA / "sparse_naive_2tables" / "checkpoint"
    with pytest.raises(BuildError, match=r"2 sparse tables \(000, 001\); say which with -paddle"):
        shell.find_table(str(save), source_for("sparse_naive_2tables"))
    for name in ("001", "1"):
        table = shell.find_table(str(save), source_for("sparse_naive_2tables", table=name))
        assert table.folder.endswith("checkpoint/001")
    with pytest.raises(BuildError, match=r"no table folder '7' \(-paddle_table\); it has 000, 0"):
        shell.find_table(str(save), source_for("sparse_naive_2tables", table="7"))
    with pytest.raises(BuildError, match=r"002 \(-paddle_table\): not a sparse table: dense "):
        shell.find_table(str(save), source_for("sparse_naive_2tables", table="002"))


def test_the_trainers_configuration_names_the_table_and_its_layout(tmp_path: Path) -> None:
    """-paddle_config alone: which folder, which accessor, dim and rules; by table name when
    it has two sparse tables (else both are read)."""
    desc = DATA / "sparse_naive_2tables" / "fleet_desc.prototxt"
    tables = tuple(parse_fleet_desc(desc.read_bytes(), str(desc)))
    save = DATA / "sparse_naive_2tables" / "base"
    # both, as a version of two tables (tests/test_paddle_tables.py); find_table reads one
    with pytest.raises(BuildError, match=r"2 sparse tables to read \(000 \(emb_a\), 001 \(emb_b\)"):
        shell.find_table(str(save), PaddleSource(config=tables, config_name=str(desc)))
    picked = shell.find_table(
        str(save), PaddleSource(table="emb_b", config=tables, config_name=str(desc))
    )
    assert picked.folder.endswith("base/001") and picked.layout.dim == 6
    assert picked.layout.embed_rule.name == "naive"
    single = DATA / "ctr_common_adagrad" / "fleet_desc.prototxt"
    ctr = PaddleSource(config=tuple(parse_fleet_desc(single.read_bytes(), "f")), config_name="f")
    table = shell.find_table(str(DATA / "ctr_common_adagrad" / "checkpoint"), ctr)
    assert table.folder.endswith("checkpoint/000") and table.layout.describe() == (
        "ctr_common (dim 8, optimizer adagrad)"
    )


def test_a_save_without_a_sparse_table_says_what_each_folder_is(tmp_path: Path) -> None:
    save = tmp_path / "save"
    shutil.copytree(DATA / "sparse_adam" / "base" / "001", save / "001")
    (save / "000").mkdir()
    (save / "000" / "part-000-00000").write_text("0.5 0.25 0.125\n")
    with pytest.raises(BuildError) as caught:
        shell.find_table(str(save), source_for("sparse_adam"))
    message = str(caught.value)
    assert "no sparse table (000: its first row is not a key and 6" in message
    assert "0.125" not in message  # what a file holds is never repeated
    assert "001: dense parameters (part-000.gz)" in message
    with pytest.raises(BuildError, match="not a parameter-server save"):
        shell.find_table(str(DATA / "sparse_adam"), source_for("sparse_adam"))


@pytest.mark.slow
def test_an_empty_delta_builds_only_with_allow_empty(tmp_path: Path) -> None:
    save = DATA / "ctr_common_adagrad" / "delta_empty"
    args = build_args(save, tmp_path / "out", 2, **CTR_FLAGS)
    done = run_builder(*args)
    assert done.returncode == 1 and "4 input files hold no record" not in done.stderr
    assert "no input files" in done.stderr and "-allow_empty" in done.stderr, done.stderr
    done = run_builder(*args, "-allow_empty")
    assert done.returncode == 0, done.stderr
    meta = json.loads(next((tmp_path / "out" / "meta_info").iterdir()).read_text())
    assert meta["record_count"] == 0


# ---------------------------------------------------------------------------------------------
# The command line and bad saves


@pytest.mark.slow
def test_the_cli_builds_a_save_with_the_configuration_only(tmp_path: Path) -> None:
    save = DATA / "sparse_naive_2tables" / "checkpoint"
    desc = DATA / "sparse_naive_2tables" / "fleet_desc.prototxt"
    args = build_args(save, tmp_path / "out", 2, input_format="paddle_ps",
                      paddle_config=desc, paddle_table="emb_b", quiet="false")  # fmt: skip
    done = run_builder(*args)
    assert done.returncode == 0, done.stderr
    assert "114 records from 4 files (" in done.stdout, done.stdout
    assert "checkpoint/001, sparse (dim 6, optimizer naive)), 114 distinct keys, into 2 shards" in (
        done.stdout
    )
    meta = json.loads(sorted((tmp_path / "out" / "meta_info").iterdir())[0].read_text())
    assert meta["value_width"] == 6 * 4 and meta["key_format"] == "cube"


@pytest.mark.parametrize("save", ["base", "delta"])
def test_a_first_order_table_builds_the_bytes_of_a_sequencefile_of_its_weights(
    tmp_path: Path, save: str
) -> None:
    """The DeepFM save's first-order table (CtrCommonAccessor + adagrad at D=3: embedx_dim 0),
    read with the layout flags alone (-paddle_dim 3): its rows of 7 numbers and of 8 (the
    embedx g2sum, -nan or 0) build the bytes a SequenceFile of each key's embed_w (Python's
    float of the row's 6th number, as float32) builds."""
    save_dir = DATA / "ctr_common_first_order" / save / "001"
    keys, weights = [], []
    for part in sorted(save_dir.iterdir()):
        for line in part.read_text().splitlines():
            numbers = line.split()
            assert len(numbers) == 8 or (len(numbers) == 9 and numbers[8] in ("-nan", "0"))
            keys.append(int(numbers[0]))
            weights.append([float(numbers[6])])
    reference = write_reference_seqfile(
        tmp_path / "seq" / "part-00000",
        np.array(keys, dtype=np.uint64),
        np.array(weights, dtype="<f4"),
    )
    paddle = PaddleSource(accessor="ctr_common", dim=3, optimizer="adagrad")
    build(config(tmp_path / "from_seqfile", workers=1), reference.parent)
    build(config(tmp_path / "from_save", input_format="paddle_ps", paddle=paddle, workers=1),
          save_dir)  # fmt: skip
    assert output_digests(tmp_path / "from_save") == output_digests(tmp_path / "from_seqfile")
    meta = json.loads(sorted((tmp_path / "from_save" / "meta_info").iterdir())[0].read_text())
    assert meta["value_width"] == 4


@pytest.mark.slow
def test_the_cli_refuses_embedx_w_for_a_first_order_table(tmp_path: Path) -> None:
    """cube-builder with the DeepFM's configuration: by default both tables build (the
    first-order one serving embed_w); -paddle_value naming embedx_w exits 1 naming the table."""
    scenario = DATA / "ctr_common_first_order"
    args = build_args(scenario / "base", tmp_path / "out", 2, input_format="paddle_ps",
                      paddle_config=scenario / "fleet_desc.prototxt")  # fmt: skip
    done = run_builder(*args)
    assert done.returncode == 0, done.stderr
    meta = json.loads(sorted((tmp_path / "out" / "meta_info").iterdir())[0].read_text())
    assert [t["value_width"] for t in meta["tables"]] == [24, 4]
    done = run_builder(*build_args(scenario / "base", tmp_path / "out2", 2, "-paddle_value",
                                   "show,click,embed_w,embedx_w", input_format="paddle_ps",
                                   paddle_config=scenario / "fleet_desc.prototxt"))  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "base/001: -paddle_value show,click,embed_w,embedx_w: ctr_common (dim 3, optimizer " in (
        done.stderr
    )
    assert "has no embedx_w (embedx_dim 0" in done.stderr


def save_copy(tmp_path: Path, save: str = "delta", scenario: str = "ctr_common_adagrad") -> Path:
    target = tmp_path / "save"
    shutil.copytree(DATA / scenario / save, target)
    return target


CTR_FLAGS = dict(input_format="paddle_ps", paddle_accessor="ctr_common", paddle_dim=8,
                 paddle_optimizer="adagrad")  # fmt: skip
CTR_ARGS = [arg for name, value in CTR_FLAGS.items() for arg in (f"-{name}", str(value))]


def corrupt_row(save: Path) -> tuple[Path, str]:
    part = save / "000" / "part-000-00002"
    lines = part.read_text().splitlines(keepends=True)
    lines[4] = lines[4].replace(" ", " x", 1)  # line 5: the slot column is not a number
    part.write_text("".join(lines))
    return part, "line 5: field 2 (slot), column 6: not a decimal number (a letter at column 6)"


def negative_key(save: Path) -> tuple[Path, str]:
    part = save / "000" / "part-000-00001"
    part.write_text("-" + part.read_text())
    return part, "line 1: field 1 (key), column 1: not an unsigned decimal integer (keys are"


def key_too_large(save: Path) -> tuple[Path, str]:
    part = save / "000" / "part-000-00003"
    lines = part.read_text().splitlines(keepends=True)
    lines[9] = "18446744073709551616" + lines[9][lines[9].index(" ") :]
    part.write_text("".join(lines))
    return part, "line 10: field 1 (key), column 1: does not fit in 64 bits"


def short_row_in_gzip(save: Path) -> tuple[Path, str]:
    save = save.parent / "save"
    part = save / "000" / "part-000-00000.gz"
    lines = gzip.decompress(part.read_bytes()).decode().splitlines(keepends=True)
    lines[20] = " ".join(lines[20].split()[:-1]) + "\n"  # one number short
    part.write_bytes(gzip.compress("".join(lines).encode()))
    return part, "line 21: 12 numbers after the key; ctr_common (dim 8, optimizer adagrad) rows"


def truncated_gzip(save: Path) -> tuple[Path, str]:
    part = save / "000" / "part-000-00001.gz"
    data = gzip.compress(gzip.decompress(part.read_bytes()) * 30)
    part.write_bytes(data[: len(data) // 2])
    return part, "not a whole gzip file (it ends inside a compressed stream, near byte"


def corrupt_gzip(save: Path) -> tuple[Path, str]:
    part = save / "000" / "part-000-00003.gz"
    data = bytearray(part.read_bytes())
    data[-8] ^= 0xFF  # the CRC
    part.write_bytes(bytes(data))
    return part, "not a whole gzip file (Error -3 while decompressing data: incorrect data check"


def garbage_after_gzip(save: Path) -> tuple[Path, str]:
    part = save / "000" / "part-000-00002.gz"
    part.write_bytes(part.read_bytes() + b"\0\0\0\0")
    return part, "not a whole gzip file (something else than a gzip member follows one"


def cut_inside_last_row(save: Path) -> tuple[Path, str]:
    """An interrupted copy: the last row cut after its 7th number, which is a short row's
    count (it would serve the row's embedx_w as zeros)."""
    part = save / "000" / "part-000-00002"
    lines = part.read_text().splitlines(keepends=True)
    lines[-1] = " ".join(lines[-1].split()[:8])
    part.write_text("".join(lines))
    return part, f"line {len(lines)}: the file ends inside this row (no newline after it"


def vertical_tab(save: Path) -> tuple[Path, str]:
    part = save / "000" / "part-000-00001"
    lines = part.read_text().splitlines(keepends=True)
    fields = lines[2].split(" ")
    lines[2] = " ".join(fields[:3]) + "\v" + " ".join(fields[3:])
    part.write_text("".join(lines))
    column = len(" ".join(fields[:3])) + 1
    return part, f"line 3: field 3 (unseen_days), column {column - len(fields[2])}: not a decimal"


def endless_line(save: Path) -> tuple[Path, str]:
    part = save / "000" / "part-000-00002"
    part.write_bytes(b"7 " + b"1" * (3 << 20))
    return part, "line 1: longer than 1048576 bytes (not a parameter-server text table)"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("save", "corrupt"),
    [
        ("delta", corrupt_row),
        ("delta", negative_key),
        ("delta", key_too_large),
        ("checkpoint", short_row_in_gzip),
        ("checkpoint", truncated_gzip),
        ("checkpoint", corrupt_gzip),
        ("checkpoint", garbage_after_gzip),
        ("delta", endless_line),
        ("delta", cut_inside_last_row),
        ("delta", vertical_tab),
    ],
    ids=lambda value: value if isinstance(value, str) else value.__name__,
)
def test_a_bad_save_fails_naming_the_file_and_line_and_publishes_nothing(
    tmp_path: Path, save: str, corrupt: Callable[[Path], tuple[Path, str]]
) -> None:
    copy = save_copy(tmp_path, save)
    part, message = corrupt(copy)
    output = tmp_path / "out"
    spill = tmp_path / "spill"
    done = run_builder(*build_args(copy, output, 2, tmp_dir=spill, **CTR_FLAGS))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {part}"), done.stderr
    assert message in lines[0], lines[0]
    assert_no_leftovers(output)
    assert not (output / "meta_info").exists()
    assert list(spill.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-paddle_dim", "8"], "-paddle_dim needs -input_format paddle_ps"),
        (["-input_format", "paddle_ps"], "needs -paddle_accessor, -paddle_dim, -paddle_optimizer"),
        (["-input_format", "paddle_ps", "-paddle_accessor", "CtrDymfAccessor", "-paddle_dim",
          "8", "-paddle_optimizer", "adagrad"], "CtrDymfAccessor is not supported"),
        ([*CTR_ARGS, "-paddle_value", "embed_w,cvm"], "not cvm"),
        ([*CTR_ARGS, "-key_format", "cube"], "-key_format is for SequenceFiles"),
        (["-input_format", "paddle_ps", "-paddle_dtype", "int8"], "-paddle_dtype"),
    ],
)  # fmt: skip
def test_bad_paddle_flags_exit_2(tmp_path: Path, extra: list[str], message: str) -> None:
    done = run_builder(*build_args(tmp_path, tmp_path / "out", 1), *extra)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr


@pytest.mark.slow
def test_an_unreadable_configuration_exits_1(tmp_path: Path) -> None:
    (tmp_path / "desc.txt").write_text("not { a config\n")
    for path, message in ((tmp_path / "missing", "No such file"), (tmp_path / "desc.txt", "not")):
        args = build_args(DATA / "sparse_adam" / "base", tmp_path / "out", 1,
                          input_format="paddle_ps", paddle_config=path)  # fmt: skip
        done = run_builder(*args)
        assert done.returncode == 1 and f"-paddle_config {path}" in done.stderr, done.stderr
        assert message in done.stderr


# ---------------------------------------------------------------------------------------------
# Damaged and hostile inputs (issue 36 item 6): one clear error naming the file (and line), or
# a correct reading; nothing published; every wait bounded


def two_member_gzip(text: bytes, first_size: int) -> bytes:
    """`text` as two gzip members, the first exactly `first_size` bytes long (stored blocks,
    its text padded with blank lines to that size)."""
    lines = text.splitlines(keepends=True)
    head, tail = b"".join(lines[: len(lines) // 2]), b"".join(lines[len(lines) // 2 :])
    pad = first_size - len(gzip.compress(head, compresslevel=0, mtime=0))
    while True:
        member = gzip.compress(head + b"\n" * pad, compresslevel=0, mtime=0)
        if len(member) == first_size:
            return member + gzip.compress(tail, mtime=0)
        pad += first_size - len(member)
        assert pad >= 0


@pytest.mark.parametrize("boundary_gap", [1, 0, 2])
def test_a_gzip_member_ending_by_a_read_boundary_is_read(tmp_path: Path, boundary_gap: int) -> None:
    """Two members, the first ending 1 byte (and 0 and 2) before the 1 MiB read: read whole
    (the reader used to judge the next member by its first byte alone and refuse the file)."""
    plain = DATA / "ctr_common_adagrad" / "delta" / "000" / "part-000-00001"
    text = plain.read_bytes() * 40
    part = tmp_path / "part-000-00000.gz"
    part.write_bytes(two_member_gzip(text, (1 << 20) - boundary_gap))
    layout = source_for("ctr_common_adagrad").layout_for(None)
    got = [k for k, _, _ in shell.table_batches(str(part), layout, ValueSpec(), 4 << 20)]
    want = [k for k, _, _ in shell.table_batches(str(plain), layout, ValueSpec(), 4 << 20)]
    assert np.concatenate(got).tolist() == np.concatenate(want).tolist() * 40


def test_a_fifo_in_a_parts_place_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO swapped in for a part after the listing: refused by name, not waited on (an
    open() of a FIFO blocks until some writer comes)."""
    import os
    import threading

    save = save_copy(tmp_path)
    source = source_for("ctr_common_adagrad")
    table = shell.find_table(str(save), source)
    victim = save / "000" / "part-000-00002"
    victim.unlink()
    os.mkfifo(victim)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            for path in shell.local_paths(table):
                list(shell.table_batches(str(path), table.layout, ValueSpec(), 1 << 20))
        except BaseException as exc:  # reported below
            outcome.append(exc)

    for reader in (read, lambda: outcome.append(_first_row_error(str(victim)))):
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "blocked on the FIFO"
    assert len(outcome) == 2 and all(isinstance(e, BuildError) for e in outcome), outcome
    assert str(outcome[0]).startswith(f"{victim}: a FIFO (a part file must be a regular file")


def _first_row_error(path: str) -> BaseException:
    try:
        shell.first_row(path)
    except BuildError as exc:
        return exc
    raise AssertionError("first_row read a FIFO")


@pytest.mark.slow
def test_a_fifo_swapped_in_during_a_build_fails_it(tmp_path: Path) -> None:
    """The whole build (its reader processes): exit 1 naming the FIFO, nothing published."""
    import subprocess
    import sys

    save = save_copy(tmp_path)
    output = tmp_path / "out"
    script = f"""
import os, sys
from cube.builder import paddle_ps, cli
real = paddle_ps.find_tables
def swapped(*args, **kwargs):
    found = real(*args, **kwargs)
    victim = {str(save / "000" / "part-000-00002")!r}
    os.unlink(victim)
    os.mkfifo(victim)
    return found
paddle_ps.find_tables = swapped
sys.exit(cli.main(sys.argv[1:]))
"""
    args = build_args(save, output, 2, **CTR_FLAGS)
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "part-000-00002: a FIFO (a part file must be a regular file" in done.stderr
    assert_no_leftovers(output)


@pytest.mark.slow
def test_blank_line_padding_builds_at_dim_1024(tmp_path: Path) -> None:
    """16 MiB of blank lines in a 16 KiB gzip, then one row at dim 1024: built (blank lines are
    skipped), its arrays sized by rows read (this asked for 32 GiB: lines x 1022 doubles)."""
    save = tmp_path / "save" / "000"
    save.mkdir(parents=True)
    row = "7 0 0 0 1 1 " + " ".join(["0.5"] * (1 + 1 + 1021 + 1)) + "\n"
    (save / "part-000-00000.gz").write_bytes(gzip.compress(b"\n" * (16 << 20) + row.encode()))
    assert (save / "part-000-00000.gz").stat().st_size < 20 << 10
    flags = {**CTR_FLAGS, "paddle_dim": 1024}
    done = run_builder(*build_args(save.parent, tmp_path / "out", 1, **flags))
    assert done.returncode == 0, done.stderr
    meta = json.loads(next((tmp_path / "out" / "meta_info").iterdir()).read_text())
    assert meta["record_count"] == 1 and meta["value_width"] == 1022 * 4


@pytest.mark.slow
def test_a_file_outside_a_save_is_not_repeated_in_the_error(tmp_path: Path) -> None:
    """-input_path naming some other file (a donefile's typo): refused without its text."""
    other = tmp_path / "credentials.txt"
    other.write_text("user=admin password=hunter2\n")
    done = run_builder(*build_args(other, tmp_path / "out", 1, **CTR_FLAGS))
    assert done.returncode == 1 and f"error: {other} line 1: field 1 (key)" in done.stderr
    assert "hunter2" not in done.stderr and "admin" not in done.stderr, done.stderr


# ---------------------------------------------------------------------------------------------
# A plain build of a save (issue 36 item 5): the error says -input_format paddle_ps


def test_a_plain_build_of_a_save_suggests_paddle_ps_and_the_layouts_its_rows_fit(
    tmp_path: Path,
) -> None:
    """No -input_format: the save is not SequenceFiles, and the error says how to build it,
    with the layouts its first rows fit (found by the paddle_ps module), never their content;
    a file that is neither keeps the SequenceFile reader's error."""
    save = DATA / "ctr_common_adagrad" / "base"
    with pytest.raises(BuildError) as caught:
        build(config(tmp_path / "out", input_format="seqfile"), save)
    message = str(caught.value)
    assert message.startswith(f"{save}: not SequenceFiles (000/part-"), message
    assert "looks like a PaddlePaddle parameter-server save" in message
    assert "build it with -input_format paddle_ps" in message and "-paddle_config FILE" in message
    assert "ctr_common (dim 8, optimizer adagrad)" in message  # the layout it was saved with
    part = next(p for p in sorted((save / "000").iterdir()) if p.stat().st_size)
    first = shell.head_rows(str(part), count=1)[0].decode()
    shown = [token for token in first.split() if len(token) >= 5 and token in message]
    assert not shown, shown  # nothing read from the file is echoed
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())

    other = tmp_path / "other"
    other.mkdir()
    (other / "part-00000").write_bytes(b"1 2 3\nhello\n")
    refuse_paddle_save([other / "part-00000"], str(other), str(other))  # the reader's error


@pytest.mark.slow
def test_the_cli_suggests_paddle_ps_for_a_save(tmp_path: Path) -> None:
    done = run_builder(*build_args(DATA / "ctr_double_adagrad" / "checkpoint", tmp_path / "o", 1))
    assert done.returncode == 1, done.stderr
    assert "build it with -input_format paddle_ps" in done.stderr, done.stderr
    assert "ctr_double (dim 8, optimizer adagrad)" in done.stderr, done.stderr
