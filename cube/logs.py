"""One logging setup for every command: human-readable lines by default, or one JSON object
per line (`--log_format json`) for log collectors, to stderr and optionally a file."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

LOG_FORMATS = ("text", "json")
# attributes every LogRecord has; anything else on a record (logging's `extra=`) is a field
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "program", "pid", "message", ...extra fields, "exception"}."""

    def __init__(self, program: str, tag: str = "") -> None:
        super().__init__()
        self.program = program
        self.tag = tag

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "program": self.program,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if self.tag:
            entry["role"] = self.tag
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value if isinstance(value, (str, int, float, bool)) else str(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(
    program: str,
    level: int | str,
    log_format: str = "text",
    log_file: str | Path | None = None,
    text_format: str = "%(asctime)s %(levelname)s %(name)s: %(message)s",
    tag: str = "",
) -> None:
    """Configure the root logger for a command: `level`, `log_format` (text or json), stderr
    and `log_file` (its directory created). Replaces any earlier configuration."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    formatter = (
        JsonFormatter(program, tag) if log_format == "json" else logging.Formatter(text_format)
    )
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=handlers, force=True)
