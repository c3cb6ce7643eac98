"""The agent's durable memory in `deploy_path/agent_state/` (JSON, written via temp + rename).

- `tasks/<command>@<version>.json`: one file per task, rewritten at each state or phase change.
  A task found `running` at start was cut off by a crash or kill -9: it is marked failed
  ("interrupted") so the next identical command re-runs it (a download resumes its `.part`).
- `versions.json`: placed versions with their provenance (md5, size, source, mode, chain) and a
  placement sequence number that orders them for retention.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from cube.fsutil import atomic_write_json

log = logging.getLogger("cube.agent")


class Journal:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.tasks_dir = state_dir / "tasks"
        self.versions_path = state_dir / "versions.json"

    def open(self) -> None:
        """Create the directories and drop temp files a crash left behind."""
        self.tasks_dir.mkdir(parents=True, exist_ok=True)
        for folder in (self.state_dir, self.tasks_dir):
            for entry in os.scandir(folder):
                if entry.is_file() and entry.name.startswith(".") and ".tmp-" in entry.name:
                    os.unlink(entry.path)

    @staticmethod
    def task_file_name(command: str, version: str) -> str:
        return f"{command}@{version}.json"

    def load_tasks(self) -> list[dict[str, Any]]:
        tasks = []
        for path in sorted(self.tasks_dir.glob("*.json")):
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(record, dict) or "command" not in record:
                    raise ValueError("not a task record")
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable task journal %s: %s", path, exc)
                continue
            tasks.append(record)
        return tasks

    def save_task(self, record: dict[str, Any]) -> None:
        name = self.task_file_name(record["command"], record["version"])
        atomic_write_json(self.tasks_dir / name, record)

    def drop_task(self, command: str, version: str) -> None:
        (self.tasks_dir / self.task_file_name(command, version)).unlink(missing_ok=True)

    def load_versions(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.versions_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", self.versions_path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def save_versions(self, versions: dict[str, dict[str, Any]]) -> None:
        atomic_write_json(self.versions_path, versions)
