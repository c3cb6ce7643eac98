"""A parameter-server save of several sparse tables built into one version of named tables
(cube.layout's TABLES): the layout of its output, tars and meta_info, each table's values those
of the table built alone, per-table layout flags, deltas that must keep their base's tables,
and the transfer's and agent's reading of such a tar.

The save is the real trainer's two-table save (tests/data/paddle_ps/sparse_naive_2tables:
SparseAccessor + naive, emb_a at D=4 in 000, emb_b at D=6 in 001, a dense table in 002); its
checkpoint save (mode 0, same tables) serves as a delta's save."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.build_inputs import output_digests
from test_builder import build_args, run_builder
from test_builder_paddle_ps import BASE, DATA, config

from cube import format as fmt
from cube.agent.unpack import UnsafeTar, extract_shard_tar, shard_dirs
from cube.builder.build import BuildError, BuildResult, build
from cube.builder.cli import config_from_flags, flag_set
from cube.builder.paddle_ps import (
    TableFlags,
    TablesSource,
    find_table,
    find_tables,
    layout_flags,
    per_table_values,
    read_table,
)
from cube.flags import FlagError
from cube.layout import LayoutError, parse_tables
from cube.paddle_ps import PaddleSource, ValueSpec, parse_fleet_desc
from cube.shard import Shard, ShardStack
from cube.transfer import build as builds

SCENARIO = DATA / "sparse_naive_2tables"
DESC = SCENARIO / "fleet_desc.prototxt"
CONFIG = tuple(parse_fleet_desc(DESC.read_bytes(), str(DESC)))
TABLES = ["000", "001"]
WIDTHS = {"000": 4 * 4, "001": 6 * 4}  # embed_w + embedx_w as float32: D numbers


def configured(table: str = "", value: ValueSpec | None = None) -> PaddleSource:
    """The trainer's configuration (two sparse tables) and -paddle_table `table`."""
    return PaddleSource(
        table=table, value=value or ValueSpec(), config=CONFIG, config_name=str(DESC)
    )


def flagged(table: str = "all", dim: str = "000:4,001:6", accessor: str = "sparse",
            optimizer: str = "naive") -> TablesSource:  # fmt: skip
    """Layout flags only, as cube-builder reads them (-paddle_dim per table)."""
    every_accessor, every_dim, every_optimizer, per_table = layout_flags(accessor, dim, optimizer)
    return TablesSource(
        accessor=every_accessor, dim=every_dim, optimizer=every_optimizer, table=table,
        per_table=per_table,
    )  # fmt: skip


def build_save(
    out: Path,
    paddle: PaddleSource,
    save: str | Path = "base",
    mode: str = "base",
    variable_width: bool = False,
) -> BuildResult:
    path = save if isinstance(save, Path) else SCENARIO / save
    built = config(
        out, 3, mode, input_format="paddle_ps", paddle=paddle, allow_empty=True, workers=1
    )
    return build(replace(built, variable_width=variable_width), path)


def header(directory: Path) -> dict[str, Any]:
    """A shard directory's index header fields."""
    data = (directory / "index.cube").read_bytes()
    return fmt.decode_header("index", data[: fmt.HEADER_SIZE], str(directory), len(data))


def served(directories: list[Path], keys: np.ndarray) -> list[bytes]:
    """What shards serve for `keys` (each key looked up in the shard that has it)."""
    values: dict[int, bytes] = {}
    for directory in directories:
        stack = ShardStack([Shard.open(directory, verify=True)])
        result = stack.lookup(keys)
        gathered = stack.gather(result).to_list()
        for key, found, value in zip(keys.tolist(), result.found, gathered, strict=True):
            if found:
                values[key] = value
        stack.close()
    assert len(values) == len(keys)
    return [values[k] for k in keys.tolist()]


def test_two_tables_build_one_version_of_named_tables(tmp_path: Path) -> None:
    """-paddle_config naming two sparse tables, no -paddle_table: every shard directory holds
    TABLES and a folder of shard files per table; its tar the same members, its md5 the tar's;
    headers name the table; meta_info sums the tables and lists each; each table serves what
    the table built alone (-paddle_table 000, 001: a version of one table, as ever) serves."""
    result = build_save(tmp_path / "multi", configured())
    assert result.tables == ("000", "001")
    assert "base/000, sparse (dim 4, optimizer naive); " in result.input_note
    version = result.version_dir
    for shard in range(3):
        part = version / f"emb_part{shard}"
        assert (part / "TABLES").read_text() == "000\n001\n"
        assert sorted(p.name for p in part.iterdir()) == ["000", "001", "TABLES"]
        for name in TABLES:
            assert sorted(p.name for p in (part / name).iterdir()) == ["data.cube", "index.cube"]
            fields = header(part / name)
            assert fields["table"] == name and fields["dict_name"] == "emb"
            assert fields["shard"] == shard and fields["shard_num"] == 3
            assert fields["version"] == str(BASE) and fields["value_width"] == WIDTHS[name]
        tar = version / f"emb_part{shard}.tar"
        with tarfile.open(tar) as opened_tar:
            assert opened_tar.getnames() == [
                "./TABLES", "./000/index.cube", "./000/data.cube", "./001/index.cube",
                "./001/data.cube",
            ]  # fmt: skip
            for member in opened_tar.getmembers():
                handle = opened_tar.extractfile(member)
                assert handle is not None
                assert handle.read() == (part / member.name).read_bytes()
        md5 = hashlib.md5(tar.read_bytes()).hexdigest()
        assert (version / f"emb_part{shard}.tar.md5").read_text() == f"{md5}  emb_part{shard}.tar\n"
        meta: dict[str, Any] = dict(result.metas[shard])
        assert meta["md5"] == md5 and [t["table"] for t in meta["tables"]] == TABLES
        assert [t["value_width"] for t in meta["tables"]] == [16, 24]
        assert meta["value_width"] == 0  # the tables' widths differ
        assert meta["record_count"] == sum(t["record_count"] for t in meta["tables"])
        for field, file in (("data_len_list", "data.cube"), ("index_len_list", "index.cube")):
            assert meta[field] == [str((part / n / file).stat().st_size) for n in TABLES]
        info = tmp_path / "multi" / "meta_info" / f"{BASE}_{BASE}_{shard}_0.json"
        assert json.loads(info.read_text()) == meta
    for name in TABLES:
        alone = build_save(tmp_path / f"alone{name}", configured(table=name))
        assert alone.tables == () and not (alone.version_dir / "emb_part0" / "TABLES").exists()
        keys, _ = read_table(str(SCENARIO / "base"), configured(table=name))
        assert len(keys) and result.distinct_keys > len(keys)
        ours = served([version / f"emb_part{s}" / name for s in range(3)], keys)
        theirs = served([alone.version_dir / f"emb_part{s}" for s in range(3)], keys)
        assert ours == theirs and {len(v) for v in ours} == {WIDTHS[name]}
        records = [m["tables"][TABLES.index(name)]["record_count"] for m in result.metas]
        assert records == [m["record_count"] for m in alone.metas]


def test_each_table_serves_the_trainers_lookups(tmp_path: Path) -> None:
    """The values a version of two tables serves are what the trainer's own lookups of each
    embedding returned (expected.json), in both saves."""
    info = json.loads((SCENARIO / "expected.json").read_text())
    for save in ("base", "checkpoint"):
        result = build_save(tmp_path / save, configured(table="emb_a,emb_b"), save)
        for name, table in info["saves"][save]["tables"].items():
            folder = info["tables"][name]["folder"]
            keys = np.array(table["keys"], dtype=np.uint64)
            want = np.frombuffer(bytes.fromhex("".join(table["lookup_f32le_hex"])), "<f4")
            parts = [result.version_dir / f"emb_part{s}" / folder for s in range(3)]
            got = np.frombuffer(b"".join(served(parts, keys)), "<f4")
            assert got.shape == want.shape
            assert np.all(np.abs(got - want) <= 5e-6 * np.abs(want))


def test_layout_flags_per_table_build_what_the_configuration_builds(tmp_path: Path) -> None:
    """-paddle_table all (or 000,001, in any order) with -paddle_dim 000:4,001:6: the same
    files, byte for byte, as the trainer's configuration gives; the flags' per-table syntax."""
    build_save(tmp_path / "config", configured())
    build_save(tmp_path / "flags", flagged())
    build_save(tmp_path / "list", flagged(table="001,0"))
    digests = output_digests(tmp_path / "config")
    assert digests == output_digests(tmp_path / "flags") == output_digests(tmp_path / "list")
    every = flagged(dim="000:4,001:6", optimizer="000:naive,naive,001:naive")
    assert every.per_table == (TableFlags("000", dim=4, optimizer="naive,naive"),
                               TableFlags("001", dim=6, optimizer="naive"))  # fmt: skip
    build_save(tmp_path / "rules", every)
    assert output_digests(tmp_path / "rules") == digests
    assert per_table_values("paddle_dim", "8") == ("8", {})
    for bad in ("8,001:6", "000:4,,001:6", ":4", "000:", "000:4,000:4"):
        with pytest.raises(ValueError, match="-paddle_dim"):
            per_table_values("paddle_dim", bad)
    with pytest.raises(ValueError, match="either one value for every table, or TABLE:VALUE"):
        per_table_values("paddle_optimizer", "000:adam,naive,adagrad")
    with pytest.raises(ValueError, match=r"-paddle_dim \(table 001\): 'x' is not a whole"):
        layout_flags("", "000:4,001:x", "")


def test_one_named_table_is_a_version_of_one_table_as_ever(tmp_path: Path) -> None:
    """-paddle_table 001 (and emb_b): a version of one unnamed table, byte for byte the same
    with per-table flags naming it."""
    build_save(tmp_path / "named", configured(table="emb_b"))
    build_save(tmp_path / "flags", flagged(table="001", dim="001:6"))
    build_save(tmp_path / "plain", flagged(table="1", dim="6"))
    digests = output_digests(tmp_path / "named")
    assert digests == output_digests(tmp_path / "flags") == output_digests(tmp_path / "plain")
    assert not any("TABLES" in name or "/001/" in name for name in digests)


def test_what_does_not_say_which_tables_or_their_layouts_is_refused(tmp_path: Path) -> None:
    save = str(SCENARIO / "base")
    with pytest.raises(BuildError, match=r"2 sparse tables \(000, 001\); say which with -pa"):
        find_tables(save, flagged(table="", dim="4"))
    with pytest.raises(BuildError, match="or -paddle_table all to build every one"):
        find_tables(save, flagged(table="", dim="4"))
    # one dim for both: table 001's rows do not fit D=4 (refused naming its file and line)
    with pytest.raises(BuildError, match=r"base/001/part-000-0000\d line 1"):
        build_save(tmp_path / "one_dim", flagged(dim="4"))
    with pytest.raises(BuildError, match=r"-paddle_dim name table '003', which this build "):
        find_tables(save, flagged(dim="000:4,001:6,003:8"))
    with pytest.raises(BuildError, match=r"table 001: -input_format paddle_ps needs -paddle_dim"):
        find_tables(save, flagged(dim="000:4"))
    with pytest.raises(BuildError, match=r"table 000: -paddle_dim gives it two values"):
        find_tables(save, flagged(dim="000:4,0:4,001:6"))
    with pytest.raises(BuildError, match=r"-paddle_table 000,000: names table 000 twice"):
        find_tables(save, configured(table="000,000"))
    with pytest.raises(BuildError, match=r"002 \(-paddle_table\): not a sparse table: dense"):
        find_tables(save, configured(table="000,002"))
    with pytest.raises(BuildError, match=r"one table's folder; several tables"):
        find_tables(f"{save}/000", flagged())
    with pytest.raises(BuildError, match=r"-paddle_dim 9, but .* says embedx_dim 5: dim 6"):
        find_tables(save, TablesSource(config=CONFIG, config_name="c", per_table=(
            TableFlags("001", dim=9),)))  # fmt: skip
    # a tool reading one table (iter_table, the Spark engine) says it reads one
    with pytest.raises(BuildError, match=r"2 sparse tables to read \(000 \(emb_a\), 001 \(emb_"):
        find_table(save, configured())
    with pytest.raises(BuildError, match="-delete_path with several tables"):
        deletes = tmp_path / "deletes"
        deletes.write_text("1\n")
        build(config(tmp_path / "d", 3, "delta", input_format="paddle_ps",
                     paddle=configured(), workers=1), SCENARIO / "checkpoint", deletes)  # fmt: skip


def cli_flags(*args: str) -> list[str]:
    return ["-dict_name", "d", "-input_path", "/in", "-output_path", "/out", "-shard_num", "2",
            "-input_format", "paddle_ps", *args]  # fmt: skip


def test_the_cli_reads_per_table_flags_and_refuses_malformed_ones() -> None:
    flags = flag_set().parse(cli_flags(
        "-paddle_accessor", "sparse", "-paddle_optimizer", "naive", "-paddle_dim", "000:4,001:6",
        "-paddle_table", "all"))  # fmt: skip
    paddle = config_from_flags(flags, 1_700_000_000).paddle
    assert isinstance(paddle, TablesSource) and paddle.table == "all" and paddle.dim == 0
    assert paddle.per_table == (TableFlags("000", dim=4), TableFlags("001", dim=6))
    plain = config_from_flags(flag_set().parse(cli_flags(
        "-paddle_accessor", "sparse", "-paddle_optimizer", "naive", "-paddle_dim", "4")),
        1_700_000_000).paddle  # fmt: skip
    assert plain is not None and plain.dim == 4 and not getattr(plain, "per_table", ())
    for args, message in (
        (["-paddle_dim", "4,001:6"], "either one value for every table, or TABLE:VALUE"),
        (["-paddle_dim", "000:x"], r"-paddle_dim \(table 000\): 'x' is not a whole number"),
        (["-paddle_accessor", "000:nope"], "unknown accessor 'nope'"),
        (["-paddle_dim", "-1"], "-paddle_dim must be > 0"),
        (["-paddle_dim", "8"], "needs -paddle_accessor, -paddle_optimizer"),
    ):
        with pytest.raises(FlagError, match=message):
            config_from_flags(flag_set().parse(cli_flags(*args)), 1_700_000_000)


def test_a_delta_must_have_its_bases_tables(tmp_path: Path) -> None:
    """A delta of two tables over their base builds (each table's width checked against its
    base table's); one with another table set, or one unnamed table, is refused before it is
    read; a table whose width changes is refused unless -variable_width."""
    out = tmp_path / "out"
    build_save(out, configured())
    delta = build_save(out, configured(), "checkpoint", "delta")
    assert delta.tables == ("000", "001") and delta.warnings == ()
    assert (delta.version_dir / "emb_part1" / "TABLES").read_text() == "000\n001\n"
    assert all(m["mode"] == "delta" for m in delta.metas)
    shutil.rmtree(delta.version_dir)  # the next deltas are built as the same version
    one = tmp_path / "one_table"
    shutil.copytree(SCENARIO / "checkpoint", one, ignore=shutil.ignore_patterns("001"))
    with pytest.raises(
        BuildError,
        match=r"would have the tables 000, its base .* has the tables "
        r"000, 001: a delta must have its base's tables",
    ):
        build_save(out, flagged(table="all", dim="4"), one, "delta")
    with pytest.raises(BuildError, match=r"no folder 001, where .* puts its sparse table emb_b"):
        build_save(out, configured(), one, "delta")
    wide = configured(value=ValueSpec(("show", "click", "embed_w", "embedx_w")))
    with pytest.raises(
        BuildError,
        match=r"table 000 of delta 1700000000_1700000100 has 24-byte "
        r"values, its base 1700000000's 16-byte values",
    ):
        build_save(out, wide, "checkpoint", "delta")
    varied = build_save(out, wide, "checkpoint", "delta", variable_width=True)
    assert [t["value_width"] for t in varied.metas[0]["tables"]] == [24, 32]


def test_a_delta_of_one_table_over_a_base_of_several_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    build_save(out, configured())
    with pytest.raises(
        BuildError,
        match="would have one unnamed table, its base 1700000000 has the tables 000, 001",
    ):
        build_save(out, configured(table="emb_a"), "checkpoint", "delta")
    single = tmp_path / "single"
    build_save(single, configured(table="emb_a"))
    with pytest.raises(
        BuildError,
        match="would have the tables 000, 001, its base 1700000000 has one unnamed table",
    ):
        build_save(single, configured(), "checkpoint", "delta")


# ---------------------------------------------------------------------------------------------
# The transfer's and the agent's reading of such a tar


def rewrite_tar(source: Path, target: Path, change: dict[str, bytes | None]) -> Path:
    """A copy of a tar with members replaced (bytes) or left out (None), others as they are."""
    with tarfile.open(source) as old, tarfile.open(target, "w", format=tarfile.GNU_FORMAT) as new:
        for member in old.getmembers():
            name = member.name.removeprefix("./")
            if name in change and change[name] is None:
                continue
            handle = old.extractfile(member)
            assert handle is not None
            kept = change.get(name) or handle.read()
            member.size = len(kept)
            new.addfile(member, io.BytesIO(kept))
        for name, data in change.items():
            if (
                data is not None
                and name not in old.getnames()
                and f"./{name}" not in old.getnames()
            ):
                info = tarfile.TarInfo(f"./{name}")
                info.size = len(data)
                new.addfile(info, io.BytesIO(data))
    return target


def test_the_transfer_reads_each_tables_counts(tmp_path: Path) -> None:
    result = build_save(tmp_path / "out", configured())
    shards = builds.check_outputs(result.version_dir, "emb", 3)
    for shard, meta in zip(shards, result.metas, strict=True):
        assert shard.md5 == meta["md5"] and shard.records == meta["record_count"]
        assert shard.value_width == 0 and shard.deleted == 0
        assert shard.tables == tuple(
            (t["table"], t["record_count"], 0, t["value_width"]) for t in meta["tables"]
        )
        counts = builds.read_table_counts(shard.tar)
        assert list(counts) == TABLES and builds.read_counts(shard.tar) == (
            shard.records, 0, 0)  # fmt: skip
    tar = result.version_dir / "emb_part0.tar"
    index = (result.version_dir / "emb_part0" / "000" / "index.cube").read_bytes()
    changes: list[tuple[dict[str, bytes | None], str]] = [
        ({"001/index.cube": None}, r"no 001/index.cube \(TABLES lists it\)"),
        ({"TABLES": b"000\n../x\n"}, "TABLES: table names must be"),
        ({"TABLES": b"000\nCHAIN\n"}, "may not be called 'CHAIN'"),
        ({"index.cube": index}, "both TABLES and a top-level index.cube"),
    ]
    for change, message in changes:
        with pytest.raises(builds.BuildError, match=message):
            builds.read_table_counts(rewrite_tar(tar, tmp_path / "bad.tar", change))
    alone = build_save(tmp_path / "alone", configured(table="000"))
    one = builds.read_table_counts(alone.version_dir / "emb_part0.tar")
    assert list(one) == [""] and builds.check_outputs(alone.version_dir, "emb", 3)[0].tables == ()


def test_the_agent_places_a_version_of_several_tables(tmp_path: Path) -> None:
    result = build_save(tmp_path / "out", configured())
    tar = result.version_dir / "emb_part2.tar"
    placed = tmp_path / "data" / "1700000000"
    files = extract_shard_tar(tar, placed)
    assert files == ["000/data.cube", "000/index.cube", "001/data.cube", "001/index.cube",
                     "TABLES"]  # fmt: skip
    assert shard_dirs(placed) == [placed / "000", placed / "001"]
    assert parse_tables((placed / "TABLES").read_text()) == TABLES
    for name in TABLES:
        assert (placed / name / "data.cube").read_bytes() == (
            result.version_dir / "emb_part2" / name / "data.cube").read_bytes()  # fmt: skip
    assert shard_dirs(tmp_path) == [tmp_path]  # no TABLES: one table, the directory itself
    index = (result.version_dir / "emb_part0" / "000" / "index.cube").read_bytes()
    other = (result.version_dir / "emb_part2" / "000" / "data.cube").read_bytes()
    changes: list[tuple[dict[str, bytes | None], str]] = [
        ({"001/data.cube": None}, r"no '001/data.cube' \(TABLES lists its table\)"),
        ({"TABLES": b"000\n001\n002\n"}, r"no '002/index.cube'"),
        ({"TABLES": b"000\n000\n"}, "its TABLES is not a list of table names"),
        ({"index.cube": index}, "both TABLES and a top-level index.cube"),
        ({"001/data.cube": other}, "does not hold a valid shard: 001 is not a readable shard"),
    ]
    for number, (change, message) in enumerate(changes):
        bad = rewrite_tar(tar, tmp_path / f"bad{number}.tar", change)
        with pytest.raises(UnsafeTar, match=message):
            extract_shard_tar(bad, tmp_path / f"x{number}")
    (tmp_path / "TABLES").write_text("a\n../b\n")
    with pytest.raises(LayoutError):
        shard_dirs(tmp_path)


@pytest.mark.slow
def test_the_cli_builds_every_table_the_configuration_lists(tmp_path: Path) -> None:
    args = build_args(SCENARIO / "base", tmp_path / "out", 2, input_format="paddle_ps",
                      paddle_config=DESC, quiet="false")  # fmt: skip
    done = run_builder(*args)
    assert done.returncode == 0, done.stderr
    assert "base/000, sparse (dim 4, optimizer naive); " in done.stdout, done.stdout
    assert "base/001, sparse (dim 6, optimizer naive)), 51 distinct keys, into 2 shards" in (
        done.stdout
    )
    assert (tmp_path / "out" / f"{BASE}_{BASE}" / "dict_part1" / "TABLES").is_file()
    flags = ["-input_format", "paddle_ps", "-paddle_accessor", "sparse", "-paddle_optimizer",
             "naive"]  # fmt: skip
    done = run_builder(*build_args(SCENARIO / "base", tmp_path / "o2", 2), *flags,
                       "-paddle_dim", "4,001:6")  # fmt: skip
    assert done.returncode == 2 and "either one value for every table" in done.stderr
    done = run_builder(*build_args(SCENARIO / "base", tmp_path / "o3", 2), *flags,
                       "-paddle_dim", "000:4,001:6", "-paddle_table", "all")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert output_digests(tmp_path / "o3") == output_digests(tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# A DeepFM's save: first-order weights (a table without embedx_w) beside its embeddings

DEEPFM = DATA / "ctr_common_first_order"
DEEPFM_DESC = DEEPFM / "fleet_desc.prototxt"


def deepfm(table: str = "", value: ValueSpec | None = None) -> PaddleSource:
    """The DeepFM job's configuration: `emb` (D=8) in 000, `first_order` (D=3, embedx_dim 0)
    in 001, both CtrCommonAccessor + adagrad."""
    return PaddleSource(
        table=table,
        value=value or ValueSpec(),
        config=tuple(parse_fleet_desc(DEEPFM_DESC.read_bytes(), str(DEEPFM_DESC))),
        config_name=str(DEEPFM_DESC),
    )


@pytest.mark.parametrize("save", ["checkpoint", "base", "delta"])
def test_a_first_order_table_serves_embed_w_beside_the_embeddings(
    tmp_path: Path, save: str
) -> None:
    """The real DeepFM save built with its configuration: a version of two tables, 000 serving
    embed_w and the 5 embedx_w (24 bytes), 001 the first-order weight alone (4 bytes: embed_w,
    the third number of the trainer's lookup of show, click, embed_w), each equal to the
    trainer's lookups to the 6 digits the text keeps; 001's rows of 7 numbers and of 8 (their
    embedx g2sum -nan or 0) alike."""
    info = json.loads((DEEPFM / "expected.json").read_text())
    result = build_save(tmp_path / save, deepfm(), DEEPFM / save)
    assert result.tables == ("000", "001")
    assert "001, ctr_common (dim 3, optimizer adagrad)" in result.input_note
    assert [t["value_width"] for t in result.metas[0]["tables"]] == [24, 4]
    for name, served_from in (("emb", slice(2, None)), ("first_order", slice(2, 3))):
        table = info["saves"][save]["tables"][name]
        folder = info["tables"][name]["folder"]
        keys = np.array(table["keys"], dtype=np.uint64)
        lookup = np.frombuffer(bytes.fromhex("".join(table["lookup_f32le_hex"])), "<f4")
        want = lookup.reshape(len(keys), -1)[:, served_from]
        parts = [result.version_dir / f"emb_part{s}" / folder for s in range(3)]
        got = np.frombuffer(b"".join(served(parts, keys)), "<f4").reshape(want.shape)
        assert np.all(np.abs(got - want) <= 5e-6 * np.abs(want)), name
    # with -paddle_value show,click,embed_w: 12 bytes, the trainer's whole lookup
    cvm = build_save(tmp_path / "cvm", deepfm("001", ValueSpec(("show", "click", "embed_w"))),
                     DEEPFM / save)  # fmt: skip
    assert cvm.metas[0]["value_width"] == 12


def test_embedx_w_named_for_a_first_order_table_is_refused(tmp_path: Path) -> None:
    """-paddle_value naming embedx_w, for a version that has the first-order table (alone or
    beside the embeddings): refused before anything is read, naming the table and why."""
    for table in ("001", "all", "first_order"):
        for fields in (("embed_w", "embedx_w"), ("show", "click", "embed_w", "embedx_w")):
            with pytest.raises(BuildError) as caught:
                build_save(tmp_path / "out", deepfm(table, ValueSpec(fields)), DEEPFM / "base")
            text = str(caught.value)
            assert text.startswith(f"{DEEPFM / 'base'}/001: -paddle_value {','.join(fields)}: ")
            assert "ctr_common (dim 3, optimizer adagrad) has no embedx_w (embedx_dim 0" in text
            assert "leave -paddle_value out (embed_w alone is served)" in text
            assert not (tmp_path / "out" / "meta_info").exists()
    build_save(tmp_path / "emb", deepfm("000", ValueSpec(("embed_w", "embedx_w"))), DEEPFM / "base")


def test_a_nan_elsewhere_in_a_first_order_table_fails_its_build(tmp_path: Path) -> None:
    """-nan is read in the embedx g2sum of the first-order table only: in its embed_w (or in
    the embeddings' table, which has embedx_w) the build fails naming file, line, field and
    column."""
    for folder, index in (("001", 5), ("001", 6), ("000", 12)):
        save = tmp_path / f"save{folder}{index}"
        shutil.copytree(DEEPFM / "base", save)
        part = save / folder / "part-000-00002"
        lines = part.read_bytes().split(b"\n")
        row = next(i for i, line in enumerate(lines) if len(line.split()) > index + 1)
        fields = lines[row].split(b" ")
        fields[index + 1] = b"-nan"
        lines[row] = b" ".join(fields)
        part.write_bytes(b"\n".join(lines))
        column = len(b" ".join(fields[: index + 1])) + 2
        with pytest.raises(BuildError) as caught:
            build_save(tmp_path / f"out{folder}{index}", deepfm(), save)
        name = ("slot", "unseen_days", "delta_score", "show", "click", "embed_w", "embed_g2sum",
                "embedx_w[0]", "embedx_w[1]", "embedx_w[2]", "embedx_w[3]", "embedx_w[4]",
                "embedx_g2sum")[index]  # fmt: skip
        assert str(caught.value).startswith(
            f"{part} line {row + 1}: field {index + 2} ({name}), column {column}: not a finite "
            "number"
        ), caught.value
