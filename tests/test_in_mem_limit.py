"""`--in_mem` on a table that cannot fit: the server reads its memory limit (cgroup v1/v2, the
machine's) and loads such a version without populating or locking it, says so once (log and
status), and serves it; the pure rule and the limit readers on fake /proc and /sys trees; and a
real cube-server in a cgroup v1 memory group smaller than its table (root only: the memory
controller is writable here), which before this was OOM-killed at load."""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from helpers.procs import expected_fixed, fixed_values, running_server, scrape, write_version
from helpers.stubs import control_stub

from cube.client import CubeClient
from cube.pb import cube_pb2
from cube.processes import poll_until
from cube.server.memory import (
    HEADROOM_MIN,
    hot_cache_budget,
    in_mem_refusal,
    locked_bytes,
    memory_limit,
)

MIB = 1 << 20
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
_GROUPS = itertools.count()


def test_the_rule_keeps_room_for_the_process_and_the_version_it_replaces() -> None:
    assert in_mem_refusal(100 * MIB, 0, 1024 * MIB, "the cgroup limit of /x") == ""
    # 1 GiB limit: 256 MiB kept for the process, 700 MiB pinned by the current version
    refusal = in_mem_refusal(100 * MIB, 700 * MIB, 1024 * MIB, "the cgroup limit of /x")
    assert "100 MiB do not fit the 68 MiB" in refusal
    assert "the cgroup limit of /x 1024 MiB" in refusal and "700 MiB pinned" in refusal
    # a large limit keeps a tenth
    assert in_mem_refusal(9000 * MIB, 0, 10_000 * MIB, "s") == ""
    assert in_mem_refusal(9001 * MIB, 0, 10_000 * MIB, "s") != ""
    assert in_mem_refusal(1, 0, HEADROOM_MIN, "s") != ""


def _fake(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, sys_fs = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       24683772 kB\nMemFree: 1 kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "status").write_text("Name:\tx\nVmLck:\t    2048 kB\nVmRSS:\t1 kB\n")
    for name, text in files.items():
        path = sys_fs / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, sys_fs


def test_the_limit_is_the_smallest_on_the_cgroup_path(tmp_path: Path) -> None:
    v1 = "4:memory:/jobs/cube\n1:cpu:/\n0::/\n"
    proc, sys_fs = _fake(
        tmp_path / "v1",
        v1,
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: none
            "memory/jobs/memory.limit_in_bytes": f"{3 << 30}\n",
            "memory/jobs/cube/memory.limit_in_bytes": f"{8 << 30}\n",
        },
    )
    limit, source = memory_limit(proc, sys_fs)
    assert limit == 3 << 30 and source.endswith("memory/jobs")
    assert locked_bytes(proc) == 2 * MIB
    proc, sys_fs = _fake(tmp_path / "v2", "0::/kubepods/pod1\n", {})
    (sys_fs / "kubepods" / "pod1").mkdir(parents=True)
    (sys_fs / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    (sys_fs / "kubepods" / "memory.max").write_text(f"{1 << 30}\n")
    assert memory_limit(proc, sys_fs)[0] == 1 << 30
    proc, sys_fs = _fake(tmp_path / "none", "0::/\n", {})
    assert memory_limit(proc, sys_fs) == (24683772 * 1024, "the machine's memory")


@pytest.fixture
def memory_group() -> Iterator[Path]:
    if os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and cgroup v1's memory controller")
    group = CGROUP_V1 / f"cube-test-{os.getpid()}-{next(_GROUPS)}"
    group.mkdir()
    try:
        yield group
    finally:
        group.rmdir()  # (the test stopped every process it put there)


@pytest.mark.slow
def test_a_table_larger_than_the_cgroup_is_served_not_oom_killed(
    tmp_path: Path, memory_group: Path
) -> None:
    width, count = 4096, 80_000  # 328 MB of values, in a group of 300 MiB
    keys = np.arange(1, count + 1, dtype=np.uint64) * 2654435761
    data = tmp_path / "data"
    write_version(data, "7", keys, fixed_values(keys, width, 3), current=True)
    for name in ("index.cube", "data.cube"):  # as after a reboot: nothing in the page cache
        fd = os.open(data / "7" / name, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    (memory_group / "memory.limit_in_bytes").write_text(str(300 * MIB))
    procs = memory_group / "cgroup.procs"

    def join_group() -> None:  # runs in the server's process before it starts
        procs.write_text(str(os.getpid()))

    args = ("--in_mem", "true", "--metrics_port", "0", "--hot_cache_mb", "40")
    with running_server(data, *args, preexec_fn=join_group) as server:
        server.wait_serving()
        sample = keys[:: count // 500]

        def current() -> dict[str, Any]:
            with grpc.insecure_channel(server.control_address) as channel:
                request = cube_pb2.ControlRequest(cmd="status")
                reply = control_stub(channel).cmd(request, timeout=30)
            state: dict[str, Any] = json.loads(reply.detail_json)["current"]
            return state

        with CubeClient(shards=[[server.address]]) as client:
            result = client.seek(sample)
            assert result.found.all()
            assert np.array_equal(result.column.as_rows(), expected_fixed(sample, width, 3))

            def cached() -> bool:  # lookups go on until the hot cache holds what they ask
                answer = client.seek(sample)
                assert answer.found.all()
                assert np.array_equal(answer.column.as_rows(), expected_fixed(sample, width, 3))
                return bool(current()["hot_cache"]["keys"] >= sample.shape[0])

            assert poll_until(cached, timeout=60, interval=0.2, check=server.check_running)
            result = client.seek(sample)  # from the hot cache now, the same values
        assert np.array_equal(result.column.as_rows(), expected_fixed(sample, width, 3))
        state = current()
        note = state["memory_note"]
        assert "do not fit" in note and str(memory_group) in note, note
        # the index alone is pinned (100k keys: about 1.4 MB), the values are not
        assert "its index pinned alone" in note, note
        assert note.endswith("a hot cache of 40 MiB a worker in front of it"), note
        assert state["hot_cache"]["hits"] >= sample.shape[0]
        assert 0 < state["hot_cache"]["bytes"] <= 40 * MIB
        assert 0 < state["locked_bytes"] < 4 * MIB, state["locked_bytes"]
        assert server.log().count("do not fit") == 1
        # what an operator sees: the version not in memory, the worker's disk faults
        port = server.written_ports()["metrics_port"]
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
        key = ("cube_server_version_in_memory", (("slot", "current"), ("worker", "0")))
        assert samples[key] == 0.0
        faults = ("cube_server_major_page_faults_total", (("worker", "0"),))
        assert samples[faults] > 0
        hits = ("cube_server_hot_cache_hits_total", (("slot", "current"), ("worker", "0")))
        assert samples[hits] >= sample.shape[0]
        assert server.process.poll() is None
    assert int((memory_group / "memory.max_usage_in_bytes").read_text()) <= 300 * MIB


@pytest.mark.slow
def test_a_base_switch_in_1_3x_one_version_fails_no_lookup_and_pins_the_new_one_after(
    tmp_path: Path, memory_group: Path
) -> None:
    """Issue 37 item 4: a group of 1.3x one version (two versions of 901 MB in 1,172 MB;
    1,046 MB may be pinned): the first is pinned at start; the second loads unpinned beside
    it, served paged (both pinned would be 1.8 GB: the server was OOM-killed); after the
    switch the first gives its pages back and the second is pinned. Lookups run all along and
    none fails; the group's peak stays under its limit (the kernel would OOM-kill otherwise)."""
    width, count = 4096, 220_000
    keys = np.arange(1, count + 1, dtype=np.uint64) * 2654435761
    data = tmp_path / "data"
    write_version(data, "7", keys, fixed_values(keys, width, 1), current=True)
    write_version(data, "8", keys, fixed_values(keys, width, 2))
    version_bytes = sum(p.stat().st_size for p in (data / "7").iterdir())
    for version in ("7", "8"):  # as after a reboot: nothing in the page cache
        for name in ("index.cube", "data.cube"):
            fd = os.open(data / version / name, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    limit = int(version_bytes * 1.3)
    (memory_group / "memory.limit_in_bytes").write_text(str(limit))
    procs = memory_group / "cgroup.procs"

    def join_group() -> None:
        procs.write_text(str(os.getpid()))

    def status(server: Any) -> dict[str, Any]:
        with grpc.insecure_channel(server.control_address) as channel:
            reply = control_stub(channel).cmd(cube_pb2.ControlRequest(cmd="status"), timeout=60)
        detail: dict[str, Any] = json.loads(reply.detail_json)
        return detail

    def command(server: Any, cmd: str, **fields: str) -> None:
        with grpc.insecure_channel(server.control_address) as channel:
            control_stub(channel).cmd(cube_pb2.ControlRequest(cmd=cmd, **fields), timeout=120)

    with running_server(data, "--in_mem", "true", preexec_fn=join_group) as server:
        server.wait_serving()
        first = status(server)["current"]
        assert first["memory_note"] == "" and first["locked_bytes"] >= count * width
        failures: list[BaseException] = []
        stop = threading.Event()
        sample = keys[:: count // 200]

        def lookups() -> None:
            with CubeClient(shards=[[server.address]], retry=2) as client:
                while not stop.is_set():
                    try:
                        result = client.seek(sample)
                        assert result.found.all() and result.version in ("7", "8")
                        tag = 1 if result.version == "7" else 2
                        assert np.array_equal(
                            result.column.as_rows(), expected_fixed(sample, width, tag)
                        )
                    except BaseException as exc:
                        failures.append(exc)
                        return

        held = [0]  # the most memory the group could not give back: anonymous + mlocked

        def watch_memory() -> None:
            while not stop.wait(0.05):
                stat = dict(
                    line.split() for line in (memory_group / "memory.stat").read_text().splitlines()
                )
                held[0] = max(held[0], int(stat["total_rss"]) + int(stat["total_unevictable"]))

        looker = threading.Thread(target=lookups)
        looker.start()
        watcher = threading.Thread(target=watch_memory)
        watcher.start()
        try:
            command(server, "bg_load_base", version_path="/8")
            loaded = status(server)["background"]
            assert "do not fit" in loaded["memory_note"], loaded
            command(server, "enable", version="8")

            def settled() -> bool:
                detail = status(server)
                current, background = detail["current"], detail["background"]
                return bool(
                    current["version"] == "8"
                    and current["memory_note"] == ""
                    and current["locked_bytes"] >= count * width
                    and background["locked_bytes"] == 0
                )

            assert poll_until(settled, 60, 0.2), status(server)
        finally:
            stop.set()
            looker.join(60)
            watcher.join(60)
        assert not failures, failures[0]
        assert server.process.poll() is None
    # what must fit: the process and its pinned pages (the page cache fills the rest)
    print(f"switch: held at most {held[0] / version_bytes:.2f}x one version")
    assert version_bytes < held[0] <= limit, (version_bytes, held[0], limit)


def test_the_hot_cache_takes_a_share_of_what_the_pinned_index_leaves() -> None:
    gib = 1 << 30
    # nothing pinned: a fifth of the limit, shared out among the workers
    assert hot_cache_budget(10 * gib, 1) == 2 * gib
    assert hot_cache_budget(10 * gib, 4) == 2 * gib // 4
    # a pinned index leaves less: half of what is left after it and the process's headroom
    assert hot_cache_budget(10 * gib, 1, pinned_bytes=8 * gib) == (10 * gib - gib - 8 * gib) // 2
    assert hot_cache_budget(2 * gib, 1, pinned_bytes=2 * gib) == 0
