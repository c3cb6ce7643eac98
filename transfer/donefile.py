"""Donefiles: `base.txt` / `patch.txt`, one JSON object per line, appended by the trainer.

A line is `{"id": "<ts>", "key": "<ts>", "input": "<dir>"}`; for a base `id == key`, for a patch
`key` is the id of the base it applies to. Ids are decimal integers (Unix timestamps in the
original) given as a string or a number; they name versions, so nothing else is accepted. A
patch line may also carry `"delete": "<dir or file>"` (keys to delete, passed to the builder as
`-delete_path`). A base line may carry `"allow_shrink": true` (ours): this base goes live even
when it is empty or much smaller than the live version (transfer.conf `max_shrink`,
`allow_empty_base`); use it for an intended shrink, after a refusal says why. Other fields are
ignored, so the original's lines stay valid.

Parsing is pure. Fetching the text (a local directory, `http(s)://` or `ftp://`) and mirroring an
input directory use aiohttp and fsspec; nothing runs a shell.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

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
    except ValueError as exc:
        return bad(f"not JSON ({exc.msg} at column {exc.colno})")
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


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/\s]*)@")


def redact(text: str) -> str:
    """`text` with the user and password of every URL in it hidden (`ftp://***@host/...`):
    what the API shows of addresses, inputs and messages must not hand out credentials."""
    return _USERINFO.sub(r"\1***@", text)


def short_error(exc: BaseException, limit: int = 200) -> str:
    """An exception from a remote source as `Type: text`, the text cut to `limit` characters
    (it may quote what a server sent, e.g. a reason phrase)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def is_url(address: str) -> bool:
    return urlsplit(address).scheme in ("http", "https", "ftp", "file")


def resolve_input(donefile_address: str, source: str) -> str:
    """Where an entry's input lives: a URL stays as it is; a path is local when the donefile is
    local (relative paths relative to the donefile directory), and on the donefile's server
    (same scheme, host and port) when the donefile is a URL, as the original resolved it."""
    if is_url(source):
        return source
    if not is_url(donefile_address):
        path = Path(source)
        return str(path if path.is_absolute() else (Path(donefile_address) / path))
    parts = urlsplit(donefile_address)
    if parts.scheme == "file":
        path = Path(source)
        return str(path if path.is_absolute() else (Path(parts.path) / path))
    path = source if source.startswith("/") else parts.path.rstrip("/") + "/" + source
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class SourceUnavailable(Exception):
    """A donefile or input that could not be read this time (the message says why)."""


async def read_donefile(address: str, name: str, timeout: float = 30.0) -> str:
    """The text of `<address>/<name>`; '' when it does not exist yet."""
    if not is_url(address) or urlsplit(address).scheme == "file":
        base = Path(urlsplit(address).path if is_url(address) else address)
        try:
            data = await asyncio.to_thread((base / name).read_bytes)
        except FileNotFoundError:
            return ""
        except OSError as exc:
            raise SourceUnavailable(f"{base / name}: {exc.strerror}") from exc
        return data.decode("utf-8", errors="replace")
    url = address.rstrip("/") + "/" + name
    try:
        data = await asyncio.wait_for(asyncio.to_thread(_cat_url, url), timeout)
    except FileNotFoundError:
        return ""
    except (TimeoutError, OSError, ValueError, RuntimeError) as exc:
        raise SourceUnavailable(f"{url}: {short_error(exc)}") from exc
    return data.decode("utf-8", errors="replace")


def _filesystem(url: str):
    """An fsspec filesystem for `url` and the path to use with it (a fresh instance: nothing
    cached between polls)."""
    from fsspec.core import url_to_fs  # imported lazily: only remote donefiles need it

    return url_to_fs(url, skip_instance_cache=True)


def _cat_url(url: str) -> bytes:
    fs, path = _filesystem(url)
    return fs.cat_file(path)


def mirror_input(source: str, dest: Path) -> list[str]:
    """Copy the files of the input directory `source` (a URL) into `dest` (replaced), through
    fsspec (HTTP directory index pages or FTP listings). Sub-directories and hidden files are
    skipped, as the builder would skip them. Returns the file names. Blocking: run in a thread."""
    fs, base = _filesystem(source.rstrip("/"))
    base = base.rstrip("/")
    try:
        listing = fs.ls(base + "/" if "://" in base else base, detail=True)
    except FileNotFoundError as exc:
        raise SourceUnavailable(f"input {source}: not found") from exc
    except (OSError, ValueError, RuntimeError) as exc:
        raise SourceUnavailable(f"input {source}: cannot list: {short_error(exc)}") from exc
    files: dict[str, str] = {}
    for item in listing:
        full = str(item["name"])
        name = full.rstrip("/").rsplit("/", 1)[-1]
        if item.get("type") == "directory" or full.endswith("/"):
            continue
        if not name or name.startswith(".") or name in ("index.html", "index.htm"):
            continue
        if not full.startswith(base + "/"):
            continue  # a link out of the directory (parent, elsewhere)
        files[name] = full
    if not files:
        raise SourceUnavailable(f"input {source}: no files")
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, full in sorted(files.items()):
        try:
            fs.get_file(full, str(tmp / name))
        except (OSError, ValueError, RuntimeError) as exc:
            raise SourceUnavailable(f"input {full}: {short_error(exc)}") from exc
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return sorted(files)
