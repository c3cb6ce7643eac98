"""bench/dram.py and bench/disk.py run and report what they say they measure (tiny sizes:
the figures are bench/RESULTS.md's, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_dram_reports_a_dependent_miss_dearer_than_an_independent_one() -> None:
    result = _run("cube.bench.dram", "--gib", "0.25", "--seconds", "0.1")
    chase, gather = float(result["chase_ns"]), float(result["gather_ns"])  # type: ignore[arg-type]
    assert chase > gather > 0
    assert result["floor_us_per_1000_keys"] == round(gather * 3, 1)


@pytest.mark.slow
def test_disk_reports_reads_per_second_at_each_depth(tmp_path: Path) -> None:
    result = _run("cube.bench.disk", "--dir", str(tmp_path), "--gib", "0.02", "--seconds", "0.2")
    depths = result["reads_per_s_by_depth"]
    assert isinstance(depths, dict) and set(depths) == {"1", "4", "16", "32", "64"}
    assert all(value > 0 for value in depths.values())
    assert not list(tmp_path.iterdir())  # its file removed
