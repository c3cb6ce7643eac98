"""Running cube-builder for one version and checking what it produced.

The builder is a subprocess started from an argv list (never a shell) with a timeout; its exit
code is checked and the tail of its stderr becomes the version's failure reason. Before anything
is deployed every shard's tar must exist, match its `.md5`, and list only plain files and
directories with safe relative names (the agent checks again; a bad build should not even
reach it), and its `index.cube` header must be readable: it gives the shard's record and
deleted-key counts and value width, which the transfer compares with the live version before
deploying (a base that empties or shrinks the table, a delta of another value width). A tar of
a version of several tables (cube.layout's TABLES) has one `<table>/index.cube` per table: each
is read (`read_table_counts`), and the shard's counts are their sums, its width the one they
share (0, values of varying width, when they differ: the builder checks each table's width
against its base's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cube import format as fmt
from cube import remote
from cube.fsutil import Md5Error, check_md5_file
from cube.layout import TABLES_FILE, LayoutError, member_problem, parse_tables, tar_name
from cube.shard import INDEX_FILE

log = logging.getLogger("cube.transfer.build")
_STDERR_TAIL = 2000


class BuildError(Exception):
    """A build that cannot be deployed; the message is the version's failure reason.
    `permanent`: the builder ran and refused the input (bad records, an empty input, a
    delta of another value width): building the same line again would fail again."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def resolve_command(name: str) -> str:
    """An executable for `name`: a path as given, else on PATH, else next to this Python (the
    venv's console scripts)."""
    if os.sep in name:
        path = Path(name).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
        raise BuildError(f"buildtool_local {name!r} is not an executable file")
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise BuildError(f"buildtool_local {name!r} was not found on PATH nor in {beside.parent}")


# The builder's flags the transfer sets itself (builder_argv; last_version and master_address
# as the original's transfer set them): transfer.conf's builder_flags may not repeat them.
TRANSFER_SET_FLAGS = frozenset({
    "dict_name", "input_path", "output_path", "shard_num", "job_mode", "cur_version",
    "depend_version", "last_version", "only_build", "partitioner", "delete_path", "quiet",
    "master_address", "fetch_timeout", "allow_empty", "variable_width",
})  # fmt: skip


def builder_argv(
    tool: str,
    *,
    dict_name: str,
    input_path: str,
    output_path: str,
    shard_num: int,
    mode: str,
    cur_version: str,
    depend_version: str,
    partitioner: str,
    delete_path: str = "",
    fetch_timeout: float | None = None,
    variable_width: bool = False,
    extra_flags: tuple[str, ...] = (),
) -> list[str]:
    """The builder's command line; `fetch_timeout` for an input it fetches itself (a remote
    one, not mirrored). Always `-allow_empty`: the transfer decides about empty versions
    itself (a patch may be empty; an empty base is refused unless allow_empty_base)."""
    argv = [
        tool,
        "-dict_name", dict_name,
        "-input_path", input_path,
        "-output_path", output_path,
        "-shard_num", str(shard_num),
        "-job_mode", mode,
        "-cur_version", cur_version,
        "-depend_version", depend_version,
        "-only_build", "false",
        "-partitioner", partitioner,
        "-quiet",
        "-allow_empty",
    ]  # fmt: skip
    if variable_width:
        argv.append("-variable_width")
    if delete_path:
        argv += ["-delete_path", delete_path]
    if fetch_timeout is not None:
        argv += ["-fetch_timeout", f"{fetch_timeout:g}"]
    return argv + list(extra_flags)


SMALL_INPUT_BYTES = 256 << 20  # built in the builder's own process (see small_input)


def small_input(input_path: str) -> bool:
    """Whether a local input is small enough to build in one process (`-workers 1`): forking
    the reading and finishing processes costs ~0.5 s, more than they save below ~3M records,
    and a patch's freshness is counted in seconds (issue 37). Remote or unreadable inputs are
    not small (the builder's default holds)."""
    if "://" in input_path:
        return False
    total = 0
    try:
        paths = [Path(input_path)] if Path(input_path).is_file() else Path(input_path).rglob("*")
        for number, path in enumerate(paths):
            if number > 10_000:  # (bounded: a folder of many files is not small)
                return False
            if path.is_file():
                total += path.stat().st_size
                if total > SMALL_INPUT_BYTES:
                    return False
    except OSError:
        return False
    return True


def builder_settings_problem(
    tool: str, flags: tuple[str, ...], paddle_saves: bool, read_config: bool = False
) -> str:
    """What cube-builder would refuse in the flags a build gets from transfer.conf
    (`builder_flags`, after `-input_format paddle_ps` when `paddle_saves`), parsed by the
    builder's own flag parser with the flags the transfer sets around them (`builder_argv`):
    unknown flags, bad values, flags that do not go together; with `read_config`, a local
    -paddle_config that exists is read too. "" when nothing, or when `tool` (buildtool_local) is not
    cube-builder: another tool's flags are its own."""
    if PurePosixPath(tool).name != "cube-builder":
        return ""
    from cube.builder.build import BuildError as BuilderError
    from cube.builder.cli import check_flags
    from cube.flags import FlagError

    paddle = ("-input_format", "paddle_ps") if paddle_saves else ()
    argv = builder_argv(
        tool,
        dict_name="check",
        input_path="/input",
        output_path="/output",
        shard_num=1,
        mode="base",
        cur_version="1",
        depend_version="1",
        partitioner="mod",
        extra_flags=(*paddle, *flags),
    )[1:]
    try:
        parsed = check_flags(argv)
        config = parsed.paddle_config
        # a local file that is there is read now; one that is not there yet is read by each
        # build (a Fleet trainer writes its fleet_desc.prototxt with its first save)
        if read_config and config and not remote.is_remote(config) and Path(config).exists():
            check_flags(argv, read_config=True)
    except (FlagError, BuilderError) as exc:
        return f"cube-builder would refuse them: {' '.join(str(exc).split())}"
    return ""


async def run_builder(
    argv: list[str], timeout: float, on_start: Callable[[int], None] | None = None
) -> str:
    """Run the builder; return its stderr. BuildError on timeout or a non-zero exit."""
    log.info("running %s", " ".join(argv))
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise BuildError(f"cannot start builder {argv[0]}: {exc.strerror}") from exc
    if on_start:
        on_start(proc.pid)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        raise BuildError(f"builder timed out after {timeout:g}s") from None
    except asyncio.CancelledError:
        _kill_group(proc.pid)
        await proc.wait()
        raise
    text = stderr.decode("utf-8", errors="replace")
    for line in stdout.decode("utf-8", errors="replace").splitlines()[-20:]:
        log.debug("builder: %s", line)
    for line in text.splitlines()[-50:]:
        log.info("builder stderr: %s", line)
    status = await proc.wait()  # communicate() waited for the exit: this reads its status
    if status != 0:
        tail = text.strip()[-_STDERR_TAIL:] or "(no stderr)"
        # an exit status is the builder's verdict on the input; a signal (< 0) is not
        raise BuildError(f"builder exited with status {status}: {tail}", status > 0)
    return text


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@dataclass(frozen=True)
class ShardOutput:
    shard: int
    tar: Path
    md5: str
    size: int
    records: int  # live records in the shard (its index header's record_count)
    deleted: int  # keys a delta deletes (tombstone_count); 0 for a base
    value_width: int | None = None  # its header's value_width (0: varying); None: not said
    # a version of several tables: (table, records, deleted, value width) of each, in TABLES
    # order (the fields above are their sums and shared width, `read_counts`)
    tables: tuple[tuple[str, int, int, int | None], ...] = ()


def check_tar(path: Path) -> None:
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                problem = member_problem(member)
                if problem:
                    raise BuildError(f"{path}: member {member.name!r}: {problem}")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BuildError(f"{path}: not a readable tar ({exc})") from exc


Counts = tuple[int, int, int | None]  # records, deleted keys, value width (None: not said)
MAX_TABLES_BYTES = 64 << 10  # a TABLES member: at most MAX_TABLES names of 128 characters


def read_counts(path: Path) -> Counts:
    """(records, deleted keys, value width) from the header of the tar's top-level
    index.cube: one member header and 4 KiB read, whatever the tar's size. The width is None
    when the header has none. A tar of several tables (`read_table_counts`): its tables'
    sums, and the width they share (0 when they differ: values of varying width; None when
    one is not said)."""
    return counts_of(read_table_counts(path))


def counts_of(tables: dict[str, Counts]) -> Counts:
    """A shard's counts from its tables' (`read_table_counts`): sums, and the shared width."""
    if "" in tables:
        return tables[""]
    counts = list(tables.values())
    widths = {width for _, _, width in counts}
    width = None if None in widths else (widths.pop() if len(widths) == 1 else 0)
    return sum(c[0] for c in counts), sum(c[1] for c in counts), width


def read_table_counts(path: Path) -> dict[str, Counts]:
    """The counts (`read_counts`) of each table of a shard tar, from its index headers:
    {"": counts} for a tar of one unnamed table (its top-level index.cube); for a tar of
    several tables (a TABLES member, cube.layout's contract), each table's
    `<table>/index.cube`, in TABLES order. BuildError when a header or a table listed is
    missing or unreadable, or TABLES is malformed or beside a top-level index.cube."""
    headers: dict[tuple[str, ...], Counts] = {}
    listed: list[str] | None = None
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                parts = tuple(p for p in PurePosixPath(member.name).parts if p != ".")
                if not member.isfile():
                    continue
                if parts == (TABLES_FILE,):
                    listed = _tables_member(tar, member, path)
                elif parts[-1:] == (INDEX_FILE,) and len(parts) <= 2:
                    headers[parts] = _header_counts(tar, member, f"{path}: {'/'.join(parts)}")
    except fmt.ShardFormatError as exc:
        raise BuildError(str(exc)) from exc
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BuildError(f"{path}: not a readable tar ({exc})") from exc
    if listed is None:
        if (INDEX_FILE,) not in headers:
            raise BuildError(f"{path}: no top-level {INDEX_FILE}")
        return {"": headers[(INDEX_FILE,)]}
    if (INDEX_FILE,) in headers:
        raise BuildError(f"{path}: both {TABLES_FILE} and a top-level {INDEX_FILE}")
    missing = [name for name in listed if (name, INDEX_FILE) not in headers]
    if missing:
        raise BuildError(f"{path}: no {missing[0]}/{INDEX_FILE} ({TABLES_FILE} lists it)")
    return {name: headers[(name, INDEX_FILE)] for name in listed}


def _tables_member(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> list[str]:
    if member.size > MAX_TABLES_BYTES:
        raise BuildError(f"{path}: {TABLES_FILE} of {member.size} bytes (a list of names?)")
    handle = tar.extractfile(member)
    assert handle is not None  # a regular file
    try:
        return parse_tables(handle.read().decode("utf-8"))
    except (LayoutError, UnicodeDecodeError) as exc:
        raise BuildError(f"{path}: {TABLES_FILE}: {exc}") from None


def _header_counts(tar: tarfile.TarFile, member: tarfile.TarInfo, where: str) -> Counts:
    """(records, deleted keys, width) from an index.cube member's header (4 KiB read)."""
    handle = tar.extractfile(member)
    assert handle is not None  # a regular file
    fields = fmt.decode_header("index", handle.read(fmt.HEADER_SIZE), where, member.size)
    records, deleted = fields.get("record_count"), fields.get("tombstone_count", 0)
    if not isinstance(records, int) or not isinstance(deleted, int) or records < 0:
        raise BuildError(f"{where}: header without a record count")
    width = fields.get("value_width")
    valid = isinstance(width, int) and not isinstance(width, bool) and width >= 0
    return records, max(deleted, 0), width if valid else None


def check_outputs(
    out_dir: Path, dict_name: str, shard_num: int, verify: bool = True
) -> list[ShardOutput]:
    """Every shard's tar and md5 (verified against the tar's bytes and listed when `verify`).
    Blocking: run in a thread."""
    shards = []
    for shard in range(shard_num):
        tar = out_dir / tar_name(dict_name, shard)
        if not tar.is_file():
            raise BuildError(f"{tar}: missing (the builder wrote no tar for shard {shard})")
        try:
            expected = check_md5_file(tar, verify=verify)
        except Md5Error as exc:
            raise BuildError(str(exc)) from None
        if expected is None:
            raise BuildError(f"{tar}.md5: missing (the builder wrote no md5)")
        if verify:
            check_tar(tar)
        tables = read_table_counts(tar)
        records, deleted, width = counts_of(tables)
        size = tar.stat().st_size
        named = tuple((name, *counts) for name, counts in tables.items() if name)
        shards.append(ShardOutput(shard, tar, expected, size, records, deleted, width, named))
    return shards


def read_meta_infos(
    output_root: Path, cur: str, depend: str, shards: Iterable[int]
) -> dict[str, str]:
    """The builder's `meta_info/<cur>_<depend>_<shard>_0.json` of `shards`, shard -> JSON
    text (missing or unreadable ones left out). Blocking: run in a thread."""
    metas = {}
    for shard in shards:
        path = output_root / "meta_info" / f"{cur}_{depend}_{shard}_0.json"
        try:
            text = path.read_text(encoding="utf-8")
            json.loads(text)
        except (OSError, ValueError):
            continue
        metas[str(shard)] = text.strip()
    return metas
