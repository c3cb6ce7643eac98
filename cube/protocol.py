"""The HTTP JSON contract of cube-agent and cube-transfer (the original's shapes; described in
docs/ROLLOUT.md). Pure: both sides import it, so the agent's validation and the transfer's
requests, and the agent's task reports and the transfer's reading of them, cannot drift.

- Every answer is the envelope `{"success": "0"|"255"|"2", "message": str, "data": ...}`:
  "0" the request succeeded, "255" it failed (the message says why), "2" unknown API.
- A command (`POST /agent/cmd`) is the original's `Work` object: `Work.to_json` is what the
  transfer sends, `parse_work` what the agent accepts (BadRequest names the field at fault).
- A task report (`data` of a command or `task` query) is read back with `TaskReport`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cube.fsutil import is_md5_hex
from cube.layout import NAME_RULE, clip, is_name, output_dir_name, served_name

OK, ERROR, UNKNOWN_API = "0", "255", "2"


def envelope(data: Any = None, message: str = "", success: str = OK) -> dict[str, Any]:
    return {"success": success, "message": message, "data": data}


@dataclass(frozen=True)
class Reply:
    """An envelope read back: `ok` when success is "0"."""

    success: str
    message: str
    data: Any

    @property
    def ok(self) -> bool:
        return self.success == OK


def read_envelope(answer: object) -> Reply | None:
    """The envelope in a decoded JSON answer, None when it is not one."""
    if not isinstance(answer, dict) or "success" not in answer:
        return None
    message = answer.get("message")
    text = message if isinstance(message, str) else ""
    return Reply(str(answer.get("success")), text, answer.get("data"))


# ---------------------------------------------------------------------------------------------
# commands


class BadRequest(ValueError):
    """A request field that cannot be used; the message names the field."""


def check_name(field: str, value: object) -> str:
    """A version or dict name that is safe as one path component (no '/', no '..')."""
    if not is_name(value):
        raise BadRequest(f"{field}: {clip(value, 80)} is not a valid name ({NAME_RULE})")
    return value


def version_dir_name(version: str, depend: str = "", mode: str = "") -> str:
    """The directory name a version is placed and served under.

    Accepts the directory name itself (`<depend>` for a base, `<depend>_<cur>` for a delta) or the
    original's pair (`version=<cur>`, `depend=<depend>`, `mode=delta`). The builder names a base's
    output `<depend>_<depend>`; it is served as `<depend>`.
    """
    check_name("version", version)
    if depend:
        check_name("depend", depend)
    if served_name(version) != version:
        return served_name(version)
    if mode == "delta" and depend and "_" not in version and version != depend:
        return output_dir_name(depend, version)
    return version


def normalize_chain(chain: object, version: str) -> list[str]:
    """Validate a delta's chain (base first); it must end with the delta itself (appended if
    the sender left it out)."""
    if not isinstance(chain, list) or not chain:
        raise BadRequest(f"chain: a delta ({version}) needs a non-empty list, base first")
    names = [check_name("chain entry", name) for name in chain]
    if names[-1] != version:
        names.append(version)
    if len(names) < 2:
        raise BadRequest(f"chain: {names} has no base before the delta {version}")
    if len(set(names)) != len(names):
        raise BadRequest(f"chain: {names} names a version twice")
    return names


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
    # the original's other fields: sent by the transfer, accepted (and not needed) by the agent
    depend: str = ""
    deploy_path: str = ""
    port: int = 0
    id: str = ""
    key: str = ""

    def to_json(self) -> dict[str, Any]:
        """The POST /agent/cmd body (the original's Work field names)."""
        body: dict[str, Any] = {
            "dict_name": self.dict_name,
            "shard_seq": self.shard_seq,
            "deploy_path": self.deploy_path,
            "command": self.command,
            "version": self.version,
            "depend": self.depend,
            "mode": self.mode,
            "source": self.source,
            "port": self.port,
            "id": self.id,
            "key": self.key,
        }
        if self.md5:
            body["md5"] = self.md5
        if self.size is not None:
            body["size"] = self.size
        if self.chain:
            body["chain"] = list(self.chain)
        if self.task_command:
            body["task_command"] = self.task_command
        return body

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


def pick_deploy_path(requested: str, deploy_paths: Sequence[Path]) -> Path:
    """The instance a request is for, among an agent's deploy paths (its --deploy_path, then
    --instances): the one `requested` names (it must name one; it may be left out when there
    is only one). BadRequest otherwise."""
    if len(deploy_paths) == 1 and not requested:
        return deploy_paths[0]
    for path in deploy_paths:
        if requested and _same_path(requested, path):
            return path
    served = ", ".join(repr(str(path)) for path in deploy_paths)
    if not requested:
        raise BadRequest(f"deploy_path: required: this agent serves several instances ({served})")
    if len(deploy_paths) == 1:
        raise BadRequest(
            f"deploy_path: {clip(requested)} is not this agent's --deploy_path {served}"
        )
    raise BadRequest(
        f"deploy_path: {clip(requested)} is none of this agent's instances ({served};"
        " --deploy_path and --instances)"
    )


# Fields the original cube-transfer's command body always carries (its Go struct has no
# omitempty on them) and this project's transfer never sends.
_ORIGINAL_TRANSFER_FIELDS = ("finish_status", "rollback_info")


def asked_the_original_way(body: object) -> bool:
    """Whether a POST /agent/cmd body comes from the original cube-transfer, which takes the
    reply as the outcome (its agent answered when the work was done); this project's transfer
    polls the task instead."""
    return isinstance(body, dict) and any(key in body for key in _ORIGINAL_TRANSFER_FIELDS)


def parse_work(body: object, deploy_path: Path) -> Work:
    """Validate a POST /agent/cmd body; BadRequest names the offending field. A delta's
    `chain` is required, except from the original transfer (which has none): its Work has an
    empty chain, for the agent to take from what it serves (`Agent.submit`)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    command = _text(body, "command")
    if command not in COMMANDS:
        raise BadRequest(f"command: {clip(command)} is not one of {', '.join(COMMANDS)}")
    requested_path = _text(body, "deploy_path")
    if requested_path:
        pick_deploy_path(requested_path, [deploy_path])
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
        if mode == "delta" and (body.get("chain") or not asked_the_original_way(body)):
            chain = normalize_chain(body.get("chain"), version)
    return Work(command, version, mode, dict_name, shard_seq, source, md5, size, chain)


# ---------------------------------------------------------------------------------------------
# tasks

RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"
# Task.reason values a program reacts to
SERVER_UNREACHABLE = "server_unreachable"  # the server did not answer: wait for it
CORRUPT_VERSION = "corrupt_version"  # the placed copy failed a check and is gone: download
NO_SPACE = "no_space"  # the download does not fit on the disk (or --disk_limit): free some


@dataclass(frozen=True)
class TaskReport:
    """A task as an agent reports it (the agent's Task.to_json)."""

    command: str
    version: str
    state: str
    message: str = ""
    reason: str = ""
    progress: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: object) -> TaskReport | None:
        """None when `data` is not a task report."""
        if not isinstance(data, dict) or data.get("state") not in (RUNNING, SUCCEEDED, FAILED):
            return None
        progress = data.get("progress")
        return cls(
            command=str(data.get("command") or ""),
            version=str(data.get("version") or ""),
            state=str(data["state"]),
            message=data["message"] if isinstance(data.get("message"), str) else "",
            reason=data["reason"] if isinstance(data.get("reason"), str) else "",
            progress=progress if isinstance(progress, dict) else {},
        )
