"""Asynchronous, idempotent, journaled tasks: one per (command, version).

The HTTP handler only submits and returns; the work runs as an asyncio task the transfer polls.
Rules (docs/ROLLOUT.md): repeating a running or succeeded command returns the existing task (a
succeeded one is re-run only when its effect is gone, e.g. the version dir was deleted); a failed
one is restarted; another command on a version that has a running task is refused, and so is a
second server command (reload/enable/rollback) while one runs, since the server serializes them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cube.agent.journal import Journal
from cube.protocol import FAILED, RUNNING, SUCCEEDED

log = logging.getLogger("cube.agent")

MAX_FINISHED_TASKS = 256
INTERRUPTED = (
    "interrupted: the agent stopped while this task ran; send the same command again to resume it"
)


class TaskBusy(Exception):
    """A command that conflicts with a running task; the message names that task."""


class TaskFailed(Exception):
    """An expected failure of a task; its message is what the transfer sees, its `reason` (if
    any) what a program may act on (see Task.reason)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Task:
    command: str
    version: str
    request: dict[str, Any] = field(default_factory=dict)
    state: str = RUNNING
    message: str = ""
    started_at: float = field(default_factory=lambda: round(time.time(), 3))
    finished_at: float | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    runs: int = 1
    reason: str = ""  # of a failure, for programs: "server_unreachable", "corrupt_version"

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "version": self.version,
            "state": self.state,
            "message": self.message,
            "reason": self.reason,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "progress": dict(self.progress),
            "runs": self.runs,
        }

    def to_record(self) -> dict[str, Any]:
        return {**self.to_json(), "request": self.request}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Task:
        return cls(
            command=str(record["command"]),
            version=str(record["version"]),
            request=dict(record.get("request") or {}),
            state=str(record.get("state", FAILED)),
            message=str(record.get("message", "")),
            started_at=float(record.get("started_at") or 0.0),
            finished_at=record.get("finished_at"),
            progress=dict(record.get("progress") or {}),
            reason=str(record.get("reason") or ""),
            runs=int(record.get("runs", 1)),
        )


Runner = Callable[[Task, Callable[[], None]], Awaitable[str]]


class TaskManager:
    """Owns every task, its asyncio handle and its journal file."""

    def __init__(
        self,
        journal: Journal,
        runners: dict[str, Runner],
        exclusive: set[str],
        still_done: Callable[[Task, dict[str, Any]], Awaitable[bool]],
        expected_errors: tuple[type[BaseException], ...] = (),
        on_end: Callable[[Task], None] = lambda task: None,
    ) -> None:
        self.on_end = on_end  # told of every task that ends (the metrics count them)
        self.journal = journal
        self.runners = runners
        self.exclusive = exclusive
        self.still_done = still_done
        self.expected_errors: tuple[type[BaseException], ...] = (TaskFailed, *expected_errors)
        self._tasks: dict[tuple[str, str], Task] = {}
        self._handles: dict[tuple[str, str], asyncio.Task[Any]] = {}
        self._lock = asyncio.Lock()

    def recover(self) -> None:
        """Load the journal; tasks cut off by a crash become failed ('interrupted')."""
        for record in self.journal.load_tasks():
            task = Task.from_record(record)
            if task.state == RUNNING:
                task.state, task.message = FAILED, INTERRUPTED
                task.finished_at = round(time.time(), 3)
                self.journal.save_task(task.to_record())
            self._tasks[(task.command, task.version)] = task

    def find(self, command: str, version: str) -> Task | None:
        return self._tasks.get((command, version))

    def latest_for(self, version: str) -> Task | None:
        tasks = [t for t in self._tasks.values() if t.version == version]
        return max(tasks, key=lambda t: t.started_at) if tasks else None

    def all(self) -> list[Task]:
        return sorted(self._tasks.values(), key=lambda t: t.started_at)

    def running(self) -> list[Task]:
        return [t for t in self._tasks.values() if t.state == RUNNING]

    async def submit(self, command: str, version: str, request: dict[str, Any]) -> Task:
        async with self._lock:
            existing = self._tasks.get((command, version))
            if existing is not None and existing.state == RUNNING:
                return existing
            for other in self.running():
                if other.version == version:
                    raise TaskBusy(
                        f"{other.command} of version {version} is running; send {command} "
                        "after it has finished"
                    )
                if command in self.exclusive and other.command in self.exclusive:
                    raise TaskBusy(
                        f"{other.command} of version {other.version} is running and the "
                        f"cube-server takes one control command at a time; retry {command} "
                        "later"
                    )
            if (
                existing is not None
                and existing.state == SUCCEEDED
                and await self.still_done(existing, request)
            ):
                return existing
            task = Task(command, version, request, runs=existing.runs + 1 if existing else 1)
            self._tasks[(command, version)] = task
            self._save(task)
            self._handles[(command, version)] = asyncio.create_task(
                self._run(task, self.runners[command]), name=f"{command}@{version}"
            )
            self._prune()
            return task

    async def _run(self, task: Task, runner: Runner) -> None:
        log.info("%s %s: started (run %d)", task.command, task.version, task.runs)
        try:
            task.message = await runner(task, lambda: self._save(task))
            task.state = SUCCEEDED
        except asyncio.CancelledError:
            task.state, task.message = FAILED, INTERRUPTED
            raise
        except self.expected_errors as exc:
            task.state, task.message = FAILED, str(exc)
            task.reason = getattr(exc, "reason", "")
        except Exception as exc:  # its text may quote what a source sent: only in the log
            log.exception("%s %s: internal error", task.command, task.version)
            task.state = FAILED
            task.message = f"internal error ({type(exc).__name__}); details in the agent's log"
        finally:
            task.finished_at = round(time.time(), 3)
            self._handles.pop((task.command, task.version), None)
            self._save(task)
            self.on_end(task)
            log.info("%s %s: %s: %s", task.command, task.version, task.state, task.message)

    def _save(self, task: Task) -> None:
        try:
            self.journal.save_task(task.to_record())
        except OSError as exc:  # a full disk must not kill the task loop; the state is in memory
            log.error("cannot journal task %s %s: %s", task.command, task.version, exc)

    def _prune(self) -> None:
        finished = [t for t in self.all() if t.state != RUNNING]
        for task in finished[: max(0, len(finished) - MAX_FINISHED_TASKS)]:
            del self._tasks[(task.command, task.version)]
            self.journal.drop_task(task.command, task.version)

    async def wait_for(self, task: Task, timeout: float) -> None:
        """Wait up to `timeout` s for `task` to end (it goes on running after a timeout or if
        the waiter is cancelled)."""
        handle = self._handles.get((task.command, task.version))
        if handle is not None and task.state == RUNNING:
            await asyncio.wait([asyncio.shield(handle)], timeout=timeout)

    async def wait_idle(self, timeout: float) -> None:
        """Wait (bounded) for running tasks; for tests and shutdown."""
        handles = list(self._handles.values())
        if handles:
            await asyncio.wait(handles, timeout=timeout)

    async def close(self) -> None:
        for handle in list(self._handles.values()):
            handle.cancel()
        await self.wait_idle(timeout=10.0)
