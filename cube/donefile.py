"""Donefiles: `base.txt` / `patch.txt`, one JSON object per line, appended by the trainer (or
kv_to_seqfile, the CTR example) and read by cube-transfer. Pure, but for `append_line`.

A line is `{"id": "<ts>", "key": "<ts>", "input": "<dir>"}`; for a base `id == key`, for a patch
`key` is the id of the base it applies to. Ids are decimal integers (Unix timestamps in the
original) given as a string or a number; they name versions, so nothing else is accepted. A
patch line may also carry `"delete": "<dir or file>"` (keys to delete, passed to the builder as
`-delete_path`). A base line may carry `"allow_shrink": true` (ours): this base goes live even
when it is empty or much smaller than the live version (transfer.conf `max_shrink`,
`allow_empty_base`); use it for an intended shrink, after a refusal says why. Other fields are
ignored, so the original's lines stay valid.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

BASE_FILE = "base.txt"
PATCH_FILE = "patch.txt"
ID = re.compile(r"\d{1,20}")  # a version id (a timestamp)
VERSION_NAME = re.compile(r"\d{1,20}(?:_\d{1,20})?")  # a base <id> or a delta <base>_<id>


@dataclass(frozen=True)
class DonefileEntry:
    file: str  # base.txt | patch.txt
    line_no: int  # 1-based
    id: str
    key: str
    input: str
    delete: str = ""
    allow_shrink: bool = False

    @property
    def is_base(self) -> bool:
        return self.file == BASE_FILE

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line_no}"


@dataclass(frozen=True)
class BadLine:
    """A line that is not a version; `reason` says why without repeating the line."""

    file: str
    line_no: int
    reason: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line_no}"


def split_complete_lines(text: str) -> list[str]:
    """The lines a writer has finished: everything up to the last newline, plus a final
    unterminated line only when it already parses as a JSON object (a writer may be mid-append,
    and a half line must not be judged malformed)."""
    lines = text.split("\n")
    tail = lines.pop()
    if tail.strip():
        try:
            if isinstance(json.loads(tail), dict):
                lines.append(tail)
        except ValueError:
            pass
    return [line.rstrip("\r") for line in lines]


def parse_line(file: str, line_no: int, text: str) -> DonefileEntry | BadLine | None:
    """One donefile line; None for a blank line."""
    if not text.strip():
        return None

    def bad(reason: str) -> BadLine:
        return BadLine(file, line_no, f"{file}:{line_no}: {reason}")

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return bad(f"not JSON ({exc.msg} at column {exc.colno})")
    except ValueError:  # e.g. a number too long to convert
        return bad("not JSON")
    if not isinstance(obj, dict):
        return bad(f"expected a JSON object, got {type(obj).__name__}")
    fields = {}
    for name in ("id", "key"):
        value = obj.get(name)
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return bad(f"field {name!r} is missing or not a string/integer ({_kind(value)})")
        value = str(value).strip()
        if not ID.fullmatch(value):
            return bad(f"field {name!r} must be a decimal integer of 1 to 20 digits (a timestamp)")
        fields[name] = str(int(value))
    source = obj.get("input")
    if not isinstance(source, str) or not source.strip():
        return bad(f"field 'input' is missing or empty ({_kind(source)})")
    delete = obj.get("delete", "")
    if not isinstance(delete, str):
        return bad(f"field 'delete' must be a string path ({_kind(delete)})")
    allow_shrink = obj.get("allow_shrink", False)
    if not isinstance(allow_shrink, bool):
        return bad(f"field 'allow_shrink' must be true or false ({_kind(allow_shrink)})")
    if file == BASE_FILE and fields["id"] != fields["key"]:
        return bad(f"a base line needs id == key, got id {fields['id']} key {fields['key']}")
    if file == BASE_FILE and delete:
        return bad("a base line cannot carry 'delete'")
    if file != BASE_FILE and allow_shrink:
        return bad("'allow_shrink' applies to base lines only (a patch may be empty anyway)")
    return DonefileEntry(
        file, line_no, fields["id"], fields["key"], source.strip(), delete.strip(), allow_shrink
    )


def _kind(value: object) -> str:
    """What a bad field holds, without repeating it (error messages never echo what was
    fetched)."""
    return "missing" if value is None else f"a JSON {type(value).__name__}"


def parse_lines(file: str, text: str, start_line: int = 0) -> list[DonefileEntry | BadLine]:
    """Entries of the complete lines after the first `start_line` lines."""
    out: list[DonefileEntry | BadLine] = []
    for offset, line in enumerate(split_complete_lines(text)[start_line:]):
        parsed = parse_line(file, start_line + offset + 1, line)
        if parsed is not None:
            out.append(parsed)
    return out


def count_complete_lines(text: str) -> int:
    return len(split_complete_lines(text))


# ----------------------------------------------------------------------------------------------
# where things are


def format_line(
    version_id: str, key: str, input_path: str, delete: str = "", allow_shrink: bool = False
) -> str:
    """A donefile line (without its newline), fields in the original's order."""
    fields: dict[str, object] = {"id": version_id, "key": key, "input": input_path}
    if delete:
        fields["delete"] = delete
    if allow_shrink:
        fields["allow_shrink"] = True
    return json.dumps(fields)


def append_line(path: Path, line: str) -> None:
    """Append one whole line with a single write, so a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
