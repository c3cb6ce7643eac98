"""cube-bench: the report and runner pieces in-process, then the real command as a subprocess
(servers started on loopback, outputs written, every server it started gone afterwards, also
after Ctrl-C and with a missing binary)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import numpy as np
import psutil
import pytest

from cube.bench import report
from cube.bench.cube_bench import _memory_shortfall, check_answers
from cube.bench.keyspace import parse_distribution, values_of
from cube.bench.procs import ProcessRegistry
from cube.bench.runner import (
    Attempt,
    BenchError,
    LevelConfig,
    LevelResult,
    run_attempt,
    run_level,
    wait_for_quiet,
)
from cube.bench.targets import (
    Dataset,
    DataSource,
    Target,
    make_dataset,
    make_derived,
    rows_from_list,
)

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

REPO = Path(__file__).resolve().parent.parent
CUBE_BENCH = Path(sys.executable).parent / "cube-bench"
HAVE_REDIS = bool(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode == 0
)


# --- pure pieces ----------------------------------------------------------------------------


def test_dataset_keys_are_distinct_and_values_sized() -> None:
    data = make_dataset(5000, 40, seed=3)
    assert data.keys.dtype == np.uint64 and np.unique(data.keys).shape[0] == 5000
    assert data.values.shape == (5000, 40)
    absent = data.absent_keys(100)
    assert absent.shape[0] == 100 and not np.isin(absent, data.keys).any()
    embeddings = make_dataset(100, 0, dim=8, seed=3)
    assert embeddings.value_size == 32
    assert embeddings.expected(np.arange(3)).dtype == np.float32


def test_a_derived_data_set_is_never_held_and_checks_like_a_random_one(tmp_path: Path) -> None:
    """--dataset derived: values derived from keys (bench.keyspace), loaded in chunks, answers
    checked from the key alone; --distribution zipf:THETA skews the draws."""
    data = make_derived(5000, 24, distribution=parse_distribution("zipf:0.99"))
    rows = np.array([0, 17, 4999])
    assert np.array_equal(data.expected(rows), values_of(data.keys_at(rows), 24))
    assert sum(keys.shape[0] for keys, _ in data.chunks(1024)) == 5000
    draws = np.concatenate([data.draw(np.random.default_rng(i), 1000) for i in range(20)])
    _unique, counts = np.unique(draws, return_counts=True)
    assert counts.max() > 200  # the hottest key: ~9% of 20k draws at theta 0.99 over 5000
    target = _DictTarget(ProcessRegistry(), tmp_path, {})
    target.setup(data)
    assert check_answers(target, data, 300, "asyncio", seed=2) == 330
    # only the server's copy counts: 100M x 64 B fits where a held data set would not
    assert _memory_shortfall(100_000_000, 64, available=20 << 30, dataset="derived") == ""
    assert "--dataset derived" in _memory_shortfall(100_000_000, 64, available=20 << 30)


def test_rows_from_list_zero_fills_misses_and_rejects_wrong_sizes() -> None:
    matrix, misses = rows_from_list([b"ab", None, b"cd"], 2, 0)
    assert misses == 1
    assert matrix.tolist() == [[97, 98], [0, 0], [99, 100]]
    with pytest.raises(ValueError, match="value bytes"):
        rows_from_list([b"abc", b"de"], 2, 0)


class _DictTarget(Target):
    """An in-process target (no server): lets the runner be tested without processes."""

    name = "dict"
    clients_made = 0  # thread clients made (a test alone on an xdist worker starts at 0)

    def check_available(self, client_mode: str) -> None:
        pass

    def setup(self, data: DataSource) -> None:
        self.table: dict[int, bytes] = {
            int(k): row.tobytes()
            for keys, values in data.chunks(1000)
            for k, row in zip(keys.tolist(), values, strict=True)
        }
        self.width = data.value_size

    def _fetch(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        return rows_from_list([self.table.get(k) for k in keys.tolist()], self.width, 0)

    def thread_client(self) -> _DictThreadClient:
        self.clients_made += 1
        return _DictThreadClient(self)

    def async_client(self, concurrency: int) -> _DictAsyncClient:
        return _DictAsyncClient(self)


class _DictThreadClient:
    def __init__(self, target: _DictTarget) -> None:
        self.target = target

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        return self.target._fetch(keys)

    def close(self) -> None:
        pass


class _DictAsyncClient:
    def __init__(self, target: _DictTarget) -> None:
        self.target = target

    async def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        return self.target._fetch(keys)

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def dict_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[_DictTarget, Dataset]:
    data = make_dataset(2000, 16, seed=5)
    target = _DictTarget(ProcessRegistry(), tmp_path_factory.mktemp("dict"), {})
    target.setup(data)
    return target, data


@pytest.mark.parametrize("mode", ["thread", "shared", "asyncio"])
def test_runner_measures_a_fixed_number_of_requests(
    dict_target: tuple[_DictTarget, Dataset], mode: str
) -> None:
    target, data = dict_target
    cfg = LevelConfig(2, 50, warmup=0.05, duration=1, requests=200, timeout=30, mode=mode)
    made = target.clients_made
    attempt = run_attempt(target, data, cfg, [])
    assert target.clients_made - made == {"thread": 2, "shared": 1, "asyncio": 0}[mode]
    assert attempt.requests >= 200
    assert attempt.misses == 0
    assert attempt.window > 0 and (attempt.latencies_ns > 0).all()
    row = report.summarize(run_level_result(cfg, attempt))
    assert row["threads"] == 2 and row["qps"] > 0 and abs(row["keys_per_s"] - row["qps"] * 50) <= 50


def run_level_result(cfg: LevelConfig, attempt: Attempt) -> LevelResult:
    return LevelResult(cfg, attempt, [{"other_load": attempt.other_load, "loadavg": 0.0}])


def test_runner_reports_a_failing_client_with_target_and_level(
    dict_target: tuple[_DictTarget, Dataset],
) -> None:
    target, data = dict_target

    class Broken(_DictTarget):
        def _fetch(self, keys: np.ndarray) -> NoReturn:
            raise ConnectionError("server went away")

    broken = Broken(ProcessRegistry(), target.workdir, {})
    broken.table, broken.width = target.table, target.width
    cfg = LevelConfig(3, 10, warmup=0.05, duration=0.2, requests=0, timeout=5, mode="thread")
    with pytest.raises(BenchError, match=r"dict, 3 threads.*server went away"):
        run_attempt(broken, data, cfg, [])


def test_a_level_disturbed_by_another_process_is_repeated_and_flagged(
    dict_target: tuple[_DictTarget, Dataset],
) -> None:
    target, data = dict_target
    # a busy process of our own, ended by PID, uses about a core: far above the threshold
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        cfg = LevelConfig(1, 20, warmup=0.1, duration=0.4, requests=0, timeout=5, mode="thread")
        messages: list[str] = []
        waited = wait_for_quiet([], 0.2, 1.2, messages.append)
        assert waited >= 1.2 and "waiting up to" in messages.pop()
        level = run_level(target, data, cfg, max_other_load=0.2, max_repeats=1, log=messages.append)
    finally:
        hog.kill()
        hog.wait(10)
    assert len(level.attempts) == 2
    assert level.disturbed and min(a["other_load"] for a in level.attempts) > 0.2
    assert "repeating" in messages[0] and "no repeats left" in messages[1]
    assert report.summarize(level)["tries"] == 2


def test_check_answers_catches_a_wrong_value(dict_target: tuple[_DictTarget, Dataset]) -> None:
    target, data = dict_target
    assert check_answers(target, data, 100, "asyncio", seed=1) > 100
    key = int(data.keys[0])
    saved = target.table[key]
    target.table[key] = bytes(len(saved))
    try:
        with pytest.raises(BenchError, match=f"wrong value for key {key}"):
            check_answers(target, data, data.keys.shape[0], "thread", seed=1)
    finally:
        target.table[key] = saved


def test_markdown_has_the_seed_columns_ratios_and_disturbances() -> None:
    rows = {
        "redis": [_row(1, 700.0), _row(4, 1100.0)],
        "cube": [_row(1, 900.0), _row(4, 2200.0, disturbed=True)],
    }
    ratios = report.ratios(rows)
    assert ratios == [
        {"threads": 1, "redis_qps": 700.0, "cube/redis": 1.29},
        {"threads": 4, "redis_qps": 1100.0, "cube/redis": 2.0},
    ]
    result = {
        "command": "cube-bench --targets cube,redis",
        "started": "now",
        "settings": {
            "keys": 1000,
            "value_size": 40,
            "dim": 0,
            "batch": 1000,
            "client": "thread",
            "requests": 0,
            "duration": 1.0,
            "warmup": 0.5,
            "max_other_load": 0.25,
            "max_repeats": 2,
        },
        "machine": {"cores": "2"},
        "versions": {"python": "3"},
        "targets": {name: {"levels": r} for name, r in rows.items()},
        "ratios": ratios,
    }
    text = report.markdown(result, "results.png")
    assert "| threads | batch | avg latency (µs) | QPS |" in text
    assert "| 4 | 2.0 |" in text  # the ratio table
    assert "cube C=4" in text and "⚠" in text
    assert "![throughput" in text


def _row(threads: int, qps: float, disturbed: bool = False) -> dict[str, float | bool]:
    return {
        "threads": threads, "batch": 1000, "avg_us": 1000.0, "p50_us": 900.0, "p99_us": 2000.0,
        "qps": qps, "keys_per_s": int(qps * 1000), "server_cpu_us_per_req": 500.0,
        "client_cpu_us_per_req": 700.0, "other_load": 0.5 if disturbed else 0.0,
        "tries": 3 if disturbed else 1, "disturbed": disturbed,
    }  # fmt: skip


# --- the command ----------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_leftovers(pids: list[int]) -> None:
    """Cleanup if the test fails: end the servers cube-bench reported starting, by PID."""
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for child in proc.children(recursive=True):  # e.g. cube-server's workers
                with contextlib.suppress(psutil.Error):
                    child.kill()
            proc.kill()


def _started_pids(output: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"^started \S+ pid (\d+)", output, re.MULTILINE)]


def test_unknown_target_and_bad_flags_exit_2() -> None:
    settings = (
        ["--targets", "mongodb"],
        ["--batch", "0"],
        ["--threads", "1,x"],
        ["--keys", "100", "--batch", "1000"],  # every request would repeat keys
    )
    for args in settings:
        proc = subprocess.run(
            [str(CUBE_BENCH), *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith("error:")


def test_a_data_set_larger_than_memory_is_refused_before_any_work(tmp_path: Path) -> None:
    """100M x 64 B was killed by the OOM killer after 4 minutes (24 GB); now it is refused."""
    assert _memory_shortfall(1_000_000, 40, available=1 << 30) == ""
    said = _memory_shortfall(100_000_000, 64, available=20 << 30)
    assert "--keys 100,000,000 of 64 B need about 23.5 GiB" in said
    assert "20.0 GiB is available" in said and "bench.scale" in said
    proc = subprocess.run(  # (generating 10**12 keys would outlast the timeout)
        [str(CUBE_BENCH), "--targets", "cube", "--keys", str(10**12), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "GiB of memory" in proc.stderr, proc.stderr


def test_a_refused_run_leaves_no_temp_directory(tmp_path: Path) -> None:
    """Every early exit left an empty cube-bench-* directory in /tmp (69 on this machine)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PATH": str(tmp_path)}  # (no redis-server)
    for args in (["--targets", "redis"], ["--targets", "cube", "--keys", str(10**12)]):
        proc = subprocess.run(
            [str(CUBE_BENCH), *args, "--out", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=60, check=False, env=env,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert not list(temp.iterdir()), (args, list(temp.iterdir()))


def test_missing_binary_is_named_with_how_to_install_it(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no redis-server, no memcached here
    proc = subprocess.run(
        [str(CUBE_BENCH), "--targets", "redis", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert (
        "redis-server not found" in proc.stderr and "apt-get install -y redis-server" in proc.stderr
    )
    proc = subprocess.run(
        [str(CUBE_BENCH), "--targets", "redis,memcached", "--skip_missing", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "skipping redis" in proc.stderr and "no target left" in proc.stderr


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server not installed (make debs)")
def _signal_thread(pid: int, tid: int, signum: int) -> None:
    """tgkill(2): a signal to one thread of another process."""
    import ctypes
    import platform

    number = {"x86_64": 234, "aarch64": 131}.get(platform.machine())
    if number is None:
        pytest.skip(f"no tgkill syscall number for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(number, pid, tid, signum) == 0, os.strerror(ctypes.get_errno())


def test_ctrl_c_stops_every_server_it_started(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            str(CUBE_BENCH), "--targets", "redis", "--threads", "1", "--keys", "2000",
            "--duration", "60", "--warmup", "0.2", "--quiet_wait", "0",
            "--out", str(tmp_path / "out"),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    output = proc.stdout
    assert output is not None  # stdout=PIPE
    reader = threading.Thread(target=lambda: lines.extend(output), daemon=True)
    reader.start()
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not any("answers checked" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        pids = _started_pids("".join(lines))
        assert pids and all(_alive(pid) for pid in pids)
        time.sleep(0.5)  # inside the measured level
        # Ctrl-C as the kernel may deliver it: to a client thread, not the main one (which
        # then has to wake up to handle it)
        client_thread = max(t.id for t in psutil.Process(proc.pid).threads())
        assert client_thread != proc.pid
        _signal_thread(proc.pid, client_thread, signal.SIGINT)
        assert proc.wait(5) == 130
        reader.join(10)
        assert "stopping servers" in "".join(lines)
        assert not [pid for pid in pids if _alive(pid)]
        assert not (tmp_path / "out" / "results.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _kill_leftovers(pids)


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server not installed (make debs)")
def test_quick_run_of_cube_and_redis_writes_reports_and_stops_its_servers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            str(CUBE_BENCH), "--targets", "cube,redis", "--threads", "1,2", "--keys", "3000",
            "--batch", "200", "--duration", "0.6", "--warmup", "0.2", "--workers", "2",
            "--max_repeats", "0", "--quiet_wait", "0", "--check_sample", "500",
            "--out", str(out),
        ],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    pids = _started_pids(proc.stdout)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result = json.loads((out / "results.json").read_text())
        assert set(result["targets"]) == {"cube", "redis"}
        for name, target in result["targets"].items():
            assert [r["threads"] for r in target["levels"]] == [1, 2], name
            for row in target["levels"]:
                assert row["qps"] > 0 and row["requests"] > 0, (name, row)
                assert row["misses"] == 0, (name, row)
                assert row["server_cpu_us_per_req"] > 0, (name, row)
        assert len(result["targets"]["cube"]["pids"]) == 3  # supervisor + 2 workers
        assert [r["threads"] for r in result["ratios"]] == [1, 2]
        assert all(r["cube/redis"] > 0 for r in result["ratios"])
        markdown = (out / "results.md").read_text()
        assert "## cube" in markdown and "## redis" in markdown and "cube/redis" in markdown
        assert (out / "results.png").read_bytes().startswith(b"\x89PNG")
        every_pid = {p for t in result["targets"].values() for p in t["pids"]} | set(pids)
        assert pids and not [pid for pid in every_pid if _alive(pid)]
    finally:
        _kill_leftovers(pids)


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server not installed (make debs)")
def test_a_derived_zipf_run_loads_in_chunks_and_reports_keys_per_server_cpu_second(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            str(CUBE_BENCH), "--targets", "cube,redis", "--threads", "2", "--keys", "3000",
            "--batch", "200", "--duration", "0.6", "--warmup", "0.2", "--max_repeats", "0",
            "--quiet_wait", "0", "--check_sample", "500", "--dataset", "derived",
            "--distribution", "zipf:0.99", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    pids = _started_pids(proc.stdout)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "derived, zipf:0.99 draws" in proc.stdout
        result = json.loads((out / "results.json").read_text())
        assert result["settings"]["dataset"] == "derived"
        for name, target in result["targets"].items():
            (row,) = target["levels"]
            assert row["misses"] == 0 and row["keys_per_server_cpu_s"] > 0, (name, row)
        assert "keys/server CPU-s" in (out / "results.md").read_text()
        assert "derived from the keys" in (out / "results.md").read_text()
    finally:
        _kill_leftovers(pids)
    bad = subprocess.run(
        [str(CUBE_BENCH), "--distribution", "zipf:2", "--out", str(out)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "--distribution" in bad.stderr
