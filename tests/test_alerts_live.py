"""Every alert of the chart fires in a real Prometheus (issue 35 item 1).

Debian's `prometheus` scrapes a local cluster (cube-local: two shards of two replicas, a
cube-server and a cube-agent each, and the cube-transfer, real processes on loopback) started
with the arguments `helm template` renders for them, as the chart's ServiceMonitors name the
jobs (a shard's Service: its servers and agents; the transfer's), and evaluates the chart's
rendered PrometheusRule, each alert's `for` set to 1s, a few thresholds made reachable and
the rate/increase windows made 20 s through `metrics.prometheusRule.alerts`. A server of two
workers rendered with `server.workers: 2` runs beside it. Then the failure each alert
watches for is made to happen, one after the other, and the test waits until Prometheus
reports the alert firing, and resolved once the fault is gone:

- CubeReplicaNotServing: servers up before any base is published (resolved: a base goes live);
- CubeLookupErrors: lookups sent to a server that serves nothing yet (UNAVAILABLE);
- CubeWorkerUnreachable: worker 1 of the two-worker server stopped (SIGSTOP; resolved:
  SIGCONT);
- CubeLookupP99High: batches of 100,000 keys against a 5 ms budget (after 10-key lookups:
  the p99 it sees grows past theirs);
- CubeReplicaUnreachable, CubeShardUnreachable: both servers of shard 1 stopped (resolved:
  started again);
- CubeDonefileUnreadable: the donefile's directory moved away (then back);
- CubeRolloutAborted, CubeVersionAbandoned: a base whose input is not a SequenceFile (the
  builder refuses it);
- CubeNoNewVersion: the live version older than a 20 s threshold (resolved: a new base);
- CubeAgentDiskFull: a replica's volume filled to 95 % of its emptyDir size (`--disk_limit`);
- CubeAgentDownloadsFailing, CubeReplicaBehind, CubeShardsOnDifferentVersions: a base
  published while that volume is full: its download fails (`no_space`), the other replicas
  take it (quorum 1); resolved once the file is removed and the transfer catches it up;
- CubeRolloutStuck: an agent stopped (SIGSTOP) during a rollout, against an 8 s threshold
  (resolved: SIGCONT, the rollout ends);
- at the end, every alert over a window (CubeLookupP99High, CubeLookupErrors,
  CubeDonefileUnreadable, CubeRolloutAborted, CubeVersionAbandoned, CubeAgentDownloadsFailing)
  resolved once its 20 s window is past the fault: every alert has fired and resolved.

Every process started here is stopped by its PID at the end. About 100 s on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
import yaml
from helpers.procs import ServerProc, scrape, start_server
from helpers.stubs import fast_stub
from helpers.transfer_helpers import write_table

from cube.pb import cube_fast_pb2
from cube.processes import free_port, poll_until, spawn, stop_child
from cube.transfer.config import parse_config
from cube.transfer.local import Cluster, ClusterSpec, stop, up

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "cube"
HELM = REPO / ".tools" / "bin" / "helm"
PROMETHEUS = shutil.which("prometheus")
NAMESPACE = "ml"
RELEASE = "t"
OPERATOR_APIS = (
    "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
)  # fmt: skip

pytestmark = [
    pytest.mark.slow,  # a cluster, two servers more and a Prometheus
    pytest.mark.skipif(not HELM.exists(), reason="helm comes from `make tools` (.tools/)"),
    pytest.mark.skipif(
        PROMETHEUS is None, reason="prometheus comes with Debian's prometheus package (make debs)"
    ),
    pytest.mark.timeout(420),
]

# thresholds the test can reach in seconds; every other alert keeps the file's
THRESHOLDS = {"CubeLookupP99High": 0.005, "CubeNoNewVersion": 20, "CubeRolloutStuck": 8}
# windows the test can see pass: the alerts over a rate()/increase() range resolve once their
# fault is over by that long (the file's 5 and 15 minutes would outlast the test)
WINDOWS = dict.fromkeys(
    ("CubeLookupP99High", "CubeLookupErrors", "CubeDonefileUnreadable", "CubeRolloutAborted",
     "CubeVersionAbandoned", "CubeAgentDownloadsFailing"),
    "20s",
)  # fmt: skip
DISK = "8Mi"  # agent.storage.size: the agents' --disk_limit
# what CubeLookupP99High compares with its threshold
P99 = (
    "histogram_quantile(0.99, sum by (job, le) "
    '(rate(cube_server_request_duration_seconds_bucket{{job="{job}"}}[5m])))'
)
KEYS = 20_000  # a base: 10,000 keys of 16 bytes a shard, a tar of 320 kB


def chart_values() -> dict[str, Any]:
    alerts = yaml.safe_load((CHART / "files" / "alerts.yml").read_text())
    names = [rule["alert"] for group in alerts["groups"] for rule in group["rules"]]
    overrides: dict[str, dict[str, Any]] = {name: {"for": "1s"} for name in names}
    for name, threshold in THRESHOLDS.items():
        overrides[name]["threshold"] = threshold
    for name, window in WINDOWS.items():
        overrides[name]["window"] = window
    return {
        "dict": {"shards": 2, "replicas": 2},
        "server": {"inMem": False},
        "agent": {"storage": {"size": DISK}},
        "transfer": {"pollInterval": 1, "quorum": 1},
        "metrics": {
            "serviceMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True, "alerts": overrides},
        },
    }


# ---------------------------------------------------------------------------------------------
# the chart, rendered


def render(tmp: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    path = tmp / f"values-{len(list(tmp.glob('values-*')))}.yaml"
    path.write_text(yaml.safe_dump(values))
    done = subprocess.run(
        [str(HELM), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--values",
         str(path), *OPERATOR_APIS],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """command -> its container (the first StatefulSet's: shard 0's, or the transfer's)."""
    found: dict[str, dict[str, Any]] = {}
    for workload in of_kind(docs, "StatefulSet"):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            found.setdefault(container["command"][0], container)
    return found


def flags_of(args: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in args if arg.startswith("--"))


# What a pod's command line says about where it runs, replaced by cube-local's own (ports,
# addresses, paths, TLS files, the cluster's DNS names) or set through ClusterSpec.
PLACE = {
    "host", "port", "tcp_ports", "worker_ports", "control_host", "control_port", "data_dir",
    "metrics_host", "metrics_port", "tls_cert", "tls_key", "tls_ca", "deploy_path", "server",
    "allowed_sources", "transfer_address", "config", "partitioner", "poll_interval",
    "dead_timeout",
}  # fmt: skip


def local_args(container: dict[str, Any]) -> list[str]:
    """The container's arguments that hold wherever it runs (the rest are cube-local's)."""
    kept = []
    for arg in container["args"]:
        name, _, value = arg.removeprefix("--").partition("=")
        if name in PLACE or name.startswith("peer") or ".svc." in value:
            continue
        kept.append(arg)
    return kept


@dataclass
class Target:
    job: str  # the Service a ServiceMonitor selects, as the Operator names the job
    process: str  # the cube-local process: server1_0, agent1_0, transfer
    pod: str


def monitored(docs: list[dict[str, Any]], shards: int, replicas: int) -> list[Target]:
    """What the chart's ServiceMonitors scrape, as local processes: each endpoint's port by
    name through the Service to the container that declares it, in every pod of the
    StatefulSet the Service selects."""
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    targets = []
    for monitor in of_kind(docs, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services.values()
                      if selector.items() <= s["metadata"]["labels"].items()]  # fmt: skip
        selects = service["spec"]["selector"].items()
        (workload,) = [
            w for w in of_kind(docs, "StatefulSet")
            if selects <= w["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        name = workload["metadata"]["name"]
        ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            (container,) = [
                c for c in workload["spec"]["template"]["spec"]["containers"]
                if ports[endpoint["port"]] in {p["name"] for p in c.get("ports", [])}
            ]  # fmt: skip
            role = container["command"][0].removeprefix("cube-")
            if role == "transfer":
                targets.append(Target(service["metadata"]["name"], "transfer", f"{name}-0"))
                continue
            shard = int(workload["metadata"]["labels"]["cube.shard"])
            for replica in range(replicas):
                process = f"{role}{shard}_{replica}"
                targets.append(Target(service["metadata"]["name"], process, f"{name}-{replica}"))
    assert {t.process for t in targets} == {
        f"{role}{i}_{j}" for role in ("server", "agent") for i in range(shards)
        for j in range(replicas)
    } | {"transfer"}  # fmt: skip
    return targets


# ---------------------------------------------------------------------------------------------
# Prometheus


class Prometheus:
    """`prometheus` on a free loopback port with a storage directory of its own; its alerts
    by the HTTP API."""

    def __init__(self, tmp: Path, config: dict[str, Any]) -> None:
        assert PROMETHEUS is not None
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.log = tmp / "prometheus.log"
        self.process = spawn(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            self.log,
        )  # fmt: skip
        if not poll_until(self.ready, 30, 0.2, check=self.running):
            raise TimeoutError(f"prometheus not ready in 30 s:\n{self.log.read_text()[-3000:]}")
        self.fired: set[str] = set()  # the alerts seen firing

    def running(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")

    def get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.loads(reply.read())

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                return True
        except OSError:
            return False

    def alerts(self, name: str, state: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The alerts `name` in `state` ("firing"; "" for pending or firing) whose labels
        include `labels`."""
        return [
            alert for alert in self.get("/api/v1/alerts")["data"]["alerts"]
            if alert["labels"]["alertname"] == name and (alert["state"] == state or not state)
            and labels.items() <= alert["labels"].items()
        ]  # fmt: skip

    def fires(self, name: str, timeout: float = 45.0, **labels: str) -> dict[str, Any]:
        """Wait until Prometheus says `name` fires (with `labels`); the alert."""
        if not poll_until(lambda: bool(self.alerts(name, "firing", labels)), timeout, 0.25):
            raise AssertionError(f"{name} {labels} not firing after {timeout} s: {self.summary()}")
        alert: dict[str, Any] = self.alerts(name, "firing", labels)[0]
        self.fired.add(name)
        return alert

    def resolves(self, name: str, timeout: float = 45.0, **labels: str) -> None:
        """Wait until `name` (with `labels`) is neither firing nor pending."""
        if not poll_until(lambda: not self.alerts(name, "", labels), timeout, 0.25):
            raise AssertionError(f"{name} {labels} still active after {timeout} s")

    def value(self, expr: str) -> float:
        """The value of an instant query that gives one series."""
        query = urllib.parse.urlencode({"query": expr})
        (result,) = self.get(f"/api/v1/query?{query}")["data"]["result"]
        return float(result["value"][1])

    def summary(self) -> str:
        active = self.get("/api/v1/alerts")["data"]["alerts"]
        return json.dumps([(a["labels"]["alertname"], a["state"]) for a in active])

    def stop(self) -> None:
        stop_child(self.process, 10)


def scrape_config(cluster: Cluster, targets: list[Target], extra: dict[str, Any]) -> dict[str, Any]:
    """A 1 s scrape of every target by the job the chart's ServiceMonitor gives it, labelled
    with its pod as the Operator labels it; 1 s rule evaluations; `extra` a job more."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for target in targets:
        port = cluster.proc(target.process).metrics_port
        labels = {"pod": target.pod, "namespace": NAMESPACE}
        jobs.setdefault(target.job, []).append({"targets": [f"127.0.0.1:{port}"], "labels": labels})
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yml"],
        "scrape_configs": [
            *({"job_name": job, "static_configs": configs} for job, configs in jobs.items()),
            extra,
        ],
    }


# ---------------------------------------------------------------------------------------------
# faults


@contextlib.contextmanager
def lookups(address: str, keys: np.ndarray, per_second: float) -> Iterator[list[str]]:
    """Lookups of `keys` sent to `address` in a thread while the block runs; the gRPC codes of
    those refused."""
    codes: list[str] = []
    done = threading.Event()

    def send() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = fast_stub(channel)
            request = cube_fast_pb2.SeekRequest(keys=keys.astype("<u8").tobytes())
            while not done.wait(1 / per_second):
                try:
                    stub.Seek(request, timeout=10)
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield codes
    finally:
        done.set()
        thread.join(15)


def publish(tmp: Path, donefile: Path, version: str, records: int = KEYS) -> None:
    inputs = write_table(tmp / "input" / version, records)
    with open(donefile / "base.txt", "a") as f:
        f.write(json.dumps({"id": version, "key": version, "input": str(inputs)}) + "\n")


def publish_garbage(tmp: Path, donefile: Path, version: str) -> None:
    """A base whose input is not a SequenceFile: the builder refuses it."""
    inputs = tmp / "input" / version
    inputs.mkdir(parents=True)
    (inputs / "part-00000").write_bytes(b"not a sequence file\n" * 100)
    with open(donefile / "base.txt", "a") as f:
        f.write(json.dumps({"id": version, "key": version, "input": str(inputs)}) + "\n")


def worker(server: ServerProc, index: int) -> psutil.Process:
    """Worker `index` of a server started here (its supervisor's child)."""
    for child in psutil.Process(server.pid).children():
        line = " ".join(child.cmdline())
        if f"--worker_index {index}" in line or f"--worker_index={index}" in line:
            return child
    raise AssertionError(f"no worker {index} under pid {server.pid}")


def fill(deploy_path: Path, agent_metrics: int, left: float) -> Path:
    """A file in an agent's volume leaving `left` of its capacity free (a sparse file: what
    counts against --disk_limit is its size), as anything else on the volume would."""
    samples = scrape(f"http://127.0.0.1:{agent_metrics}/metrics")
    room = {name: value for (name, _labels), value in samples.items()
            if name.startswith("cube_agent_disk_")}  # fmt: skip
    capacity = room["cube_agent_disk_capacity_bytes"]
    junk = deploy_path / "junk"
    with open(junk, "wb") as f:
        f.truncate(int(room["cube_agent_disk_available_bytes"] - left * capacity))
    return junk


def timed(log: list[str]) -> Callable[[str], None]:
    start = time.monotonic()

    def note(what: str) -> None:
        log.append(f"{time.monotonic() - start:6.1f} s  {what}")

    return note


# ---------------------------------------------------------------------------------------------
# the test


def test_every_alert_fires_in_a_real_prometheus(tmp_path: Path) -> None:
    """Long: one cluster, one Prometheus, the faults one after the other (the table above)."""
    steps: list[str] = []
    note = timed(steps)
    docs = render(tmp_path, chart_values())
    commands = containers(docs)
    for command in ("cube-server", "cube-agent", "cube-transfer"):  # every process is scraped
        assert "metrics_port" in flags_of(commands[command]["args"]), command
    assert flags_of(commands["cube-agent"]["args"])["disk_limit"] == DISK
    targets = monitored(docs, 2, 2)
    (conf_map,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith(
        "-transfer")]  # fmt: skip
    cfg = parse_config(conf_map["data"]["transfer.conf"], "transfer.conf", tmp_path)
    (rule,) = of_kind(docs, "PrometheusRule")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule["spec"]))
    transfer_flags = flags_of(commands["cube-transfer"]["args"])
    two_workers = containers(render(tmp_path, {**chart_values(), "server": {"workers": 2}}))
    server_args = [a for a in local_args(two_workers["cube-server"]) if "--workers" not in a]

    donefile = tmp_path / "donefile"
    spec = ClusterSpec(
        dir=tmp_path / "cluster", shards=cfg.shard_num, replicas=cfg.copy_num, donefile=donefile,
        dict_name=cfg.dict_name, mode=cfg.mode, quorum=cfg.quorum, partitioner=cfg.partitioner,
        poll_interval=float(transfer_flags["poll_interval"]),
        dead_timeout=float(transfer_flags["dead_timeout"]),
        server_args=local_args(commands["cube-server"]),
        agent_args=local_args(commands["cube-agent"]),
        transfer_args=local_args(commands["cube-transfer"]),
        metrics=True, create_donefile_dir=True,
    )  # fmt: skip
    (tmp_path / "workers" / "data").mkdir(parents=True)
    workers_metrics = free_port()
    workers = start_server(  # starting while the cluster does
        tmp_path / "workers" / "data", *server_args, "--metrics_port", str(workers_metrics),
        workers=2, wait=False,
    )  # fmt: skip
    try:
        cluster = up(spec, health_timeout=90)
    except BaseException:
        workers.stop()
        raise
    stopped: list[psutil.Process] = []  # SIGSTOPped: SIGCONT before anything else at the end
    prometheus: Prometheus | None = None
    try:
        workers.wait_up(60)
        extra_job = {
            "job_name": "t-cube-workers", "scrape_interval": "3s", "scrape_timeout": "3s",
            "static_configs": [{"targets": [f"127.0.0.1:{workers_metrics}"]}],
        }  # a worker that does not answer costs its supervisor's scrape 2 s  # fmt: skip
        prometheus = Prometheus(tmp_path, scrape_config(cluster, targets, extra_job))
        note(f"cluster, two-worker server and prometheus up ({len(targets)} monitored targets)")
        run_the_faults(tmp_path, cluster, workers, prometheus, stopped, note)
        every = {r["alert"] for group in rule["spec"]["groups"] for r in group["rules"]}
        assert prometheus.fired == every, sorted(every - prometheus.fired)
    finally:
        for process in stopped:
            with contextlib.suppress(psutil.Error):
                process.resume()
        if prometheus is not None:
            prometheus.stop()
        workers.stop()
        cluster.down()
        print("\n".join(steps))


def run_the_faults(
    tmp: Path,
    cluster: Cluster,
    workers: ServerProc,
    prometheus: Prometheus,
    stopped: list[psutil.Process],
    note: Callable[[str], None],
) -> None:
    """Long: each fault of the module's table in turn, and the alerts it must fire."""
    donefile = Path(parse_config((cluster.dir / "transfer.conf").read_text(), "t",
                                 cluster.dir).donefile_address)  # fmt: skip
    dict_name = cluster.dict_name
    shard0 = f"127.0.0.1:{cluster.proc('server0_0').port}"
    even = np.arange(2, KEYS + 1, 2, dtype=np.uint64)  # shard 0's keys (mod 2)

    def all_up() -> bool:  # every server, agent and the transfer, as the monitors say
        targets = prometheus.get("/api/v1/targets")["data"]["activeTargets"]
        return len(targets) == 9 + 1 and all(t["health"] == "up" for t in targets)

    assert poll_until(all_up, 30, 0.5), prometheus.get("/api/v1/targets")

    # servers with nothing to serve yet: not serving, and they refuse lookups (rate()[5m] of a
    # series younger than that counts its errors over the 5 minutes: more than 300 to fire)
    with lookups(shard0, even[:10], per_second=150) as codes:
        prometheus.fires("CubeReplicaNotServing", pod="t-cube-shard-0-0")
        prometheus.fires("CubeLookupErrors", job="t-cube-shard-0", code="UNAVAILABLE")
    assert codes and set(codes) == {"UNAVAILABLE"}
    note("CubeReplicaNotServing, CubeLookupErrors")
    # a worker of the two-worker server stops answering
    one = worker(workers, 1)
    one.suspend()
    stopped.append(one)
    prometheus.fires("CubeWorkerUnreachable", job="t-cube-workers", worker="1")
    one.resume()
    stopped.remove(one)
    prometheus.resolves("CubeWorkerUnreachable", job="t-cube-workers", worker="1")
    note("CubeWorkerUnreachable fired and resolved")

    publish(tmp, donefile, "1700000001")
    cluster.wait_version("1700000001", 60)
    prometheus.resolves("CubeReplicaNotServing", pod="t-cube-shard-0-0")
    note("base 1 live: CubeReplicaNotServing resolved")

    # 10-key lookups, then batches of 100,000 keys: what the alert sees grows past its budget
    # (not asserted: that 10-key ones stay under it, on a machine as busy as a test run's)
    with lookups(shard0, even[:10], per_second=200) as codes:
        time.sleep(2)
    time.sleep(2)  # scraped
    small = prometheus.value(P99.format(job="t-cube-shard-0"))
    assert not codes
    big = np.resize(even, 100_000)
    with lookups(shard0, big, per_second=20):
        alert = prometheus.fires("CubeLookupP99High", job="t-cube-shard-0")
    assert float(alert["value"]) > max(small, THRESHOLDS["CubeLookupP99High"])
    note(f"CubeLookupP99High (p99 {small * 1000:.2f} ms, then {float(alert['value']) * 1000:.1f})")

    # a shard's replicas down, then back
    stop([cluster.proc("server1_0"), cluster.proc("server1_1")], timeout=10)
    for replica in ("0", "1"):
        prometheus.fires("CubeReplicaUnreachable", shard="1", replica=replica)
    prometheus.fires("CubeShardUnreachable", shard="1", dict=dict_name)
    for name in ("server1_0", "server1_1"):
        cluster.restart(name)
    prometheus.resolves("CubeShardUnreachable", shard="1")
    prometheus.resolves("CubeReplicaUnreachable", shard="1")
    note("CubeReplicaUnreachable, CubeShardUnreachable fired and resolved")

    # the donefile's directory gone, then back
    moved = donefile.with_name("donefile.moved")
    donefile.rename(moved)
    try:
        prometheus.fires("CubeDonefileUnreadable", dict=dict_name)
    finally:
        moved.rename(donefile)
    note("CubeDonefileUnreadable")

    # a base the builder refuses
    publish_garbage(tmp, donefile, "1700000002")
    prometheus.fires("CubeRolloutAborted", dict=dict_name, outcome="aborted")
    prometheus.fires("CubeVersionAbandoned", dict=dict_name)
    note("CubeRolloutAborted, CubeVersionAbandoned")

    # the live version grows old; a replica's volume fills up; a base it cannot take
    prometheus.fires("CubeNoNewVersion", dict=dict_name)
    agent = cluster.proc("agent1_1")
    deploy_path = Path(agent.argv[agent.argv.index("--deploy_path") + 1])
    junk = fill(deploy_path, agent.metrics_port, left=0.05)
    prometheus.fires("CubeAgentDiskFull", pod="t-cube-shard-1-1")
    note("CubeNoNewVersion, CubeAgentDiskFull")
    publish(tmp, donefile, "1700000003")
    failing = prometheus.fires(
        "CubeAgentDownloadsFailing", reason="no_space", instance=f"127.0.0.1:{agent.metrics_port}"
    )
    prometheus.fires("CubeReplicaBehind", shard="1", replica="1", dict=dict_name)
    prometheus.fires("CubeShardsOnDifferentVersions", job="t-cube-shard-1")
    prometheus.resolves("CubeNoNewVersion", dict=dict_name)  # the others took it
    assert failing["labels"]["job"] == "t-cube-shard-1"
    note("CubeAgentDownloadsFailing, CubeReplicaBehind, CubeShardsOnDifferentVersions")
    junk.unlink()
    prometheus.resolves("CubeAgentDiskFull", pod="t-cube-shard-1-1")
    prometheus.resolves("CubeReplicaBehind", shard="1", replica="1", timeout=60)
    prometheus.resolves("CubeShardsOnDifferentVersions", job="t-cube-shard-1")
    note("the volume emptied: the replica caught up, those resolved")

    # an agent that stops answering in the middle of a rollout
    hung = psutil.Process(cluster.proc("agent0_1").pid)
    hung.suspend()
    stopped.append(hung)
    publish(tmp, donefile, "1700000004")
    prometheus.fires("CubeRolloutStuck", dict=dict_name)
    hung.resume()
    stopped.remove(hung)
    cluster.wait_version("1700000004", 60)
    prometheus.resolves("CubeRolloutStuck", dict=dict_name)
    note("CubeRolloutStuck fired and resolved")

    # every fault is over: the alerts over a window resolve once it has passed
    for name in WINDOWS:
        prometheus.resolves(name, timeout=60)
    note(f"{', '.join(WINDOWS)} resolved ({WINDOWS['CubeLookupErrors']} windows)")
