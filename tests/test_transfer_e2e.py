"""cube-transfer end to end on real processes: a cube-local cluster (2 shards x 2 replicas of
cube-server + cube-agent, one cube-transfer running the real cube-builder) fed through
donefiles, checked through the SDK.

One cluster serves the whole module (starting one costs seconds); every test starts from
whatever is live, uses fresh version ids, and ends with every replica on one version. While
processes are killed, a background prober keeps looking keys up: no request may fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
import pytest
from numpy.typing import NDArray

from cube.client import CubeClient
from cube.processes import health_status, poll_until
from cube.seqfile import SequenceFileWriter
from cube.transfer.local import Cluster, ClusterSpec, command, http_json, up
from cube.values import ValueColumn

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

DIM = 4
WAIT = 60.0
T = TypeVar("T")
_ids = itertools.count(int(time.time()) // 10 * 10, 10)

WRAPPER = """\
#!{python}
# cube-builder, then (when the input has a .tamper file) damage shard 0's tar like a bad disk,
# a bad copy or a hostile producer would.
import hashlib, io, os, subprocess, sys, tarfile
args = sys.argv[1:]
rc = subprocess.call([{builder!r}, *args])
if rc:
    sys.exit(rc)
opts = {{args[i].lstrip("-"): args[i + 1] for i in range(len(args) - 1)
        if args[i].startswith("-") and not args[i + 1].startswith("-")}}
marker = os.path.join(opts["input_path"], ".tamper")
if os.path.exists(marker):
    mode = open(marker).read().strip()
    out = os.path.join(opts["output_path"], opts["depend_version"] + "_" + opts["cur_version"])
    tar_path = os.path.join(out, opts["dict_name"] + "_part0.tar")
    if mode in ("corrupt", "md5"):
        with tarfile.open(tar_path) as tar:
            member = next(m for m in tar if m.name.endswith("data.cube"))
            where = member.offset_data + 4096 + 8
        with open(tar_path, "r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif mode == "evil":
        with tarfile.open(tar_path, "a") as tar:
            info = tarfile.TarInfo("../evil")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    if mode != "md5":
        digest = hashlib.md5(open(tar_path, "rb").read()).hexdigest()
        with open(tar_path + ".md5", "w") as f:
            f.write(digest + "  " + os.path.basename(tar_path) + "\\n")
"""


Table = tuple[NDArray[np.uint64], NDArray[np.float32]]  # keys, values


@dataclasses.dataclass
class E2E:
    """The module's cluster, and the tables the tests published to it by version."""

    root: Path
    cluster: Cluster
    donefile: Path
    tables: dict[str, Table] = dataclasses.field(default_factory=dict)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    root = tmp_path_factory.mktemp("transfer-e2e")
    wrapper = root / "tampering-builder"
    wrapper.write_text(WRAPPER.format(python=sys.executable, builder=command("cube-builder")))
    os.chmod(wrapper, 0o755)
    (root / "donefile").mkdir()
    spec = ClusterSpec(
        dir=root / "cluster",
        shards=2,
        replicas=2,
        donefile=root / "donefile",
        poll_interval=0.2,
        phase_timeout=40.0,
        dead_timeout=20.0,
        # max_shrink: test_kill9_agent_during_download publishes a 20000-record base, which the
        # later tests replace with 2000-record ones (a deliberate 90% shrink); version_retries:
        # the failures these tests cause end there, not retried behind the next tests' backs
        # (test_a_base_failed_on_unreachable_replicas_is_retried_once_they_answer: its own)
        transfer_overrides={
            "buildtool_local": str(wrapper),
            "retries": 1,
            "max_shrink": 0.95,
            "version_retries": 0,
        },
    )
    cluster = up(spec)
    try:
        yield E2E(root=root, cluster=cluster, donefile=root / "donefile")
    finally:
        cluster.down(timeout=5.0)


# ---------------------------------------------------------------------------------------------
# helpers


def write_input(
    root: Path, name: str, keys: npt.ArrayLike, values: npt.ArrayLike, tamper: str = ""
) -> Path:
    """An input directory under `root`: a SequenceFile of `keys` to `values`."""
    path = root / "input" / name
    path.mkdir(parents=True, exist_ok=True)
    column = ValueColumn.fixed(np.ascontiguousarray(values).view(np.uint8).reshape(-1), DIM * 4)
    with SequenceFileWriter(path / "part-00000") as writer:
        writer.write_batch(np.asarray(keys, dtype=np.uint64), column)
    if tamper:
        (path / ".tamper").write_text(tamper)
    return path


def table(n: int, seed: int) -> Table:
    rng = np.random.default_rng(seed)
    keys = np.arange(1, n + 1, dtype=np.uint64)
    return keys, rng.standard_normal((n, DIM), dtype=np.float32)


def append(donefile: Path, file: str, line: str | dict[str, str]) -> None:
    text = line if isinstance(line, str) else json.dumps(line)
    with open(donefile / file, "a", encoding="utf-8") as f:
        f.write(text + "\n")


def new_base(ctx: E2E, n: int = 2000, tamper: str = "", wait: bool = True) -> str:
    version = str(next(_ids))
    keys, values = table(n, int(version))
    path = write_input(ctx.root, version, keys, values, tamper)
    append(ctx.donefile, "base.txt", {"id": version, "key": version, "input": str(path)})
    ctx.tables[version] = (keys, values)
    if wait:
        ctx.cluster.wait_version(version, WAIT)
    return version


def new_patch(
    ctx: E2E,
    base: str,
    changed: int = 50,
    deleted: npt.ArrayLike = (),
    tamper: str = "",
    wait: bool = True,
) -> str:
    cur = str(next(_ids))
    version = f"{base}_{cur}"
    keys, values = ctx.tables[live(ctx)]
    rng = np.random.default_rng(int(cur))
    patch_keys = keys[:changed]
    patch_values = rng.standard_normal((changed, DIM), dtype=np.float32)
    path = write_input(ctx.root, version, patch_keys, patch_values, tamper)
    line = {"id": cur, "key": base, "input": str(path)}
    deleted = np.asarray(deleted, dtype=np.uint64)
    if len(deleted):
        delete = ctx.root / "input" / f"{version}.delete"
        delete.write_text("".join(f"{int(k)}\n" for k in deleted))
        line["delete"] = str(delete)
    append(ctx.donefile, "patch.txt", line)
    new_values = values.copy()
    new_values[:changed] = patch_values
    if len(deleted):
        new_values[np.isin(keys, deleted)] = 0
    ctx.tables[version] = (keys, new_values)
    if wait:
        ctx.cluster.wait_version(version, WAIT)
    return version


def live(ctx: E2E) -> str:
    version: str = ctx.cluster.transfer_info()["live_version"]
    return version


def ensure_base(ctx: E2E) -> str:
    current = live(ctx)
    return current if current else new_base(ctx)


def served(ctx: E2E) -> list[str]:
    return [row["version"] for row in ctx.cluster.instance_rows()]


def lookup(ctx: E2E, keys: NDArray[np.uint64]) -> tuple[NDArray[np.float32], str | None]:
    with CubeClient.from_conf(ctx.cluster.cube_conf) as client:
        result = client.seek(keys)
        return client.get_embeddings(keys, dim=DIM), result.version


def check_served(ctx: E2E, version: str) -> None:
    assert served(ctx) == [version] * 4
    keys, values = ctx.tables[version]
    got, seen = lookup(ctx, keys)
    assert seen == version
    np.testing.assert_array_equal(got, values)


def record(ctx: E2E, version: str, mode: str | None = None) -> dict[str, Any]:
    def final() -> dict[str, Any] | None:
        for rec in ctx.cluster.history()[::-1]:
            same = rec["version"] == version and (mode is None or rec["mode"] == mode)
            if same and rec["status_str"] in ("finished", "failed", "refused", "skipped"):
                return rec
        return None

    return wait_for(final, f"a final record for {version}", step=0.2)


def record_of_line(ctx: E2E, line: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((rec for rec in ctx.cluster.history() if rec["line"] == line), None)

    return wait_for(found, f"a record for {line}", step=0.2)


def line_count(ctx: E2E, file: str) -> int:
    path = ctx.donefile / file
    return len(path.read_text().splitlines()) if path.exists() else 0


def agent_task(ctx: E2E, instance: str, command: str, version: str) -> dict[str, Any] | None:
    port = ctx.cluster.proc(f"agent{instance}").port
    with contextlib.suppress(OSError, ValueError):
        data = http_json(f"http://127.0.0.1:{port}/agent/status")["data"]
        for task in data.get("tasks") or []:
            if task["command"] == command and task["version"] == version:
                return cast(dict[str, Any], task)
    return None


def wait_for(
    predicate: Callable[[], T | None], what: str, timeout: float = WAIT, step: float = 0.05
) -> T:
    """poll_until, returning what the predicate found (the record, the task)."""
    found: T | None = None

    def ready() -> bool:
        nonlocal found
        found = predicate()
        return bool(found)

    if not poll_until(ready, timeout, step):
        raise AssertionError(f"timed out waiting for {what}")
    assert found is not None
    return found


def kill9(ctx: E2E, name: str) -> None:
    proc = ctx.cluster.proc(name)
    os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: proc.process() is None, f"{name} to die", 10)


class Prober:
    """Looks keys up without pause in a thread; every failure is kept."""

    def __init__(self, ctx: E2E, keys: NDArray[np.uint64]) -> None:
        self.conf = ctx.cluster.cube_conf
        self.keys = keys
        self.errors: list[str] = []
        self.calls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with CubeClient.from_conf(self.conf) as client:
            while not self._stop.is_set():
                try:
                    client.get_embeddings(self.keys, dim=DIM)
                    self.calls += 1
                except Exception as exc:  # every failure counts
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.01)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# ---------------------------------------------------------------------------------------------
# the happy path


def test_base_delta_delete_and_rollback(ctx: E2E) -> None:
    base = new_base(ctx)
    check_served(ctx, base)
    keys, _ = ctx.tables[base]
    delta = new_patch(ctx, base, changed=100, deleted=keys[-10:])
    check_served(ctx, delta)
    got, _ = lookup(ctx, keys[-10:])
    assert not got.any()  # deleted keys are misses (zero rows)
    delta2 = new_patch(ctx, base, changed=20)
    check_served(ctx, delta2)
    info = ctx.cluster.transfer_info()
    assert info["live_chain"] == [base, delta, delta2]

    reply = http_json(ctx.cluster.transfer_url + "/dict/rollback", {"version": base}, timeout=WAIT)
    assert reply["success"] == "0", reply
    check_served(ctx, base)
    assert ctx.cluster.transfer_info()["live_chain"] == [base]
    # a later patch applies on the rolled-back chain
    after = new_patch(ctx, base, changed=5)
    check_served(ctx, after)
    assert ctx.cluster.transfer_info()["live_chain"] == [base, after]
    history = ctx.cluster.history()
    assert [r["mode"] for r in history if r["version"] == base][-1] == "rollback"


# ---------------------------------------------------------------------------------------------
# bad input: each fails alone, with its reason, and the next good line still deploys


def test_bad_donefile_lines_fail_alone(ctx: E2E) -> None:
    before = ensure_base(ctx)
    n = line_count(ctx, "base.txt")
    append(ctx.donefile, "base.txt", '{"id": "1", "key": "1", "input": "/x"')  # malformed JSON
    rec = record_of_line(ctx, f"base.txt:{n + 1}")
    assert rec["status_str"] == "failed" and "not JSON" in rec["message"]

    missing = str(next(_ids))
    append(ctx.donefile, "base.txt", {"id": missing, "key": missing, "input": "/no/such/input/dir"})
    rec = record(ctx, missing)
    assert rec["status_str"] == "failed"
    assert "input /no/such/input/dir does not exist" in rec["message"]

    broken = str(next(_ids))
    bad_input = ctx.root / "input" / broken
    bad_input.mkdir(parents=True)
    (bad_input / "part-00000").write_bytes(b"this is not a SequenceFile at all")
    append(ctx.donefile, "base.txt", {"id": broken, "key": broken, "input": str(bad_input)})
    rec = record(ctx, broken)
    assert rec["status_str"] == "failed" and "builder exited with status 1" in rec["message"]
    assert "part-00000" in rec["message"]  # the builder's own explanation

    orphan = f"1600000000_{next(_ids)}"
    orphan_input = write_input(ctx.root, orphan, *table(10, 1))
    cur = orphan.split("_")[1]
    append(ctx.donefile, "patch.txt", {"id": cur, "key": "1600000000", "input": str(orphan_input)})
    rec = record(ctx, orphan)
    assert rec["status_str"] == "refused"
    assert "is for base 1600000000, but the live base is" in rec["message"]

    assert served(ctx) == [before] * 4  # nothing of the above reached a server
    good = new_base(ctx)
    check_served(ctx, good)


def test_an_empty_base_is_refused_and_the_live_version_keeps_serving(ctx: E2E) -> None:
    before = ensure_base(ctx)
    version = str(next(_ids))
    empty = ctx.root / "input" / version
    empty.mkdir(parents=True)
    (empty / "part-00000").write_bytes(b"")  # the upstream job lost its output
    append(ctx.donefile, "base.txt", {"id": version, "key": version, "input": str(empty)})
    rec = record(ctx, version)
    assert rec["status_str"] == "refused" and "has no records" in rec["message"], rec
    check_served(ctx, before)
    for instance in ("0_0", "0_1", "1_0", "1_1"):
        assert agent_task(ctx, instance, "download", version) is None  # nothing downloaded


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        ("md5", "does not match its .md5"),
        ("evil", "leaves the target directory ('..')"),
        ("corrupt", "reload did not reach quorum"),
    ],
)
def test_damaged_builds_deploy_nothing(ctx: E2E, tamper: str, reason: str) -> None:
    before = ensure_base(ctx)
    bad = new_base(ctx, tamper=tamper, wait=False)
    rec = record(ctx, bad)
    assert rec["status_str"] == "failed" and reason in rec["message"], rec["message"]
    if tamper == "corrupt":  # md5 and tar were fine: the server's checksums caught it
        assert "nothing was switched" in rec["message"]
    assert served(ctx) == [before] * 4
    check_served(ctx, before)


def test_agents_refuse_damaged_tars_the_transfer_did_not_check(ctx: E2E) -> None:
    """With verify_output off, the agents' own md5 and member checks must stop the rollout."""
    conf = ctx.cluster.dir / "transfer.conf"
    original = conf.read_text()
    conf.write_text(original.replace("verify_output: true", "verify_output: false"))
    try:
        ctx.cluster.restart("transfer")
        before = ensure_base(ctx)
        for tamper, reason in (("md5", "md5"), ("evil", "..")):
            bad = new_base(ctx, tamper=tamper, wait=False)
            rec = record(ctx, bad)
            assert rec["status_str"] == "failed", rec
            assert "download did not reach quorum" in rec["message"]
            assert reason in rec["message"]
            assert served(ctx) == [before] * 4
    finally:
        conf.write_text(original)
        ctx.cluster.restart("transfer")
    check_served(ctx, before)


# ---------------------------------------------------------------------------------------------
# kill -9


def test_kill9_agent_during_download(ctx: E2E) -> None:
    base = ensure_base(ctx)
    agent = ctx.cluster.proc("agent0_1")
    original = list(agent.argv)
    agent.argv = [*original, "--limit_rate", "40000"]
    ctx.cluster.restart("agent0_1")
    keys = ctx.tables[base][0][:200]
    try:
        with Prober(ctx, keys) as prober:
            version = new_base(ctx, n=20000, wait=False)  # ~160 KB per shard: seconds at 40 KB/s
            wait_for(
                lambda: (
                    (agent_task(ctx, "0_1", "download", version) or {})
                    .get("progress", {})
                    .get("bytes")
                ),
                "agent0_1 to have downloaded some bytes",
            )
            kill9(ctx, "agent0_1")
            agent.argv = original
            ctx.cluster.restart("agent0_1")
            ctx.cluster.wait_version(version, WAIT)
        assert prober.errors == [] and prober.calls > 0
        task = agent_task(ctx, "0_1", "download", version)
        assert task is not None and task["state"] == "succeeded", task
        check_served(ctx, version)
    finally:
        agent.argv = original


def test_kill9_server_during_load(ctx: E2E) -> None:
    base = ensure_base(ctx)
    server = ctx.cluster.proc("server0_1")
    original = list(server.argv)
    server.argv = [*original, "--load_delay", "3"]
    ctx.cluster.restart("server0_1", timeout=WAIT)
    keys = ctx.tables[base][0][:200]
    try:
        with Prober(ctx, keys) as prober:
            version = new_patch(ctx, base.split("_")[0], changed=30, wait=False)
            wait_for(
                lambda: (
                    (agent_task(ctx, "0_1", "reload", version) or {})
                    .get("progress", {})
                    .get("phase")
                    == "load"
                ),
                "agent0_1 to have asked its server to load",
            )
            kill9(ctx, "server0_1")  # mid-load: --load_delay holds the load for 3 s
            server.argv = original
            ctx.cluster.restart("server0_1", timeout=WAIT)
            ctx.cluster.wait_version(version, WAIT)
        assert prober.errors == [] and prober.calls > 0
        check_served(ctx, version)
    finally:
        server.argv = original


def test_kill9_transfer_mid_deploy_resumes_without_losing_the_chain(ctx: E2E) -> None:
    base = ensure_base(ctx).split("_")[0]
    if live(ctx) != base:
        new_base(ctx)
        base = live(ctx)
    first = new_patch(ctx, base, changed=10)
    server = ctx.cluster.proc("server1_0")
    original = list(server.argv)
    server.argv = [*original, "--load_delay", "4"]
    ctx.cluster.restart("server1_0", timeout=WAIT)
    try:
        with Prober(ctx, ctx.tables[first][0][:200]) as prober:
            second = new_patch(ctx, base, changed=40, wait=False)
            wait_for(
                lambda: (
                    (ctx.cluster.transfer_info().get("deployment") or {}).get("phase") == "reload"
                ),
                "the transfer to be in its reload phase",
            )
            kill9(ctx, "transfer")
            ctx.cluster.restart("transfer")
            ctx.cluster.wait_version(second, WAIT)
        assert prober.errors == [] and prober.calls > 0
    finally:
        server.argv = original
        ctx.cluster.restart("server1_0", timeout=WAIT)
    ctx.cluster.wait_version(second, WAIT)  # the restarted server came back on it
    check_served(ctx, second)
    info = ctx.cluster.transfer_info()
    assert info["live_chain"] == [base, first, second]
    for instance in ("0_0", "0_1", "1_0", "1_1"):  # the resumed transfer did not download again
        task = agent_task(ctx, instance, "download", second)
        assert task is not None and task["state"] == "succeeded"
    events = (ctx.cluster.dir / "transfer" / "tmp" / "transfer_events.jsonl").read_text()
    starts = [e for e in map(json.loads, events.splitlines()) if e["event"] == "deploy_start"]
    assert [e["version"] for e in starts].count(second) == 1
    # and the next patch continues the same chain
    third = new_patch(ctx, base, changed=5)
    assert ctx.cluster.transfer_info()["live_chain"] == [base, first, second, third]
    check_served(ctx, third)


def test_quorum_one_rolls_out_past_a_dead_replica_which_catches_up_on_return(ctx: E2E) -> None:
    before = ensure_base(ctx)
    conf = ctx.cluster.dir / "transfer.conf"
    original_conf = conf.read_text()
    transfer = ctx.cluster.proc("transfer")
    original_argv = list(transfer.argv)
    conf.write_text(original_conf.replace("quorum: 2", "quorum: 1"))
    transfer.argv = [*original_argv, "--dead_timeout", "3"]
    ctx.cluster.restart("transfer")
    try:
        kill9(ctx, "agent0_1")
        version = new_base(ctx, wait=False)
        wait_for(lambda: live(ctx) == version, "the version to go live without agent0_1")
        rows = {r["instance"]: r["version"] for r in ctx.cluster.instance_rows()}
        assert rows["0_0"] == rows["1_0"] == rows["1_1"] == version
        assert ctx.cluster.proc("server0_1").process() is not None  # its server still serves
        ctx.cluster.restart("agent0_1")
        ctx.cluster.wait_version(version, WAIT)  # the reconciler brought it up to date
        check_served(ctx, version)
        assert before != version
    finally:
        conf.write_text(original_conf)
        transfer.argv = original_argv
        if ctx.cluster.proc("agent0_1").process() is None:
            ctx.cluster.restart("agent0_1")
        ctx.cluster.restart("transfer")


def test_a_corrupt_replica_never_answers_misses_and_is_repaired(ctx: E2E) -> None:
    """Issue 9's first case. One byte of a replica's served shard is corrupted on disk and its
    server restarted: the server refuses the version and says NOT_SERVING (a client asking
    only it gets an error, never a batch of misses); clients of both replicas keep getting
    every key; the transfer records the failure with its reason and repairs the replica by a
    new download, after which it serves the live version again."""
    from grpc_health.v1 import health_pb2

    from cube.client import ShardUnavailableError

    version = ensure_base(ctx)
    keys = ctx.tables[version][0]
    shard0 = keys[keys % 2 == 0][:200]
    server = ctx.cluster.proc("server0_1")
    address = f"127.0.0.1:{server.port}"
    layer = ctx.root / "cluster" / "instances" / "0_1" / "data" / version / "data.cube"
    with Prober(ctx, shard0) as prober:
        kill9(ctx, "server0_1")
        with open(layer, "r+b") as f:  # one byte of the values section, not the header
            f.seek(4096 + 7)
            byte = f.read(1)
            f.seek(4096 + 7)
            f.write(bytes([byte[0] ^ 0x5A]))
        ctx.cluster.restart("server0_1", timeout=WAIT)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert health_status(address) == not_serving or served(ctx)[1] == version
        with CubeClient(shards=[[address]], retry=0) as alone:
            try:
                result = alone.seek(shard0)
            except ShardUnavailableError as exc:
                assert "serves no version" in str(exc) or "data.cube" in str(exc)
            else:  # already repaired (the reconciler is fast): then every key is there
                assert result.found.all() and result.version == version
        events = ctx.root / "cluster" / "transfer" / "tmp" / "transfer_events.jsonl"
        wait_for(
            lambda: "corrupt_version" in events.read_text(), "the failure's reason in the journal"
        )
        ctx.cluster.wait_version(version, WAIT)
    assert prober.errors == [] and prober.calls > 0
    check_served(ctx, version)

    def caught_up() -> bool:  # journaled when the reconciler next sees the replica live
        lines = events.read_text().splitlines()
        return any('"caught_up"' in line and '"0_1"' in line for line in lines)

    wait_for(caught_up, "the catch-up of 0_1 in the journal")


# ---------------------------------------------------------------------------------------------
# retries


def test_a_base_failed_on_unreachable_replicas_is_retried_once_they_answer(tmp_path: Path) -> None:
    """The first base fails because no agent answers; once they are started it goes live on
    its own, without its line being published again."""
    from cube.transfer.local import stop

    donefile = tmp_path / "donefile"
    donefile.mkdir()
    spec = ClusterSpec(
        dir=tmp_path / "cluster", shards=1, replicas=2, donefile=donefile, poll_interval=0.2,
        phase_timeout=30.0, dead_timeout=2.0,
        transfer_overrides={"version_retry_backoff": 1.0, "version_retries": 30},
    )  # fmt: skip
    cluster = up(spec)
    try:
        agents = [cluster.proc("agent0_0"), cluster.proc("agent0_1")]
        stop(agents, timeout=10.0)
        version = str(next(_ids))
        keys, values = table(500, int(version))
        path = write_input(tmp_path, version, keys, values)
        append(donefile, "base.txt", {"id": version, "key": version, "input": str(path)})

        def failed_with_a_retry() -> bool:
            recs = [r for r in cluster.history() if r["version"] == version]
            return bool(recs) and recs[-1]["status_str"] == "failed" and recs[-1]["retry_at"] > 0

        assert poll_until(failed_with_a_retry, WAIT, 0.2), cluster.history()
        rec = next(r for r in cluster.history() if r["version"] == version)
        assert "download did not reach quorum" in rec["last_error"], rec
        # the retries come sooner than the agents: cube-local status shows one waiting
        assert poll_until(lambda: f"retrying {version}" in cluster.status_table(), WAIT, 0.1)
        for agent in agents:
            cluster.restart(agent.name)
        cluster.wait_version(version, 3 * WAIT)
        [rec] = [r for r in cluster.history() if r["version"] == version]
        assert rec["status_str"] == "finished" and rec["attempts"] >= 2, rec
        assert len((donefile / "base.txt").read_text().splitlines()) == 1  # not published again
        with CubeClient.from_conf(cluster.cube_conf) as client:
            np.testing.assert_array_equal(client.get_embeddings(keys, dim=DIM), values)
    finally:
        cluster.down(timeout=5.0)
