"""cube-builder -input_format paddle_ps: read a PaddlePaddle parameter-server save directly.

The shell around the pure `cube.paddle_ps`: which folder of a save holds the sparse table
(`find_table`), the trainer's PSParameter text (`load_config`), and each part file read in
batches of whole lines, plain or gzip (`table_batches`), for the local build's readers and the
Spark build's map tasks alike; `iter_table` / `read_table` give a save's served values as
arrays to other tools. docs/INPUT_FORMATS.md is the user's page.

A save (`fleet.save_persistables(exe, dir, mode)`) is one folder per table, named by table id
(`000`, `001`, ...): a sparse table writes `part-<server>-<shard>` per table shard (gzip with a
`.gz` name in modes 0 and 3; empty ones included), a dense table `part-<server>[.gz]` of 1-3
numbers a line. The sparse table is told by those names and its first row (a key and 6 or more
numbers), or by the configuration, or named with -paddle_table; never by its number (the
dense part is 001 in one job and 000 in another).
"""

from __future__ import annotations

import os
import stat
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from cube import remote
from cube.builder.build import BuildError
from cube.builder.sources import FETCH_TIMEOUT, InputFile, list_inputs, read_bytes
from cube.kernel import COMPILED
from cube.paddle_ps import (
    SPARSE_PART,
    PaddleRowError,
    PaddleSource,
    TableConfig,
    TableLayout,
    ValueSpec,
    fitting_layouts,
    parse_fleet_desc,
    parse_rows,
    sparse_folder_problem,
)
from cube.values import ValueColumn

MAX_LINE = 1 << 20  # a row is hundreds of bytes; a longer "line" is not a text table
MAX_CONFIG_BYTES = 16 << 20
SNIFF_BYTES = 64 << 10
# From this much input a reader loads the compiled parser (~0.3-0.7 s) instead of numpy's.
COMPILED_FROM_BYTES = 1 << 20


@dataclass(frozen=True)
class PaddleTable:
    """The table a build reads: its folder (for messages), its part files in reading order
    (empty ones left out) and its layout."""

    folder: str
    files: list[InputFile]
    layout: TableLayout
    config: TableConfig | None = None


def load_config(path: str, timeout: float = FETCH_TIMEOUT) -> tuple[TableConfig, ...]:
    """-paddle_config: the tables of a PSParameter text file (local, s3:// or webhdfs://)."""
    try:
        if remote.is_remote(path):
            text = read_bytes(path, MAX_CONFIG_BYTES, timeout)
        else:
            with open(path, "rb") as file:
                text = file.read(MAX_CONFIG_BYTES + 1)
            if len(text) > MAX_CONFIG_BYTES:
                raise BuildError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
        return tuple(parse_fleet_desc(text, remote.redact(path)))
    except OSError as exc:
        raise BuildError(f"-paddle_config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise BuildError(f"-paddle_config {exc}") from None


# ---------------------------------------------------------------------------------------------
# Which table


def find_table(
    input_path: str, source: PaddleSource, timeout: float = FETCH_TIMEOUT
) -> PaddleTable:
    """The sparse table to build from `input_path`: a save directory (its numbered folders),
    one table's folder, or one part file. BuildError saying why when there is none, or more
    than one and the flags do not say which."""
    deadline = time.monotonic() + timeout
    shown = remote.redact(input_path)
    listing = list_inputs(input_path, timeout, include_empty=True)
    base = input_path.rstrip("/")
    if len(listing) == 1 and listing[0].url == base:  # one file
        return _table(shown, listing, source, None)
    folders: dict[str, list[InputFile]] = {}
    direct: list[InputFile] = []
    for file in listing:
        relative = file.url[len(base) + 1 :]
        parts = relative.split("/")
        if len(parts) == 1:
            direct.append(file)
        elif len(parts) == 2 and parts[0].isdigit():
            folders.setdefault(parts[0], []).append(file)
    if direct and all(SPARSE_PART.fullmatch(_name(f)) for f in direct):
        return _table(shown, direct, source, None)  # the input is a table's folder
    if not folders:
        raise BuildError(
            f"{shown}: not a parameter-server save: no numbered table folders (000, 001, ...) "
            "and no part-<server>-<shard> files"
        )

    def problem(folder: str) -> str:
        files = folders[folder]
        first = next((f for f in files if f.size), None)
        row = None if first is None else first_row(first.url, _left(deadline, shown, timeout))
        return sparse_folder_problem([_name(f) for f in files], row)

    if source.table:
        named = [folder for folder in sorted(folders) if source.names(folder)]
        if not named:
            raise BuildError(
                f"{shown}: no table folder {source.table!r} (-paddle_table); it has "
                f"{', '.join(sorted(folders))}"
            )
        why = problem(named[0])
        if why:
            raise BuildError(f"{shown}/{named[0]} (-paddle_table): not a sparse table: {why}")
        return _table(f"{shown}/{named[0]}", folders[named[0]], source, named[0])
    configured = source.sparse_tables
    if configured:
        if len(configured) > 1:
            listed = ", ".join(f"{t.folder} ({t.table_name})" for t in configured)
            raise BuildError(
                f"{source.config_name} has {len(configured)} sparse tables: {listed}; say "
                "which with -paddle_table"
            )
        folder = configured[0].folder
        if folder not in folders:
            raise BuildError(
                f"{shown}: no folder {folder}, where {source.config_name} puts its sparse "
                f"table {configured[0].table_name}; it has {', '.join(sorted(folders))}"
            )
        why = problem(folder)
        if why:
            raise BuildError(f"{shown}/{folder}: not a sparse table: {why}")
        return _table(f"{shown}/{folder}", folders[folder], source, folder)
    problems = {folder: problem(folder) for folder in sorted(folders)}
    sparse = [folder for folder, why in problems.items() if not why]
    if len(sparse) == 1:
        return _table(f"{shown}/{sparse[0]}", folders[sparse[0]], source, sparse[0])
    if not sparse:
        listed = "; ".join(f"{folder}: {why}" for folder, why in problems.items())
        raise BuildError(f"{shown}: no sparse table ({listed})")
    raise BuildError(
        f"{shown}: {len(sparse)} sparse tables ({', '.join(sparse)}); say which with "
        "-paddle_table (a folder name)"
    )


def _table(
    folder: str, files: list[InputFile], source: PaddleSource, number: str | None
) -> PaddleTable:
    config = source.config_for(number) if number is not None else None
    try:
        layout = source.layout_for(config)
    except ValueError as exc:
        raise BuildError(f"{folder}: {exc}") from None
    return PaddleTable(folder, [f for f in files if f.size], layout, config)


def _name(file: InputFile) -> str:
    return file.url.rsplit("/", 1)[-1]


def _left(deadline: float, shown: str, timeout: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise BuildError(f"{shown}: not listed and inspected within {timeout:g} s")
    return left


def first_row(url: str, timeout: float = FETCH_TIMEOUT) -> bytes | None:
    """The first non-blank line of a part file (plain or gzip; local or remote), from its
    first bytes; None when they hold none (blank lines, or not readable as gzip: the folder is
    then judged by its file names, and the build's reading says what is wrong)."""
    rows = head_rows(url, timeout, 1)
    return rows[0] if rows else None


def head_rows(url: str, timeout: float = FETCH_TIMEOUT, count: int = 1) -> list[bytes]:
    """Up to `count` non-blank whole lines from the first bytes of a part file (`first_row`'s
    rules: [] when they hold none)."""
    try:
        if remote.is_remote(url):
            with remote.Reader(url, min(60.0, timeout), block=SNIFF_BYTES) as reader:
                head = next(reader.blocks(0), b"")
        else:
            with open_regular(url) as file:
                head = file.read(SNIFF_BYTES)
    except remote.RemoteError as exc:
        raise BuildError(f"{remote.redact(url)}: {exc}") from None
    except OSError as exc:
        raise BuildError(f"{url}: {exc.strerror}") from None
    if head[:2] == b"\x1f\x8b":
        try:
            head = zlib.decompressobj(31).decompress(head, SNIFF_BYTES)
        except zlib.error:
            return []  # not readable as gzip: the build says so, with the line
    lines = bytes(head).split(b"\n")
    if count > 1 and len(lines) > 1 and len(head) >= SNIFF_BYTES:
        lines.pop()  # cut by the sniff: not a whole line
    return [line for line in lines if line.strip(b" \t\r")][:count]


HINT_ROWS = 64  # rows sampled for `save_hint`


def save_hint(input_path: str, timeout: float = 60.0) -> str:
    """For a SequenceFile build of `input_path` whose files are not SequenceFiles: when it is
    a parameter-server save (`find_table` finds its sparse table by its files and first
    rows), the flags to build it with: -input_format paddle_ps and the layout flags its
    first rows fit (`fitting_layouts`); "" when it is not one. It names layouts and counts,
    never what the files hold."""
    locate = PaddleSource(accessor="ctr_common", dim=8, optimizer="adagrad")  # finds, no more
    try:
        table = find_table(input_path, locate, timeout)
        rows = head_rows(table.files[0].url, timeout, HINT_ROWS) if table.files else []
    except BuildError:
        return ""
    single = not remote.is_remote(input_path) and Path(input_path).is_file()
    fits = fitting_layouts(rows)
    if not fits and single:
        return ""  # a lone file of rows this reader does not know: no sign of a save
    advice = "-input_format paddle_ps"
    sample = f"its first {len(rows)} rows" if len(rows) != 1 else "its first row"
    if len(fits) == 1:
        layout, short = fits[0]
        dim = "D (its rows are saved without their embedx part: D is the model's embedding size)"
        flags = (
            f"{advice} -paddle_accessor {layout.accessor.name} -paddle_dim "
            f"{dim if short else layout.dim} -paddle_optimizer {layout.embed_rule.name}"
        )
        return (
            f"it looks like a PaddlePaddle parameter-server save ({table.folder}, a sparse "
            f"table): build it with {flags}, the one layout {sample} fit (-paddle_config "
            "FILE, the trainer's fleet_desc.prototxt, says so for sure)"
        )
    if fits:
        names = [
            f"{c.accessor.name} (dim {'any' if short else c.dim}, optimizer {c.embed_rule.name})"
            for c, short in fits[:6]
        ]
        more = f" and {len(fits) - 6} more" if len(fits) > 6 else ""
        layouts = f"{sample} fit {', '.join(names)}{more}"
    elif rows:
        layouts = f"{sample} fit no layout this reader knows"
    else:
        layouts = "its first part file holds no row to tell the layout by"
    return (
        f"it looks like a PaddlePaddle parameter-server save ({table.folder}, a sparse table): "
        f"build it with {advice} and its layout: -paddle_config FILE (the trainer's "
        f"fleet_desc.prototxt), or -paddle_accessor, -paddle_dim, -paddle_optimizer; {layouts}"
    )


# ---------------------------------------------------------------------------------------------
# Reading a part file


def open_regular(path: str) -> BinaryIO:
    """`path` opened for reading when it is a regular file; BuildError otherwise. Opened
    without blocking first: a FIFO put in a part's place after the listing would block a
    plain open() until some writer came, i.e. forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BuildError(f"{path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise BuildError(
                f"{path}: {kind} (a part file must be a regular file; was it replaced "
                "during the build?)"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def table_batches(
    path: str, layout: TableLayout, value: ValueSpec, batch_bytes: int
) -> Iterator[tuple[np.ndarray, ValueColumn, int]]:
    """(keys, values, bytes of the file read so far) for about `batch_bytes` of text at a
    time, cut at line ends. BuildError naming the file and line for a row that does not fit
    the layout, a line too long to be a row, a gzip file that is cut short or corrupt, a file
    whose last row has no newline (Paddle ends every row with one: a copy cut short inside a
    row would otherwise serve the row's missing numbers as zeros), or a part that is not a
    regular file (a FIFO would block the build)."""
    width = value.width(layout)
    with open_regular(path) as raw:
        size = raw.seek(0, 2)
        raw.seek(0)
        gzipped = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        compiled = COMPILED and size >= COMPILED_FROM_BYTES
        carry = b""
        line = 1

        def parsed(data: memoryview | bytes) -> tuple[np.ndarray, ValueColumn, int]:
            nonlocal line
            try:
                rows = parse_rows(data, layout, value, path, line, compiled or None)
            except PaddleRowError as exc:
                raise BuildError(str(exc)) from None
            line += rows.lines
            return rows.keys, ValueColumn.fixed(rows.value_bytes(), width), raw.tell()

        blocks = _gunzip(raw, path, size, batch_bytes) if gzipped else _plain(raw, batch_bytes)
        for block in blocks:
            data = carry + block if carry else block
            cut = data.rfind(b"\n") + 1
            if not cut:
                if len(data) > MAX_LINE:
                    raise BuildError(
                        f"{path} line {line}: longer than {MAX_LINE} bytes (not a "
                        "parameter-server text table)"
                    )
                carry = data
                continue
            carry = data[cut:]
            yield parsed(memoryview(data)[:cut])
        if carry.strip(b" \t\r"):
            raise BuildError(
                f"{path} line {line}: the file ends inside this row (no newline after it; "
                "Paddle ends every row with one: a file cut short?)"
            )
        if carry:  # blanks after the last newline
            yield parsed(carry)


def _plain(raw: BinaryIO, batch_bytes: int) -> Iterator[bytes]:
    while block := raw.read(batch_bytes):
        yield block


def _gunzip(raw: BinaryIO, path: str, size: int, batch_bytes: int) -> Iterator[bytes]:
    """The text of a gzip file (members one after another, each one's CRC and length
    checked by zlib), in blocks of at most `batch_bytes`. zlib's stream rather than
    gzip.GzipFile: a third less CPU per byte here (bench/RESULTS.md). BuildError for a file
    cut short, corrupt, or with something else than a gzip member after one."""

    def broken(why: str) -> BuildError:
        return BuildError(
            f"{path}: not a whole gzip file ({why}, near byte {raw.tell()} of {size})"
        )

    stream = zlib.decompressobj(31)
    pending = b""
    while True:
        if not pending:
            pending = raw.read(1 << 20)
            if not pending:
                if not stream.eof:
                    raise broken("it ends inside a compressed stream")
                return
        try:
            block = stream.decompress(pending, batch_bytes)
        except zlib.error as exc:
            raise broken(" ".join(str(exc).split())) from None
        pending = stream.unconsumed_tail
        if block:
            yield block
        if stream.eof:  # what follows the member is in unused_data (unconsumed_tail too)
            rest = stream.unused_data
            if len(rest) == 1:  # the member ended a byte before a read's end: the next byte
                rest += raw.read(1 << 20)  # tells a member (1f 8b) from anything else
            if rest and rest[:2] != b"\x1f\x8b":
                raise broken("something else than a gzip member follows one")
            stream = zlib.decompressobj(31)
            pending = rest
            if not pending and not (pending := raw.read(1 << 20)):
                return


def iter_table(
    input_path: str, source: PaddleSource, batch_bytes: int = 4 << 20
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The rows of a save's sparse table (`find_table`), part file after part file, as
    (uint64 keys, values: rows x value count of the value dtype): what a build would serve,
    for tools (a trainer's check of what it saved, the transfer's look at a save) that want
    the numbers rather than shards. Local files; BuildError as for a build."""
    table = find_table(input_path, source)
    value = source.value
    dtype = np.dtype(value.dtype).newbyteorder("<")
    for path in local_paths(table):
        for keys, values, _ in table_batches(str(path), table.layout, value, batch_bytes):
            yield keys, values.blob.view(dtype).reshape(len(keys), value.count(table.layout))


def read_table(input_path: str, source: PaddleSource) -> tuple[np.ndarray, np.ndarray]:
    """All of `iter_table` at once (the whole table in memory: for small tables and tests)."""
    parts = list(iter_table(input_path, source))
    if not parts:
        table = find_table(input_path, source)
        dtype = np.dtype(source.value.dtype).newbyteorder("<")
        return np.empty(0, np.uint64), np.empty((0, source.value.count(table.layout)), dtype)
    return np.concatenate([k for k, _ in parts]), np.concatenate([v for _, v in parts])


def describe(table: PaddleTable) -> str:
    """One line for the build's summary."""
    return f"{table.folder}, {table.layout.describe()}"


def local_paths(table: PaddleTable) -> list[Path]:
    return [Path(f.url) for f in table.files]
