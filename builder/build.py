"""cube-builder's pipeline: SequenceFiles (or a PaddlePaddle parameter-server save's sparse
table, `cube.builder.paddle_ps`) in, one version directory of shards out.

1. Read (in up to `workers` processes, each over a contiguous run of the sorted input files):
   record batches are routed to shards (vectorized) and appended to per-shard spill files.
2. Finish each shard (the processes again, one shard at a time each): join its spill parts in
   input order, map them, build the table (`cube.index.build_table`: the last record of a key
   wins, deletions win over records), write `index.cube` + `data.cube` (`cube.shard`), then the
   tar with its md5 computed in the same pass.
3. Publish: everything is built in `<output>/.tmp-<depend>_<cur>-<pid>/`, renamed to
   `<output>/<depend>_<cur>` when complete; then `meta_info/<cur>_<depend>_<shard>_0.json`.
   On any error the staging and spill directories are removed and nothing is published.

Memory: about `memory_mb` in all for input batches and their grouped copies while reading;
while finishing, one shard's keys and table per worker process (its values stay on an mmap of
the spill). Delete keys are held in memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import (
    FIRST_EXCEPTION,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cube.builder.meta import (
    META_DIR,
    ShardOutput,
    meta_info_name,
    shard_meta_info,
    write_meta_file,
)
from cube.builder.spill import (
    SourceFile,
    Spiller,
    SpillPart,
    group_positions,
    open_parts,
    remove_part,
)
from cube.builder.tarball import sync_files, write_md5_file, write_tar
from cube.fsutil import atomic_write_text, fsync_dir
from cube.index import COMPILED_MIN_KEYS, build_table, compiled_kernels
from cube.layout import (
    TABLES_FILE,
    describe_widths,
    output_dir_name,
    part_name,
    served_version,
    tables_text,
    value_widths,
    width_change,
)
from cube.paddle_ps import KEY_FORMAT, PaddleSource, TableLayout, ValueSpec
from cube.routing import check_partitioner, shard_of
from cube.seqfile import MAGIC as SEQ_MAGIC
from cube.seqfile import LocatedBatch, SequenceFileReader
from cube.shard_writer import DATA_FILE, INDEX_FILE, write_shard
from cube.values import ValueColumn

if TYPE_CHECKING:
    from cube.builder.paddle_ps import PaddleTable

MODES = ("base", "delta")
INPUT_FORMATS = ("seqfile", "paddle_ps")
TAR_MEMBERS = (INDEX_FILE, DATA_FILE)
# Input size from which the compiled loops repay their load (~0.7 s): COMPILED_MIN_KEYS
# records of 48 bytes (8-byte keys, 32-byte values and the framing).
_WARM_INPUT_BYTES = COMPILED_MIN_KEYS * 48
_MAX_BATCH_BYTES = 4 << 20  # cache-sized: per-batch temporaries stay warm and are reused


class BuildError(RuntimeError):
    """A build that cannot go on; the message is one line for the user."""


@dataclass(frozen=True)
class BuildConfig:
    dict_name: str
    output_path: Path
    shard_num: int
    mode: str  # "base" | "delta"
    cur_version: int
    depend_version: int
    partitioner: str = "mod"
    key_format: str = "auto"
    tmp_dir: Path | None = None  # spill location; None: inside the staging directory
    memory_mb: int = 1024
    workers: int = 2
    allow_empty: bool = False  # build a version with no record and no deletion
    variable_width: bool = False  # a delta's values may have another width than its base's
    input_format: str = "seqfile"  # seqfile | paddle_ps (a parameter-server save)
    paddle: PaddleSource | None = None  # how to read a save (-input_format paddle_ps)

    def __post_init__(self) -> None:
        problems = []
        if self.input_format not in INPUT_FORMATS:
            problems.append(f"input_format must be one of {', '.join(INPUT_FORMATS)}")
        if (self.input_format == "paddle_ps") != (self.paddle is not None):
            problems.append("input_format paddle_ps goes with the -paddle_* settings")
        if self.input_format == "paddle_ps" and self.key_format != "auto":
            problems.append("-key_format is for SequenceFiles (a save's keys are decimal)")
        if not self.dict_name or "/" in self.dict_name or self.dict_name.startswith("."):
            problems.append(f"dict_name {self.dict_name!r} must be a plain file name")
        if self.shard_num < 1:
            problems.append(f"shard_num must be >= 1, got {self.shard_num}")
        if self.mode not in MODES:
            problems.append(f"job_mode must be base or delta, got {self.mode!r}")
        if self.cur_version < 0 or self.depend_version < 0:
            problems.append("versions must be Unix times (or 0, the original's local mode)")
        if self.mode == "delta" and self.cur_version <= self.depend_version:
            problems.append(
                f"a delta's cur_version ({self.cur_version}) must be later than its "
                f"depend_version ({self.depend_version})"
            )
        if self.memory_mb < 1:
            problems.append(f"memory_mb must be >= 1, got {self.memory_mb}")
        if self.workers < 1:
            problems.append(f"workers must be >= 1, got {self.workers}")
        try:
            check_partitioner(self.partitioner)
        except ValueError as exc:
            problems.append(str(exc))
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def version_dir_name(self) -> str:
        """`<depend>_<cur>`: the builder's output directory (for a base, `<depend>_<depend>`)."""
        return output_dir_name(str(self.depend_version), str(self.cur_version))

    @property
    def served_version(self) -> str:
        """The version name servers use: `<depend>` for a base, `<depend>_<cur>` for a delta."""
        return served_version(str(self.depend_version), str(self.cur_version), self.mode == "base")

    def shard_name(self, shard: int) -> str:
        return part_name(self.dict_name, shard)


@dataclass(frozen=True)
class BuildResult:
    version_dir: Path
    meta_paths: list[Path]
    metas: list[dict[str, Any]]
    shards: list[ShardOutput]
    records_read: int
    input_files: int
    key_formats: tuple[str, ...]
    seconds: float
    phase_seconds: dict[str, float]  # read, finish, publish
    warnings: tuple[str, ...] = ()  # for the user (the CLI prints them on stderr)
    input_note: str = ""  # what was read, when not SequenceFiles (the table of a save)
    tables: tuple[str, ...] = ()  # a version of several tables: their names (TABLES)

    @property
    def distinct_keys(self) -> int:
        """Keys the shards hold: a key read several times is one (its last record), a
        deleted key none."""
        return sum(shard.record_count for shard in self.shards)


# ---------------------------------------------------------------------------------------------
# Inputs


def list_input_files(root: str | os.PathLike[str], include_empty: bool = False) -> list[Path]:
    """Every regular, non-empty file under `root` whose name (and directories' names) does not
    start with a dot, recursively, in sorted path order (depth first, names in byte order).
    Symlinks are skipped. Empty files (e.g. Hadoop's `_SUCCESS` marker) hold no records and
    are skipped, unless `include_empty` (a save's layout is told by its file names, empty
    ones included). `root` may itself be a regular file."""
    root = Path(root)
    try:
        info = root.lstat()
    except OSError as exc:
        raise BuildError(f"{root}: {exc.strerror}") from None
    if stat.S_ISREG(info.st_mode):
        return [root] if info.st_size or include_empty else []
    if not stat.S_ISDIR(info.st_mode):
        raise BuildError(f"{root}: not a directory or regular file")
    found: list[tuple[tuple[bytes, ...], Path]] = []

    def walk(directory: Path, parts: tuple[bytes, ...]) -> None:
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            raise BuildError(f"{directory}: {exc.strerror}") from None
        for entry in entries:
            if entry.name.startswith("."):
                continue
            key = (*parts, os.fsencode(entry.name))
            if entry.is_dir(follow_symlinks=False):
                walk(Path(entry.path), key)
            elif entry.is_file(follow_symlinks=False) and (
                include_empty or entry.stat(follow_symlinks=False).st_size
            ):
                found.append((key, Path(entry.path)))

    walk(root, ())
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


class DeleteListError(ValueError):
    """A line of a -delete_path file that is not a key; names the file and line."""


def parse_delete_keys(data: bytes, source: str) -> np.ndarray:
    """Keys to delete from text: one decimal uint64 per line; blank lines and lines starting
    with `#` are ignored; spaces, tabs and CR around a key are allowed.

    The common case (digits and whitespace only) is parsed without a per-line Python loop;
    anything else goes line by line, which also locates the first bad line."""
    buf = np.frombuffer(data, dtype=np.uint8)
    is_digit = (buf >= ord("0")) & (buf <= ord("9"))
    is_space = (buf == 32) | (buf == 9) | (buf == 13) | (buf == 10)
    if (is_digit | is_space).all():
        run_starts = np.flatnonzero(is_digit & ~np.concatenate([[False], is_digit[:-1]]))
        line_of_start = np.cumsum(buf == 10)[run_starts] if run_starts.shape[0] else run_starts
        one_per_line = not (line_of_start[1:] == line_of_start[:-1]).any()
        tokens = data.split()
        if one_per_line and all(len(t) <= 20 for t in tokens[:: max(1, len(tokens) // 1000)]):
            with contextlib.suppress(OverflowError, ValueError):
                return np.array(tokens, dtype=np.bytes_).astype(np.uint64)
    return _parse_delete_lines(data, source)


def _parse_delete_lines(data: bytes, source: str) -> np.ndarray:
    keys = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        shown = line[:40].decode("utf-8", "replace")
        if not line.isdigit():
            raise DeleteListError(f"{source} line {number}: {shown!r} is not a decimal key")
        value = int(line)
        if value >= 1 << 64:
            raise DeleteListError(f"{source} line {number}: {shown} does not fit in 64 bits")
        keys.append(value)
    return np.array(keys, dtype=np.uint64)


def read_delete_keys(path: str | os.PathLike[str]) -> np.ndarray:
    """All keys listed in a file or a directory of files (see `parse_delete_keys`)."""
    chunks = []
    for file in list_input_files(path):
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise BuildError(f"{file}: {exc.strerror}") from None
        chunks.append(parse_delete_keys(data, str(file)))
    return np.concatenate(chunks) if chunks else np.empty(0, dtype=np.uint64)


def refuse_empty_input(
    config: BuildConfig, source: str, files: int, records: int | None, deletions: int
) -> None:
    """BuildError when the build would hold nothing, no record and no deletion (an input
    directory left empty upstream, a typo in its path), unless `config.allow_empty`.
    `records` is None before the input is read: then only "no input file" is refused."""
    if config.allow_empty or deletions:
        return
    how = "pass -allow_empty to build an empty version on purpose"
    if not files:
        raise BuildError(
            f"{source}: no input files (an empty directory, or only empty or hidden files); "
            f"nothing to build: {how}"
        )
    if records == 0:
        raise BuildError(f"{source}: {files} input files hold no record; nothing to build: {how}")


def split_runs(sizes: Sequence[int], groups: int) -> list[tuple[int, int]]:
    """Cut a sequence into at most `groups` contiguous, non-empty runs of about equal total
    size; returns (start, end) index pairs covering everything in order."""
    count = len(sizes)
    groups = max(1, min(groups, count))
    if count == 0:
        return []
    cumulative = np.cumsum(np.asarray(sizes, dtype=np.float64) + 1.0)
    targets = cumulative[-1] * np.arange(1, groups) / groups
    cuts = np.searchsorted(cumulative, targets, side="left") + 1
    bounds = sorted({0, count, *(int(c) for c in cuts if 0 < c < count)})
    return list(itertools.pairwise(bounds))


def route_keys(keys: np.ndarray, shard_num: int, partitioner: str) -> list[np.ndarray]:
    """Keys split by owning shard (input order kept within a shard)."""
    if shard_num == 1:
        return [keys]
    order, bounds = group_positions(shard_of(keys, shard_num, partitioner), shard_num)
    grouped = keys.take(order)
    return [grouped[bounds[s] : bounds[s + 1]] for s in range(shard_num)]


# ---------------------------------------------------------------------------------------------
# Stage 1: read and spill


@dataclass(frozen=True)
class ReadTask:
    files: tuple[str, ...]
    spill_dir: str
    shard_num: int
    partitioner: str
    key_format: str
    batch_bytes: int
    paddle: tuple[TableLayout, ValueSpec] | None = None  # a parameter-server table's files


@dataclass(frozen=True)
class ReadOutput:
    parts: list[SpillPart]
    records: int
    key_formats: tuple[str, ...]


def spill_batches(batches: Iterable[tuple[np.ndarray, ValueColumn]], spiller: Spiller) -> int:
    """Route (keys, values) batches into the spiller; returns the record count."""
    records = 0
    for keys, values in batches:
        spiller.add(keys, values)
        records += int(keys.shape[0])
    return records


def read_and_spill(task: ReadTask, on_bytes: Callable[[int], None] | None = None) -> ReadOutput:
    """Stage 1 for one run of input files (runs in a worker process or inline). The values of
    an uncompressed file stay in it: only where each one is gets spilled."""
    report = on_bytes or _report_progress
    spiller = Spiller(Path(task.spill_dir), task.shard_num, task.partitioner)
    formats: dict[str, None] = {}
    records = 0
    if task.paddle is not None:
        return _read_paddle(task, spiller, report)
    for path in task.files:
        with SequenceFileReader(path, task.key_format, task.batch_bytes) as reader:
            formats[reader.key_format] = None
            done = 0
            source = -1
            if reader.values_in_place:
                info = os.fstat(reader.fileno())
                source = spiller.add_source(SourceFile.of(path, info))
            batches = reader.located_batches() if source >= 0 else reader.batches()
            for batch in batches:
                if isinstance(batch, LocatedBatch):
                    spiller.add_located(batch.keys, source, batch.locations)
                else:
                    spiller.add(batch.keys, batch.values)
                records += len(batch)
                if batch.offsets.shape[0]:
                    position = int(batch.offsets[-1])
                    report(position - done)
                    done = position
            report(reader.file_size - done)
    return ReadOutput(spiller.finish(), records, tuple(formats))


def _read_paddle(task: ReadTask, spiller: Spiller, report: Callable[[int], None]) -> ReadOutput:
    """read_and_spill for the part files of a parameter-server table (their values are
    parsed, so spilled as bytes)."""
    from cube.builder.paddle_ps import table_batches

    assert task.paddle is not None
    layout, value = task.paddle
    records = 0
    for path in task.files:
        done = 0
        for keys, values, position in table_batches(path, layout, value, task.batch_bytes):
            spiller.add(keys, values)
            records += int(keys.shape[0])
            report(position - done)
            done = position
    return ReadOutput(spiller.finish(), records, (KEY_FORMAT,))


# Progress from worker processes: a shared byte counter set up by the pool initializer.
_progress_counter: Any = None
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_PR_SET_PDEATHSIG = 1


def _init_worker(counter: Any, parent: int | None) -> None:
    global _progress_counter
    _progress_counter = counter
    # The parent decides what a signal means (abort_active_builds); a forked worker must not
    # run the parent's handler, nor clean up the parent's directories.
    _active_workspaces.clear()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked while forking us
    _die_with_parent(parent)


def _die_with_parent(parent: int | None) -> None:
    """Linux: get SIGKILL when the parent exits, however it exits (no orphaned workers).
    `parent`: the builder's pid when it forked us itself, else None (no check)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:  # it exited before prctl took effect
        os._exit(1)


def _report_progress(count: int) -> None:
    if _progress_counter is not None and count:
        with _progress_counter.get_lock():
            _progress_counter.value += count


# ---------------------------------------------------------------------------------------------
# Stage 2: finish one shard


@dataclass(frozen=True)
class FinishTask:
    parts: tuple[SpillPart, ...]  # this shard's spill from each reader, in input order
    deleted: np.ndarray  # keys to tombstone in this shard
    shard_dir: str
    tar_path: str
    meta: dict[str, Any]  # stored in the shard file headers


def finish_shard(task: FinishTask, on_bytes: Callable[[int], None] | None = None) -> ShardOutput:
    """Table, shard files, tar + md5 for one shard; removes its spill files when done."""
    with open_parts(list(task.parts)) as (keys, values):
        built = build_table(keys, deleted=task.deleted)
        del keys
        # not synced yet: the disk writes them while the tar is made, synced after it
        header = write_shard(task.shard_dir, built, values, task.meta, sync=False)
        del built, values
    for part in task.parts:
        if part.directory:
            remove_part(part)
    if not task.tar_path:  # a table of a version of several: packed with the others
        sync_files([Path(task.shard_dir) / name for name in TAR_MEMBERS])
        return shard_output(header, task.meta, 0, "")
    return package_shard(header, Path(task.shard_dir), Path(task.tar_path), task.meta)


def package_shard(
    header: dict[str, Any], shard_dir: Path, tar_path: Path, meta: dict[str, Any]
) -> ShardOutput:
    """After `write_shard(..., sync=False)`: the tar and its md5 file, everything fsynced;
    what the shard's meta_info will say."""
    tar_size, md5 = write_tar(tar_path, shard_dir, TAR_MEMBERS, mtime=int(meta["cur"]), sync=False)
    sync_files([*(shard_dir / name for name in TAR_MEMBERS), tar_path])
    write_md5_file(tar_path, md5)
    return shard_output(header, meta, tar_size, md5)


def shard_output(
    header: dict[str, Any], meta: dict[str, Any], tar_size: int, md5: str
) -> ShardOutput:
    """What a shard's index header (`write_shard`'s) and tar say of it."""
    return ShardOutput(
        shard=int(meta["shard"]),
        record_count=int(header["record_count"]),
        tombstone_count=int(header["tombstone_count"]),
        value_width=int(header["value_width"]),
        build_id=str(header["build_id"]),
        index_size=int(header["file_size"]),
        data_size=int(header["data_file_size"]),
        tar_size=tar_size,
        md5=md5,
    )


# ---------------------------------------------------------------------------------------------
# The whole build


@dataclass
class Progress:
    """Callbacks for a progress display (the CLI plugs tqdm in); all optional."""

    start_reading: Callable[[int], None] = lambda total_bytes: None
    read_bytes: Callable[[int], None] = lambda count: None
    start_finishing: Callable[[int], None] = lambda shards: None
    shard_done: Callable[[ShardOutput], None] = lambda output: None
    close: Callable[[], None] = lambda: None


@dataclass(eq=False)
class Workspace:
    """Staging and spill directories of one build; removed unless published. The target is
    `<output_path>/<version_dir_name>`, or `<output_path>/<target_name>` when one is given
    (cube-import's data directories name a version as the server does)."""

    config: BuildConfig
    target_name: str | None = None
    staging: Path = field(init=False)
    spill: Path = field(init=False)
    target: Path = field(init=False)

    def __post_init__(self) -> None:
        output = self.config.output_path
        name = self.target_name or self.config.version_dir_name
        self.target = output / name
        if os.path.lexists(self.target):
            raise BuildError(f"{self.target} already exists; refusing to overwrite it")
        self.staging = output / f".tmp-{name}-{os.getpid()}"
        self.spill = self.staging / ".spill"
        _active_workspaces.append(self)  # before anything exists: a signal may come any time
        try:
            output.mkdir(parents=True, exist_ok=True)
            self.staging.mkdir()
            if self.config.tmp_dir is None:
                self.spill.mkdir()
            else:
                self.config.tmp_dir.mkdir(parents=True, exist_ok=True)
                self.spill = Path(
                    tempfile.mkdtemp(prefix=f"cube-spill-{name}-", dir=self.config.tmp_dir)
                )
        except OSError as exc:
            self.close()
            raise BuildError(f"cannot create the build directories: {exc}") from None

    def close(self) -> None:
        """Forget this workspace (after publishing); discards what is left of it."""
        self.discard()
        if self in _active_workspaces:
            _active_workspaces.remove(self)

    def discard(self) -> None:
        for path in (self.spill, self.staging):
            shutil.rmtree(path, ignore_errors=True)

    def publish(self) -> Path:
        shutil.rmtree(self.spill, ignore_errors=True)
        if os.path.lexists(self.target):
            raise BuildError(f"{self.target} appeared during the build; not replacing it")
        os.rename(self.staging, self.target)
        fsync_dir(self.target.parent)
        return self.target


_active_workspaces: list[Workspace] = []


def abort_active_builds() -> None:
    """For a signal handler, which then exits at once with os._exit: kill this process's worker
    processes and remove the staging and spill directories of builds in progress. (Unwinding a
    build by raising from a signal handler can deadlock inside the process pool's locks.)"""
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=10)
    for workspace in list(_active_workspaces):
        workspace.discard()


def shard_header_meta(
    config: BuildConfig, shard: int, key_formats: Sequence[str]
) -> dict[str, Any]:
    """What every shard file header records about its build."""
    return {
        "dict_name": config.dict_name,
        "shard": shard,
        "shard_num": config.shard_num,
        "partitioner": config.partitioner,
        "version": config.served_version,
        "depend": str(config.depend_version),
        "cur": str(config.cur_version),
        "mode": config.mode,
        "key_format": ",".join(key_formats) or config.key_format,
    }


def build(
    config: BuildConfig,
    input_path: str | os.PathLike[str],
    delete_path: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    input_name: str = "",
) -> BuildResult:
    """Build one version from SequenceFiles, or from a parameter-server save's sparse table
    with `config.paddle` (see the module docstring). `input_name` names
    the input in messages (a remote input fetched into `input_path`; default: input_path)."""
    started = time.monotonic()
    progress = progress or Progress()
    if delete_path is not None and config.mode != "delta":
        raise BuildError("-delete_path needs -job_mode delta")
    source = input_name or str(input_path)
    paddle = None
    note = ""
    if config.paddle is not None:
        from cube.builder.paddle_ps import describe, find_tables, local_paths

        tables, several = find_tables(str(input_path), config.paddle)
        if several:
            return build_tables(config, tables, delete_path, progress, source, started)
        table = tables[0]
        files = local_paths(table)
        paddle = (table.layout, config.paddle.value)
        note = describe(table)
    else:
        files = list_input_files(input_path)
        refuse_paddle_save(files, str(input_path), source)
    refuse_table_change(config, ())
    deleted = read_delete_keys(delete_path) if delete_path is not None else np.empty(0, np.uint64)
    refuse_empty_input(config, source, len(files), None, int(deleted.shape[0]))
    warmer = _Warmer(files)
    workspace = Workspace(config)
    try:
        with _Pool(config.workers, after_fork=warmer.start) as pool:
            reads = _read_all(pool, config, files, workspace.spill, progress, paddle)
            records = sum(r.records for r in reads)
            refuse_empty_input(config, source, len(files), records, int(deleted.shape[0]))
            phases = {"read": time.monotonic() - started}
            if warmer.finish():  # the readers were forked before the loops were loaded
                pool.restart()
            formats = tuple(dict.fromkeys(f for r in reads for f in r.key_formats))
            if paddle is not None:  # a save's keys are uint64s, whether or not it has rows
                formats = (KEY_FORMAT,)
            outputs = _finish_all(
                pool, config, workspace.staging, reads, deleted, formats, progress
            )
        progress.close()
        warnings = check_delta_width(config, outputs)
        phases["finish"] = time.monotonic() - started - phases["read"]
        version_dir = workspace.publish()
    except BaseException:
        progress.close()
        raise
    finally:
        workspace.close()
    return _result(config, version_dir, outputs, formats, records, len(files), started, phases,
                   warnings, note)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# A version of several tables


@dataclass(frozen=True)
class PackTask:
    """A shard of a version of several tables, its tables finished: write its TABLES file,
    then its tar (TABLES, then each table's index.cube and data.cube) and md5."""

    shard: int
    part_dir: str
    tar_path: str
    tables: tuple[tuple[str, ShardOutput], ...]  # (name, what finishing it wrote), in order
    mtime: int


def pack_tables(task: PackTask, on_bytes: Callable[[int], None] | None = None) -> ShardOutput:
    """`PackTask`: the shard's TABLES file, tar and md5; its ShardOutput sums its tables'
    (records, deleted keys, file sizes), with each table's in `tables` and the width they
    share (0 when they differ: values of varying width, as the part as a whole has)."""
    part = Path(task.part_dir)
    names = [name for name, _ in task.tables]
    atomic_write_text(part / TABLES_FILE, tables_text(names))
    members = [TABLES_FILE, *(f"{name}/{file}" for name in names for file in TAR_MEMBERS)]
    tar_path = Path(task.tar_path)
    tar_size, md5 = write_tar(tar_path, part, members, mtime=task.mtime, sync=False)
    sync_files([part / TABLES_FILE, tar_path])
    write_md5_file(tar_path, md5)
    outputs = [output for _, output in task.tables]
    widths = {o.value_width for o in outputs}
    return ShardOutput(
        shard=task.shard,
        record_count=sum(o.record_count for o in outputs),
        tombstone_count=sum(o.tombstone_count for o in outputs),
        value_width=widths.pop() if len(widths) == 1 else 0,
        build_id=",".join(o.build_id for o in outputs),
        index_size=sum(o.index_size for o in outputs),
        data_size=sum(o.data_size for o in outputs),
        tar_size=tar_size,
        md5=md5,
        tables=task.tables,
    )


def build_tables(
    config: BuildConfig,
    tables: Sequence[PaddleTable],
    delete_path: str | os.PathLike[str] | None,
    progress: Progress,
    source: str,
    started: float,
) -> BuildResult:
    """`build` for a parameter-server save's several sparse tables: one version of named
    tables (cube.layout's TABLES), each shard directory holding TABLES and one `<table>/` of
    index.cube + data.cube per table, its tar the same members. Every table is routed by the
    same shard_num and partitioner. The tables are read in one pool run (each into its own
    spill; the memory budget shared as for one table), then every (table, shard) is finished
    in one run, biggest first (one shard of one table in memory per worker), then each
    shard's tar is written. A delta must have its base's tables (`refuse_table_change`), and
    each table its base table's value width (`check_table_widths`). Long: `build`'s steps
    (workspace, pool, phases, publish, result) for several tables, kept in one reading order
    as `build` keeps them."""
    from cube.builder.paddle_ps import describe, local_paths

    if delete_path is not None:
        raise BuildError(
            "-delete_path with several tables: a delete list does not say which table its keys "
            "are of; build the tables' deletions as Paddle saves them (in the delta save)"
        )
    names = [table.name for table in tables]
    refuse_table_change(config, names)
    assert config.paddle is not None
    value = config.paddle.value
    files = [local_paths(table) for table in tables]
    every = [path for table_files in files for path in table_files]
    note = "; ".join(describe(table) for table in tables)
    refuse_empty_input(config, source, len(every), None, 0)
    warmer = _Warmer(every)
    workspace = Workspace(config)
    formats = (KEY_FORMAT,)
    try:
        with _Pool(config.workers, after_fork=warmer.start) as pool:
            progress.start_reading(sum(path.stat().st_size for path in every))
            tasks = []  # each table in up to `workers` runs, sharing the memory budget
            for name, table, table_files in zip(names, tables, files, strict=True):
                spill = workspace.spill / name
                layout = (table.layout, value)
                workers = config.workers
                tasks.append(_read_tasks(config, table_files, spill, layout, workers, workers))
            flat = [task for table_tasks in tasks for task in table_tasks]
            done = pool.run(read_and_spill, flat, progress.read_bytes, lambda _output: None)
            reads, at = [], 0
            for table_tasks in tasks:
                reads.append(done[at : at + len(table_tasks)])
                at += len(table_tasks)
            records = sum(r.records for r in done)
            refuse_empty_input(config, source, len(every), records, 0)
            phases = {"read": time.monotonic() - started}
            if warmer.finish():
                pool.restart()
            finished = _finish_tables(pool, config, workspace.staging, names, reads, formats)
            progress.start_finishing(config.shard_num)
            packs = [
                PackTask(
                    shard=shard,
                    part_dir=str(workspace.staging / config.shard_name(shard)),
                    tar_path=str(workspace.staging / f"{config.shard_name(shard)}.tar"),
                    tables=tuple((name, finished[name][shard]) for name in names),
                    mtime=config.cur_version,
                )
                for shard in range(config.shard_num)
            ]
            outputs = pool.run(pack_tables, packs, lambda _n: None, progress.shard_done)
        progress.close()
        warnings = check_table_widths(config, names, outputs)
        phases["finish"] = time.monotonic() - started - phases["read"]
        version_dir = workspace.publish()
    except BaseException:
        progress.close()
        raise
    finally:
        workspace.close()
    return _result(config, version_dir, outputs, formats, records, len(every), started, phases,
                   warnings, note, tuple(names))  # fmt: skip


def _finish_tables(
    pool: _Pool,
    config: BuildConfig,
    staging: Path,
    names: Sequence[str],
    reads: Sequence[Sequence[ReadOutput]],
    formats: tuple[str, ...],
) -> dict[str, list[ShardOutput]]:
    """Every (table, shard) finished into `<part>/<table>/` (no tar: `pack_tables` writes
    one per shard), biggest first; {table: its shards' outputs in shard order}."""
    tasks = []
    for name, table_reads in zip(names, reads, strict=True):
        for shard in range(config.shard_num):
            parts = tuple(r.parts[shard] for r in table_reads) or (SpillPart(shard, "", 0, 0, 0),)
            tasks.append(
                FinishTask(
                    parts=parts,
                    deleted=np.empty(0, np.uint64),
                    shard_dir=str(staging / config.shard_name(shard) / name),
                    tar_path="",
                    meta={**shard_header_meta(config, shard, formats), "table": name},
                )
            )
    order = sorted(range(len(tasks)), key=lambda i: -sum(p.count for p in tasks[i].parts))
    outputs = pool.run(finish_shard, [tasks[i] for i in order], lambda _n: None, lambda _o: None)
    finished: dict[str, list[ShardOutput]] = {name: [] for name in names}
    for index, output in sorted(zip(order, outputs, strict=True)):
        finished[tasks[index].meta["table"]].append(output)
    return finished


def base_metas(config: BuildConfig) -> tuple[list[tuple[Path, dict[str, Any]]] | None, str]:
    """The meta_info of a delta's base, `meta_info/<depend>_<depend>_<shard>_0.json` in the
    output path (the builder wrote them with the base), (path, meta) per shard; (None, why)
    when they cannot be read there."""
    depend = config.depend_version
    meta_dir = config.output_path / META_DIR
    paths = sorted(meta_dir.glob(f"{depend}_{depend}_*_0.json"))
    if not paths:
        return None, f"no {meta_info_name(depend, depend, 0)} (nor other shards') in {meta_dir}"
    metas = []
    for path in paths:
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return None, f"{path}: unreadable ({type(exc).__name__})"
        if not isinstance(meta, dict) or meta.get("dict_name") != config.dict_name:
            return None, f"{path} is not a meta_info of dict {config.dict_name}"
        metas.append((path, meta))
    return metas, ""


def meta_tables(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tables a shard's meta_info lists ({} for a version of one unnamed table)."""
    tables = meta.get("tables")
    if not isinstance(tables, list):
        return {}
    return {str(t["table"]): t for t in tables if isinstance(t, dict) and "table" in t}


def refuse_table_change(config: BuildConfig, names: Sequence[str]) -> None:
    """BuildError when a delta's tables (`names`; empty: one unnamed table) are not its
    base's, as the base's meta_info in the output path lists them: a server applies a
    delta's tables to its base's tables of the same names, so a chain has one table set.
    Nothing is checked when the base's meta_info cannot be read (the transfer's output
    path normally holds it)."""
    if config.mode != "delta":
        return
    metas, _ = base_metas(config)
    if not metas:
        return
    base = list(meta_tables(metas[0][1]))
    if sorted(base) == sorted(names):
        return

    def said(tables: Sequence[str]) -> str:
        return f"the tables {', '.join(tables)}" if tables else "one unnamed table"

    raise BuildError(
        f"delta {config.served_version} would have {said(names)}, its base "
        f"{config.depend_version} has {said(base)}: a delta must have its base's tables; "
        "refused (build the delta with the base's tables: -paddle_table, -paddle_config)"
    )


def check_table_widths(
    config: BuildConfig, names: Sequence[str], outputs: Sequence[ShardOutput]
) -> tuple[str, ...]:
    """`check_delta_width` for each table of a delta of several tables: a table whose values
    have another width than its base table's is a BuildError, unless -variable_width."""
    if config.mode != "delta" or config.variable_width:
        return ()
    warnings = []
    metas, why = base_metas(config)
    for name in names:
        delta = value_widths(
            (o.record_count, o.value_width)
            for shard in outputs
            for n, o in shard.tables
            if n == name
        )
        if not delta:
            continue
        if metas is None:
            warnings.append(
                f"warning: the value width of table {name} of delta {config.served_version} "
                f"({describe_widths(delta)}) is not checked against its base "
                f"{config.depend_version}: {why}"
            )
            continue
        base = value_widths(
            (int(t.get("record_count", 0)), int(t.get("value_width", 0)))
            for _, meta in metas
            for t in [meta_tables(meta).get(name, {})]
            if t
        )
        change = width_change(base, delta)
        if change is not None:
            raise BuildError(
                f"table {name} of delta {config.served_version} has {change[1]}, its base "
                f"{config.depend_version}'s {change[0]}: clients reading {change[0]} would "
                "fail on every lookup; refused (pass -variable_width if the dictionary's "
                "values may vary in width)"
            )
    return tuple(warnings)


def _result(
    config: BuildConfig,
    version_dir: Path,
    outputs: list[ShardOutput],
    formats: tuple[str, ...],
    records: int,
    input_files: int,
    started: float,
    phases: dict[str, float],
    warnings: tuple[str, ...],
    note: str,
    tables: tuple[str, ...] = (),
) -> BuildResult:
    """A published build's meta_info files written, and its result (the publish phase timed
    up to now)."""
    metas, meta_paths = write_meta_infos(config, outputs, formats)
    elapsed = time.monotonic() - started
    return BuildResult(
        version_dir=version_dir,
        meta_paths=meta_paths,
        metas=metas,
        shards=outputs,
        records_read=records,
        input_files=input_files,
        key_formats=formats,
        seconds=elapsed,
        phase_seconds={**phases, "publish": elapsed - phases["read"] - phases["finish"]},
        warnings=warnings,
        input_note=note,
        tables=tables,
    )


def refuse_paddle_save(files: Sequence[Path], input_path: str, source: str) -> None:
    """A BuildError suggesting -input_format paddle_ps (and the layout flags its rows fit)
    when the first input file is not a SequenceFile and the input is a parameter-server
    save (`cube.builder.paddle_ps.save_hint`); otherwise nothing: the reading says what is
    wrong. The message names files and layouts, never what a file holds."""
    if not files:
        return
    try:
        with open(files[0], "rb") as file:
            if file.read(len(SEQ_MAGIC)) == SEQ_MAGIC:
                return
    except OSError:
        return  # the reading says why
    from cube.builder.paddle_ps import save_hint

    hint = save_hint(input_path)
    if hint:
        name = files[0].relative_to(input_path) if files[0] != Path(input_path) else files[0]
        raise BuildError(f"{source}: not SequenceFiles ({name} is not one); {hint}")


def base_widths(config: BuildConfig) -> tuple[frozenset[int] | None, str]:
    """The value widths of a delta's base (`value_widths`), from the base's
    `meta_info/<depend>_<depend>_<shard>_0.json` in the output path (the builder wrote them
    with the base); (None, why) when they cannot be read there."""
    metas, why = base_metas(config)
    if metas is None:
        return None, why
    shards = []
    for path, meta in metas:
        records, width = meta.get("record_count"), meta.get("value_width")
        if not isinstance(records, int) or not isinstance(width, int):
            return None, f"{path} has no record_count and value_width"
        shards.append((records, width))
    return value_widths(shards), ""


def check_delta_width(config: BuildConfig, outputs: Sequence[ShardOutput]) -> tuple[str, ...]:
    """A delta whose values have another width than its base's is a BuildError (naming both
    widths and versions), unless `config.variable_width` (`cube.layout.width_change` says
    when). Returns warnings: the base's width could not be read."""
    if config.mode != "delta" or config.variable_width:
        return ()
    delta = value_widths((o.record_count, o.value_width) for o in outputs)
    if not delta:
        return ()  # no values (empty, or deletions only): no width to compare
    base, why = base_widths(config)
    if base is None:
        return (
            f"warning: the value width of delta {config.served_version} "
            f"({describe_widths(delta)}) is not checked against its base "
            f"{config.depend_version}: {why}",
        )
    change = width_change(base, delta)
    if change is None:
        return ()
    raise BuildError(
        f"delta {config.served_version} has {change[1]}, its base {config.depend_version} "
        f"{change[0]}: clients reading {change[0]} would fail on every lookup; refused "
        "(pass -variable_width if the dictionary's values may vary in width)"
    )


def write_meta_infos(
    config: BuildConfig, outputs: Sequence[ShardOutput], formats: Sequence[str]
) -> tuple[list[dict[str, Any]], list[Path]]:
    """`meta_info/<cur>_<depend>_<shard>_0.json` for each built shard (after the version
    directory is published); returns the metas and their paths."""
    common = {
        "dict_name": config.dict_name,
        "version": config.served_version,
        "depend": str(config.depend_version),
        "cur": str(config.cur_version),
        "mode": config.mode,
        "partitioner": config.partitioner,
        "shard_num": config.shard_num,
        "key_format": ",".join(formats) or config.key_format,
        "split": 0,
    }
    metas = [shard_meta_info(output, common) for output in outputs]
    meta_dir = config.output_path / META_DIR
    meta_dir.mkdir(parents=True, exist_ok=True)
    # each is written and fsynced on its own (with its directory): in threads, the waits overlap
    with ThreadPoolExecutor(min(16, max(1, len(outputs)))) as threads:
        meta_paths = list(
            threads.map(
                lambda pair: write_meta_file(
                    meta_dir,
                    meta_info_name(config.cur_version, config.depend_version, pair[0].shard),
                    pair[1],
                ),
                zip(outputs, metas, strict=True),
            )
        )
    return metas, meta_paths


class _Warmer:
    """Loads the compiled build loops (numba's import and cached code, ~0.7 s) for a large
    input: in a thread of the parent while the readers run, then the shards are finished by
    workers forked after it, which inherit them (one load, and not before the readers start).
    A small input builds with numpy and loads nothing."""

    def __init__(self, files: list[Path]) -> None:
        size = 0
        for path in files:
            with contextlib.suppress(OSError):
                size += path.stat().st_size
        self.wanted = size >= _WARM_INPUT_BYTES
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        """Called once the readers are forked: from now on a thread is harmless to them."""
        if self.wanted and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="warm-kernels", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            _load_kernels()
        except BaseException as exc:  # reported by finish(), in the building thread
            self._error = exc

    def finish(self) -> bool:
        """Wait for the loading (or load now, when no thread ran); True when it ran in a
        thread, i.e. the current workers lack the loops and new ones should be forked."""
        if not self.wanted:
            return False
        if self._thread is None:
            _load_kernels()
            return False
        self._thread.join()
        if self._error is not None:
            raise self._error
        return True


def _load_kernels() -> None:
    kernels = compiled_kernels(COMPILED_MIN_KEYS)
    if kernels is not None:
        kernels.warm()


def _read_all(
    pool: _Pool,
    config: BuildConfig,
    files: list[Path],
    spill: Path,
    progress: Progress,
    paddle: tuple[TableLayout, ValueSpec] | None = None,
) -> list[ReadOutput]:
    tasks = _read_tasks(config, files, spill, paddle, pool.workers)
    progress.start_reading(sum(f.stat().st_size for f in files))
    if not tasks:
        return []
    return pool.run(read_and_spill, tasks, progress.read_bytes, lambda _output: None)


def _read_tasks(
    config: BuildConfig,
    files: list[Path],
    spill: Path,
    paddle: tuple[TableLayout, ValueSpec] | None,
    workers: int,
    sharing: int = 0,
) -> list[ReadTask]:
    """The files cut into up to `workers` runs, one reader task each, spilling under
    `spill`; the memory budget shared by as many readers as run at once: the runs, or
    `sharing` (the workers, when the runs of several tables run in one pool)."""
    sizes = [f.stat().st_size for f in files]
    runs = split_runs(sizes, workers)
    budget = (config.memory_mb << 20) // max(1, sharing or len(runs))
    # a reader holds about 4 batches: input chunk, parsed keys/values, grouped copy, slack
    batch_bytes = max(1 << 20, min(_MAX_BATCH_BYTES, budget // 4))
    tasks = []
    for number, (lo, hi) in enumerate(runs):
        directory = spill / f"reader{number}"
        tasks.append(
            ReadTask(
                files=tuple(str(f) for f in files[lo:hi]),
                spill_dir=str(directory),
                shard_num=config.shard_num,
                partitioner=config.partitioner,
                key_format=config.key_format,
                batch_bytes=batch_bytes,
                paddle=paddle,
            )
        )
    return tasks


def _finish_all(
    pool: _Pool,
    config: BuildConfig,
    staging: Path,
    reads: list[ReadOutput],
    deleted: np.ndarray,
    formats: tuple[str, ...],
    progress: Progress,
) -> list[ShardOutput]:
    deleted_by_shard = route_keys(deleted, config.shard_num, config.partitioner)
    tasks = []
    for shard in range(config.shard_num):
        name = config.shard_name(shard)
        parts = tuple(r.parts[shard] for r in reads) or (SpillPart(shard, "", 0, 0, 0),)
        tasks.append(
            FinishTask(
                parts=parts,
                deleted=deleted_by_shard[shard],
                shard_dir=str(staging / name),
                tar_path=str(staging / f"{name}.tar"),
                meta=shard_header_meta(config, shard, formats),
            )
        )
    # Biggest shards first, so two workers end at about the same time.
    tasks.sort(key=lambda t: -sum(p.count for p in t.parts))
    progress.start_finishing(len(tasks))
    outputs = pool.run(finish_shard, tasks, lambda _n: None, progress.shard_done)
    return sorted(outputs, key=lambda o: o.shard)


# A stage's task: (task, on_bytes) -> output; on_bytes None in a worker, which reports the bytes
# it reads through the shared counter instead (read_and_spill, finish_shard).
TaskFunction = Callable[[Any, Callable[[int], None] | None], Any]


class _Pool:
    """Runs tasks inline (one worker) or in worker processes, reporting progress. `isolate`:
    in a worker process even with one worker (cube-import: a SIGBUS from a mapped input cut
    short kills the worker, not the process that owns the staging directories; the run then
    raises BrokenProcessPool)."""

    def __init__(
        self, workers: int, after_fork: Callable[[], None] = lambda: None, isolate: bool = False
    ) -> None:
        self.workers = max(1, workers)
        self.after_fork = after_fork  # called once the first workers exist
        self.isolate = isolate
        self._executor: ProcessPoolExecutor | None = None
        self._counter: Any = None

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restart()

    def restart(self) -> None:
        """End the workers; the next run forks new ones from this process as it is now."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def _start(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # fork is cheap and safe while this process runs no other thread
            method = "fork" if threading.active_count() == 1 else "forkserver"
            context = multiprocessing.get_context(method)
            self._counter = context.Value("q", 0)
            self._executor = ProcessPoolExecutor(
                self.workers,
                mp_context=context,
                initializer=_init_worker,
                # a forkserver's children are the server's, not ours: it ends when we do
                initargs=(self._counter, os.getpid() if method == "fork" else None),
            )
        return self._executor

    def run(
        self,
        function: TaskFunction,
        tasks: list[Any],
        on_bytes: Callable[[int], None],
        on_done: Callable[[Any], None],
    ) -> list[Any]:
        """Results in task order; the first failure is raised once every started task ends."""
        # With workers, even a single task runs in one: a parent that grew while reading would
        # make forked children pay copy-on-write faults on its freed heap.
        if self.workers == 1 and not self.isolate:
            results = []
            for task in tasks:
                result = function(task, on_bytes)
                on_done(result)
                results.append(result)
            return results
        # Workers are forked on the first submit: no signal handler may run (and exit) between
        # a fork and the pool knowing its child, or that child would outlive us.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            executor = self._start()
            futures: list[Future[Any]] = [executor.submit(_in_worker, function, t) for t in tasks]
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        self.after_fork()
        reported = self._counter.value
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
            now = self._counter.value
            on_bytes(now - reported)
            reported = now
            for future in done:
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    wait(pending)  # bounded: running tasks end on their own
                    raise future.exception()  # type: ignore[misc]
                on_done(future.result())
        return [f.result() for f in futures]


def _in_worker(function: TaskFunction, task: Any) -> Any:
    """Run a task in a worker; errors come back as BuildError with the same one-line message
    (some exception types, e.g. SequenceFileError, cannot be rebuilt from their pickle)."""
    try:
        return function(task, None)  # progress goes through the shared counter
    except Exception as exc:
        raise BuildError(task_error_message(exc)) from None


def task_error_message(exc: Exception) -> str:
    """The one-line message of a task's failure, to send back to the driving process: the
    text of an expected error (BuildError, ValueError, OSError), else prefixed with its type
    (a bug)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (BuildError, ValueError, OSError)):
        message = f"{type(exc).__name__}: {message}"
    return message
