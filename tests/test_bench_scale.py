"""The scale benchmark (bench/scale_e2e.py, `make bench-scale`) at a toy size: the derived data
and the distributions in-process, then the real harness as a subprocess (a cube-local cluster
per size, a version of several tables, Redis when installed): every phase timed, answers
checked and none wrong, then nothing of it left (temp files, processes), also after Ctrl-C;
and a size that cannot fit refused before any work."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from cube.bench.keyspace import (
    DerivedData,
    Distribution,
    draw_pool,
    keys_of,
    parse_distribution,
    values_of,
    zeta,
    zipf_ranks,
)
from cube.bench.scale_e2e import FLAGS, shortfall

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

HARNESS = [sys.executable, "-m", "cube.bench.scale_e2e"]
TOY = [
    "--keys", "20000", "--baseline_keys", "5000", "--batch", "200", "--inflight", "8",
    "--duration", "1", "--warmup", "0.3", "--pool", "64", "--tables", "3",
    "--keys_per_table", "10", "--quiet_wait", "0", "--check_every", "4", "--patch_keys", "5000",
]  # fmt: skip


# --- in-process -------------------------------------------------------------------------------


def test_derived_data_is_distinct_checkable_and_streamed_in_chunks() -> None:
    data = DerivedData(10_000, 20, table=3)
    chunks = list(data.chunks(3000))
    assert [k.shape[0] for k, _ in chunks] == [3000, 3000, 3000, 1000]
    keys = np.concatenate([k for k, _ in chunks])
    assert np.unique(keys).shape[0] == 10_000
    assert np.array_equal(chunks[1][1], values_of(chunks[1][0], 20))
    assert chunks[0][1][0, :8].tobytes() == int(keys[0]).to_bytes(8, "little")
    assert not np.isin(keys, keys_of(np.arange(10_000))).any()  # another table, other keys
    assert not np.isin(data.absent_keys(500), keys).any()


def test_zipf_is_skewed_like_ycsb_and_scattered() -> None:
    rng = np.random.default_rng(5)
    ranks = zipf_ranks(rng, 100_000, 0.99, 400_000)
    share = np.bincount(ranks.astype(np.int64)) / ranks.shape[0]
    assert share[0] == pytest.approx(1 / zeta(100_000, 0.99), rel=0.05)
    assert share[1] == pytest.approx(share[0] / 2**0.99, rel=0.08)
    # the hottest key numbers are not the first ones: scattered over the table
    ids = Distribution("zipf", 0.99).draw(rng, 100_000, 400_000)
    hottest = np.argsort(np.bincount(ids.astype(np.int64), minlength=100_000))[-20:]
    assert hottest.max() - hottest.min() > 50_000
    # Euler-Maclaurin beyond 2^22 terms, against the plain sum
    n = (1 << 22) + 123_457
    exact = float(np.sum(np.arange(1, n + 1, dtype=np.float64) ** -0.99))
    assert zeta(n, 0.99) == pytest.approx(exact, rel=1e-12)
    uniform = draw_pool(DerivedData(1000, 8), parse_distribution("uniform"), 4, 50, seed=1)
    assert uniform.shape == (4, 50)
    for bad in ("zipf", "zipf:1", "zipf:x", "pareto"):
        with pytest.raises(ValueError):
            parse_distribution(bad)


def test_a_size_that_cannot_fit_is_refused_with_what_it_needs(tmp_path: Path) -> None:
    flags = FLAGS.parse(["--keys", "100000000", "--tmp", str(tmp_path)])
    said = shortfall(flags, free_disk=10 << 30, available=4 << 30)
    assert "GiB free, the run needs about" in said and "GiB of memory is available" in said
    assert shortfall(flags, free_disk=1 << 50, available=1 << 50) == ""
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.run(
        [*HARNESS, "--keys", str(10**12), "--tmp", str(temp), "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "refused" in proc.stderr, proc.stderr
    assert not list(temp.iterdir()) and not (tmp_path / "r.json").exists()


# --- the harness, end to end ------------------------------------------------------------------


def _gone(pids: list[int]) -> bool:
    return not [pid for pid in pids if psutil.pid_exists(pid) and _not_zombie(pid)]


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_toy_run_checks_answers_times_phases_and_cleans_up(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = tmp_path / "result.json"
    redis = ["--redis"] if shutil.which("redis-server") else []
    started = time.monotonic()
    proc = subprocess.run(
        [*HARNESS, *TOY, *redis, "--tmp", str(temp), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - started < 60
    result = json.loads(out.read_text())
    assert result["ok"] is True
    labels = [run["label"] for run in result["runs"]]
    assert labels == ["baseline", "scale", "dlrm", *(["redis"] if redis else [])]
    for run in result["runs"]:
        assert set(run["lookups"]) == {"uniform", "zipf:0.99"}, run["label"]
        for name, level in run["lookups"].items():
            assert level["checked"] > 0 and level["wrong"] == 0 and level["failed"] == 0, name
            assert level["server_cpu_us_per_1000_keys"] > 0 and level["keys_per_server_cpu_s"] > 0
            assert level["p99_us"] >= level["p50_us"] > 0
    scale = result["runs"][1]
    assert scale["keys"] == 20_000 and scale["input_bytes"] > 20_000 * 64
    marks = scale["after_line_s"]
    assert list(marks) == [
        "line_seen", "build_start", "built", "downloaded", "reloaded", "enabled", "served",
    ]  # fmt: skip
    times = list(marks.values())
    assert times == sorted(times)
    assert set(scale["phase_s"]) == {"build", "download", "load", "enable"}
    assert set(result["ratios"]) == {"uniform", "zipf:0.99"}
    patch = scale["patch"]  # rolled out onto the base while lookups ran: none failed
    assert patch["keys"] == 5_000 and patch["version"].startswith(scale["version"] + "_")
    assert patch["after_line_s"]["served"] >= patch["after_line_s"]["enabled"] > 0
    during = patch["lookups_during"]
    assert during["checked"] > 0 and during["wrong"] == 0 and during["failed"] == 0
    assert "patch of 5,000 keys" in proc.stdout
    dlrm = result["runs"][2]
    assert dlrm["tables"] == 3 and dlrm["lookups"]["uniform"]["keys_per_request"] == 30
    assert "| scale | 20,000 | uniform |" in proc.stdout
    assert not list(temp.iterdir()), list(temp.iterdir())
    assert _gone([pid for run in result["runs"] for pid in run["server_pids"]])


def test_ctrl_c_stops_the_cluster_and_removes_its_files(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    args = [*TOY, "--baseline_keys", "0", "--tables", "0", "--duration", "60"]
    proc = subprocess.Popen(
        [*HARNESS, *args, "--tmp", str(temp), "--out", str(tmp_path / "r.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    children: list[int] = []
    try:
        lines = []
        for line in proc.stdout:  # until the lookups run
            lines.append(line)
            if "keys drawn" in line:
                break
        assert proc.poll() is None, "".join(lines)
        time.sleep(1.0)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(children) >= 5  # 2 servers, 2 agents, the transfer
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 130, "".join(lines) + rest
        assert "interrupted" in rest
        assert _gone(children)
        assert not list(temp.iterdir()) and not (tmp_path / "r.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in children:
            if _not_zombie(pid):
                os.kill(pid, signal.SIGKILL)
