"""Test helper: the original Cube's files, written byte by byte from its sources' description,
independently of the importer's reader (cube/original_format.py).

What the original's C++ cube-builder writes (core/cube/cube-builder/src/main.cpp,
builder_job.cpp, crovl_builder_increment.cpp, util.cpp of PaddlePaddle/Serving), all integers
little-endian:

- Output of one build: `<output>/<depend>_<cur>/<dict>_part<i>/` for every shard i (a base has
  depend = cur), with `<dict>_part<i>.tar` (`tar -cvPf` of the directory's `.`: members `./`,
  `./data.0`, ...) and `<dict>_part<i>.tar.md5` (md5sum's line) next to it. Key k goes to shard
  `k % shard_num`.
- `data.<j>`: records `uint32 (len(value) + 4)` then the value, appended; a record that would
  pass the data file limit (1 GiB) starts the next file. Numbers continue across versions: a
  patch's files come after the previous version's.
- `index.<k>`: `(uint64 key, uint64 file << 32 | offset)` per record, in the order added; one
  file per version that has records, k counting those versions.
- `data.n`: uint32 count, then uint32 size of every data file so far (previous versions' too).
- `index.n`: uint32 0 (hash index), uint32 records added so far (all versions, duplicates
  counted), uint32 index file count, uint64 size of every index file so far.
- A shard without records in a base: the builder stops before writing data.n and index.n (an
  empty directory, a tar of `./` only). In a patch it writes data.n and index.n again, with no
  new file.

A deployment of the original (core/cube/cube-agent/src/agent/work.go): the agent downloads a
shard's tar into `<deploy>/cube_data/<shard>/<dir>/` (dir: `<depend>` for a base,
`<depend>_<cur>` for a patch), untars it there, links each data.*/index.* file (and the lists)
as `<deploy>/data/<file>`, copies those links into `<deploy>/data/<dir>/`, and writes `<dir>`
into `<deploy>/data/VERSION` and `<deploy>/cube_data/VERSION`. So `data/<dir>/` holds links to
the files of the base and of every patch so far, the lists being the newest version's.

Run as a module to write a large table for the benchmark:
    python -m tests.original_cube --records 1000000 --shards 4 --out /tmp/orig
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DATA_FILE_LIMIT = 1 << 30  # the original's MAX_BLOCK_SIZE; tests pass a small one


@dataclass
class ShardState:
    """What the original builder carries from one version to the next (its meta_info)."""

    data_sizes: list[int] = field(default_factory=list)
    index_sizes: list[int] = field(default_factory=list)
    count: int = 0
    failed_base: bool = False  # a base without records: no lists, no later patch possible


def write_shard_version(
    directory: Path,
    records: Sequence[tuple[int, bytes]],
    state: ShardState,
    data_file_limit: int = DATA_FILE_LIMIT,
    base: bool = True,
) -> None:
    """One shard of one version, as the builder's add()/done() leave it in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    if base and not records:
        state.failed_base = True
        return
    data_number = len(state.data_sizes)
    buffer = bytearray()
    pairs = bytearray()
    for key, value in records:
        total = len(value) + 4
        if len(buffer) + total > data_file_limit:
            (directory / f"data.{data_number}").write_bytes(bytes(buffer))
            state.data_sizes.append(len(buffer))
            data_number += 1
            buffer = bytearray()
        address = (data_number << 32) + len(buffer)
        buffer += struct.pack("<I", total) + value
        pairs += struct.pack("<QQ", key, address)
        state.count += 1
    if buffer:
        (directory / f"data.{data_number}").write_bytes(bytes(buffer))
        state.data_sizes.append(len(buffer))
    if records:
        (directory / f"index.{len(state.index_sizes)}").write_bytes(bytes(pairs))
        state.index_sizes.append(len(pairs))
    data_n = struct.pack("<I", len(state.data_sizes))
    data_n += b"".join(struct.pack("<I", size) for size in state.data_sizes)
    (directory / "data.n").write_bytes(data_n)
    index_n = struct.pack("<III", 0, state.count, len(state.index_sizes))
    index_n += b"".join(struct.pack("<Q", size) for size in state.index_sizes)
    (directory / "index.n").write_bytes(index_n)


def pack_tar(directory: Path) -> Path:
    """`<directory>.tar` of `.` as `tar -cvPf` makes it (GNU format), and its `.md5` line."""
    tar_path = directory.with_name(directory.name + ".tar")
    with tarfile.open(tar_path, "w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("./")
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        tar.addfile(info)
        for path in sorted(directory.iterdir()):
            info = tarfile.TarInfo(f"./{path.name}")
            info.size = path.stat().st_size
            info.mode = 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)
    digest = hashlib.md5(tar_path.read_bytes()).hexdigest()
    tar_path.with_name(tar_path.name + ".md5").write_text(f"{digest}  {tar_path}\n")
    return tar_path


@dataclass
class OriginalBuilder:
    """Builds versions of one dict like the original's cube-builder: a base, then patches
    (`-job_mode delta`) that carry each shard's state on."""

    output: Path
    dict_name: str
    shard_num: int
    data_file_limit: int = DATA_FILE_LIMIT
    states: list[ShardState] = field(default_factory=list)
    depend: int = 0

    def build(self, records: Iterable[tuple[int, bytes]], cur: int, base: bool) -> Path:
        if base:
            self.states = [ShardState() for _ in range(self.shard_num)]
            self.depend = cur
        by_shard: list[list[tuple[int, bytes]]] = [[] for _ in range(self.shard_num)]
        for key, value in records:
            by_shard[key % self.shard_num].append((key, value))
        version_dir = self.output / f"{self.depend}_{cur}"
        for shard in range(self.shard_num):
            directory = version_dir / f"{self.dict_name}_part{shard}"
            write_shard_version(
                directory, by_shard[shard], self.states[shard], self.data_file_limit, base
            )
            pack_tar(directory)
        return version_dir


def deploy(version_dirs: Sequence[Path], dict_name: str, shard: int, deploy_path: Path) -> Path:
    """What the original agent leaves for shard `shard` after downloading these versions (a
    base first) and loading each: cube_data/<shard>/<dir>/ and data/ with links."""
    data = deploy_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    for version_dir in version_dirs:
        depend, cur = version_dir.name.split("_")
        name = depend if depend == cur else f"{depend}_{cur}"
        download = deploy_path / "cube_data" / str(shard) / name
        download.mkdir(parents=True)
        tar = version_dir / f"{dict_name}_part{shard}.tar"
        for source in (tar, tar.with_name(tar.name + ".md5")):
            (download / source.name).write_bytes(source.read_bytes())
        with tarfile.open(download / tar.name) as archive:
            archive.extractall(download, filter="data")
        (download / ".download_done").touch()
        if depend == cur:  # a base: the old links go
            for old in data.iterdir():
                if old.is_symlink():
                    old.unlink()
        for entry in sorted(download.iterdir()):
            if entry.name.startswith(("data.", "index.")):
                link = data / entry.name
                if link.is_symlink():
                    link.unlink()
                os.symlink(entry.resolve(), link)
        version_path = data / name
        version_path.mkdir(exist_ok=True)
        for link in data.iterdir():
            if link.is_symlink():
                copied = version_path / link.name
                if copied.is_symlink():
                    copied.unlink()
                os.symlink(os.readlink(link), copied)
        (data / "VERSION").write_text(f"{name}\n")
        (deploy_path / "cube_data" / "VERSION").write_text(f"{name}\n")
    return deploy_path


def main() -> None:
    parser = argparse.ArgumentParser(description="write an original-format Cube build")
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--width", type=int, default=32, help="value bytes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--version", type=int, default=1_700_000_000)
    args = parser.parse_args()
    builder = OriginalBuilder(args.out, "bench", args.shards)
    records = (
        (key * 2654435761 % (1 << 63), key.to_bytes(8, "little") * (args.width // 8))
        for key in range(args.records)
    )
    version_dir = builder.build(records, args.version, base=True)
    print(version_dir)


if __name__ == "__main__":
    main()
