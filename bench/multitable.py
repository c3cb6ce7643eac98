"""One version of several tables for the benchmarks, assembled from single-table builds.

cube-builder builds a version of several tables only from PaddlePaddle parameter-server saves
(`-input_format paddle_ps -paddle_table all`). A benchmark of DLRM-shaped requests (26 tables x
~40 keys) wants tables of derived values (bench.keyspace: every answer checkable from its key)
at sizes a Paddle text save would take minutes to write and parse. So each table is built on its
own, from a SequenceFile, by the real `cube-builder` (`-job_mode base`, the same `-shard_num`
for all: the same key -> shard rule), and the shards are then laid out as cube/layout.py's
TABLES contract says a version of several tables is, in each server's data_dir:

    <data_dir>/VERSION                       the version's name
    <data_dir>/<version>/TABLES              the table names, one a line
    <data_dir>/<version>/<table>/index.cube  (moved from <table>'s build, shard <i>)
    <data_dir>/<version>/<table>/data.cube

which is what a server of shard <i> reads after an agent unpacked a several-table build's tar
(`builder/build.py` pack_tables writes the same members). What this skips, and so does not
measure: the transfer and the agents (the version is put in place, then the servers start on
it); the single-table `bench.scale_e2e` run measures those.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from cube.bench.keyspace import DerivedData, write_input
from cube.bench.scale import builder_command
from cube.layout import TABLES_FILE, part_name, tables_text, version_text

SHARD_FILES = ("index.cube", "data.cube")


def build_table(
    data: DerivedData,
    name: str,
    dict_name: str,
    work: Path,
    shards: int,
    files: int = 1,
    timeout: float = 3600,
) -> list[Path]:
    """`data` written as SequenceFiles and built by cube-builder into `work/<name>/` (as dict
    `dict_name`: the shards record it, and a server serves only its own dict's); the input is
    removed once built. Returns each shard's part directory."""
    root = work / name
    write_input(root / "input", data, files)
    argv = [
        *builder_command(),
        f"-dict_name={dict_name}",
        f"-input_path={root / 'input'}",
        f"-output_path={root / 'output'}",
        f"-shard_num={shards}",
        "-job_mode=base",
        "-only_build=true",
        "-quiet",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    shutil.rmtree(root / "input", ignore_errors=True)
    if done.returncode:
        raise RuntimeError(f"cube-builder of table {name} failed: {done.stderr.strip()[-2000:]}")
    parts = []
    for shard in range(shards):
        found = [
            p for p in (root / "output").glob(f"*/{part_name(dict_name, shard)}") if p.is_dir()
        ]
        if len(found) != 1:
            raise RuntimeError(f"table {name}: expected one shard {shard} directory, got {found}")
        parts.append(found[0])
    return parts


def assemble_version(
    tables: list[tuple[str, list[Path]]], data_dirs: list[Path], version: str
) -> None:
    """Lay out one version of `tables` ((name, the part directory of each shard), in order) in
    each shard's `data_dirs[i]`: TABLES, then each table's files moved in (same file system:
    renames), then VERSION naming it (last, so a server never sees half a version)."""
    names = [name for name, _ in tables]
    text = tables_text(names)  # checks the names as a server will
    for shard, data_dir in enumerate(data_dirs):
        target = data_dir / version
        target.mkdir(parents=True)
        for name, parts in tables:
            (target / name).mkdir()
            for file in SHARD_FILES:
                (parts[shard] / file).rename(target / name / file)
        (target / TABLES_FILE).write_text(text)
        (data_dir / "VERSION").write_text(version_text(version))


def build_version(
    tables: list[tuple[str, DerivedData]],
    dict_name: str,
    work: Path,
    data_dirs: list[Path],
    version: str,
) -> dict[str, float]:
    """Each table built (bench.keyspace data, cube-builder), then the version assembled in
    `data_dirs` (one per shard); the builds' directories are removed. Seconds taken."""
    started = time.perf_counter()
    built = [
        (name, build_table(data, name, dict_name, work, len(data_dirs))) for name, data in tables
    ]
    build_s = time.perf_counter() - started
    assemble_version(built, data_dirs, version)
    for name, _ in built:
        shutil.rmtree(work / name, ignore_errors=True)
    return {"build_s": build_s, "total_s": time.perf_counter() - started}
