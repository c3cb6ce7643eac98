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

Several tables (`find_tables`): `-paddle_table all`, a comma list of tables, or a
-paddle_config listing several sparse tables (without -paddle_table) build every such table into
one version of named tables (cube.layout's TABLES), each with its own layout: the
configuration's entry, or the layout flags for every table, each overridden by the table's own
(`-paddle_dim 000:1,001:9`, `TableFlags`).
"""

from __future__ import annotations

import os
import stat
import time
import zlib
from collections.abc import Callable, Iterator
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
    check_layout_flags,
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


ALL_TABLES = "all"  # -paddle_table all: every sparse table of the save


@dataclass(frozen=True)
class PaddleTable:
    """The table a build reads: its folder (for messages), its part files in reading order
    (empty ones left out) and its layout; `name`: its folder's name in the save (000, 001,
    ...), the table's name in a version of several tables ("" for a table folder or part file
    given as the input)."""

    folder: str
    files: list[InputFile]
    layout: TableLayout
    config: TableConfig | None = None
    name: str = ""


# ---------------------------------------------------------------------------------------------
# Layout flags per table


@dataclass(frozen=True)
class TableFlags:
    """One table's own layout flags: `-paddle_dim 000:1,001:9` is TableFlags("000", dim=1)
    and TableFlags("001", dim=9). `table`: a folder name, table id or (with -paddle_config)
    table name, as -paddle_table names tables. "" and 0: not given (the flag's value for every
    table, or the configuration, says it)."""

    table: str
    accessor: str = ""
    dim: int = 0
    optimizer: str = ""


@dataclass(frozen=True)
class TablesSource(PaddleSource):
    """A PaddleSource whose layout flags may differ per table (`per_table`): the flags'
    values for every table, each overridden by a table's own (`table_source`). Each flag is
    checked on its own here; whether a table's layout is complete, when it is read."""

    per_table: tuple[TableFlags, ...] = ()

    def __post_init__(self) -> None:
        if not self.per_table:
            super().__post_init__()
            return
        check_layout_flags(self.accessor, self.optimizer, self.dim)
        for given in self.per_table:
            check_layout_flags(given.accessor, given.optimizer, given.dim)


_LAYOUT_FLAGS = ("accessor", "dim", "optimizer")
_EACH_TABLE = "TABLE:VALUE for each table (e.g. -paddle_dim 000:1,001:9)"


def per_table_values(flag: str, text: str) -> tuple[str, dict[str, str]]:
    """A layout flag's text: one value for every table, returned first (`8`), or a value per
    table, returned as {table: value} (`000:1,001:9`; for -paddle_optimizer a table's value
    may be two rules, `000:adam,naive,001:adagrad`). ValueError for a mix of both, an empty
    name or value, or a table named twice."""
    text = text.strip()
    if ":" not in text:
        return text, {}
    values: dict[str, str] = {}
    current, continues = "", False
    for item in (part.strip() for part in text.split(",")):
        name, sep, value = item.partition(":")
        name, value = name.strip(), value.strip()
        if sep and name and value and ":" not in value:
            if name in values:
                raise ValueError(f"-{flag} {text!r}: table {name!r} is named twice")
            values[name] = value
            current = name
            continues = flag == "paddle_optimizer"
        elif continues and item and not sep and "," not in values[current]:
            values[current] += f",{item}"  # the embedx rule of embed_rule,embedx_rule
        else:
            raise ValueError(
                f"-{flag} {text!r}: either one value for every table, or {_EACH_TABLE}"
            )
    return "", values


def layout_flags(
    accessor: str, dim: str, optimizer: str
) -> tuple[str, int, str, tuple[TableFlags, ...]]:
    """-paddle_accessor, -paddle_dim and -paddle_optimizer as given: (accessor, dim,
    optimizer) for every table, and the tables' own (`TableFlags`, in the order first named).
    ValueError saying which flag is malformed."""
    every: list[str] = []
    per: list[dict[str, str]] = []
    for flag, text in zip(_LAYOUT_FLAGS, (accessor, dim, optimizer), strict=True):
        value, values = per_table_values(f"paddle_{flag}", text)
        every.append(value)
        per.append(values)

    def number(text: str, table: str = "") -> int:
        try:
            return int(text) if text else 0
        except ValueError:
            where = f" (table {table})" if table else ""
            raise ValueError(f"-paddle_dim{where}: {text!r} is not a whole number") from None

    names = dict.fromkeys(name for values in per for name in values)
    tables = tuple(
        TableFlags(
            name, per[0].get(name, ""), number(per[1].get(name, ""), name), per[2].get(name, "")
        )
        for name in names
    )
    for given in tables:
        check_layout_flags(given.accessor, given.optimizer, given.dim)
    return every[0], number(every[1]), every[2], tables


def names_table(source: PaddleSource, wanted: str, folder: str) -> bool:
    """Whether `wanted` names the table in `folder`: its folder name, its number, or the table
    name the configuration gives it (as -paddle_table names a table)."""
    if folder == wanted or (wanted.isdigit() and folder.isdigit() and int(folder) == int(wanted)):
        return True
    table = source.config_for(folder)
    return table is not None and table.table_name == wanted


def table_source(source: PaddleSource, folder: str) -> PaddleSource:
    """What the table in `folder` is read with: `source`'s layout flags for every table, each
    overridden by the table's own (TablesSource). BuildError for a table given one flag twice
    (as 0 and 000, say), or whose layout the flags and configuration leave incomplete."""
    per_table = source.per_table if isinstance(source, TablesSource) else ()
    if not per_table:
        return source
    chosen = {name: getattr(source, name) for name in _LAYOUT_FLAGS}
    given: dict[str, str] = {}
    for entry in per_table:
        if not names_table(source, entry.table, folder):
            continue
        for name in _LAYOUT_FLAGS:
            value = getattr(entry, name)
            if value:
                if name in given:
                    raise BuildError(
                        f"table {folder}: -paddle_{name} gives it two values (as "
                        f"{given[name]!r} and {entry.table!r})"
                    )
                given[name] = entry.table
                chosen[name] = value
    try:
        return PaddleSource(
            accessor=chosen["accessor"],
            dim=chosen["dim"],
            optimizer=chosen["optimizer"],
            table=folder,
            value=source.value,
            config=source.config,
            config_name=source.config_name,
        )
    except ValueError as exc:
        raise BuildError(f"table {folder}: {exc}") from None


def _has_table_flags(source: PaddleSource) -> bool:
    return isinstance(source, TablesSource) and bool(source.per_table)


def _unused_table_flags(source: PaddleSource, chosen: list[str], shown: str) -> None:
    """BuildError for per-table layout flags naming no table the build reads."""
    for entry in source.per_table if isinstance(source, TablesSource) else ():
        if not any(names_table(source, entry.table, folder) for folder in chosen):
            flags = [f"-paddle_{n}" for n in _LAYOUT_FLAGS if getattr(entry, n)]
            raise BuildError(
                f"{shown}: {', '.join(flags)} name table {entry.table!r}, which this build does "
                f"not read (it reads {', '.join(chosen)})"
            )


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
    than one and the flags do not say which (or say several: `find_tables`)."""
    tables, several = find_tables(input_path, source, timeout)
    if several:
        listed = ", ".join(_listed(source, t.name) for t in tables)
        raise BuildError(
            f"{remote.redact(input_path)}: {len(tables)} sparse tables to read ({listed}); "
            "this reads one: say which with -paddle_table (a folder name)"
        )
    return tables[0]


def find_tables(
    input_path: str, source: PaddleSource, timeout: float = FETCH_TIMEOUT
) -> tuple[list[PaddleTable], bool]:
    """The sparse tables to build from `input_path`, in folder order, and whether they make a
    version of named tables (cube.layout's TABLES): with -paddle_table `all` (every sparse
    table: the configuration's, else those the files and first rows tell), a comma list of
    tables, or, without -paddle_table, a configuration listing several sparse tables.
    Otherwise one table (a version of one unnamed table, as ever): the one -paddle_table
    names, the configuration's only sparse table, or the only folder that holds one.
    BuildError saying why when there is none, or several and nothing says which."""
    deadline = time.monotonic() + timeout
    shown = remote.redact(input_path)
    wanted = source.table.strip()
    listing = list_inputs(input_path, timeout, include_empty=True)
    base = input_path.rstrip("/")
    folders: dict[str, list[InputFile]] = {}
    direct: list[InputFile] = []
    for file in listing:
        relative = file.url[len(base) + 1 :]
        parts = relative.split("/")
        if len(parts) == 1:
            direct.append(file)
        elif len(parts) == 2 and parts[0].isdigit():
            folders.setdefault(parts[0], []).append(file)
    one_file = len(listing) == 1 and listing[0].url == base
    if one_file or (direct and all(SPARSE_PART.fullmatch(_name(f)) for f in direct)):
        if wanted == ALL_TABLES or "," in wanted or _has_table_flags(source):
            raise BuildError(
                f"{shown}: one table's {'part file' if one_file else 'folder'}; several tables "
                "(-paddle_table all or a list, or per-table layout flags) are read from the "
                "save directory, which holds their numbered folders"
            )
        return [_table(shown, listing if one_file else direct, source, None)], False
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

    chosen, several = _choose(shown, source, wanted, sorted(folders), problem)
    _unused_table_flags(source, chosen, shown)
    tables = [
        _table(f"{shown}/{f}", folders[f], table_source(source, f), f, several) for f in chosen
    ]
    return tables, several


def _choose(
    shown: str,
    source: PaddleSource,
    wanted: str,
    folders: list[str],
    problem: Callable[[str], str],
) -> tuple[list[str], bool]:
    """`find_tables`' choice among a save's numbered `folders` (sorted): the folders to read,
    and whether they make a version of named tables. Long: one branch per way of saying which
    tables (a list, all, one named, the configuration's, what the files tell)."""
    configured = source.sparse_tables
    if "," in wanted:
        chosen: list[str] = []
        for name in (part.strip() for part in wanted.split(",")):
            named = [folder for folder in folders if name and names_table(source, name, folder)]
            if not named:
                raise BuildError(
                    f"{shown}: no table folder {name!r} (-paddle_table {wanted}); it has "
                    f"{', '.join(folders)}"
                )
            why = problem(named[0])
            if why:
                raise BuildError(f"{shown}/{named[0]} (-paddle_table): not a sparse table: {why}")
            if named[0] in chosen:
                raise BuildError(f"-paddle_table {wanted}: names table {named[0]} twice")
            chosen.append(named[0])
        return sorted(chosen), True
    if wanted and wanted != ALL_TABLES:
        named = [folder for folder in folders if names_table(source, wanted, folder)]
        if not named:
            raise BuildError(
                f"{shown}: no table folder {wanted!r} (-paddle_table); it has {', '.join(folders)}"
            )
        why = problem(named[0])
        if why:
            raise BuildError(f"{shown}/{named[0]} (-paddle_table): not a sparse table: {why}")
        return [named[0]], False
    if configured and (wanted == ALL_TABLES or len(configured) > 1 or not wanted):
        for table in configured:
            if table.folder not in folders:
                raise BuildError(
                    f"{shown}: no folder {table.folder}, where {source.config_name} puts its "
                    f"sparse table {table.table_name}; it has {', '.join(folders)}"
                )
            why = problem(table.folder)
            if why:
                raise BuildError(f"{shown}/{table.folder}: not a sparse table: {why}")
        several = wanted == ALL_TABLES or len(configured) > 1
        return [table.folder for table in configured], several
    problems = {folder: problem(folder) for folder in folders}
    sparse = [folder for folder, why in problems.items() if not why]
    if not sparse:
        listed = "; ".join(f"{folder}: {why}" for folder, why in problems.items())
        raise BuildError(f"{shown}: no sparse table ({listed})")
    if wanted == ALL_TABLES:
        return sparse, True
    if len(sparse) == 1:
        return sparse, False
    raise BuildError(
        f"{shown}: {len(sparse)} sparse tables ({', '.join(sparse)}); say which with "
        "-paddle_table (a folder name), or -paddle_table all to build every one into a version "
        "of named tables (each table's layout: -paddle_config, or per-table flags such as "
        "-paddle_dim 000:1,001:9)"
    )


def _listed(source: PaddleSource, folder: str) -> str:
    """`000 (emb_a)`: a table folder and, when the configuration names it, its name."""
    config = source.config_for(folder)
    return f"{folder} ({config.table_name})" if config is not None else folder


def _table(
    folder: str,
    files: list[InputFile],
    source: PaddleSource,
    number: str | None,
    named: bool = False,
) -> PaddleTable:
    config = source.config_for(number) if number is not None else None
    try:
        layout = source.layout_for(config)
        source.value.check(layout)
    except ValueError as exc:
        raise BuildError(f"{folder}: {exc}") from None
    name = number if named and number is not None else ""
    return PaddleTable(folder, [f for f in files if f.size], layout, config, name)


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
