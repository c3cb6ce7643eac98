"""kv_to_seqfile: turn a text file of keys and values into a Cube-dialect SequenceFile plus a
donefile line, the way the Cube tools hand a dictionary to cube-transfer.

    kv_to_seqfile --input FILE --output_dir DIR [--donefile_dir DIR] [--id ID]
                  [--patch --base_id ID] [--key_format cube|bytes_be]

Input lines come in either of the original tool's two formats, chosen per file from its first
non-blank line:
  * `key:value`                  value = the literal text after the first ':'
  * `key show click f1 f2 ...`   whitespace-separated; f1... become float32 little-endian,
                                 show and click are dropped
Keys are decimal uint64. A line that does not fit the file's format is an error naming the line.

Output: `<output_dir>/<id>/base/feature` (or `.../patch/feature`), written to a temp name and
renamed; then one line is appended to `<donefile_dir>/base.txt` (or `patch.txt`):
`{"id": "<id>", "key": "<key>", "input": "<absolute dir of feature>"}` with key == id for a
base and key == --base_id for a patch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from builder.seqfile import SequenceFileWriter
from cube.flags import FlagError, FlagSet, run_cli
from cube.values import ValueColumn

_KV_LINE = re.compile(rb"^(\d+):(.*)$", re.DOTALL)
_MAX_KEY = (1 << 64) - 1
_BATCH = 65536
DIALECT_FOR_KEY_FORMAT = {"cube": "cube", "bytes_be": "byteswritable"}


class InputError(ValueError):
    """A line of the input that does not parse; the message names file and line."""


def _key(text: bytes, where: str) -> int:
    if not text.isdigit():
        raise InputError(f"{where}: key {text[:40]!r} is not a decimal uint64")
    key = int(text)
    if key > _MAX_KEY:
        raise InputError(f"{where}: key {key} does not fit in a uint64")
    return key


def detect_format(line: bytes) -> str:
    """ "kv" for `key:value`, "floats" for `key show click f1 ...`."""
    return "kv" if _KV_LINE.match(line) else "floats"


def parse_line(line: bytes, fmt: str, where: str) -> tuple[int, bytes]:
    if fmt == "kv":
        match = _KV_LINE.match(line)
        if match is None:
            raise InputError(f"{where}: expected 'key:value' like the file's first line")
        return _key(match.group(1), where), match.group(2)
    fields = line.split()
    if len(fields) < 3:
        raise InputError(
            f"{where}: expected 'key show click f1 f2 ...' like the file's first line, "
            f"got {len(fields)} fields"
        )
    key = _key(fields[0], where)
    try:
        numbers = [float(f) for f in fields[1:]]
    except ValueError:
        raise InputError(f"{where}: show, click and features must be numbers") from None
    return key, np.asarray(numbers[2:], dtype="<f4").tobytes()


def read_records(path: Path) -> Iterator[tuple[list[int], list[bytes]]]:
    """Batches of (keys, values), streaming; the format is fixed by the first non-blank line."""
    fmt = None
    keys: list[int] = []
    values: list[bytes] = []
    with open(path, "rb") as lines:
        for number, raw_line in enumerate(lines, start=1):
            line = raw_line.rstrip(b"\r\n")
            if not line.strip():
                continue
            if fmt is None:
                fmt = detect_format(line)
            key, value = parse_line(line, fmt, f"{path} line {number}")
            keys.append(key)
            values.append(value)
            if len(keys) >= _BATCH:
                yield keys, values
                keys, values = [], []
    if keys:
        yield keys, values


def write_feature(input_path: Path, feature: Path, dialect: str = "cube") -> int:
    """Write the SequenceFile; returns the record count. Nothing is left behind on error."""
    count = 0
    with SequenceFileWriter(feature, dialect=dialect) as writer:
        for keys, values in read_records(input_path):
            writer.write_batch(np.array(keys, dtype=np.uint64), ValueColumn.from_list(values))
            count += len(keys)
        if count == 0:
            raise InputError(f"{input_path}: no records (every line is blank)")
    return count


def donefile_line(version_id: str, key: str, input_dir: Path) -> str:
    return json.dumps({"id": version_id, "key": key, "input": str(input_dir.resolve())})


def append_line(path: Path, line: str) -> None:
    """Append one whole line with a single write, so readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


FLAGS = (
    FlagSet("kv_to_seqfile", "Convert key/value text lines to a Cube SequenceFile + donefile.")
    .add("input", str, None, "text file of `key:value` or `key show click f1 ...` lines")
    .add("output_dir", str, "./data", "data root; writes <output_dir>/<id>/base|patch/feature")
    .add("donefile_dir", str, None, "where base.txt / patch.txt live [<output_dir>/donefile]")
    .add("id", str, None, "version id [current unix time]")
    .add("patch", bool, False, "write a patch (delta) instead of a base")
    .add("base_id", str, None, "with --patch: the id of the base this patch applies to")
    .add(
        "key_format",
        str,
        "cube",
        "output keys: cube (raw LE) or bytes_be (BytesWritable)",
        choices=tuple(DIALECT_FOR_KEY_FORMAT),
    )
)


def run(argv: Sequence[str]) -> int:
    flags = FLAGS.parse(argv)
    if not flags.input:
        raise FlagError("--input is required")
    version_id = flags.id if flags.id is not None else str(int(time.time()))
    if not version_id or "/" in version_id or version_id in (".", ".."):
        raise FlagError(f"--id {version_id!r} must be a plain name")
    if flags.patch and not flags.base_id:
        raise FlagError("--patch needs --base_id (the base this patch applies to)")
    if flags.base_id and not flags.patch:
        raise FlagError("--base_id only makes sense with --patch")
    kind = "patch" if flags.patch else "base"
    key = flags.base_id if flags.patch else version_id
    output_dir = Path(flags.output_dir)
    donefile_dir = Path(flags.donefile_dir) if flags.donefile_dir else output_dir / "donefile"
    input_path = Path(flags.input)
    if not input_path.is_file():
        print(f"error: --input {input_path}: no such file", file=sys.stderr)
        return 1
    feature_dir = output_dir / version_id / kind
    feature = feature_dir / "feature"
    if feature.exists():
        print(f"error: {feature} already exists; pick another --id", file=sys.stderr)
        return 1
    created = [d for d in (feature_dir, feature_dir.parent) if not d.exists()]
    feature_dir.mkdir(parents=True, exist_ok=True)
    try:
        count = write_feature(input_path, feature, DIALECT_FOR_KEY_FORMAT[flags.key_format])
    except (InputError, OSError) as exc:
        for directory in created:  # leave no empty version directory behind
            with contextlib.suppress(OSError):
                directory.rmdir()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    line = donefile_line(version_id, key, feature_dir)
    append_line(donefile_dir / f"{kind}.txt", line)
    print(f"wrote {count} records to {feature}")
    print(f"appended to {donefile_dir / f'{kind}.txt'}: {line}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
