"""Durable, all-or-nothing file writes shared by the builder, agent, transfer and server, and
the md5 files that travel with the builder's tars.

A reader sees the old file or the new one, never half of either, even across kill -9 or power
loss: write a temp file in the same directory, fsync it, rename it over the target, fsync the
directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or create inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 1) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# md5 files: the builder writes `<tar>.md5` in md5sum's format; the transfer and agents check it

_MD5_HEX = re.compile(r"[0-9a-fA-F]{32}")


def is_md5_hex(text: str) -> bool:
    return _MD5_HEX.fullmatch(text) is not None


def md5_line(md5: str, name: str) -> str:
    """One md5sum line: `md5sum -c` accepts it."""
    return f"{md5}  {name}\n"


def md5_of_line(text: str) -> str | None:
    """The digest in an md5sum-style line ("<hex>  <name>"), lower-case; None if there is
    none (callers name the file in their own error)."""
    fields = text.split(maxsplit=1)
    if not fields or not is_md5_hex(fields[0]):
        return None
    return fields[0].lower()


def file_md5(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class Md5Error(ValueError):
    """A file that does not match its `.md5` file, or an `.md5` file without a digest; the
    message names the file."""


def check_md5_file(path: str | os.PathLike[str], verify: bool = True) -> str | None:
    """The digest `<path>.md5` (md5sum's line) gives, `path` checked against it when `verify`;
    None when there is no `<path>.md5` (the caller decides whether that is an error).
    Md5Error when the digests differ or the file holds no digest."""
    md5_path = Path(f"{os.fspath(path)}.md5")
    try:
        text = md5_path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    expected = md5_of_line(text)
    if expected is None:
        raise Md5Error(f"{md5_path}: no md5 hash (32 hex digits) at its start")
    if verify:
        actual = file_md5(path)
        if actual != expected:
            raise Md5Error(f"{path}: md5 {actual} does not match its .md5 file ({expected})")
    return expected
