"""cube-builder: turn a directory of SequenceFiles into one version of sharded Cube files.

Thin shell over `builder.build`: flags (the original's names, gflags style), versions, the
progress bar, exit codes, and registering each shard's meta with a transfer.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# numpy's OpenBLAS starts a thread per core at import; a build never calls BLAS, and on a
# small machine those threads only compete with the workers
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from cube import hadoop, remote
from cube.builder.build import (
    INPUT_FORMATS,
    BuildConfig,
    BuildError,
    BuildResult,
    DeleteListError,
    Progress,
    abort_active_builds,
    build,
)
from cube.builder.meta import RegisterError, ShardOutput, register_meta
from cube.builder.paddle_ps import TablesSource, layout_flags, load_config
from cube.builder.sources import fetch_inputs
from cube.builder.spark_build import DEFAULT_SHARD_MB, SparkSettings, SparkStats, build_on_spark
from cube.flags import FlagError, FlagSet, flag, one_line, run_cli
from cube.paddle_ps import (
    ACCESSORS,
    DEFAULT_VALUE,
    DTYPES,
    SGD_RULES,
    VALUE_FIELDS,
    PaddleSource,
    ValueSpec,
    check_layout_flags,
    parse_value_fields,
)
from cube.routing import PARTITIONERS
from cube.seqfile import KEY_FORMATS

EXIT_OK, EXIT_FAILED, EXIT_BAD_FLAGS, EXIT_NOT_REGISTERED = 0, 1, 2, 3

DESCRIPTION = """\
Reads every regular, non-empty file under -input_path whose name does not start with a dot
(recursively, sorted by path, symlinks skipped) as a SequenceFile of (uint64 key, value bytes);
when a key occurs more than once the last record wins, across files in that order.

-input_format paddle_ps reads a PaddlePaddle parameter-server save instead (what
fleet.save_persistables writes, any mode): -input_path is the save directory (its numbered
table folders), one table's folder, or one part file; plain and gzip part files. The sparse
table is found by its files and rows (or -paddle_config, or named with -paddle_table); its rows'
columns are given by -paddle_accessor, -paddle_dim and -paddle_optimizer, or by -paddle_config
(the trainer's PSParameter text). Each row's value is its -paddle_value columns as
-paddle_dtype; a row saved without its embedx part has zeros there. A row that does not fit is
an error naming the file and line. docs/INPUT_FORMATS.md has the details.

Several sparse tables (a DeepFM's first-order weights and embeddings, say) build into one
version of named tables: -paddle_table all (every sparse table), a comma list (000,001), or,
without -paddle_table, a -paddle_config listing several sparse tables. Each table is named by
its folder (000, 001, ...), has its own layout (-paddle_config's entry; or the layout flags,
which apply to every table unless given per table as TABLE:VALUE: -paddle_dim 000:1,001:9,
-paddle_optimizer 000:adam,naive,001:adagrad) and its own value width (-paddle_value and
-paddle_dtype apply to each table); all are sharded alike. Each shard directory then holds
TABLES (the names, one a line) and <table>/{index.cube,data.cube} per table, its tar the
members ./TABLES and ./<table>/index.cube, ./<table>/data.cube; its meta_info sums the tables'
counts and lists each in "tables". A delta must have its base's tables (refused otherwise).
-paddle_table 001 still builds that one table as a version of one unnamed table.

Output (built in <output_path>/.tmp-<depend>_<cur>-<pid>/, renamed when complete):
  <output_path>/<depend>_<cur>/<dict>_part<i>/{index.cube,data.cube}  (several tables: above)
  <output_path>/<depend>_<cur>/<dict>_part<i>.tar       members ./index.cube, ./data.cube
  <output_path>/<depend>_<cur>/<dict>_part<i>.tar.md5   "<md5>  <dict>_part<i>.tar"
  <output_path>/meta_info/<cur>_<depend>_<i>_0.json
Servers name a base version <depend> and a delta <depend>_<cur>. A delta needs only its base
(-depend_version); -last_version is accepted for compatibility and ignored. With the default
-only_build=true the build's version is the current Unix time (a base: depend = cur = now);
with -only_build=false, -cur_version is required and a base's -depend_version defaults to it.
The original ignores -cur_version (and a base's -depend_version) under -only_build=true; here
giving them without -only_build=false is an error (exit 2), never silently ignored.
An existing <output_path>/<depend>_<cur> is never overwritten (exit 1).

The values of uncompressed input files are not copied: the shards are written from the input
files themselves, which must stay unchanged until the build ends (a changed file fails it).
Spill files (-tmp_dir) hold 16 bytes a record, plus the values of compressed input.

-key_format auto: LongWritable and Text keys as such; BytesWritable keys of 8 bytes are the
Cube tools' raw little-endian uint64, of 12 bytes genuine BytesWritable (big-endian).

-delete_path (delta only): a text file, or a directory of them (same file rules as the input),
with one decimal key (0 .. 2^64-1) per line; blank lines and lines starting with # are ignored.
Those keys become tombstones in the delta; a key both written and deleted in one delta is
deleted.

A build that would hold nothing (no input file, or input files without a record, and no
key to delete) is refused (exit 1, naming -input_path) unless -allow_empty: an empty input
directory is more often a failed upstream job or a typo than an intended empty version. A
delta that only deletes keys is not empty.

A delta's values must have the width of its base's (the base's meta_info in -output_path
says it): a fixed-width dictionary whose delta brings values of another width would serve
both, and a client reading fixed-width values (get_embeddings) would fail on every lookup.
Such a delta is refused (exit 1, naming both widths) unless -variable_width. An empty delta
or one that only deletes keys has no width; a base whose values vary in width already
(value_width 0) takes deltas of any width.

Remote input: -input_path and -delete_path may be s3://bucket/prefix (credentials, endpoint
and region from the AWS environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL,
AWS_DEFAULT_REGION, ...; needs pip install 'cube-py[s3]'), webhdfs://namenode:port/path
(the namenode's HTTP port), or hdfs:// and afs:// through the Hadoop client command as
Paddle's HDFSClient runs it (-hadoop_home or $HADOOP_HOME, -hadoop_configs or
$CUBE_HADOOP_CONFIGS: fs.default.name, hadoop.job.ugi). The local engine fetches the files
first, same rules and order, into a temporary directory under -tmp_dir (default:
-output_path), removed when the build ends; -fetch_timeout bounds the listing and the fetch.

-engine spark runs the same build on a Spark cluster (pip install 'cube-py[spark]', Java 17+):
one map task per input file, a shuffle keyed by shard, one task per shard writing its files
with the same writer. Same flags, same output, byte for byte; -workers, -memory_mb and -tmp_dir
are the local engine's. The master is -spark_master, else what spark-submit or
spark-defaults.conf say, else local[*]; -output_path must be a file system the driver and
every executor see. A shard whose records pass -spark_shard_mb is refused (raise it with
spark.executor.memory at about 3x, or use more shards).

Exit status: 0 built (and registered), 1 build failed (nothing published), 2 bad flags,
3 built and published locally but registering with -master_address failed."""


@dataclass(frozen=True)
class BuilderFlags:
    """cube-builder's flags (the original's names)."""

    dict_name: str = flag("", "dictionary name, prefix of the shard outputs", required=True)
    input_path: str = flag(
        "",
        "directory (or file) of SequenceFiles; or s3://, webhdfs://, hdfs://, afs:// (see above)",
        required=True,
        metavar="PATH",
    )
    output_path: str = flag("", "output root directory", required=True, metavar="DIR")
    shard_num: int = flag(0, "number of shards", required=True)
    job_mode: str = flag(
        "base", "base: a full table; delta: changes over a base", choices=("base", "delta")
    )
    cur_version: int = flag(
        -1,
        "this build's version (Unix time; 0 as in the original's local mode); -1: unset;"
        " needs -only_build=false",
    )
    depend_version: int = flag(
        -1,
        "base version: a base's own (needs -only_build=false), a delta's base (required for "
        "a delta); -1: unset",
    )
    last_version: int = flag(0, "accepted for compatibility; not needed")
    only_build: bool = flag(
        True,
        "true: the build's version is the current time, as the original (-cur_version, and "
        "a base's -depend_version, are refused); false: -cur_version",
    )
    master_address: str = flag(
        "",
        "host:port of a cube-transfer: POST each shard's meta "
        "to http://<master>/dict/meta_info/register",
        metavar="HOST:PORT",
    )
    key_format: str = flag("auto", "how to read keys", choices=KEY_FORMATS)
    partitioner: str = flag(
        "mod",
        "key to shard: mod = key % shard_num, murmur3 = murmur3_32(key) % shard_num",
        choices=PARTITIONERS,
    )
    delete_path: str = flag("", "delta only: keys to delete (see above)", metavar="PATH")
    allow_empty: bool = flag(
        False,
        "build a version with no record and no deletion (an empty input is refused otherwise)",
    )
    variable_width: bool = flag(
        False,
        "the dictionary's values may vary in width: a delta may have values of another "
        "width than its base's (refused otherwise)",
    )
    fetch_timeout: float = flag(
        3600.0, "seconds to list and fetch a remote input (all its files) and delete list"
    )
    hadoop_home: str = hadoop.home_flag()
    hadoop_configs: str = hadoop.configs_flag()
    quiet: bool = flag(False, "no progress bar and no summary line")
    tmp_dir: str = flag("", "where to spill records (default: inside -output_path)", metavar="DIR")
    memory_mb: int = flag(1024, "read and spill buffer budget in MiB")
    engine: str = flag(
        "local",
        "local: processes on this machine; spark: a Spark cluster (see above)",
        choices=("local", "spark"),
    )
    spark_master: str = flag(
        "", "-engine spark: the master URL (e.g. local[2], yarn)", metavar="URL"
    )
    spark_conf: str = flag(
        "",
        "-engine spark: extra settings, comma-separated key=value (e.g. spark.executor.memory=12g)",
        metavar="KEY=VALUE,...",
    )
    spark_shard_mb: int = flag(
        DEFAULT_SHARD_MB,
        "-engine spark: the most records (keys + values) one shard task may hold, in MiB",
    )
    input_format: str = flag(
        "seqfile",
        "seqfile: SequenceFiles; paddle_ps: a PaddlePaddle parameter-server save (see above)",
        choices=INPUT_FORMATS,
    )
    paddle_accessor: str = flag(
        "",
        "paddle_ps: the table's accessor: "
        + ", ".join(f"{a.name} ({a.paddle_class})" for a in ACCESSORS.values())
        + " (default: -paddle_config's); per table: TABLE:ACCESSOR,...",
    )
    paddle_dim: str = flag(
        "",
        "paddle_ps: the model's embedding size D (sparse_embedding size=[_, D]; embedx_dim "
        "is D-3 for ctr_common, D-1 for sparse) (default: -paddle_config's); per table: "
        "TABLE:D,... (e.g. 000:1,001:9)",
        metavar="D",
    )
    paddle_optimizer: str = flag(
        "",
        "paddle_ps: the table's optimizer rule, "
        + "|".join(SGD_RULES)
        + ", or embed_rule,embedx_rule (default: -paddle_config's); per table: "
        "TABLE:RULE[,EMBEDX_RULE],...",
    )
    paddle_config: str = flag(
        "",
        "paddle_ps: the trainer's PSParameter in protobuf text (fleet_desc.prototxt): "
        "tables, accessors, dims and rules (local or remote: see above)",
        metavar="PATH",
    )
    paddle_table: str = flag(
        "",
        "paddle_ps: the sparse table to read when the save has several: its folder (000), "
        "table id, or table name (with -paddle_config); several, into one version of named "
        "tables: a comma list (000,001) or all (what a -paddle_config of several builds when "
        "this flag is not given)",
    )
    paddle_value: str = flag(
        "",
        "paddle_ps: the columns of a served value, in order, from "
        + ", ".join(VALUE_FIELDS)
        + " (show,click,embed_w,embedx_w: what a model with a cvm op looks up); none given: "
        + ",".join(DEFAULT_VALUE)
        + ", embed_w alone for a table without embedx_w (embedx_dim 0), which refuses a "
        "-paddle_value naming embedx_w",
    )
    paddle_dtype: str = flag(
        "float32", "paddle_ps: the served numbers' type (little-endian)", choices=DTYPES
    )
    workers: int = flag(
        min(2, os.cpu_count() or 1),
        "processes for reading and finishing "
        "shards (each finishing one shard holds its keys and table in memory)",
    )


def flag_set() -> FlagSet[BuilderFlags]:
    return FlagSet("cube-builder", DESCRIPTION, spec=BuilderFlags)


PADDLE_FLAGS = (
    "paddle_accessor",
    "paddle_dim",
    "paddle_optimizer",
    "paddle_config",
    "paddle_table",
    "paddle_value",
    "paddle_dtype",
)


def paddle_source(flags: BuilderFlags, read_config: bool = True) -> PaddleSource | None:
    """The -paddle_* flags (-paddle_config read: BuildError if it cannot be); FlagError when
    they do not go together, or are given without -input_format paddle_ps. Without
    `read_config`, a -paddle_config is not read (its file may say the layout the flags leave
    out): the flags given are checked, and None is returned."""
    defaults = BuilderFlags()
    if flags.input_format != "paddle_ps":
        given = [f"-{n}" for n in PADDLE_FLAGS if getattr(flags, n) != getattr(defaults, n)]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise FlagError(f"{', '.join(given)} {verb} -input_format paddle_ps")
        return None
    if flags.key_format != "auto":
        raise FlagError("-key_format is for SequenceFiles (a save's keys are decimal text)")
    try:
        value = ValueSpec(parse_value_fields(flags.paddle_value), flags.paddle_dtype)
        accessor, dim, optimizer, per_table = layout_flags(
            flags.paddle_accessor, flags.paddle_dim, flags.paddle_optimizer
        )
        if flags.paddle_config and not read_config:  # the flags given, as PaddleSource would
            check_layout_flags(accessor, optimizer, dim)
            return None
        config = (
            load_config(flags.paddle_config, flags.fetch_timeout) if flags.paddle_config else ()
        )
        return TablesSource(
            accessor=accessor,
            dim=dim,
            optimizer=optimizer,
            table=flags.paddle_table,
            value=value,
            config=config,
            config_name=flags.paddle_config,
            per_table=per_table,
        )
    except ValueError as exc:
        raise FlagError(str(exc)) from None


def config_from_flags(flags: BuilderFlags, now: int, read_config: bool = True) -> BuildConfig:
    """Check the flags and settle the versions; FlagError on anything wrong (BuildError when
    -paddle_config cannot be read). Without `read_config`, -paddle_config is not read
    (`paddle_source`) and the config is only for checking: its `paddle` is a stand-in."""
    for name, given in (
        ("dict_name", flags.dict_name),
        ("input_path", flags.input_path),
        ("output_path", flags.output_path),
    ):
        if not given:
            raise FlagError(f"--{name} is required")
    if flags.shard_num < 1:
        raise FlagError(f"--shard_num must be >= 1, got {flags.shard_num}")
    try:
        hadoop.configure(flags.hadoop_home, flags.hadoop_configs)
    except ValueError as exc:
        raise FlagError(f"--hadoop_configs: {exc}") from None
    mode = flags.job_mode
    if flags.delete_path and mode != "delta":
        raise FlagError("--delete_path needs --job_mode delta")
    depend = flags.depend_version
    if flags.only_build:
        _refuse_versions_with_only_build(flags)
        cur = now
        if mode == "base":
            depend = now
    else:
        cur = flags.cur_version
        if cur < 0:
            raise FlagError("--cur_version is required with --only_build=false")
        if mode == "base" and depend < 0:
            depend = cur
    if mode == "delta" and depend < 0:
        raise FlagError("--depend_version (the base version) is required for a delta")
    try:
        return BuildConfig(
            dict_name=flags.dict_name,
            output_path=Path(flags.output_path),
            shard_num=flags.shard_num,
            mode=mode,
            cur_version=cur,
            depend_version=depend,
            partitioner=flags.partitioner,
            key_format=flags.key_format,
            tmp_dir=Path(flags.tmp_dir) if flags.tmp_dir else None,
            memory_mb=flags.memory_mb,
            workers=flags.workers,
            allow_empty=flags.allow_empty,
            variable_width=flags.variable_width,
            input_format=flags.input_format,
            paddle=_checked_paddle(flags, read_config),
        )
    except ValueError as exc:
        raise FlagError(str(exc)) from None


def _checked_paddle(flags: BuilderFlags, read_config: bool) -> PaddleSource | None:
    source = paddle_source(flags, read_config)
    if source is None and flags.input_format == "paddle_ps":  # -paddle_config not read
        return PaddleSource(accessor="ctr_common", dim=8, optimizer="adagrad")
    return source


def check_flags(argv: Sequence[str], read_config: bool = False) -> BuilderFlags:
    """What cube-builder would refuse in `argv` before reading any input, as a FlagError
    (cube-transfer checks its builder settings at start with this): unknown flags, bad
    values, flags that do not go together, -engine spark's settings; -paddle_config is read
    only with `read_config` (BuildError when it cannot be). Help and version flags, which
    would print and exit without building, are refused too."""
    for arg in argv:
        if arg in ("-h", "-help", "--help", "-version", "--version"):
            raise FlagError(f"{arg} prints and exits; it builds nothing")
    flags = flag_set().parse(argv)
    config_from_flags(flags, int(time.time()), read_config)
    spark_settings(flags)
    return flags


def _refuse_versions_with_only_build(flags: BuilderFlags) -> None:
    """FlagError for versions -only_build=true would ignore (the original ignores them
    silently: a build named by the clock where the user asked for a version)."""
    given = [
        f"-{name} {value}"
        for name, value in (
            ("cur_version", flags.cur_version),
            ("depend_version", flags.depend_version if flags.job_mode == "base" else -1),
        )
        if value != -1
    ]
    if given:
        raise FlagError(
            f"{' and '.join(given)} would be ignored: with -only_build=true (the default) the "
            "build's version is the current time; add -only_build=false to build that "
            "version, or leave the version flags out"
        )


def tqdm_progress() -> Progress:
    """Progress bars on stderr: input bytes read, then shards finished."""
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: worker processes are forked
    bars: list[Any] = []

    def start_reading(total: int) -> None:
        bars.append(tqdm(total=total, unit="B", unit_scale=True, desc="read", leave=False))

    def start_finishing(shards: int) -> None:
        close()
        bars.append(tqdm(total=shards, unit="shard", desc="finish", leave=False))

    def close() -> None:
        while bars:
            bars.pop().close()

    def read_bytes(count: int) -> None:
        if bars:
            bars[-1].update(count)

    def shard_done(_output: ShardOutput) -> None:
        if bars:
            bars[-1].update(1)

    return Progress(
        start_reading=start_reading,
        read_bytes=read_bytes,
        start_finishing=start_finishing,
        shard_done=shard_done,
        close=close,
    )


def spark_settings(flags: BuilderFlags) -> SparkSettings:
    """-spark_master, -spark_conf (key=value,...) and -spark_shard_mb; FlagError if malformed."""
    pairs = []
    for item in filter(None, (part.strip() for part in flags.spark_conf.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FlagError(f"--spark_conf: {item!r} is not key=value")
        pairs.append((key.strip(), value.strip()))
    try:
        return SparkSettings(flags.spark_master, tuple(pairs), flags.spark_shard_mb)
    except ValueError as exc:
        raise FlagError(f"--{exc}") from None


def register_all(master: str, config: BuildConfig, result: BuildResult) -> None:
    for output, meta in zip(result.shards, result.metas, strict=True):
        register_meta(master, register_fields(config, output, meta))


def register_fields(
    config: BuildConfig, output: ShardOutput, meta: dict[str, Any]
) -> dict[str, str]:
    """The original's form fields: name, shard, split, version (= cur), depend, meta."""
    return {
        "name": config.dict_name,
        "shard": str(output.shard),
        "split": "0",
        "version": str(config.cur_version),
        "depend": str(config.depend_version),
        "meta": json.dumps(meta, sort_keys=True),
    }


_fetch_dirs: list[Path] = []  # remote inputs fetched for the build in progress


def fetch_remote(flags: BuilderFlags, config: BuildConfig) -> tuple[str, str | None]:
    """The local input and delete paths to build from: remote ones (s3://, webhdfs://)
    fetched into a new directory under -tmp_dir (default: -output_path), which `cleanup`
    removes. BuildError when a fetch fails."""
    input_path, delete_path = flags.input_path, flags.delete_path or None
    if not remote.is_remote(input_path) and not (delete_path and remote.is_remote(delete_path)):
        return input_path, delete_path
    parent = config.tmp_dir or config.output_path
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fetched = Path(tempfile.mkdtemp(prefix=f".fetch-{os.getpid()}-", dir=parent))
    except OSError as exc:
        raise BuildError(f"cannot create a directory for the fetched input in {parent}: "
                         f"{exc.strerror}") from None  # fmt: skip
    _fetch_dirs.append(fetched)
    started = time.monotonic()
    deadline = started + flags.fetch_timeout
    paths: list[str | None] = []
    for name, path in (("input", input_path), ("delete", delete_path)):
        if path and remote.is_remote(path):
            left = max(deadline - time.monotonic(), 0.001)
            whole_save = name == "input" and config.input_format == "paddle_ps"
            files = fetch_inputs(path, fetched / name, left, config.allow_empty, whole_save)
            if not flags.quiet:
                size = sum(f.stat().st_size for f in files)
                print(f"fetched {len(files)} files ({size} bytes) of {path} in "
                      f"{time.monotonic() - started:.2f} s")  # fmt: skip
            path = str(fetched / name)
        paths.append(path)
    return input_path if paths[0] is None else paths[0], paths[1]


def cleanup() -> None:
    """Remove what fetch_remote fetched."""
    while _fetch_dirs:
        shutil.rmtree(_fetch_dirs.pop(), ignore_errors=True)


def _terminate(signum: int, _frame: Any) -> None:
    """SIGTERM/SIGINT: stop the workers, remove the unfinished build, exit 128 + signum."""
    abort_active_builds()
    cleanup()
    os.write(2, f"error: stopped by signal {signum}; the unfinished build was removed\n".encode())
    os._exit(128 + signum)


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    try:
        config = config_from_flags(flags, int(time.time()))
    except BuildError as exc:  # -paddle_config unreadable
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    settings = spark_settings(flags)
    quiet = flags.quiet
    progress = tqdm_progress() if not quiet and sys.stderr.isatty() else None
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    # A build makes few reference cycles but many objects (numba's import alone triggers
    # hundreds of collections): no cyclic GC in this short-lived process and its workers.
    collecting = gc.isenabled()
    gc.disable()
    stats: SparkStats | None = None
    try:
        if flags.engine == "spark":
            result, stats = build_on_spark(
                config,
                flags.input_path,
                flags.delete_path or None,
                settings,
                flags.fetch_timeout,
            )
        else:
            input_path, delete_path = fetch_remote(flags, config)
            result = build(
                config, input_path, delete_path, progress, remote.redact(flags.input_path)
            )
    except (BuildError, DeleteListError, ValueError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a bug: still one line, and still nothing published
        print(f"error: internal error {type(exc).__name__}: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        cleanup()
        # what the build loaded (numpy, numba) stays to the end: freezing it spares the exit's
        # collections a walk over it (~0.3 s once numba is loaded)
        gc.freeze()
        if collecting:
            gc.enable()
    for warning in result.warnings:
        print(warning, file=sys.stderr)
    if not quiet:
        rate = result.records_read / max(result.seconds, 1e-9)
        print(
            f"built {result.version_dir}: {result.records_read} records from "
            f"{result.input_files} files"
            + (f" ({result.input_note})" if result.input_note else "")
            + f", {result.distinct_keys} distinct keys, into {config.shard_num} shards in "
            f"{result.seconds:.2f} s ({rate:,.0f} records/s; "
            + ", ".join(f"{k} {v:.2f} s" for k, v in result.phase_seconds.items())
            + ")"
            + (
                f"; spark: {stats.map_tasks} map tasks, {stats.shard_tasks} shard tasks, "
                f"{stats.shuffled_bytes / max(result.records_read, 1):.1f} shuffled bytes/record"
                if stats
                else ""
            )
        )
    if flags.master_address:
        try:
            register_all(flags.master_address, config, result)
        except RegisterError as exc:
            print(
                f"error: built {result.version_dir}, but registering its meta failed: "
                f"{one_line(exc)}",
                file=sys.stderr,
            )
            return EXIT_NOT_REGISTERED
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
