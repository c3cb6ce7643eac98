"""A command request (the original's `Work` object), validated into something safe to act on.

Pure: no files, no network. Every field that becomes part of a path is checked to be one plain
path component; the request's `deploy_path`, when given, must be the agent's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cube.agent.layout import BadRequest, check_name, clip, normalize_chain, version_dir_name
from cube.fsutil import is_md5_hex

LONG_COMMANDS = ("download", "reload", "enable", "rollback")
SERVER_COMMANDS = frozenset({"reload", "enable", "rollback"})
QUERY_COMMAND = "task"
COMMANDS = (*LONG_COMMANDS, QUERY_COMMAND)
MODES = ("base", "delta")
MAX_SOURCE = 4096  # characters of a source URL or path


@dataclass(frozen=True)
class Work:
    command: str
    version: str  # the version directory name
    mode: str = ""  # "base" | "delta" | "" (unknown: decided from the placed files)
    dict_name: str = ""
    shard_seq: int = 0
    source: str = ""
    md5: str = ""
    size: int | None = None
    chain: list[str] = field(default_factory=list)
    task_command: str = ""  # for "task": which task to report ('' = the latest)

    def to_request(self) -> dict[str, Any]:
        """What the journal keeps to re-run the task (never the token)."""
        return {
            "mode": self.mode,
            "dict_name": self.dict_name,
            "shard_seq": self.shard_seq,
            "source": self.source,
            "md5": self.md5,
            "size": self.size,
            "chain": list(self.chain),
        }


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise BadRequest(f"{name}: expected a string, got {type(value).__name__}")
    return value.strip()


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None or value == "":
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        if isinstance(value, (bool, float)):
            raise ValueError
        number = int(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{name}: expected an integer, got {clip(value)}") from None
    if number < 0:
        raise BadRequest(f"{name}: must not be negative, got {number}")
    return number


def _same_path(requested: str, deploy_path: Path) -> bool:
    try:
        return Path(requested).resolve() == deploy_path.resolve()
    except (OSError, ValueError):  # a NUL byte, a symlink loop...
        return False


def parse_work(body: object, deploy_path: Path) -> Work:
    """Validate a POST /agent/cmd body; BadRequest names the offending field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    command = _text(body, "command")
    if command not in COMMANDS:
        raise BadRequest(f"command: {clip(command)} is not one of {', '.join(COMMANDS)}")
    requested_path = _text(body, "deploy_path")
    if requested_path and not _same_path(requested_path, deploy_path):
        raise BadRequest(
            f"deploy_path: {clip(requested_path)} is not this agent's --deploy_path "
            f"{str(deploy_path)!r}"
        )
    mode = _text(body, "mode")
    if mode and mode not in MODES:
        if command == "download":
            raise BadRequest(f"mode: {clip(mode)} is not one of base, delta")
        mode = ""  # other commands read the mode from the placed files (CHAIN)
    raw_version = _text(body, "version")
    if not raw_version:
        raise BadRequest("version: required")
    version = version_dir_name(raw_version, _text(body, "depend"), mode)
    dict_name = _text(body, "dict_name")
    if dict_name:
        check_name("dict_name", dict_name)
    shard_seq = _int(body, "shard_seq", 0) or 0
    if command == QUERY_COMMAND:
        task_command = _text(body, "task_command")
        if task_command and task_command not in LONG_COMMANDS:
            raise BadRequest(f"task_command: {clip(task_command)} is not one of {LONG_COMMANDS}")
        return Work(command, version, task_command=task_command)
    source = md5 = ""
    size = None
    chain: list[str] = []
    if command == "download":
        source = _text(body, "source")
        if not source:
            raise BadRequest("source: required for download")
        if len(source) > MAX_SOURCE:
            raise BadRequest(f"source: longer than {MAX_SOURCE} characters")
        if ";" in source:
            raise BadRequest("source: one tar per request (the agent serves one shard split)")
        md5 = _text(body, "md5").lower()
        if md5 and not is_md5_hex(md5):
            raise BadRequest(f"md5: {clip(md5)} is not 32 hex digits")
        size = _int(body, "size", None)
        if not mode:
            mode = "delta" if body.get("chain") or "_" in version else "base"
        if mode == "delta":
            chain = normalize_chain(body.get("chain"), version)
    return Work(command, version, mode, dict_name, shard_seq, source, md5, size, chain)
