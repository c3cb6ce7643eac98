"""The HTTP JSON contract of cube-agent and cube-transfer (the original's shapes; the agent
side is described in docs/ROLLOUT.md). Pure: both servers build answers with it and the
transfer reads agents' answers with it.

Every answer is the envelope `{"success": "0"|"255"|"2", "message": str, "data": ...}`:
"0" the request succeeded, "255" it failed (the message says why), "2" unknown API (data
lists the API)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
