"""kv_to_seqfile: turn a text file of keys and values into a Cube-dialect SequenceFile plus a
donefile line, the way the Cube tools hand a dictionary to cube-transfer.

    kv_to_seqfile --input FILE --input_format FORMAT [--output_dir DIR] [--donefile_dir DIR]
                  [--id ID] [--patch --base_id ID] [--key_format cube|bytes_be] [--dim N]

The original tool read two incompatible layouts over its history (`key:value` text, later
`key show click f1 f2 ...`), and one line often parses both ways with different meanings:
`21 0.1 0.2 0.3 0.4` is a 4-float vector, or show 0.1, click 0.2 and the vector [0.3, 0.4].
So --input_format has no default and nothing is guessed; a line that does not fit the chosen
format is an error naming the file, the line and the field. The formats, with the reasons for
each rule, are in docs/INPUT_FORMATS.md and in --help.

Output: `<output_dir>/<id>/base/feature` (or `.../patch/feature`), written to a temp name and
renamed; then one line is appended to `<donefile_dir>/base.txt` (or `patch.txt`):
`{"id": "<id>", "key": "<key>", "input": "<absolute dir of feature>"}` with key == id for a
base and key == --base_id for a patch. On any error nothing is left behind: no feature, no
empty version directory, no donefile line; the exit status is 1 (2 for a bad command line).
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from cube.donefile import append_line, format_line
from cube.flags import FlagError, FlagSet, MissingFlagsError, flag, run_cli
from cube.seqfile import SequenceFileWriter
from cube.values import ValueColumn

_MAX_KEY = (1 << 64) - 1
_F32_MAX = float(np.finfo(np.float32).max)
_F32_INF = 2.0**128 - 2.0**103  # the smallest magnitude float32 rounding makes inf
# One decimal number as training jobs print them; no nan/inf, hex, or `1_000` (Python's float()
# takes all of these, and a nan or inf embedding poisons every model that looks it up).
_NUMBER = re.compile(rb"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
# Within these characters float() accepts exactly _NUMBER (checked exhaustively up to 7
# characters), so a row is checked with one translate() and float() instead of a regex per field.
_NUMBER_CHARS = b"0123456789+-.eE"
MAX_LINE_BYTES = 16 << 20  # a 16 MiB line is ~1.5M floats: far past any embedding
_BATCH_ROWS = 65536  # rows handed to the writer at a time...
_BATCH_BYTES = 32 << 20  # ...or fewer when their values reach this size
_MAX_TRACKED = 1 << 20  # repeated keys followed when looking for the first repeat's lines
# What cube-transfer accepts as a version id (cube/donefile.py), in canonical form: the
# transfer reads "007" as 7, which would no longer match the directory written here.
_VERSION_ID = re.compile(r"0|[1-9][0-9]{0,19}")
DIALECT_FOR_KEY_FORMAT = {"cube": "cube", "bytes_be": "byteswritable"}


@dataclass(frozen=True)
class InputFormat:
    """One input line layout: how it splits, what is dropped, what the value becomes."""

    name: str
    layout: str
    example: str
    value: str  # what the stored value is, for --help and errors
    colon: bool  # `key:rest` (else whitespace-separated fields)
    counts: tuple[str, ...]  # integer fields after the key that are checked, then dropped
    floats: bool  # the rest is float32s (else the text after ':' as its bytes)


FORMATS: dict[str, InputFormat] = {
    f.name: f
    for f in (
        InputFormat(
            "show_click_floats",
            "key show click f1 f2 ...",
            "21 120 3 0.1 0.2 0.3",
            "float32 LE [f1, f2, ...]; show, click: unsigned integers, dropped",
            colon=False,
            counts=("show", "click"),
            floats=True,
        ),
        InputFormat(
            "floats",
            "key f1 f2 ...",
            "21 0.1 0.2 0.3",
            "float32 LE [f1, f2, ...]",
            colon=False,
            counts=(),
            floats=True,
        ),
        InputFormat(
            "colon_floats",
            "key:f1 f2 ...",
            "21:0.1 0.2 0.3",
            "float32 LE [f1, f2, ...]",
            colon=True,
            counts=(),
            floats=True,
        ),
        InputFormat(
            "colon_text",
            "key:text",
            "21:any text",
            "the bytes after the ':', as they are (a second ':' is refused)",
            colon=True,
            counts=(),
            floats=False,
        ),
    )
}


class InputError(ValueError):
    """A line of the input that does not parse; the message names file, line and field."""


def _show(text: bytes) -> str:
    """A field for an error message: quoted, at most 40 bytes, undecodable bytes escaped."""
    shown = text[:40].decode("utf-8", "backslashreplace")
    return repr(shown) + ("..." if len(text) > 40 else "")


class LineParser:
    """Parses the lines of one file in one format, and holds the file's vector width."""

    def __init__(self, fmt: InputFormat, path: Path, dim: int = 0):
        self.fmt = fmt
        self.path = path
        self.dim = dim  # 0: the first row's width, which every later row must then have
        self.width = dim or None
        self.width_line = 0

    def _where(self, number: int, field: int | None = None, name: str = "") -> str:
        where = f"{self.path} line {number}"
        return where if field is None else f"{where}, field {field} ({name})"

    def _layout_hint(self) -> str:
        return f"{self.fmt.name} lines are '{self.fmt.layout}'"

    def _key(self, text: bytes, number: int) -> int:
        where = self._where(number, 1, "key")
        if not text.isdigit():
            hint = ""
            if b":" in text and not self.fmt.colon:
                hint = "; a 'key:...' line needs --input_format colon_floats or colon_text"
            elif self.fmt.colon and text[:1].isspace():
                hint = "; no space before the key"
            raise InputError(
                f"{where}: {_show(text)} is not an unsigned decimal integer (keys are uint64)"
                + hint
            )
        if len(text.lstrip(b"0")) > 20 or int(text) > _MAX_KEY:
            raise InputError(f"{where}: {_show(text)} does not fit in a uint64 (max {_MAX_KEY})")
        return int(text)

    def _floats(self, fields: list[bytes], first_field: int, number: int) -> list[float]:
        """Validated floats of one row; the per-field regex runs only to name a culprit."""
        try:
            if b"".join(fields).translate(None, _NUMBER_CHARS):
                raise ValueError("a character no decimal number has")
            numbers = list(map(float, fields))
        except ValueError:
            bad = (i for i, text in enumerate(fields) if not _NUMBER.fullmatch(text))
            i = next(bad, 0)  # some field fails: the regex and float() agree on these characters
            where = self._where(number, first_field + i, f"f{i + 1}")
            raise InputError(
                f"{where}: {_show(fields[i])} is not a finite decimal number "
                "(nan, inf, hex and '_' are refused)"
            ) from None
        if max(numbers) >= _F32_INF or min(numbers) <= -_F32_INF:
            i = next(i for i, x in enumerate(numbers) if abs(x) >= _F32_INF)
            where = self._where(number, first_field + i, f"f{i + 1}")
            raise InputError(
                f"{where}: {_show(fields[i])} is outside the float32 range (|x| <= {_F32_MAX:.8g})"
            )
        if self.width is None:
            self.width, self.width_line = len(numbers), number
        elif len(numbers) != self.width:
            if self.dim:
                problem = f"{len(numbers)} floats, --dim is {self.dim}"
            else:
                problem = (
                    f"{len(numbers)} floats, line {self.width_line} has {self.width} "
                    "(one width per file: an embedding table has one dimension)"
                )
            raise InputError(f"{self._where(number)}: {problem}")
        return numbers

    def parse(self, line: bytes, number: int) -> tuple[int, list[float] | bytes]:
        """(key, floats or value bytes) of one non-blank line, line ending stripped."""
        fmt = self.fmt
        if fmt.colon:
            key_text, colon, rest = line.partition(b":")
            if not colon:
                first = line.split()[0]
                if not first.isdigit():
                    self._key(first, number)  # raises, naming the bad key
                raise InputError(
                    f"{self._where(number)}: no ':' after the key ({self._layout_hint()})"
                )
            key = self._key(key_text, number)
            if not fmt.floats:
                if b":" in rest:
                    raise InputError(
                        f"{self._where(number, 2, 'value')}: a second ':' is ambiguous (the "
                        "original tool kept only the text before it, later versions all of it)"
                    )
                return key, rest
            fields = rest.split()
            if not fields:
                raise InputError(
                    f"{self._where(number)}: no floats after the ':' ({self._layout_hint()})"
                )
            return key, self._floats(fields, 2, number)
        fields = line.split()
        key = self._key(fields[0], number)
        for i, name in enumerate(fmt.counts, start=2):
            if len(fields) < i:
                raise InputError(f"{self._where(number, i, name)}: missing ({self._layout_hint()})")
            if not fields[i - 1].isdigit():
                raise InputError(
                    f"{self._where(number, i, name)}: {_show(fields[i - 1])} is not an unsigned "
                    "decimal integer (show and click are counts; for 'key f1 f2 ...' lines use "
                    "--input_format floats)"
                )
        start = 1 + len(fmt.counts)
        if len(fields) <= start:
            after = "show and click" if fmt.counts else "the key"
            raise InputError(
                f"{self._where(number)}: no floats after {after} ({self._layout_hint()})"
            )
        return key, self._floats(fields[start:], start + 1, number)


def lines_of(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line without its ending) for each non-blank line; a line longer than
    MAX_LINE_BYTES is an error, found without holding more than that in memory."""
    with open(path, "rb") as source:
        number = 0
        while True:  # every pass consumes at least one byte of the file
            raw = source.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise InputError(f"{path} line {number}: longer than {MAX_LINE_BYTES} bytes")
            line = raw.rstrip(b"\r\n")
            if line.strip():
                yield number, line


def read_records(
    path: Path, fmt: InputFormat, dim: int = 0
) -> Iterator[tuple[list[int], ValueColumn]]:
    """Batches of (keys, values), streaming, each at most _BATCH_ROWS rows or ~_BATCH_BYTES."""
    parser = LineParser(fmt, path, dim)
    keys: list[int] = []
    values: list[list[float] | bytes] = []
    size = 0
    for number, line in lines_of(path):
        key, value = parser.parse(line, number)
        keys.append(key)
        values.append(value)
        size += 4 * len(value) if fmt.floats else len(value)
        if len(keys) >= _BATCH_ROWS or size >= _BATCH_BYTES:
            yield keys, _column(values, fmt)
            keys, values, size = [], [], 0
    if keys:
        yield keys, _column(values, fmt)


def _column(values: list[list[float] | bytes], fmt: InputFormat) -> ValueColumn:
    if not fmt.floats:  # then the parser gives bytes
        return ValueColumn.from_list(cast(list[bytes], values))
    rows = np.asarray(values, dtype=np.float64).astype("<f4")  # one width: checked per line
    return ValueColumn.fixed(rows.view(np.uint8).reshape(-1), rows.shape[1] * 4)


def write_feature(
    input_path: Path, feature: Path, fmt: InputFormat, dialect: str = "cube", dim: int = 0
) -> int:
    """Write the SequenceFile; returns the record count. Nothing is left behind on error.

    Keys must be unique: Cube keeps only the last record of a key, so a repeat would drop a
    line without a word. Checking holds 8 bytes per record (one sorted copy of the keys)."""
    count = 0
    seen: list[np.ndarray] = []
    with SequenceFileWriter(feature, dialect=dialect) as writer:
        for keys, values in read_records(input_path, fmt, dim):
            batch = np.array(keys, dtype=np.uint64)
            writer.write_batch(batch, values)
            seen.append(batch)
            count += len(keys)
        if count == 0:
            raise InputError(f"{input_path}: no records (every line is blank)")
        every = np.concatenate(seen)
        del seen
        every.sort()
        repeated = every[1:][every[1:] == every[:-1]]
        if repeated.size:
            raise InputError(_first_repeat(input_path, fmt, np.unique(repeated)))
    return count


def _first_repeat(path: Path, fmt: InputFormat, repeated: np.ndarray) -> str:
    """The message for the earliest line whose key an earlier line had (a second pass, on the
    error path only; it tracks at most _MAX_TRACKED of the repeated keys)."""
    tracked = set(repeated[:_MAX_TRACKED].tolist())
    first_line: dict[int, int] = {}
    parser = LineParser(fmt, path)
    for number, line in lines_of(path):
        key = parser.parse(line, number)[0]
        if key not in tracked:
            continue
        if key in first_line:
            return (
                f"{path} line {number}: key {key} repeats line {first_line[key]} (Cube keeps "
                f"one record per key; {repeated.size} keys repeat in all)"
            )
        first_line[key] = number
    return f"{path}: {repeated.size} keys repeat, e.g. {int(repeated[0])}"  # file changed


def formats_that_fit(path: Path) -> tuple[int, list[str]]:
    """(line number, formats) for the first non-blank line: a hint when --input_format is
    missing. Never a default: several formats usually fit, with different meanings."""
    for number, line in lines_of(path):
        fits = []
        for name in sorted(FORMATS):
            try:
                LineParser(FORMATS[name], path).parse(line, number)
            except InputError:
                continue
            fits.append(name)
        return number, fits
    return 0, []


def donefile_line(version_id: str, key: str, input_dir: Path) -> str:
    return format_line(version_id, key, str(input_dir.resolve()))


def _help() -> str:
    lines = [
        "Convert key/value text lines to a Cube SequenceFile + donefile line.",
        "",
        "input formats (--input_format, required; keys are decimal integers in [0, 2**64),",
        "each on one line only; blank lines are skipped; floats are finite decimals within",
        "float32 range, one width per file; details in docs/INPUT_FORMATS.md):",
    ]
    for fmt in FORMATS.values():
        lines.append(f"  {fmt.name:<18} {fmt.layout:<26} e.g. {fmt.example}")
        lines.append(f"  {'':<18} value: {fmt.value}")
    lines += [
        "",
        "writes <output_dir>/<id>/base/feature (patch/feature with --patch), then appends to",
        "<donefile_dir>/base.txt (patch.txt) the line",
        '  {"id": "<id>", "key": "<key>", "input": "<absolute feature dir>"}',
        "with key = id for a base and key = --base_id for a patch.",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class KvToSeqfileFlags:
    """kv_to_seqfile's flags."""

    input: str = flag("", "text file of key/value lines", required=True)
    input_format: str = flag(
        "", "layout of the input lines (see above)", choices=tuple(FORMATS), required=True
    )
    dim: int = flag(0, "float formats: floats per row, checked on every row (0: the first row's)")
    output_dir: str = flag(
        "./data", "data root; writes <output_dir>/<id>/base|patch/feature", metavar="DIR"
    )
    donefile_dir: str | None = flag(
        None,
        "where base.txt / patch.txt live (default: <output_dir>/donefile)",
        metavar="DIR",
    )
    id: str | None = flag(
        None, "version id, a decimal integer (default: the current unix time)", metavar="ID"
    )
    patch: bool = flag(False, "write a patch (delta) instead of a base")
    base_id: str | None = flag(
        None, "with --patch: the id of the base the patch applies to", metavar="ID"
    )
    key_format: str = flag(
        "cube",
        "output keys: cube (raw LE) or bytes_be (BytesWritable)",
        choices=tuple(DIALECT_FOR_KEY_FORMAT),
    )


FLAGS = FlagSet("kv_to_seqfile", _help(), spec=KvToSeqfileFlags)


def _missing_format(input_path: Path) -> FlagError:
    message = f"--input_format is required: one of {', '.join(FORMATS)} (see --help)"
    with contextlib.suppress(InputError, OSError):
        number, fits = formats_that_fit(input_path) if input_path.is_file() else (0, [])
        if number:
            fit = ", ".join(fits) if fits else "none of them"
            message += f"; {input_path} line {number} fits: {fit}"
    return FlagError(message)


def _remove(feature: Path | None, directories: list[Path]) -> None:
    """Undo what this run created (the feature, then the directories it made, innermost first)."""
    if feature is not None:
        with contextlib.suppress(OSError):
            feature.unlink()
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


def run(argv: Sequence[str]) -> int:
    try:
        flags = FLAGS.parse(argv)
    except MissingFlagsError as exc:
        if exc.missing == ["input_format"]:  # say which formats the input's lines fit
            raise _missing_format(Path(exc.values["input"])) from None
        raise
    input_path = Path(flags.input)
    fmt = FORMATS[flags.input_format]
    if flags.dim < 0:
        raise FlagError(f"--dim {flags.dim} must be >= 0")
    if flags.dim and not fmt.floats:
        raise FlagError(f"--dim only applies to float formats, not {fmt.name}")
    version_id = flags.id if flags.id is not None else str(int(time.time()))
    for name, value in (("id", version_id), ("base_id", flags.base_id)):
        if value is not None and not _VERSION_ID.fullmatch(value):
            raise FlagError(
                f"--{name} {value!r} must be a decimal integer without leading zeros, at most "
                "20 digits (cube-transfer refuses other version ids)"
            )
    if flags.patch and not flags.base_id:
        raise FlagError("--patch needs --base_id (the base this patch applies to)")
    if flags.base_id and not flags.patch:
        raise FlagError("--base_id only makes sense with --patch")
    kind = "patch" if flags.patch else "base"
    key = flags.base_id if flags.patch and flags.base_id else version_id
    output_dir = Path(flags.output_dir)
    donefile_dir = Path(flags.donefile_dir) if flags.donefile_dir else output_dir / "donefile"
    if not input_path.is_file():
        problem = "not a regular file" if input_path.exists() else "no such file"
        print(f"error: --input {input_path}: {problem}", file=sys.stderr)
        return 1
    feature_dir = output_dir / version_id / kind
    feature = feature_dir / "feature"
    if feature.exists():
        print(f"error: {feature} already exists; pick another --id", file=sys.stderr)
        return 1
    created = [d for d in (feature_dir, feature_dir.parent, output_dir) if not d.exists()]
    written = None
    try:
        feature_dir.mkdir(parents=True, exist_ok=True)
        dialect = DIALECT_FOR_KEY_FORMAT[flags.key_format]
        count = write_feature(input_path, feature, fmt, dialect, flags.dim)
        written = feature
        line = donefile_line(version_id, key, feature_dir)
        append_line(donefile_dir / f"{kind}.txt", line)
    except (InputError, OSError) as exc:
        _remove(written, created)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BaseException:
        _remove(written, created)
        raise
    print(f"wrote {count} records to {feature}")
    print(f"appended to {donefile_dir / f'{kind}.txt'}: {line}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
