"""cube-builder -engine spark: the same build as `builder.build`, with a Spark cluster doing the
reading, routing and shard writing.

One job of two stages:
1. **Map**, one task per input file (in the builder's sorted file order, numbered): the
   project's SequenceFile reader parses the file in batches (a part file of a parameter-server
   save: `builder.paddle_ps`, the table found by the driver; a remote file is first copied to
   the executor's local disk by `builder.sources`); each batch is routed by the build's
   partitioner and each shard's share becomes one chunk: (file number, chunk number, keys,
   values) as plain arrays. Each task also sends every shard a marker with its file's key
   format, so every shard task knows the formats of the whole input (the shard headers name
   them, as the local build's do).
2. **Shuffle** keyed by shard (Spark's `partitionBy`, one partition per shard), then **finish**,
   one task per shard: the chunks are put back in input order by (file, chunk) number, which
   makes "the last record of a key wins, across files in order" exact whatever order the
   shuffle delivered them in, and the project's own writer (`cube.index.build_table`,
   `cube.shard_writer.write_shard`, `package_shard`) writes the shard files, tar and md5 into
   a per-attempt directory of the staging area, renamed into place when complete.

The driver publishes as the local build does: the staging directory `<output>/.tmp-...` is
renamed to `<output>/<depend>_<cur>` only after every shard succeeded, then meta_info is
written; a failed job leaves the staging directory removed and nothing published. The output
path must be a file system the driver and every executor see (local in `local[N]`; a shared
mount on a cluster).

Memory: a map task holds about three input batches; a shard task holds its shard's records
(keys, values, the table), refused with a message naming the shard and `-spark_shard_mb` when
they would pass that budget. The output is byte-identical to the local builder's for the same
input and flags (tests/test_spark_build.py).

Why the project's reader on whole files rather than Hadoop's SequenceFileInputFormat: the
reader handles both dialects (Cube's raw little-endian keys under a BytesWritable header,
which Hadoop's reader would misread), every codec the local build does, and hands over numpy
batches instead of one Python object per record through Py4J (Spark's Hadoop input path
would pickle every record).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cube import remote
from cube.builder.build import (
    BuildConfig,
    BuildError,
    BuildResult,
    Workspace,
    check_delta_width,
    package_shard,
    refuse_empty_input,
    route_keys,
    shard_header_meta,
    task_error_message,
    write_meta_infos,
)
from cube.builder.meta import ShardOutput
from cube.builder.sources import FETCH_TIMEOUT, fetch_input, list_inputs, read_delete_list
from cube.builder.spill import route_batch, shard_owners
from cube.index import build_table
from cube.paddle_ps import KEY_FORMAT, TableLayout, ValueSpec
from cube.seqfile import SequenceFileReader, concat_columns
from cube.shard_writer import DATA_FILE, INDEX_FILE, write_shard
from cube.values import ValueColumn

DEFAULT_SHARD_MB = 4096
_MAP_BATCH_BYTES = 16 << 20  # input per batch in a map task
_MAX_DELETE_LIST_BYTES = 1 << 30
_ERROR_MARK = "cube-build-error: "
_ERROR_RE = re.compile(re.escape(_ERROR_MARK) + r"([^\n]*)")


@dataclass(frozen=True)
class SparkSettings:
    """How to reach and use the cluster (cube-builder's -spark_* flags)."""

    master: str = ""  # "" = what spark-submit or spark-defaults say, else local[*]
    conf: tuple[tuple[str, str], ...] = ()  # extra Spark settings, key=value
    shard_mb: int = DEFAULT_SHARD_MB  # the most one shard task may hold

    def __post_init__(self) -> None:
        if self.shard_mb < 1:
            raise ValueError(f"spark_shard_mb must be >= 1, got {self.shard_mb}")


@dataclass(frozen=True)
class InputSplit:
    """One map task's input: a file, numbered in the build's input order."""

    number: int
    url: str  # a local path or a URL builder.sources can fetch
    size: int


@dataclass(frozen=True)
class _JobSpec:
    """What every task needs to know (pickled to the executors with the functions)."""

    shard_num: int
    partitioner: str
    key_format: str
    staging: str
    shard_bytes: int
    config: BuildConfig
    fetch_timeout: float = FETCH_TIMEOUT  # seconds to copy one remote input file
    paddle: tuple[TableLayout, ValueSpec] | None = None  # a parameter-server table's files


@dataclass(frozen=True)
class _ShardResult:
    output: ShardOutput
    formats: tuple[str, ...]
    records: int
    shuffled_bytes: int


@dataclass(frozen=True)
class SparkStats:
    """What the job moved, for the summary and the benchmarks."""

    map_tasks: int
    shard_tasks: int
    shuffled_bytes: int  # chunk payload through the shuffle (Spark's framing not included)


# ---------------------------------------------------------------------------------------------
# Inputs


def list_splits(input_path: str, timeout: float = FETCH_TIMEOUT) -> list[InputSplit]:
    """The input files in the builder's order (`builder.sources`: local or a URL, listed
    within `timeout` seconds), one split each."""
    files = list_inputs(input_path, timeout)
    return [InputSplit(n, f.url, f.size) for n, f in enumerate(files)]


# ---------------------------------------------------------------------------------------------
# Stage 1: one file -> (shard, chunk) pairs


def map_file(spec: _JobSpec, split: InputSplit) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """Read one input file; yield (shard, marker) for every shard, then (shard, chunk) for
    every shard's share of every batch. A chunk is ("R", file, chunk number, keys bytes,
    value width, value bytes, value offsets bytes)."""
    if spec.paddle is not None:
        yield from _map_paddle_file(spec, split)
        return
    with (
        _task_errors(),
        _local_copy(split.url, spec.fetch_timeout) as path,
        SequenceFileReader(path, spec.key_format, _MAP_BATCH_BYTES) as reader,
    ):
        for shard in range(spec.shard_num):
            yield shard, ("F", split.number, reader.key_format)
        chunk = 0
        for batch in reader.batches():
            owners = shard_owners(batch.keys, spec.shard_num, spec.partitioner)
            for shard, keys, values in route_batch(batch.keys, batch.values, owners):
                yield shard, ("R", split.number, chunk, *_encode(keys, values))
                chunk += 1


def _map_paddle_file(spec: _JobSpec, split: InputSplit) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """map_file for a part file of a parameter-server table (`cube.builder.paddle_ps`)."""
    from cube.builder.paddle_ps import table_batches

    assert spec.paddle is not None
    layout, value = spec.paddle
    with _task_errors(), _local_copy(split.url, spec.fetch_timeout) as path:
        for shard in range(spec.shard_num):
            yield shard, ("F", split.number, KEY_FORMAT)
        chunk = 0
        for keys, values, _ in table_batches(path, layout, value, _MAP_BATCH_BYTES):
            owners = shard_owners(keys, spec.shard_num, spec.partitioner)
            for shard, shard_keys, shard_values in route_batch(keys, values, owners):
                yield shard, ("R", split.number, chunk, *_encode(shard_keys, shard_values))
                chunk += 1


def _encode(keys: np.ndarray, values: ValueColumn) -> tuple[bytes, int, bytes, bytes]:
    if values.width:
        return keys.tobytes(), values.width, values.blob[: values.nbytes].tobytes(), b""
    start, end = int(values.offsets[0]), int(values.offsets[-1])
    offsets = values.offsets - start
    return keys.tobytes(), 0, values.blob[start:end].tobytes(), offsets.tobytes()


def _decode(chunk: tuple[Any, ...]) -> tuple[np.ndarray, ValueColumn]:
    _, _, _, keys, width, blob, offsets = chunk
    blob_array = np.frombuffer(blob, np.uint8)
    if width:
        values = ValueColumn.fixed(blob_array, width)
    else:
        values = ValueColumn.variable(blob_array, np.frombuffer(offsets, np.int64))
    return np.frombuffer(keys, np.uint64), values


@contextlib.contextmanager
def _local_copy(url: str, timeout: float) -> Iterator[str]:
    """A local path for the file: itself, or a copy of a remote one (fetched within `timeout`
    seconds) in the executor's local directory for the life of the `with` block."""
    if not remote.is_remote(url):
        yield url
        return
    tmp = tempfile.mkdtemp(prefix="cube-spark-input-")
    try:
        yield str(fetch_input(url, Path(tmp) / "input", timeout))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _task_errors() -> Iterator[None]:
    """Inside a task: a failure becomes one marked line the driver finds in Spark's report
    (which wraps it in a Java stack trace); the same line the local engine's workers send."""
    try:
        yield
    except Exception as exc:
        message = task_error_message(exc)
        if _ERROR_MARK in message:
            raise
        raise RuntimeError(f"{_ERROR_MARK}{message}") from None


# ---------------------------------------------------------------------------------------------
# Stage 2: one shard's chunks -> shard files, tar, md5


def finish_shard(
    spec: _JobSpec, deleted: Any, shard: int, items: Iterable[tuple[int, tuple[Any, ...]]]
) -> Iterator[_ShardResult]:
    """The shard task: gather, order, build, write, package (see the module docstring)."""
    config = spec.config
    name = config.shard_name(shard)
    with _task_errors():
        formats: dict[int, str] = {}
        chunks: list[tuple[Any, ...]] = []
        held = 0
        for _, item in items:
            if item[0] == "F":
                formats[item[1]] = item[2]
                continue
            chunks.append(item)
            held += len(item[3]) + len(item[5]) + len(item[6])
            if held > spec.shard_bytes:
                raise BuildError(
                    f"shard {shard} ({name}) holds more than {spec.shard_bytes >> 20} MiB of "
                    "records, the most one Spark task may (-spark_shard_mb): raise "
                    "-spark_shard_mb (with spark.executor.memory at about 3x it), or build "
                    "with more shards (-shard_num)"
                )
        chunks.sort(key=lambda chunk: (chunk[1], chunk[2]))
        decoded = [_decode(chunk) for chunk in chunks]
        del chunks
        keys = np.concatenate([k for k, _ in decoded]) if decoded else np.empty(0, dtype=np.uint64)
        values = concat_columns([v for _, v in decoded])
        del decoded
        key_formats = tuple(dict.fromkeys(formats[number] for number in sorted(formats)))
        if spec.paddle is not None:  # a save's keys are uint64s, whether or not it has rows
            key_formats = (KEY_FORMAT,)
        meta = shard_header_meta(config, shard, key_formats)
        built = build_table(keys, deleted=deleted.value[shard])
        records = int(keys.shape[0])
        del keys
        staging = Path(spec.staging)
        attempt = Path(tempfile.mkdtemp(prefix=f".attempt-{shard}-", dir=staging))
        try:
            header = write_shard(attempt / name, built, values, meta, sync=False)
            del built, values
            output = package_shard(header, attempt / name, attempt / f"{name}.tar", meta)
            # Into place: a retried or speculative attempt writes the same bytes, so whichever
            # rename comes last changes nothing.
            (staging / name).mkdir(exist_ok=True)
            for member in (INDEX_FILE, DATA_FILE):
                os.replace(attempt / name / member, staging / name / member)
            for suffix in (".tar", ".tar.md5"):
                os.replace(attempt / f"{name}{suffix}", staging / f"{name}{suffix}")
        finally:
            shutil.rmtree(attempt, ignore_errors=True)
        yield _ShardResult(output, key_formats, records, held)


def _shard_partition(shard: int) -> int:
    return shard


# ---------------------------------------------------------------------------------------------
# The driver


def build_on_spark(
    config: BuildConfig,
    input_path: str,
    delete_path: str | None = None,
    settings: SparkSettings | None = None,
    fetch_timeout: float = FETCH_TIMEOUT,
) -> tuple[BuildResult, SparkStats]:
    """Build one version on Spark; same result, files and errors as `builder.build.build`.
    `fetch_timeout` bounds the driver's listing and delete list, and each input a task copies
    (-fetch_timeout)."""
    started = time.monotonic()
    settings = settings or SparkSettings()
    if delete_path and config.mode != "delta":
        raise BuildError("-delete_path needs -job_mode delta")
    deadline = time.monotonic() + fetch_timeout
    splits, paddle, note = _input_splits(config, input_path, fetch_timeout)
    deleted = np.empty(0, np.uint64)
    if delete_path:
        left = max(deadline - time.monotonic(), 0.001)
        deleted = read_delete_list(delete_path, _MAX_DELETE_LIST_BYTES, left)
    refuse_empty_input(config, remote.redact(str(input_path)), len(splits), None, deleted.size)
    deleted_by_shard = route_keys(deleted, config.shard_num, config.partitioner)
    workspace = Workspace(config)
    try:
        spec = _JobSpec(
            shard_num=config.shard_num,
            partitioner=config.partitioner,
            key_format=config.key_format,
            staging=str(workspace.staging),
            shard_bytes=settings.shard_mb << 20,
            config=config,
            fetch_timeout=fetch_timeout,
            paddle=paddle,
        )
        results = _run_in_session(settings, spec, splits, deleted_by_shard)
        records = sum(r.records for r in results)
        refuse_empty_input(
            config, remote.redact(str(input_path)), len(splits), records, deleted.size
        )
        results.sort(key=lambda r: r.output.shard)
        outputs = [r.output for r in results]
        warnings = check_delta_width(config, outputs)
        phases = {"spark": time.monotonic() - started}
        version_dir = workspace.publish()
    finally:
        workspace.close()
    formats = results[0].formats if results else ()
    if paddle is not None:
        formats = (KEY_FORMAT,)
    metas, meta_paths = write_meta_infos(config, outputs, formats)
    phases["publish"] = time.monotonic() - started - phases["spark"]
    result = BuildResult(
        version_dir=version_dir,
        meta_paths=meta_paths,
        metas=metas,
        shards=outputs,
        records_read=records,
        input_files=len(splits),
        key_formats=formats,
        seconds=time.monotonic() - started,
        phase_seconds=phases,
        warnings=warnings,
        input_note=note,
    )
    stats = SparkStats(len(splits), config.shard_num, sum(r.shuffled_bytes for r in results))
    return result, stats


def _input_splits(
    config: BuildConfig, input_path: str, fetch_timeout: float
) -> tuple[list[InputSplit], tuple[TableLayout, ValueSpec] | None, str]:
    """The input files as splits; for a parameter-server table also its layout and value
    spec (what map_file reads it with) and a note describing the table."""
    if config.paddle is None:
        return list_splits(str(input_path), fetch_timeout), None, ""
    from cube.builder.paddle_ps import describe, find_tables

    tables, several = find_tables(str(input_path), config.paddle, fetch_timeout)
    if several:
        raise BuildError(
            f"{len(tables)} sparse tables to build into one version "
            f"({', '.join(t.name for t in tables)}): -engine spark builds one table (name it "
            "with -paddle_table); build several with -engine local"
        )
    table = tables[0]
    splits = [InputSplit(n, f.url, f.size) for n, f in enumerate(table.files)]
    return splits, (table.layout, config.paddle.value), describe(table)


def _run_in_session(
    settings: SparkSettings, spec: _JobSpec, splits: list[InputSplit], deleted: list[np.ndarray]
) -> list[_ShardResult]:
    """Run the job in a Spark session (stopped after, when we started it)."""
    config = spec.config
    spark, ours = start_session(
        settings, f"cube-builder {config.dict_name} {config.served_version}"
    )
    try:
        return _run_job(spark.sparkContext, spec, splits, deleted)
    finally:
        if ours:
            spark.stop()


def _run_job(
    context: Any, spec: _JobSpec, splits: list[InputSplit], deleted: list[np.ndarray]
) -> list[_ShardResult]:
    shared_deletes = context.broadcast(deleted)
    try:
        mapped = context.parallelize(splits, max(1, len(splits))).flatMap(
            functools.partial(map_file, spec)
        )
        routed = mapped.partitionBy(spec.shard_num, _shard_partition)
        finished = routed.mapPartitionsWithIndex(
            functools.partial(finish_shard, spec, shared_deletes)
        )
        results: list[_ShardResult] = finished.collect()
    except Exception as exc:
        raise BuildError(_job_failure(exc)) from None
    finally:
        shared_deletes.destroy()
    missing = set(range(spec.shard_num)) - {r.output.shard for r in results}
    if missing:
        raise BuildError(f"the Spark job returned no result for shards {sorted(missing)}")
    return results


def _job_failure(exc: BaseException) -> str:
    """The one-line reason of a failed job: a task's marked message when there is one, else
    the first line of what Spark said."""
    text = str(exc)
    found = _ERROR_RE.search(text)
    if found:
        return found.group(1).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return f"the Spark job failed: {first[:300]}"


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """While a session starts (its JVM, and the Python workers the JVM starts, take this
    environment then): the workers run this Python unless PYSPARK_PYTHON says otherwise, and
    do not put their working directory first on sys.path (`python -m` would: a checkout's
    `cube/` folder there would hide the installed package's modules). Restored afterwards:
    the caller's own subprocesses keep the environment it had (PYTHONSAFEPATH left set would
    break their `python -m` of a module in the working directory)."""
    wanted = {
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONSAFEPATH": "1",
    }
    added = [name for name in wanted if name not in os.environ]
    for name in added:
        os.environ[name] = wanted[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def start_session(settings: SparkSettings, app_name: str) -> tuple[Any, bool]:
    """A SparkSession: the master and settings spark-submit gave, else -spark_master (else
    local[*]); executors run this Python unless PYSPARK_PYTHON says otherwise. Returns the
    session and whether it is ours to stop (a session already active in this process, e.g.
    a notebook's or a test's, is used as it is)."""
    try:
        from pyspark import SparkConf
        from pyspark.sql import SparkSession
    except ImportError:
        raise BuildError(
            "-engine spark needs PySpark: pip install 'cube-py[spark]' (and Java 17+)"
        ) from None
    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    conf = SparkConf()
    conf.setAppName(app_name)
    if settings.master:
        conf.setMaster(settings.master)
    elif not conf.contains("spark.master"):
        conf.setMaster("local[*]")
    conf.set("spark.ui.showConsoleProgress", "false")
    for key, value in settings.conf:
        conf.set(key, value)
    try:
        with worker_environment():
            spark = SparkSession.builder.config(conf=conf).getOrCreate()
    except Exception as exc:
        first = " ".join(str(exc).split())[:300]
        raise BuildError(
            f"cannot start Spark (master {conf.get('spark.master')}; is Java 17+ installed, "
            f"JAVA_HOME set?): {first}"
        ) from None
    spark.sparkContext.setLogLevel("WARN")
    return spark, True
