"""One logging setup for every command: human-readable lines by default, or one JSON object
per line (`--log_format json`) for log collectors, to stderr and optionally a file.

Every text line of every command has one shape (`TEXT_FORMAT`): the time, the level in
capitals, the logger's name (and the process's role, `[worker 1 pid 4242]`, where one command
runs several), then the message. A line a tool waits for on stdout (`announce`) has it too."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
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


def text_format(tag: str = "") -> str:
    """TEXT_FORMAT, with the process's role and pid after the logger's name when it has a
    role (`[worker 1 pid 4242]`: several processes of one command share a log)."""
    return (
        TEXT_FORMAT.replace("%(name)s:", f"%(name)s [{tag} pid %(process)d]:")
        if tag
        else TEXT_FORMAT
    )


def _formatter(program: str, log_format: str, tag: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(program, tag)
    return logging.Formatter(text_format(tag))


_ANNOUNCE = logging.StreamHandler(sys.stdout)


def setup_logging(
    program: str,
    level: int | str,
    log_format: str = "text",
    log_file: str | Path | None = None,
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
    formatter = _formatter(program, log_format, tag)
    for handler in handlers:
        handler.setFormatter(formatter)
    _ANNOUNCE.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=handlers, force=True)


def announce(logger: logging.Logger, message: str) -> None:
    """`message` as an INFO line of `logger` on stdout, in the log's format: for the tools
    that wait for it (cube-agent's "listening on URL", whose last word is the URL), and no bare
    line where stdout and stderr share a file (cube-local's logs)."""
    record = logger.makeRecord(logger.name, logging.INFO, "", 0, message, (), None)
    _ANNOUNCE.setStream(sys.stdout)  # the current one (tests swap it)
    _ANNOUNCE.handle(record)
