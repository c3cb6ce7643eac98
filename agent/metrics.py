"""Prometheus metrics of cube-agent: tasks by command and outcome (with the failure reason),
the time each command and each step of a download takes (fetch, verify, extract), bytes
downloaded, what is on disk (versions placed, bytes under data/) and the room left for more
(`disk_space`: the filesystem's, or what --disk_limit leaves).

`AgentCounters` is updated as tasks and steps end; `AgentCollector` reads a snapshot taken on
the event loop at scrape time. Labels are bounded: a command, an outcome, a reason code, a
step, a task state; never a version.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cube.metrics import Histogram, cumulative_buckets
from cube.protocol import CORRUPT_VERSION, NO_SPACE, SERVER_UNREACHABLE

COMMANDS = ("download", "reload", "enable", "rollback")
STEPS = ("fetch", "verify", "extract")
# a command or a step: well under a second to an hour
SECONDS_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0)


# the failure reasons a program reacts to (cube.protocol), and none: their series exist from
# the start at 0, so that the first failure is an increase (a counter that appears at 1 is not)
REASONS = ("", SERVER_UNREACHABLE, CORRUPT_VERSION, NO_SPACE)


class AgentCounters:
    def __init__(self) -> None:
        self.tasks: dict[tuple[str, str, str], int] = {  # (command, outcome, reason) -> ended
            (command, outcome, reason): 0
            for command in COMMANDS
            for outcome, reasons in (("succeeded", ("",)), ("failed", REASONS))
            for reason in reasons
        }
        self.durations = {command: Histogram(SECONDS_BUCKETS) for command in COMMANDS}
        self.steps = {step: Histogram(SECONDS_BUCKETS) for step in STEPS}
        self.downloaded_bytes = 0

    def task_ended(self, command: str, succeeded: bool, reason: str, seconds: float) -> None:
        key = (command, "succeeded" if succeeded else "failed", reason)
        self.tasks[key] = self.tasks.get(key, 0) + 1
        if command in self.durations:
            self.durations[command].observe(seconds)

    def step(self, name: str, seconds: float) -> None:
        self.steps[name].observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        return {
            "tasks": [[*key, count] for key, count in self.tasks.items()],
            "durations": {c: h.snapshot() for c, h in self.durations.items()},
            "steps": {s: h.snapshot() for s, h in self.steps.items()},
            "downloaded_bytes": self.downloaded_bytes,
        }


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under `root` (0 when it does not exist)."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def disk_space(root: Path, limit: int = 0) -> tuple[int, int]:
    """(capacity, available): the bytes the agent may keep under `root` and what is left of
    them. Without `limit`, the filesystem's size and free space; with it (an emptyDir's
    sizeLimit, which the kubelet enforces by evicting the pod, or a quota of the operator's),
    the limit and what the files under `root` leave of it, never more than the filesystem has
    free."""
    usage = shutil.disk_usage(root)
    if limit <= 0:
        return usage.total, usage.free
    return limit, max(0, min(usage.free, limit - tree_bytes(root)))


class AgentCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        counters = s["counters"]
        tasks = CounterMetricFamily(
            "cube_agent_tasks",
            "Tasks ended, by command, outcome and failure reason",
            labels=["command", "outcome", "reason"],
        )
        for command, outcome, reason, count in counters["tasks"]:
            tasks.add_metric([command, outcome, reason], count)
        durations = HistogramMetricFamily(
            "cube_agent_task_duration_seconds", "Time a task ran", labels=["command"]
        )
        for command, snapshot in counters["durations"].items():
            buckets = cumulative_buckets(SECONDS_BUCKETS, snapshot)
            durations.add_metric([command], buckets, snapshot["sum"])
        steps = HistogramMetricFamily(
            "cube_agent_download_step_duration_seconds",
            "Time a step of a download took (fetch, verify the md5, extract)",
            labels=["step"],
        )
        for step, snapshot in counters["steps"].items():
            steps.add_metric([step], cumulative_buckets(SECONDS_BUCKETS, snapshot), snapshot["sum"])
        downloaded = CounterMetricFamily(
            "cube_agent_downloaded_bytes", "Bytes of tars downloaded", labels=[]
        )
        downloaded.add_metric([], counters["downloaded_bytes"])
        running = GaugeMetricFamily("cube_agent_tasks_running", "Tasks running", labels=["command"])
        for command in COMMANDS:
            running.add_metric([command], s["running"].get(command, 0))
        versions = GaugeMetricFamily(
            "cube_agent_versions_placed", "Versions placed under data/", labels=[]
        )
        versions.add_metric([], s["versions"])
        disk = GaugeMetricFamily(
            "cube_agent_disk_bytes", "Bytes on disk, by area (data, downloads)", labels=["area"]
        )
        for area, size in s["disk"].items():
            disk.add_metric([area], size)
        capacity = GaugeMetricFamily(
            "cube_agent_disk_capacity_bytes",
            "Bytes the instance may keep: --disk_limit, else its filesystem's size",
            labels=["deploy_path"],
        )
        available = GaugeMetricFamily(
            "cube_agent_disk_available_bytes",
            "Bytes left of that capacity for more downloads",
            labels=["deploy_path"],
        )
        for space in s["space"]:
            capacity.add_metric([space["deploy_path"]], space["capacity"])
            available.add_metric([space["deploy_path"]], space["available"])
        yield from (tasks, durations, steps, downloaded, running, versions, disk)
        yield from (capacity, available)
