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

The same lines come from PaddlePaddle's trainers under other file names (`DonefileFormat`):
Fleet's `FleetUtil.write_xbox_donefile` appends to `xbox_base_done.txt` / `xbox_patch_done.txt`
and PaddleRec's `write_inference_donefile` to `base_donefile.txt` / `patch_donefile.txt`, each
line `{"id", "key", "input": "<model>/<day>/base/000" or ".../<day>/delta-<pass>/000", ...}`
naming a parameter-server save (`paddle_save_of`). The original Cube's format came from there.
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
class DonefileFormat:
    """Which two files announce bases and patches, and what their inputs are."""

    name: str  # transfer.conf's source_format
    base_file: str
    patch_file: str
    paddle_saves: bool  # inputs are parameter-server saves: <day>/base, <day>/delta-<pass>
    writer: str  # who writes these files (for messages)


DONEFILE_FORMATS = {
    f.name: f
    for f in (
        DonefileFormat("seqfile", BASE_FILE, PATCH_FILE, False, "kv_to_seqfile or a trainer"),
        # paddle.incubate.distributed.fleet.fleet_util.FleetUtil.write_xbox_donefile
        DonefileFormat(
            "paddle_fleet", "xbox_base_done.txt", "xbox_patch_done.txt", True, "Paddle's FleetUtil"
        ),
        # PaddleRec tools/utils/static_ps/flow_helper.py write_inference_donefile
        DonefileFormat(
            "paddlerec", "base_donefile.txt", "patch_donefile.txt", True, "PaddleRec's trainer"
        ),
    )
}
SEQFILE = DONEFILE_FORMATS["seqfile"]
BASE_FILES = frozenset(f.base_file for f in DONEFILE_FORMATS.values())

# <day>/base or <day>/delta-<pass> (Fleet's and PaddleRec's; delta_<pass> too), then the
# table's folder the writers append (they hard-code 000: the first table's id)
_PADDLE_SAVE = re.compile(
    r"(?:^|/)(?P<day>\d{8})/(?P<kind>base|delta[-_](?P<pass>\d{1,9}))(?:/(?P<table>\d{1,9}))?/*$"
)


@dataclass(frozen=True)
class PaddleSave:
    """What the path of a parameter-server save says of it."""

    day: str  # YYYYMMDD
    is_base: bool
    folder: str  # base | delta-<pass>
    save_dir: str  # the path without the table folder a writer appended (`.../000`)


def paddle_save_of(path: str) -> PaddleSave | None:
    """The save a donefile `input` names, when it follows the trainers' layout
    (`<model>/<day>/base[/<table>]`, `<model>/<day>/delta-<pass>[/<table>]`); None otherwise.
    Works on paths and URLs alike (it reads the end of the string)."""
    match = _PADDLE_SAVE.search(path)
    if match is None:
        return None
    save_dir = path[: match.end("kind")] if match.group("table") else path.rstrip("/")
    kind = match.group("kind")
    return PaddleSave(match.group("day"), kind == "base", kind, save_dir)


def paddlerec_relative_input(source: str, donefile_dir: str) -> str:
    """A relative `input` of a PaddleRec donefile, made relative to the donefile's directory.

    PaddleRec's online trainer (tools/static_ps_online_trainer.py, local mode) writes its
    donefiles into `runner.model_save_path` and each line's input as that same path plus
    `/<day>/base/000` (or `/<day>/delta-<pass>/000`), both as the config gives the path: a
    relative one stays relative, to the trainer's working directory (not the config's). So
    the save is `<day>/<kind>` in the donefile's own directory, wherever the trainer ran,
    provided this is the directory the line names: its last components must be the input's
    leading path (after any `..`). ValueError saying why otherwise (a donefile copied or
    mounted under another name, an input not in PaddleRec's form): the transfer is then told
    the trainer's working directory (transfer.conf `paddlerec_workdir`), never guesses."""
    match = _PADDLE_SAVE.search(source)
    if match is None:
        raise ValueError(
            f"input {source} is a relative path, not PaddleRec's <model_save_path>/<day>/base"
            " or .../<day>/delta-<pass>: it is relative to the trainer's working directory;"
            " set paddlerec_workdir in transfer.conf to that directory"
        )
    root = source[: match.start("day")].rstrip("/")
    parts = [p for p in root.split("/") if p not in ("", ".")]
    if ".." in parts:  # <workdir>/../x/y ends in x/y, whatever the working directory
        parts = parts[len(parts) - parts[::-1].index("..") :]
    folders = [p for p in os.path.normpath(donefile_dir).split("/") if p]
    if parts and folders[-len(parts) :] != parts:
        raise ValueError(
            f"input {source} is relative to the PaddleRec trainer's working directory, whose "
            f"{root} (runner.model_save_path) holds its donefiles; but they are read from "
            f"{donefile_dir}, not a folder of that name: set paddlerec_workdir in "
            "transfer.conf to the trainer's working directory, as this transfer sees it"
        )
    return source[match.start("day") :]


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
        return self.file in BASE_FILES

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
        except (ValueError, RecursionError):  # RecursionError: nesting too deep to parse
            pass
    return [line.rstrip("\r") for line in lines]


def parse_line(
    file: str, line_no: int, text: str, donefile_format: DonefileFormat = SEQFILE
) -> DonefileEntry | BadLine | None:
    """One donefile line; None for a blank line. `file` is one of the format's two files; for
    parameter-server saves (`paddle_saves`), a line whose input is a save of the other kind
    is refused (`save_kind_problem`)."""
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
    except RecursionError:  # thousands of nested brackets: json's decoder recurses per level
        return bad("not JSON (nested too deeply to parse)")
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
    is_base = file in BASE_FILES
    if is_base and fields["id"] != fields["key"]:
        return bad(f"a base line needs id == key, got id {fields['id']} key {fields['key']}")
    if is_base and delete:
        return bad("a base line cannot carry 'delete'")
    if not is_base and allow_shrink:
        return bad("'allow_shrink' applies to base lines only (a patch may be empty anyway)")
    if donefile_format.paddle_saves:
        problem = save_kind_problem(donefile_format, is_base, source.strip())
        if problem:
            return bad(problem)
    return DonefileEntry(
        file, line_no, fields["id"], fields["key"], source.strip(), delete.strip(), allow_shrink
    )


def save_kind_problem(donefile_format: DonefileFormat, is_base: bool, path: str) -> str:
    """Why a line's parameter-server save cannot be what its file announces ("" when it can,
    or when its path does not tell). A base replaces the whole table, and shrink deletions
    leave no marker in deltas, so a base save must never be applied as a patch (the keys
    shrunk away would stay served) and a delta save, which holds only the rows changed since
    the last save, never replaces a table."""
    save = paddle_save_of(path)
    if save is None or save.is_base == is_base:
        return ""
    if save.is_base:
        return (
            f"input is a base save ({save.day}/{save.folder}), but the line is in "
            f"{donefile_format.patch_file}: a base replaces the whole table (keys shrunk away "
            f"leave no mark in a delta); announce it in {donefile_format.base_file}"
        )
    return (
        f"input is a delta save ({save.day}/{save.folder}), but the line is in "
        f"{donefile_format.base_file}: a delta holds only the rows changed since the last "
        f"save; announce it in {donefile_format.patch_file}"
    )


def _kind(value: object) -> str:
    """What a bad field holds, without repeating it (error messages never echo what was
    fetched)."""
    return "missing" if value is None else f"a JSON {type(value).__name__}"


def parse_lines(
    file: str, text: str, start_line: int = 0, donefile_format: DonefileFormat = SEQFILE
) -> list[DonefileEntry | BadLine]:
    """Entries of the complete lines after the first `start_line` lines."""
    out: list[DonefileEntry | BadLine] = []
    for offset, line in enumerate(split_complete_lines(text)[start_line:]):
        parsed = parse_line(file, start_line + offset + 1, line, donefile_format)
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


def format_fleet_line(
    version_id: str, key: str, input_path: str, output_path: str, day: str, mpi_size: int = 1
) -> str:
    """A line as Paddle's `FleetUtil.write_xbox_donefile` writes it (fleet_util.py
    `_get_xbox_str`: the same fields, in its order; `record_count` is its constant, the
    job fields empty as outside a cluster). For the example trainer and the tests."""
    fields = {
        "id": version_id,
        "key": key,
        "input": input_path,
        "record_count": "111111",
        "partition_type": "2",
        "job_name": "default_job_name",
        "ins_tag": "feasign",
        "ins_path": "",
        "job_id": "",
        "monitor_data": "",
        "monitor_path": output_path.rstrip("/") + "/monitor/" + day + ".txt",
        "mpi_size": str(mpi_size),
    }
    return json.dumps(fields)


def append_line(path: Path, line: str) -> None:
    """Append one whole line with a single write, so a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
