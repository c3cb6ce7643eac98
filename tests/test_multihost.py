"""The chart's pods on hosts of their own (helpers/clustersim.py): one network namespace per pod
with its own IP on a bridge, cluster DNS names in /etc/hosts, volumes at their mountPaths, the
rendered command lines, probes and restarts as a kubelet does them. A client in another
namespace uses the rendered cube.conf.

Skipped, saying why, without root or iproute2."""

from __future__ import annotations

import base64
import contextlib
import http.client
import itertools
import json
import os
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from helpers.clustersim import RESOLVER, Namespace, SimNode, require_root_network
from helpers.procs import REPO, scrape
from test_helm import HELM, PREVIOUS_CHART, render

from cube.donefile import append_line, format_line
from cube.processes import poll_until
from cube.seqfile import SequenceFileWriter
from cube.values import ValueColumn

pytestmark = [
    pytest.mark.slow,
    # signal: a test past its timeout ends with an exception, so that its finalizers stop the
    # processes it started (close_clients; every one also dies with this process)
    pytest.mark.timeout(300, method="signal"),
    pytest.mark.skipif(bool(require_root_network()), reason=require_root_network() or "ok"),
    pytest.mark.skipif(not HELM.exists(), reason="helm comes from `make tools` (.tools/)"),
]

HELPERS = Path(__file__).parent / "helpers"  # the harness scripts run by path
DIM = 4
BASE, DELTA = "1700000000", "1700000100"
WAIT = 90.0


def table(keys: np.ndarray, tag: float) -> np.ndarray:
    """The embedding of each key in a version: (key, tag, key + tag, 1)."""
    k = keys.astype(np.float32)
    return np.stack([k, np.full_like(k, tag), k + tag, np.ones_like(k)], axis=1)


def publish(donefile: Path, version: str, keys: np.ndarray, tag: float, base: str = "") -> None:
    """A SequenceFile under donefile/input/<name> and its line in base.txt / patch.txt, the way
    a trainer hands a version over (inputs relative to the donefile directory)."""
    name = f"{base}_{version}" if base else version
    source = donefile / "input" / name
    source.mkdir(parents=True)
    column = ValueColumn.fixed(table(keys, tag).view(np.uint8).reshape(-1), DIM * 4)
    with SequenceFileWriter(source / "part-00000") as writer:
        writer.write_batch(keys, column)
    line = format_line(version, base or version, f"input/{name}")
    append_line(donefile / ("patch.txt" if base else "base.txt"), line)


OPEN_CLIENTS: list[Client] = []  # (the fixture's client lives across tests)


class Client:
    """tests/helpers/sim_client.py in a client namespace: one JSON request, one JSON answer. Every
    client a test starts is closed when the test ends (`close_clients`), and dies with the
    test process (die_with_parent)."""

    def __init__(self, node: SimNode, conf: Path, namespace: Namespace | None = None) -> None:
        self.conf = conf
        self.ns = namespace or node.namespace("client")
        env = {**os.environ, **RESOLVER}  # the node's names are in /etc/hosts
        self.process = self.ns.run(
            [sys.executable, str(HELPERS / "sim_client.py"), str(conf)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        OPEN_CLIENTS.append(self)

    def ask(self, request: dict[str, Any], timeout: float = 2 * WAIT) -> dict[str, Any]:
        """Its answer, or {"error": ...} when it has none within `timeout` s (a longer
        request, a `load`, adds its seconds) or exited."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout + request.get("seconds", 0)):
                return {"error": f"no answer in {timeout} s"}
        line = self.process.stdout.readline()  # (the client writes whole lines)
        return json.loads(line) if line else {"error": f"exited {self.process.poll()}"}

    def close(self, timeout: float = 15) -> float:
        """Close its stdin and wait for it to exit (killed after `timeout` s); the seconds it
        took to exit by itself (inf when killed)."""
        if self in OPEN_CLIENTS:
            OPEN_CLIENTS.remove(self)
        started = time.monotonic()
        if self.process.stdin:
            with contextlib.suppress(OSError):  # (a client that is gone)
                self.process.stdin.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            return float("inf")
        return time.monotonic() - started


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    """The clients a test started are closed when it ends, also when it fails or times out
    (pytest-timeout's signal method ends the test with an exception, then this runs)."""
    before = list(OPEN_CLIENTS)
    yield
    for client in [c for c in OPEN_CLIENTS if c not in before]:
        client.close(timeout=5)


KEYS = np.arange(1, 100_001, dtype=np.uint64)  # 1.6 MB of values: a download takes ~1 s
CHECK = KEYS[::97]  # the keys looked up to check a version


class PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to `ip`, checking the certificate for `name` (the cluster's name of the host,
    which the test's own namespace does not resolve)."""

    def __init__(self, name: str, ip: str, port: int, ca: str) -> None:
        super().__init__(name, port, timeout=5, context=ssl.create_default_context(cafile=ca))
        self.ip = ip

    def connect(self) -> None:
        sock = socket.create_connection((self.ip, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


@dataclass
class Cluster:
    node: SimNode
    client: Client
    donefile: Path
    conf: Path
    api: str
    api_token: str
    versions: Iterator[str]
    live: str = ""
    # with TLS: the CA and the transfer's name in its certificate
    tls_ca: str = ""
    api_name: str = ""

    def get(self, path: str) -> Any:
        """The `data` of a GET on the transfer's API (https when the cluster has TLS)."""
        headers = {"Authorization": f"Bearer {self.api_token}"}
        if self.tls_ca:
            ip, port = self.api.removeprefix("https://").rsplit(":", 1)
            connection = PinnedHTTPS(self.api_name, ip, int(port), self.tls_ca)
            try:
                connection.request("GET", path, headers=headers)
                reply = connection.getresponse()
                if reply.status != 200:
                    raise OSError(f"{path}: HTTP {reply.status}")
                return json.loads(reply.read())["data"]
            finally:
                connection.close()
        request = urllib.request.Request(f"{self.api}{path}", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as reply:
            return json.loads(reply.read())["data"]

    def info(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.get("/dict/info")
        return answer

    def phase(self) -> str | None:
        """The phase of the rollout in progress ("" when none); None while the API is down."""
        with contextlib.suppress(OSError, ValueError):
            phase: str = (self.info().get("deployment") or {}).get("phase", "")
            return phase
        return None

    def new_base(self, tag: float) -> str:
        version = next(self.versions)
        publish(self.donefile, version, KEYS, tag)
        return version

    def settled(self, timeout: float = WAIT) -> str:
        """Wait until no rollout runs, a version is live and every shard pod is ready."""
        settled = lambda: self.phase() == "" and self.info()["live_version"]  # noqa: E731
        if not poll_until(settled, timeout, 0.2):
            self.info()  # (its error)
            raise AssertionError(f"phase {self.phase()!r}")
        self.node.wait_ready(shard_pods(self.node), timeout)
        self.live = self.info()["live_version"]
        return self.live

    def background_load(self, seconds: float, conf: Path | None = None) -> Load:
        return Load(self.node, conf or self.conf, seconds)

    def instances(self) -> dict[str, dict[str, Any]]:
        """The transfer's view of each replica (/instance/status), by name."""
        return {i["name"]: i for i in self.get("/instance/status")}

    def conf_with(self, name: str, **fields: object) -> Path:
        """A copy of the rendered cube.conf with some fields changed."""
        conf = json.loads(self.conf.read_text())
        path = self.conf.with_name(name)
        path.write_text(json.dumps([dict(conf[0], **fields)]))
        return path


class Load:
    """Lookups without pause from another client namespace, in a thread; `result()` waits.
    With `until`, in rounds of `seconds` until that event is set (then `result()` merges
    them: p50 the rounds' median, p99 and max their highest)."""

    def __init__(
        self,
        node: SimNode,
        conf: Path,
        seconds: float,
        namespace: Namespace | None = None,
        until: threading.Event | None = None,
    ) -> None:
        self.client = Client(node, conf, namespace)
        self.answer: dict[str, Any] = {}
        self.rounds: list[dict[str, Any]] = []

        def run() -> None:
            while True:
                self.rounds.append(
                    self.client.ask({"load": CHECK[:200].tolist(), "seconds": seconds})
                )
                if until is None or until.is_set() or "error" in self.rounds[-1]:
                    break
            self.answer.update(merged_loads(self.rounds))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float = WAIT) -> dict[str, Any]:
        """The load's answer; `exit_s`: how long the client then took to exit."""
        self.thread.join(timeout)
        self.answer["exit_s"] = self.client.close()
        return self.answer


def merged_loads(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    if len(rounds) == 1 or any("error" in r for r in rounds):
        return next((r for r in rounds if "error" in r), rounds[0])
    versions: dict[str, int] = {}
    for r in rounds:
        for version, calls in r["versions"].items():
            versions[version] = versions.get(version, 0) + calls
    return {
        "calls": sum(r["calls"] for r in rounds),
        "errors": [e for r in rounds for e in r["errors"]][:20],
        "error_count": sum(r["error_count"] for r in rounds),
        "versions": versions,
        "mixed": sum(r["mixed"] for r in rounds),
        "p50_ms": float(np.median([r["p50_ms"] for r in rounds])),
        "p99_ms": max(r["p99_ms"] for r in rounds),
        "max_ms": max(r["max_ms"] for r in rounds),
    }


# The values of the simulated clusters: rollouts long enough to cut into, short timeouts.
VALUES: dict[str, Any] = {
    "dict": {"name": "sim_dict", "shards": 2, "replicas": 2},
    "server": {"grace": 2, "inMem": False},
    "agent": {"extraArgs": ["--limit_rate=1500000"]},
    # 1 s per attempt as before; the whole call may outlast the ~2 s stall of a kill -9
    "client": {"timeoutMs": 8000, "attemptTimeoutMs": 1000, "backupRequestMs": 100},
    "transfer": {
        "pollInterval": 0.3,
        "deadTimeout": 5,
        "quorum": 1,
        "donefile": {"address": "/donefile", "volume": {"hostPath": {"path": "/srv/donefile"}}},
    },
}


def rendered(
    tmp_path: Path, values: dict[str, Any], chart: Path | None = None
) -> list[dict[str, Any]]:
    """The chart's objects for `values` (the chart of this checkout, or `chart`)."""
    path = tmp_path / f"values-{next(_RENDERS)}.yaml"
    path.write_text(yaml.safe_dump(values))
    text = render("--values", str(path), chart=chart) if chart else render("--values", str(path))
    return [d for d in yaml.safe_load_all(text) if d]


_RENDERS = itertools.count()


def upgraded(installed: list[dict[str, Any]], docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`docs` as `helm upgrade` would apply them over `installed`: the chart's token Secret
    keeps the tokens installed (its `lookup` finds them in a cluster; `helm template` has no
    cluster to ask, so every render makes new random ones)."""
    old = {d["metadata"]["name"]: d for d in installed if d["kind"] == "Secret"}
    return [
        {**d, "data": old[d["metadata"]["name"]]["data"]}
        if d["kind"] == "Secret" and d["metadata"]["name"] in old
        else d
        for d in docs
    ]


def cube_conf(docs: list[dict[str, Any]], path: Path) -> Path:
    """The rendered cube.conf, written to `path`."""
    conf = next(d for d in docs if d["metadata"]["name"].endswith("-cube-conf"))
    path.write_text(conf["data"]["cube.conf"])
    return path


@contextlib.contextmanager
def running(tmp_path: Path, docs: list[dict[str, Any]], tls_ca: str = "") -> Iterator[Cluster]:
    """A node running `docs` (the donefile directory of hostPath /srv/donefile is
    tmp_path/donefile) and a client of the rendered cube.conf; closed at the end."""
    donefile = tmp_path / "donefile"
    donefile.mkdir()
    conf = cube_conf(docs, tmp_path / "cube.conf")
    if tls_ca:  # the client runs in a namespace, not a pod: the CA at its host path
        conf.write_text(json.dumps([dict(json.loads(conf.read_text())[0], tls_ca=tls_ca)]))
    secret = next(d for d in docs if d["kind"] == "Secret" and "api-token" in d["data"])
    token = base64.b64decode(secret["data"]["api-token"]).decode()
    node = SimNode(docs, tmp_path / "node", host_paths={"/srv/donefile": donefile})
    try:
        node.start()
        client = Client(node, conf)
        try:
            transfer = node.pod("t-cube-transfer-0")
            scheme = "https" if tls_ca else "http"
            api = f"{scheme}://{transfer.ip}:8099"
            ids = (str(1700000000 + 1000 * i) for i in itertools.count())
            name = f"{transfer.spec.subdomain}.ml.svc.cluster.local"
            yield Cluster(node, client, donefile, conf, api, token, ids, "", tls_ca, name)
        finally:
            client.close()
    except BaseException:
        print(node.report())
        raise
    finally:
        node.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp_path = tmp_path_factory.mktemp("multihost")
    with running(tmp_path, rendered(tmp_path, VALUES)) as made:
        yield made


def served_versions(node: SimNode, pod: str) -> list[str]:
    """The current versions a replica's metrics report."""
    samples = scrape(f"http://{node.pod(pod).ip}:9100/metrics")
    return [
        dict(labels)["version"]
        for (name, labels), value in samples.items()
        if name == "cube_server_version_info" and dict(labels)["slot"] == "current" and value
    ]


def answered(node: SimNode) -> float:
    """Lookup requests all replicas answered, from their metrics."""
    return sum(
        value
        for pod in shard_pods(node)
        for (name, _labels), value in scrape(f"http://{node.pod(pod).ip}:9100/metrics").items()
        if name == "cube_server_requests_total"
    )


def shard_pods(node: SimNode) -> list[str]:
    return sorted(name for name in node.pods if "-shard-" in name)


def served(client: Client, keys: np.ndarray) -> dict[str, Any]:
    return client.ask({"seek": keys.tolist(), "dim": DIM})


def assert_serves(
    cluster: Cluster, version: str, expected: np.ndarray, keys: np.ndarray = CHECK
) -> None:
    answer = served(cluster.client, keys)
    assert answer.get("version") == version, answer
    np.testing.assert_array_equal(np.asarray(answer["values"], np.float32), expected)


def measured(what: str, load: dict[str, Any]) -> None:
    """One line for bench/RESULTS.md (pytest -s shows it)."""
    print(
        f"\nMEASURED {what}: {load['calls']} lookups, p50 {load['p50_ms']:.1f} ms, p99"
        f" {load['p99_ms']:.1f} ms, max {load['max_ms']:.0f} ms, errors {load['error_count']}"
    )


def assert_clean(load: dict[str, Any]) -> None:
    """No failed request and no batch that mixed versions."""
    assert load["calls"] > 0, load
    assert load["error_count"] == 0, load["errors"]
    assert load["mixed"] == 0, load


def test_a_pod_runs_from_a_checkout_its_volume_hides_and_makes_no_host_directory(
    tmp_path: Path,
) -> None:
    """Any checkout, any machine (issue 24 item 9, issue 26 item 5). Before: a clone under /tmp
    could not run a pod (its /tmp volume hid the venv and the sources), and every mount path
    was made on the host (/var/lib/cube, /donefile: shared by two runs on one machine, one
    run removing what the other still used)."""
    mount_point = f"/var/lib/cube-sim-{os.getpid()}"  # made by no one else
    check = f"import cube.client, os; assert os.path.isdir({mount_point!r})"
    pod = {
        "kind": "Pod",
        "metadata": {"name": "hidden-code", "annotations": {"helm.sh/hook": "test"}},
        "spec": {
            "containers": [{
                "name": "check",
                "command": ["python", "-c", check],
                "volumeMounts": [  # a volume over the checkout (and its venv), as /tmp's
                    {"name": "over", "mountPath": str(REPO)},
                    {"name": "data", "mountPath": mount_point},
                ],
                "securityContext": {"readOnlyRootFilesystem": True},
            }],
            "volumes": [{"name": "over", "emptyDir": {}}, {"name": "data", "emptyDir": {}}],
        },
    }  # fmt: skip
    node = SimNode([pod], tmp_path / "node")
    try:
        node.start()
        codes = node.run_test_pods(timeout=60)
        made = Path(mount_point).exists()
    finally:
        node.close()
    assert codes == {"hidden-code": 0}, node.report()
    assert not made


def test_base_then_delta_reach_every_replica_across_hosts(cluster: Cluster) -> None:
    node, client = cluster.node, cluster.client
    started = time.monotonic()
    base = cluster.new_base(1.0)
    cluster.settled()
    took = time.monotonic() - started
    print(f"\nMEASURED first base of {len(KEYS)} keys live on 2 x 2 pods: {took:.1f} s")
    assert_serves(cluster, base, table(CHECK, 1.0))
    # `helm test`: the chart's lookup pod, in a namespace of its own, reaches every shard
    assert node.run_test_pods() == {"t-cube-test-lookup": 0}, node.report()

    changed = KEYS[::10]
    delta_id = next(cluster.versions)
    publish(cluster.donefile, delta_id, changed, 2.0, base=base)
    delta = f"{base}_{delta_id}"
    assert poll_until(lambda: served(client, CHECK).get("version") == delta, WAIT, 0.3), (
        served(client, CHECK),
        node.report(),
    )
    expected = table(KEYS, 1.0)
    expected[::10] = table(changed, 2.0)
    assert_serves(cluster, delta, expected[::97])
    # every replica of every shard serves it, not only those the client happened to ask
    conf = json.loads(cluster.conf.read_text())
    for replica in range(2):
        only = [dict(conf[0], nodes=[{"ipport_list": node_["ipport_list"].split(",")[replica]
                                      .removeprefix("list://")}
                                     for node_ in conf[0]["nodes"]])]  # fmt: skip
        path = cluster.conf.with_name(f"replica{replica}.conf")
        path.write_text(json.dumps(only))
        single = Client(node, path)
        try:
            answer = served(single, CHECK)
        finally:
            single.close()
        assert answer.get("version") == delta, answer
        np.testing.assert_array_equal(np.asarray(answer["values"], np.float32), expected[::97])
    # each replica's metrics, scraped across the bridge as Prometheus would: the version it
    # serves, and the lookups it answered (each replica of each shard answered some)
    for pod in shard_pods(node):
        samples = scrape(f"http://{node.pod(pod).ip}:9100/metrics")
        held = [
            dict(labels)["version"]
            for (name, labels), v in samples.items()
            if name == "cube_server_version_info" and dict(labels)["slot"] == "current" and v
        ]
        assert held == [delta], (pod, held)
        answered = [v for (name, _), v in samples.items() if name == "cube_server_requests_total"]
        assert sum(answered) > 0, pod
    for running_pod, container in node.containers():
        assert container.restarts == 0, (running_pod.spec.name, container.spec.name, node.report())


@pytest.mark.parametrize(
    ("pod", "container", "phase"),
    [
        ("t-cube-shard-0-1", "cube-server", "reload"),
        ("t-cube-shard-1-0", "cube-agent", "download"),
        ("t-cube-transfer-0", "cube-transfer", "download"),
    ],
)
def test_kill9_mid_rollout(cluster: Cluster, pod: str, container: str, phase: str) -> None:
    """kill -9 of a server, an agent or the transfer while a base rolls out: the kubelet
    restarts it, the rollout completes (or aborts to the previous version), every replica
    serves the live version again, and no request fails or mixes versions."""
    before = cluster.settled()
    load = cluster.background_load(12)
    tag = float(int(before) % 1000 + 3)
    version = cluster.new_base(tag)
    assert poll_until(lambda: cluster.phase() == phase, WAIT, 0.05), cluster.info()
    cluster.node.kill(pod, container)
    live = cluster.settled()
    assert live in (version, before)
    result = load.result()
    measured(f"kill -9 {container} during {phase}", result)
    assert_clean(result)
    if live == version:
        assert_serves(cluster, version, table(CHECK, tag))
    assert cluster.node.pod(pod).containers[container].restarts >= 1


def test_a_replica_cut_off_during_a_rollout(cluster: Cluster) -> None:
    """Its link goes down while a base rolls out: clients fail over without a failed request,
    the transfer goes on with the quorum (1) it has, and the replica catches up once back."""
    before = cluster.settled()
    cut = "t-cube-shard-0-1"
    answered_before = answered(cluster.node)
    load = cluster.background_load(10)
    tag = float(int(before) % 1000 + 5)
    version = cluster.new_base(tag)
    assert poll_until(lambda: cluster.phase() == "download", WAIT, 0.05), cluster.info()
    # scraped mid-rollout, under load: every replica still reports the version it serves
    for pod in shard_pods(cluster.node):
        assert served_versions(cluster.node, pod) == [before], pod
    cut_server = cluster.node.pod(cut).containers["cube-server"]
    restarts_before = cut_server.restarts
    cluster.node.cut(cut)
    try:
        went_live = lambda: cluster.phase() == "" and cluster.info()["live_version"] == version  # noqa: E731
        assert poll_until(went_live, WAIT, 0.2), cluster.info()
        result = load.result()
        measured("a replica cut off during a rollout", result)
        assert_clean(result)
        assert_serves(cluster, version, table(CHECK, tag))
        # partitioned, not dead: its kubelet (on its node) leaves it be
        assert cut_server.restarts == restarts_before
    finally:
        cluster.node.heal(cut)
    caught_up = lambda: cluster.instances()["0_1"]["serving_version"] == version  # noqa: E731
    assert poll_until(caught_up, WAIT, 0.3), cluster.instances()["0_1"]
    cluster.settled()
    # the servers counted what the client sent: each lookup is one request to each of the 2
    # shards, and a hedge or a retry adds one (the client's own lookups add a few)
    counted = answered(cluster.node) - answered_before
    assert 2 * result["calls"] <= counted <= 2.5 * result["calls"] + 100, (counted, result)


def test_a_slow_replica_is_hedged(cluster: Cluster) -> None:
    """50 ms more round trip to one replica (a relay: this kernel has no netem): with a 10 ms
    hedge the client's p99 stays within a few ms of the healthy p99 (the `la` balancer also
    learns from outrun attempts that the replica is slow), far under the added 50 ms."""
    cluster.settled()
    node = cluster.node
    hedged = cluster.conf_with("hedged.conf", backup_request=10, load_balancer="la")
    healthy = Load(node, hedged, 6).result()
    assert_clean(healthy)
    slow_pod = node.pod("t-cube-shard-0-1")
    relay = node.namespace("relay")
    relaying = relay.run(
        [sys.executable, str(HELPERS / "delay_relay.py"), "0.0.0.0", slow_pod.ip,
         "8000,8100", "50"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert relaying.stdout is not None and relaying.stdout.readline().strip() == "relaying"
        client_ns = node.namespace("slow-client")
        name = f"{slow_pod.spec.name}.{slow_pod.spec.subdomain}.ml.svc.cluster.local"
        node.resolve(client_ns, name, [relay.ip])
        slowed = Load(node, hedged, 6, namespace=client_ns).result()
        unhedged = Load(
            node, cluster.conf_with("unhedged.conf", backup_request=0, load_balancer="rr"), 4,
            namespace=client_ns,
        ).result()  # fmt: skip
    finally:
        relaying.terminate()
        relaying.wait(10)
    assert_clean(slowed)
    measured("healthy, hedged at 10 ms", healthy)
    measured("one replica +50 ms, hedged at 10 ms", slowed)
    measured("one replica +50 ms, no hedging", unhedged)
    print(
        f"p99 healthy {healthy['p99_ms']:.1f} ms; one replica +50 ms: hedged"
        f" {slowed['p99_ms']:.1f} ms, unhedged {unhedged['p99_ms']:.1f} ms"
    )
    assert unhedged["p99_ms"] > 45  # the relay does slow that replica down
    assert slowed["p99_ms"] < healthy["p99_ms"] + 5, (healthy, slowed)  # within a few ms


def test_a_replica_cut_off_and_another_slow_neither_fail_calls_nor_hold_the_exit(
    cluster: Cluster,
) -> None:
    """Issue 24, item 10: shard 0 listed with three replicas, one whose link goes down (its
    connects hang: no reset), one behind a relay far slower than the call's timeout, one
    healthy; a backup request after 20 ms, `rr`. Before, about one call in three failed by
    its deadline (its first attempt on the cut replica and its one backup request on the
    slow one, or the reverse: neither ever cooled down, their attempts being cancelled or
    ended by the deadline timer, never failed) although the third replica answers at once.
    Now no call fails, and the client exits within seconds once its stdin closes."""
    cluster.settled()
    node = cluster.node
    cut, slow = node.pod("t-cube-shard-0-0"), node.pod("t-cube-shard-0-1")
    relay = node.namespace("relay-3s")
    relaying = relay.run(
        [sys.executable, str(HELPERS / "delay_relay.py"), "0.0.0.0", slow.ip,
         "8000,8100", "3000"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    heal = False
    try:
        assert relaying.stdout is not None and relaying.stdout.readline().strip() == "relaying"
        client_ns = node.namespace("partial-client")
        node.resolve(client_ns, "slow-replica.cube.test", [relay.ip])
        conf = json.loads(cluster.conf.read_text())[0]
        names = [f"{p.spec.name}.{p.spec.subdomain}.ml.svc.cluster.local:8000" for p in (cut, slow)]
        shard_0 = [names[0], "slow-replica.cube.test:8000", names[1]]
        nodes = [{"ipport_list": "list://" + ",".join(shard_0)}, conf["nodes"][1]]
        path = cluster.conf_with(
            "partial.conf", nodes=nodes, dup=3, timeout=1000, attempt_timeout=1000,
            backup_request=20, load_balancer="rr", retry=2,
        )  # fmt: skip
        client = Client(node, path, client_ns)
        warm = client.ask({"load": CHECK[:200].tolist(), "seconds": 1})  # every link up
        assert warm.get("calls"), warm
        node.cut(cut.spec.name)
        heal = True
        load = client.ask({"load": CHECK[:200].tolist(), "seconds": 8})
        load["exit_s"] = client.close()
    finally:
        if heal:
            node.heal(cut.spec.name)
        relaying.terminate()
        relaying.wait(10)
    measured("shard 0: a replica cut off, one 3 s slow, one healthy; hedged at 20 ms", load)
    print(f"MEASURED the client exited {load['exit_s']:.2f} s after its stdin closed")
    assert_clean(load)
    assert load["exit_s"] < 5, load


def test_rolling_restart_under_load(cluster: Cluster) -> None:
    """Each shard pod deleted in turn (as the PodDisruptionBudget allows: the next one only
    when the last is ready again), with fresh emptyDir volumes: no failed request."""
    cluster.settled()
    load = cluster.background_load(45)
    for pod in shard_pods(cluster.node):
        cluster.node.delete_pod(pod)
        cluster.node.wait_ready([pod], WAIT)
    result = load.result()
    measured("rolling restart of every shard pod", result)
    assert_clean(result)
    cluster.settled()


def agent_status(cluster: Cluster, pod: str) -> dict[str, Any]:
    """A replica's agent status (GET /agent/status with the agents' token), from the node."""
    secret = next(
        d for d in cluster.node.docs if d["kind"] == "Secret" and "agent-token" in d["data"]
    )
    token = base64.b64decode(secret["data"]["agent-token"]).decode()
    request = urllib.request.Request(
        f"http://{cluster.node.pod(pod).ip}:8001/agent/status",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        status: dict[str, Any] = json.loads(reply.read())["data"]
        return status


def test_a_replica_restarted_empty_recovers_from_its_peer_while_the_transfer_is_down(
    cluster: Cluster,
) -> None:
    """Issue 35 item 4: the transfer is down (its pod deleted, as a drain would) and a server
    pod is killed with its data removed (kill -9, fresh emptyDir): its agent finds no
    transfer, gets the shard's version from the other replica's agent (md5-checked) and its
    server serves again within a bound (measured); no lookup fails meanwhile, the other
    replica answering. The transfer, back, finds the replica on the live version: nothing to
    catch up, no failure recorded."""
    assert poll_until(lambda: cluster.phase() is not None, WAIT, 0.2)  # (the API is up)
    if not cluster.info()["live_version"]:  # (run alone)
        cluster.new_base(1.0)
    live = cluster.settled()
    node, pod = cluster.node, "t-cube-shard-0-1"
    stop = threading.Event()
    load = Load(node, cluster.conf, 2, until=stop)
    node.stop_pod("t-cube-transfer-0")
    try:
        started = time.monotonic()
        node.delete_pod(pod, timeout=0)  # SIGKILL at once; the pod comes back, its data gone
        node.wait_ready([pod], WAIT)
        took = time.monotonic() - started
    finally:
        stop.set()
        result = load.result()
        node.start_pod("t-cube-transfer-0")
    measured(f"a replica killed with its data, transfer down: ready in {took:.1f} s", result)
    print(f"\nMEASURED recovery from a peer, transfer down: pod ready {took:.1f} s after kill -9")
    assert_clean(result)
    assert took < 30, took  # the bound docs/DEPLOY.md states
    assert served_versions(node, pod) == [live]
    recovery = agent_status(cluster, pod)["recovery"]
    assert recovery["state"] == "recovered" and recovery["version"] == live, recovery
    assert recovery["peer"].startswith("t-cube-shard-0-0."), recovery
    cluster.settled()  # the transfer is back and has nothing to do
    instance = cluster.instances()["0_1"]
    assert instance["serving_version"] == live and instance["failures"] == 0, instance
    tasks = agent_status(cluster, pod)["tasks"]
    assert [t["command"] for t in tasks] == ["download", "reload", "enable"], tasks


def test_helm_upgrade_with_changed_values_under_load(cluster: Cluster, tmp_path: Path) -> None:
    """Issue 35 item 6: `helm upgrade` of this chart with changed values (2 workers a server,
    which before put a worker on the agent's port; other probe timings; agent.keep 3), every
    shard pod replaced one at a time per shard while a delta rolls out: no lookup fails, no
    answer mixes versions, and every replica ends on the delta."""
    assert poll_until(lambda: cluster.phase() is not None, WAIT, 0.2)  # (the API is up)
    if not cluster.info()["live_version"]:  # (run alone)
        cluster.new_base(1.0)
    base = cluster.settled()
    node = cluster.node
    values = {**VALUES, "server": {**VALUES["server"], "workers": 2,
                                   "livenessProbe": {"periodSeconds": 3, "failureThreshold": 4,
                                                     "timeoutSeconds": 2}},
              "agent": {**VALUES["agent"], "keep": 3}}  # fmt: skip
    docs = upgraded(node.docs, rendered(tmp_path, values))
    stop = threading.Event()
    load = Load(node, cluster.conf, 2, until=stop)
    delta_id = next(cluster.versions)
    changed = KEYS[::10]
    started = time.monotonic()
    try:
        publish(cluster.donefile, delta_id, changed, 9.0, base=base.split("_")[0])
        done = node.apply(docs, timeout=WAIT)
        live = cluster.settled()
    finally:
        stop.set()
    took = time.monotonic() - started
    result = load.result()
    measured(f"helm upgrade to 2 workers a server during a delta's rollout ({took:.0f} s)", result)
    assert_clean(result)
    assert live == f"{base.split('_')[0]}_{delta_id}", live
    assert sorted(s for s in done if s.startswith("replaced t-cube-shard")) == [
        f"replaced t-cube-shard-{s}-{r}" for s in range(2) for r in range(2)
    ]
    for pod in shard_pods(node):
        server = node.pod(pod).containers["cube-server"]
        assert "--worker_ports=8000,8002" in server.spec.command, server.spec.command
        assert set(served_versions(node, pod)) == {live}, pod  # (each worker's)
    cluster.conf = cube_conf(docs, cluster.conf)  # clients take the new cube.conf
    cluster.client.close()
    cluster.client = Client(node, cluster.conf)
    assert served(cluster.client, CHECK).get("version") == live


# ---------------------------------------------------------------------------------------------
# TLS, upgrades and the harness by hand: clusters of their own


def tls_secret(tmp_path: Path, docs: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """A Secret as an operator would make for `tls.existingSecret` (tls.crt, tls.key, ca.crt)
    whose certificate names every shard's replicas and the transfer, as the chart's
    cert-manager Certificate asks; and the CA's path on the host."""
    import trustme

    ca = trustme.CA()
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    names = [f"*.{s}.ml.svc.cluster.local" for s in services if "-shard-" in s]
    names += [f"{s}.ml.svc.cluster.local" for s in services if s.endswith("-transfer")]
    cert = ca.issue_cert(*names)
    ca_path = tmp_path / "ca.crt"
    ca.cert_pem.write_to_path(str(ca_path))
    data = {
        "tls.crt": b"".join(blob.bytes() for blob in cert.cert_chain_pems),
        "tls.key": cert.private_key_pem.bytes(),
        "ca.crt": ca.cert_pem.bytes(),
    }
    secret = {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": "cube-tls", "namespace": "ml"},
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }  # fmt: skip
    return secret, str(ca_path)


def test_tls_end_to_end(tmp_path: Path) -> None:
    """Issue 26 item 2, with `tls.enabled` and a certificate Secret: the servers serve lookups
    (gRPC and the lane) over TLS, the agents their API, the transfer its API and the tars
    (agents download over https, the transfer calls them over https); the kubelet's readiness
    probe, which cannot speak TLS, asks the control port, and the replicas get ready; the
    `helm test` pod's cube-cli finds the CA through cube.conf; a client that trusts the CA gets
    the right values, a plaintext client and a plaintext API call get nothing."""
    values = {**VALUES, "dict": {"name": "sim_dict", "shards": 2, "replicas": 1},
              "agent": {}, "tls": {"enabled": True, "existingSecret": "cube-tls"}}  # fmt: skip
    docs = rendered(tmp_path, values)
    secret, ca = tls_secret(tmp_path, docs)
    with running(tmp_path, [*docs, secret], tls_ca=ca) as made:
        started = time.monotonic()
        base = made.new_base(7.0)
        made.settled()  # (the pods are ready: their probes work with TLS on)
        print(
            f"\nMEASURED TLS: first base live on 2 x 1 pods in {time.monotonic() - started:.1f} s"
        )
        assert_serves(made, base, table(CHECK, 7.0))
        assert made.node.run_test_pods() == {"t-cube-test-lookup": 0}, made.node.report()
        plain = Client(made.node, made.conf_with("plain.conf", tls_ca=None))
        try:
            assert "error" in served(plain, CHECK[:10])
        finally:
            plain.close()
        with pytest.raises(OSError):  # the API speaks https only
            urllib.request.urlopen(made.api.replace("https", "http") + "/dict/info", timeout=5)
        for pod in shard_pods(made.node):  # called over https, downloads from https only
            agent = made.node.pod(pod).containers["cube-agent"]
            assert "listening on https://" in agent.log.read_text()
            sources = "--allowed_sources=https://t-cube-transfer.ml.svc.cluster.local:8009/"
            assert sources in agent.spec.command


def test_upgrade_from_the_previous_chart_under_load(tmp_path: Path) -> None:
    """Issue 26 item 6: installed with the previous chart (0.1.0), `helm upgrade` to this one
    with 3 replicas instead of 2 and a new image, then to 2 replicas again (shards
    unchanged): the new replicas get the live version from the transfer, every pod is
    replaced one at a time per shard, and a client under load all along (with the cube.conf
    it started with) has no failed request."""
    before = rendered(tmp_path, VALUES, chart=PREVIOUS_CHART)
    grown = {**VALUES, "dict": {**VALUES["dict"], "replicas": 3}, "image": {"tag": "0.1.1"}}
    with running(tmp_path, before) as made:
        base = made.new_base(3.0)
        made.settled()
        steps = []
        for values, name in (
            (grown, "2 x 2 -> 2 x 3, new image"),
            ({**grown, "dict": VALUES["dict"]}, "2 x 3 -> 2 x 2"),
        ):
            docs = upgraded(made.node.docs, rendered(tmp_path, values))
            stop = threading.Event()
            load = Load(made.node, made.conf, 2, until=stop)
            started = time.monotonic()
            try:
                done = made.node.apply(docs, timeout=WAIT)
                made.settled()
            finally:
                stop.set()
            took = time.monotonic() - started
            result = load.result()
            measured(f"helm upgrade {name} ({took:.0f} s)", result)
            assert_clean(result)
            steps.append(done)
            made.conf = cube_conf(docs, made.conf)  # clients move to the new cube.conf
            made.client.close()
            made.client = Client(made.node, made.conf)
            assert_serves(made, base, table(CHECK, 3.0))
        grow, shrink = steps
        assert {"created t-cube-shard-0-2", "created t-cube-shard-1-2"} <= set(grow)
        replaced = [s for s in grow if s.startswith("replaced t-cube-shard-0-")]
        assert replaced == ["replaced t-cube-shard-0-1", "replaced t-cube-shard-0-0"]
        assert {"deleted t-cube-shard-0-2", "deleted t-cube-shard-1-2"} <= set(shrink)
        assert "replaced t-cube-transfer-0" in shrink  # its config changed: 2 replicas a shard
        # each agent lists its shard's replicas (--peers): their pods are replaced in turn
        replaced = [s for s in shrink if s.startswith("replaced t-cube-shard-0-")]
        assert replaced == ["replaced t-cube-shard-0-1", "replaced t-cube-shard-0-0"]
        assert sorted(made.instances()) == ["0_0", "0_1", "1_0", "1_1"]


def test_the_harness_runs_by_hand_with_your_values(tmp_path: Path) -> None:
    """Issue 26 item 5 (docs/DEPLOY.md): `python tests/helpers/clustersim.py --values ...` runs the
    chart with an operator's values until stopped, prints its pods and a client namespace,
    and leaves nothing behind."""
    values = tmp_path / "mine.yaml"
    values.write_text(yaml.safe_dump({"dict": {"name": "by_hand", "shards": 1, "replicas": 1}}))
    process = subprocess.Popen(
        [sys.executable, str(HELPERS / "clustersim.py"), "--values", str(values),
         "--workdir", str(tmp_path / "node"), "--seconds", "60", "--ready_timeout", "5"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("logs:"):
                break
        conf = json.loads((tmp_path / "node" / "cube.conf").read_text())
        assert conf[0]["dict_name"] == "by_hand"
        namespace = next(line.split()[2] for line in lines if line.startswith("client namespace"))
        assert (
            namespace
            in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True, timeout=30
            ).stdout
        )
        assert any(line.startswith("pod t-cube-shard-0-0: ") for line in lines), lines
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode == 0 and rest.rstrip().endswith("closed"), rest
    assert (
        namespace
        not in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=30
        ).stdout
    )
