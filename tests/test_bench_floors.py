"""bench/dram.py and bench/disk.py run and report what they say they measure (tiny sizes:
the figures are bench/RESULTS.md's, not asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_dram_reports_a_dependent_miss_dearer_than_an_independent_one() -> None:
    result = _run("cube.bench.dram", "--gib", "0.25", "--seconds", "0.1")
    chase, gather = float(result["chase_ns"]), float(result["gather_ns"])  # type: ignore[arg-type]
    assert chase > gather > 0
    floor = result["floor_us_per_1000_keys"]  # 3 misses a key, from the unrounded ns
    assert isinstance(floor, float) and abs(floor - gather * 3) <= 0.1


@pytest.mark.slow
def test_disk_reports_reads_per_second_at_each_depth(tmp_path: Path) -> None:
    result = _run("cube.bench.disk", "--dir", str(tmp_path), "--gib", "0.02", "--seconds", "0.2")
    depths = result["reads_per_s_by_depth"]
    assert isinstance(depths, dict) and set(depths) == {"1", "4", "16", "32", "64"}
    assert all(value > 0 for value in depths.values())
    assert not list(tmp_path.iterdir())  # its file removed


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists(),
    reason="needs root and cgroup v1's memory controller",
)
def test_switch_reports_a_pinned_switch_in_a_memory_group(tmp_path: Path) -> None:
    """bench/switch.py: a real server in a group, a base switch with lookups running."""
    result = _run(
        "cube.bench.switch", "--keys", "3000000", "--width", "64", "--share", "2.5",
        "--seconds", "60", "--dir", str(tmp_path),
    )  # fmt: skip
    assert result["failed"] == 0 and result["server_alive"] is True, result
    lookups, held = result["lookups"], result["held_peak_x_version"]
    assert "pinned_s" in result and isinstance(lookups, int) and lookups > 0
    assert isinstance(held, float) and 1.0 < held < 2.5
    assert not list(tmp_path.iterdir())  # its versions removed
