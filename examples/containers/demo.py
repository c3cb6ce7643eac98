"""The Helm chart's pods in real containers on this machine, end to end (issue 34 item 4).

    python -m examples.containers.demo [--workdir DIR] [--keep_image]    (make demo-containers)

1. renders deploy/helm/cube with `helm template` (2 shards x 2 replicas, the project's image),
   and translates its StatefulSets into podman pods (examples/containers/kube.py: strict, it
   refuses what it does not understand; podman.py runs them): the transfer pod and 4 shard pods
   (cube-server + cube-agent), each with its own IP on a network of the run and the cluster's
   names in /etc/hosts;
2. publishes a base (a SequenceFile and its base.txt line) in a directory of the host that is
   the transfer pod's donefile volume (a hostPath in the values), waits until every replica
   serves it, reads every value from the host through the SDK configured from the rendered
   cube.conf (replica names resolved to the pods' IPs) and checks them; then a patch, the same;
3. SIGKILLs the cube-server of one replica of shard 0 while a client loops over lookups (none
   may fail: the other replica answers), starts it again (its pod's volumes as they were, as a
   kubelet restarts a container), measures the time until it is SERVING again (it loads its
   version from its data directory by itself) and checks the values it serves;
4. prints the times, and removes every pod, container, network and directory it made.

The image (cube-py:<version>) is built from this checkout by deploy/docker/images.py. Needs podman,
root and helm (`make tools`). tests/test_containers.py runs the same scenario.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from numpy.typing import NDArray

from cube.client import CubeClient, CubeError
from cube.donefile import append_line, format_line
from cube.seqfile import SequenceFileWriter
from cube.values import ValueColumn
from examples.containers.kube import Probe, Rendered, translate
from examples.containers.podman import (
    REPO,
    PodmanCluster,
    engine_problem,
    ensure_image,
    images_module,
)

CHART = REPO / "deploy" / "helm" / "cube"
RELEASE, NAMESPACE = "emb", "ml"
DONEFILE_HOST_PATH = "/srv/cube-donefile"  # the hostPath in the values, mapped to a directory
DIM = 4
BASE, PATCH = "1700000000", "1700000100"
PATCHED = f"{BASE}_{PATCH}"  # the version a server names after the patch (base_patch)
BASE_KEYS = np.arange(1, 20_001, dtype=np.uint64)
PATCH_KEYS = np.arange(15_001, 25_001, dtype=np.uint64)  # 5000 changed, 5000 new
WAIT = 90.0  # the longest any one step may take (seconds)


class ScenarioError(AssertionError):
    """A step of the scenario failed (its message says which, and what was seen)."""


def helm() -> Path:
    bundled = REPO / ".tools" / "bin" / "helm"
    found = shutil.which("helm")
    return bundled if bundled.exists() else Path(found or bundled)


def values(image: str, shards: int = 2, replicas: int = 2) -> dict[str, Any]:
    """The chart's values for the run: the chart's defaults but the size, the image, a donefile
    directory of the host, a short poll, and no NetworkPolicies (nothing here enforces them,
    and the translator refuses what it would not enforce)."""
    repository, _, tag = image.rpartition(":")
    return {
        "dict": {"name": "containers_demo", "shards": shards, "replicas": replicas},
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "transfer": {
            "pollInterval": 0.5,
            "donefile": {
                "address": "/donefile",
                "volume": {"hostPath": {"path": DONEFILE_HOST_PATH, "type": "Directory"}},
            },
        },
        "networkPolicy": {"enabled": False},
    }


def render(values_file: Path) -> list[dict[str, Any]]:
    """`helm template` of the chart (no `helm test` pod: not a pod a node keeps running)."""
    done = subprocess.run(
        [str(helm()), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--skip-tests",
         "--values", str(values_file)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode:
        raise ScenarioError(f"helm template failed: {done.stderr.strip()}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def table(keys: NDArray[np.uint64], tag: float) -> NDArray[np.float32]:
    """The embedding of each key in a version: (key, tag, key + tag, 1)."""
    k = keys.astype(np.float32)
    return np.stack([k, np.full_like(k, tag), k + tag, np.ones_like(k)], axis=1)


def publish(
    donefile: Path, version: str, keys: NDArray[np.uint64], tag: float, base: str = ""
) -> None:
    """A SequenceFile under donefile/input/<name> and its donefile line (in base.txt, or in
    patch.txt when `base` is given), the input named as the transfer pod sees it."""
    name = f"{base}_{version}" if base else version
    source = donefile / "input" / name
    source.mkdir(parents=True)
    column = ValueColumn.fixed(table(keys, tag).view(np.uint8).reshape(-1), DIM * 4)
    with SequenceFileWriter(source / "part-00000") as writer:
        writer.write_batch(keys, column)
    for path in (source.parent, source, source / "part-00000"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # read by the transfer's user
    line = format_line(version, base or version, f"/donefile/input/{name}")
    append_line(donefile / ("patch.txt" if base else "base.txt"), line)


def client_conf(rendered: Rendered, ips: dict[str, str], path: Path, replica: int = -1) -> Path:
    """The rendered cube.conf with each replica's name replaced by its pod's IP (the host has
    no cluster DNS); with `replica` >= 0, only that replica of each shard. Written to `path`."""
    conf_map = next(v for k, v in rendered.config_maps.items() if k.endswith("-cube-conf"))
    names = dict(rendered.hosts(ips))
    entries = json.loads(conf_map["cube.conf"])
    for entry in entries:
        if entry.get("type") != "ipport_list":
            raise ScenarioError(f"cube.conf: type {entry.get('type')!r} (ipport_list expected)")
        for node in entry["nodes"]:
            replicas = node["ipport_list"].removeprefix("list://").split(",")
            if replica >= 0:
                replicas = [replicas[replica]]
            resolved = []
            for address in replicas:
                host, _, port = address.rpartition(":")
                if host not in names:
                    raise ScenarioError(f"cube.conf names {host}, which is no pod's name")
                resolved.append(f"{names[host]}:{port}")
            node["ipport_list"] = "list://" + ",".join(resolved)
    path.write_text(json.dumps(entries, indent=2))
    return path


def wait(what: str, ready: Callable[[], bool], timeout: float = WAIT, every: float = 0.1) -> float:
    """Seconds until `ready()`; ScenarioError after `timeout`."""
    started = time.monotonic()
    while not ready():
        if time.monotonic() - started > timeout:
            raise ScenarioError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)
    return time.monotonic() - started


def check_values(client: CubeClient, expected: dict[int, NDArray[np.float32]], version: str) -> int:
    """Every key of `expected` looked up (batches of 4096): found, of `version`, its value.
    Returns how many were checked."""
    keys = np.fromiter(expected, dtype=np.uint64)
    for start in range(0, len(keys), 4096):
        batch = keys[start : start + 4096]
        result = client.seek(batch)
        if result.version != version:
            raise ScenarioError(f"lookups answered by version {result.version}, not {version}")
        if not result.found.all():
            raise ScenarioError(f"{int((~result.found).sum())} keys missing in {version}")
        got = result.column.as_rows().view(np.float32).reshape(len(batch), DIM)
        want = np.stack([expected[int(k)] for k in batch])
        bad = np.flatnonzero((got != want).any(axis=1))
        if len(bad):
            key = int(batch[bad[0]])
            raise ScenarioError(
                f"{len(bad)} wrong values in {version}, e.g. key {key}: {got[bad[0]]}"
                f" != {want[bad[0]]}"
            )
    return len(keys)


def served_version(conf: Path) -> str | None:
    """The version a client of `conf` gets for a lookup on every shard (None: no answer)."""
    try:
        with CubeClient.from_conf(conf) as client:
            return client.seek(BASE_KEYS[:64]).version
    except CubeError:
        return None


def serving(conf: Path, version: str) -> Callable[[], bool]:
    return lambda: served_version(conf) == version


class Prober:
    """Lookups without pause on a thread, counting those that fail."""

    def __init__(self, conf: Path, keys: NDArray[np.uint64]) -> None:
        self.client = CubeClient.from_conf(conf)
        self.keys = keys
        self.calls = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="prober", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                self.client.seek(self.keys)
            except CubeError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            self.latencies.append(time.perf_counter() - started)
            self.calls += 1

    def __enter__(self) -> Prober:
        self.client.wait_ready(timeout_s=10.0)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        self.client.close()


@dataclass
class Report:
    """What the scenario measured (seconds unless said)."""

    pods_started_s: float = 0.0  # from the first `podman pod create` to every container started
    server_listening_s: float = 0.0  # a server's container start -> its lookup port accepts
    base_rollout_s: float = 0.0  # base published -> every replica SERVING it
    server_first_serving_s: float = 0.0  # a server's container start -> SERVING (the base's)
    patch_rollout_s: float = 0.0  # patch published -> every replica serves it
    values_checked: int = 0  # lookups of single keys checked against what was published
    kill_lookups: int = 0  # lookups from one server's SIGKILL until it serves again
    kill_failed_lookups: int = 0
    kill_p99_ms: float = 0.0
    restart_serving_s: float = 0.0  # the killed server's `podman start` -> SERVING
    total_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # what the translator did not emulate

    def lines(self) -> list[str]:
        return [f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
                for k, v in asdict(self).items() if k != "notes"]  # fmt: skip


@contextlib.contextmanager
def _no_proxy() -> Iterator[None]:
    """The host's lookups go straight to the pods' addresses (gRPC and urllib would take a
    proxy named in the environment)."""
    names = [n for n in os.environ if n.lower() in ("http_proxy", "https_proxy", "grpc_proxy",
                                                      "all_proxy")]  # fmt: skip
    saved = {n: os.environ.pop(n) for n in names}
    try:
        yield
    finally:
        os.environ.update(saved)


def run(workdir: Path | None = None, log: Callable[[str], None] = print) -> Report:
    """The whole scenario (see the module docstring); raises ScenarioError (with the
    containers' last log lines) when a step fails. Needs the image (ensure_image)."""
    began = time.monotonic()
    report = Report()
    image = f"cube-py:{images_module().project_version()}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(_no_proxy())
        scratch = Path(tempfile.mkdtemp(prefix="cube-containers-", dir=workdir))
        stack.callback(shutil.rmtree, scratch, True)
        donefile = scratch / "donefile"
        donefile.mkdir()
        donefile.chmod(0o755)
        (scratch / "values.yaml").write_text(yaml.safe_dump(values(image)))
        rendered = translate(render(scratch / "values.yaml"), "cluster.local",
                             [DONEFILE_HOST_PATH])  # fmt: skip
        report.notes = list(rendered.notes)
        cluster = stack.enter_context(
            PodmanCluster(rendered, scratch, {DONEFILE_HOST_PATH: donefile})
        )
        try:
            _scenario(cluster, rendered, donefile, scratch, report, log)
        except BaseException:
            log(cluster.report())
            raise
        leftover = cluster
    gone = leftover.leftovers()
    if gone:
        raise ScenarioError(f"left behind: {gone}")
    report.total_s = time.monotonic() - began
    return report


def _scenario(
    cluster: PodmanCluster,
    rendered: Rendered,
    donefile: Path,
    scratch: Path,
    report: Report,
    log: Callable[[str], None],
) -> None:
    pods = [p.name for p in rendered.pods]
    shard_pods = sorted(p for p in pods if "-shard-" in p)
    transfer = next(p for p in pods if p.endswith("-transfer-0"))
    if len(shard_pods) != 4:
        raise ScenarioError(f"expected 4 shard pods, got {shard_pods}")
    began = time.monotonic()
    cluster.start()
    report.pods_started_s = time.monotonic() - began
    log(f"pods up in {report.pods_started_s:.1f} s (prefix {cluster.prefix}):")
    for pod in pods:
        log(f"  {pod}: {cluster.ip(pod)}")

    def listening(pod: str) -> bool:
        return cluster.probe(pod, _tcp(rendered, pod, "cube-server", "grpc"))

    wait("every server's lookup port", lambda: all(listening(p) for p in shard_pods))
    first = shard_pods[0]
    listened = [time.monotonic() - cluster.pods[p].started["cube-server"] for p in shard_pods]
    report.server_listening_s = max(listened)
    wait("the transfer and every agent", lambda: cluster.ready(transfer) and all(
        cluster.ready(p, ["cube-agent"]) for p in shard_pods))  # fmt: skip

    ips = {p: cluster.ip(p) for p in pods}
    conf = client_conf(rendered, ips, scratch / "cube.conf")
    per_replica = [client_conf(rendered, ips, scratch / f"replica{r}.conf", r) for r in (0, 1)]

    # -- the base ------------------------------------------------------------------------------
    published = time.monotonic()
    publish(donefile, BASE, BASE_KEYS, 1.0)
    log(f"base {BASE} published ({len(BASE_KEYS)} keys)")
    serving_at: dict[str, float] = {}

    def all_serving() -> bool:
        for pod in shard_pods:
            if pod not in serving_at and cluster.ready(pod, ["cube-server"]):
                serving_at[pod] = time.monotonic()
        return len(serving_at) == len(shard_pods)

    wait("every replica SERVING the base", all_serving, every=0.2)
    for replica_conf in per_replica:
        wait(f"{replica_conf.name} serving {BASE}", serving(replica_conf, BASE))
    report.base_rollout_s = time.monotonic() - published
    report.server_first_serving_s = serving_at[first] - cluster.pods[first].started["cube-server"]
    expected = {int(k): v for k, v in zip(BASE_KEYS, table(BASE_KEYS, 1.0), strict=True)}
    with CubeClient.from_conf(conf) as client:
        report.values_checked += check_values(client, expected, BASE)
    log(f"base: every replica serves it after {report.base_rollout_s:.1f} s; "
        f"{len(expected)} values checked")  # fmt: skip

    # -- the patch -----------------------------------------------------------------------------
    published = time.monotonic()
    publish(donefile, PATCH, PATCH_KEYS, 2.0, base=BASE)
    log(f"patch {PATCH} published ({len(PATCH_KEYS)} keys)")
    for replica_conf in per_replica:
        wait(f"{replica_conf.name} serving {PATCHED}", serving(replica_conf, PATCHED), every=0.2)
    report.patch_rollout_s = time.monotonic() - published
    expected |= {int(k): v for k, v in zip(PATCH_KEYS, table(PATCH_KEYS, 2.0), strict=True)}
    with CubeClient.from_conf(conf) as client:
        report.values_checked += check_values(client, expected, PATCHED)
    log(f"patch: every replica serves it after {report.patch_rollout_s:.1f} s; "
        f"{len(expected)} values checked")  # fmt: skip

    # -- kill -9 of one server of shard 0, lookups going on ------------------------------------
    victim = next(p for p in shard_pods if p.endswith("-shard-0-0"))
    probe_keys = np.arange(1, 257, dtype=np.uint64)  # every shard in each lookup
    with Prober(conf, probe_keys) as prober:
        time.sleep(1.0)
        killed_at, calls_before = time.time(), prober.calls
        cluster.kill(victim, "cube-server")
        log(f"{victim}/cube-server killed (SIGKILL)")
        time.sleep(2.0)  # lookups meanwhile go to the other replica
        if cluster.running(victim, "cube-server"):
            raise ScenarioError(f"{victim}/cube-server still runs after SIGKILL")
        started = cluster.restart(victim, "cube-server")
        wait(f"{victim}/cube-server SERVING after its restart",
             lambda: cluster.ready(victim, ["cube-server"]), every=0.05)  # fmt: skip
        report.restart_serving_s = time.monotonic() - started
        report.kill_lookups = prober.calls - calls_before  # while it did not serve
        time.sleep(1.0)
    report.kill_failed_lookups = len(prober.errors)
    report.kill_p99_ms = float(np.percentile(prober.latencies, 99) * 1000)
    log(f"{victim}/cube-server SERVING {report.restart_serving_s:.2f} s after its restart; "
        f"{report.kill_lookups} lookups while it did not serve, {prober.calls} in all, "
        f"{len(prober.errors)} failed")  # fmt: skip
    if prober.errors:
        raise ScenarioError(f"{len(prober.errors)} lookups failed: {prober.errors[:5]}")
    if report.kill_lookups < 10:
        raise ScenarioError(f"only {report.kill_lookups} lookups while the server was down")
    # it loaded the version named in its data directory when it started (nobody pushed it)
    loaded = [
        line for line in cluster.logs(victim, "cube-server", 200, since=killed_at).splitlines()
        if f"serving {PATCHED}" in line
    ]  # fmt: skip
    if not loaded:
        raise ScenarioError(f"{victim}/cube-server: no 'serving {PATCHED}' in its log")
    log(f"{victim}/cube-server: {loaded[0].split(': ', 1)[-1]}")
    # its values, from it alone (replica 0 of every shard)
    with CubeClient.from_conf(per_replica[0]) as client:
        report.values_checked += check_values(client, expected, PATCHED)
    log(f"{victim}: its values checked after the restart")


def _tcp(rendered: Rendered, pod: str, container: str, port_name: str) -> Probe:
    """A TCP probe of a named port (the startup probe's action)."""
    ports = dict(rendered.pod(pod).container(container).ports)
    return Probe("tcp", ports[port_name], timeout=1.0)


def main(argv: list[str] | None = None) -> int:
    # SIGTERM ends the run as Ctrl-C does: what it made is removed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="where the run's directories go (a temp dir)")
    args = parser.parse_args(argv)
    problem = engine_problem()
    if problem:
        print(f"demo-containers: {problem}", file=sys.stderr)
        return 2
    if not helm().exists():
        print("demo-containers: helm comes from `make tools` (.tools/bin/helm)", file=sys.stderr)
        return 2
    image = f"cube-py:{images_module().project_version()}"
    problem = ensure_image(image)
    if problem:
        print(f"demo-containers: {problem}", file=sys.stderr)
        return 2
    report = run(args.workdir)
    print("\nnot emulated (the translator's notes):")
    for note in report.notes:
        print(f"  - {note}")
    print("\nmeasured:")
    for line in report.lines():
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
