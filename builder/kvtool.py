"""kvtool: print a SequenceFile's header and records (the Cube tools' `kvtool.py <file>`).

    kvtool FILE [--float] [--limit N] [--key_format auto|cube|bytes_be|bytes_le|long|text]

One line per record: the key as a decimal uint64, a tab, and the value as hex (or, with --float,
as float32 little-endian numbers). Keys that do not decode in the file's auto-detected format
(e.g. genuine BytesWritable keys that are not 8 bytes) are shown as `raw:<hex>`; with an explicit
--key_format such a key is an error naming file and offset. Exit status 1 on bad input, 2 on a
bad command line.

Flags are gflags-style like every other command (cube/flags.py: `-flag value`, `--flag=value`,
`--flagfile`, `-help`); FILE is positional as in the original, or `--file FILE`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cube.flags import FlagError, FlagSet, flag, run_cli
from cube.seqfile import KEY_FORMATS, SequenceFileError, SequenceFileReader, decode_key


def format_value(value: bytes, as_float: bool) -> str:
    if not as_float:
        return value.hex()
    if len(value) % 4:
        return f"raw:{value.hex()} ({len(value)} bytes, not float32s)"
    floats = np.frombuffer(value, dtype="<f4")
    return "[" + ", ".join(f"{x:.7g}" for x in floats.tolist()) + "]"


def header_lines(reader: SequenceFileReader) -> list[str]:
    header = reader.header
    return [
        f"# file: {reader.path}",
        f"# version: {header.version}  key class: {header.key_class}  "
        f"value class: {header.value_class}",
        f"# compression: {header.compression}  codec: {header.codec or '-'}  "
        f"key format: {reader.key_format}  dialect: {reader.dialect}",
        f"# metadata: {header.metadata}  sync: {header.sync.hex()}",
    ]


@dataclass
class _Shown:
    """What kvtool has printed so far."""

    header: bool = False
    records: int = 0


def show(args: KvtoolFlags) -> int:
    """Print the header and the records; SequenceFileError on bad input, after the records
    before the damage (a file cut short shows what it still holds)."""
    shown = _Shown()
    try:
        _show(args, shown)
    except SequenceFileError as exc:
        # read again as if the file ended where the damage starts: the records before it
        with contextlib.suppress(SequenceFileError):
            _show(args, shown, end=exc.offset)
        print(f"# {shown.records} records shown, then the damage at offset {exc.offset}")
        raise
    print(f"# {shown.records} records shown")
    return 0


def _show(args: KvtoolFlags, shown: _Shown, end: int | None = None) -> None:
    """Print what `shown` has not yet (the header, then records past the first
    shown.records), reading the file up to `end`."""
    explicit = args.key_format != "auto"
    with SequenceFileReader(args.file, key_format=args.key_format, end=end) as reader:
        if not shown.header:
            for line in header_lines(reader):
                print(line)
            shown.header = True
        decodable = reader.key_format != "auto"
        for index, (offset, key, value) in enumerate(reader.records_with_offsets()):
            if args.limit is not None and shown.records >= args.limit:
                break
            if index < shown.records:
                continue
            try:
                key_text = str(decode_key(key, reader.key_format)) if decodable else None
            except ValueError as exc:
                if explicit:
                    raise SequenceFileError(reader.path, offset, str(exc)) from None
                key_text = None
            if key_text is None:
                key_text = f"raw:{key.hex()}"
            print(f"{key_text}\t{format_value(value, args.float)}")
            shown.records += 1


@dataclass(frozen=True)
class KvtoolFlags:
    """kvtool's flags; `file` is also the positional FILE."""

    file: str = flag("", "the SequenceFile to read (or the positional FILE)", metavar="PATH")
    float: bool = flag(False, "show values as float32 lists")
    limit: int | None = flag(None, "show at most N records (default: all)")
    key_format: str = flag(
        "auto",
        "key decoding (auto: from the key class and first key)",
        choices=KEY_FORMATS,
    )


FLAGS = FlagSet(
    "kvtool",
    "Print a SequenceFile's header and records: one line per record, the key as a decimal\n"
    "uint64, a tab, the value as hex (or float32s with --float). FILE may come anywhere\n"
    "on the line; after a bare --float, write --float=true FILE (or FILE first) when FILE\n"
    "is named like a boolean (1, y, no, ...).",
    spec=KvtoolFlags,
).positional("FILE", "the SequenceFile to read (or --file)", flag="file")


def parse(argv: Sequence[str]) -> KvtoolFlags:
    args = FLAGS.parse(argv)
    if args.limit is not None and args.limit < 0:
        raise FlagError("--limit must be >= 0")
    return args


def run(argv: Sequence[str]) -> int:
    args = parse(argv)
    try:
        return show(args)
    except SequenceFileError as exc:
        sys.stdout.flush()
        print(f"error: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
