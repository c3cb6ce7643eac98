"""cube-demo (what `make demo` runs), on a small table: it checks its own lookups, and whatever
happens (success, Ctrl-C) it leaves no process behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import kill_processes_under, processes_under

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

DEMO = [sys.executable, "-m", "cube.transfer.demo"]


def test_demo_runs_checks_and_shuts_down(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    try:
        result = subprocess.run(
            [*DEMO, "--dir", str(work), "--ids", "20000", "--dim", "8"],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        out = result.stdout
        assert result.returncode == 0, out + result.stderr
        assert "checked: 5 ids + a 10,000-id batch equal the table" in out
        assert "checked: changed, new, deleted and untouched ids are all as written" in out
        assert "served by every replica" in out and "deleted (miss)" in out
        assert out.count(": stopped (pid") == 9  # transfer + 4 agents + 4 servers
        assert processes_under(work) == []
        # a second run wipes its own directory and starts again
        again = subprocess.run(
            [*DEMO, "--dir", str(work), "--ids", "1000"],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        kill_processes_under(work)


def test_demo_refuses_to_wipe_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    result = subprocess.run(
        [*DEMO, "--dir", str(tmp_path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2 and "not a cube-demo directory" in result.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_ctrl_c_stops_the_cluster(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    demo = subprocess.Popen(
        [*DEMO, "--dir", str(work), "--ids", "20000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert demo.stdout is not None  # a pipe
            line = demo.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("== 3."):
                break
        assert any(line.startswith("== 3.") for line in lines), "".join(lines)
        assert processes_under(work)  # the cluster is up
        # hold the rollout (the transfer stopped) so that the Ctrl-C lands while the demo
        # waits for it, however fast this machine would finish the demo
        (transfer,) = [p for p in processes_under(work) if "cube-transfer" in " ".join(p.cmdline())]
        transfer.suspend()
        time.sleep(0.5)
        transfer.resume()
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
        assert demo.returncode == 130, rest
        assert "interrupted" in rest and rest.count(": stopped (pid") == 9
        assert processes_under(work) == []
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        kill_processes_under(work)
