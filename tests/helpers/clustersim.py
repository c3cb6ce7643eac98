"""A Kubernetes node on this machine, for tests: it runs the objects `helm template` rendered,
one network namespace per pod, so that what crosses a network really does.

- **Network**: a bridge with a gateway address in the root namespace; each pod (and each
  client namespace a test asks for) gets a network namespace, a veth on the bridge and its
  own IP. `cut(pod)` takes the pod's link down; `heal(pod)` brings it back.
- **DNS**: `/etc/netns/<ns>/hosts` (which `ip netns exec` binds over `/etc/hosts`) names every
  pod as the cluster DNS would for headless Services:
  `<pod>.<service>.<namespace>.svc.cluster.local` and `<service>.<namespace>.svc.cluster.local`.
- **Volumes**: each container runs in a mount namespace and a root of its own
  (tests/helpers/sim_root.py: the host's `/` under a private overlay, so that no mount point is made
  on the host), with its volumes bound at their `mountPath`s (emptyDir and
  volumeClaimTemplates: directories of the pod; configMap: the rendered files; hostPath: the
  path, or the directory a test maps it to), the root file system read-only when the
  container asks for it, and the user of `runAsUser` (through setpriv).
- **Containers** run the rendered command, args and env (secretKeyRef resolved from the
  rendered Secret); the venv's console scripts stand in for the image's (the checkout and
  the venv are bound again where a volume hides them: a checkout under /tmp works).
- **Children**: every process started in a namespace dies with the test process (SIGTERM
  when the thread that started it ends: cube.processes.die_with_parent), so a test killed by
  its timeout leaves none behind.
- **Private names**: each node takes a free name prefix and a free /16 under a lock, so two
  runs on one machine do not share a bridge, a namespace or a subnet.
- **Kubelet**: a thread runs the startup, readiness and liveness probes (tcpSocket, grpc,
  httpGet: 200-399, HTTPS unverified) from the root namespace, as a kubelet does from the
  node, and restarts a container that exits or fails its liveness probe (restartPolicy
  Always), with a short backoff. Each probe starts after its initialDelaySeconds and waits its
  timeoutSeconds; liveness runs at its periodSeconds, startup and readiness at least once a
  second.
- **Upgrades**: `apply(docs)` is `helm upgrade` to other objects and what the StatefulSet
  controller then does (immutable fields refused, pods added and removed, changed pods
  replaced one at a time, highest ordinal first, each once the later ones are ready).

Needs root, iproute2, util-linux (unshare, setpriv) and overlayfs; `require_root_network()`
says why not when they are missing. Every namespace, link, process and directory it made is
removed by `close()`, by name and PID.

    with SimNode(docs, workdir) as node:
        node.start()
        node.wait_ready(timeout=60)
        client = node.namespace("client")
        client.run([python, "-c", "..."])

By hand, with the chart and values of your own (as root; docs/DEPLOY.md, "How it is tested"):

    .venv/bin/python tests/helpers/clustersim.py --values my-values.yaml \\
        --host_path /srv/donefile=/tmp/my-donefile --workdir /tmp/my-node
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2

from cube.processes import create_time, die_with_parent, health_status, poll_until, same_process

BIN = Path(sys.executable).parent  # the venv's console scripts stand in for the image's
SIM_ROOT = Path(__file__).with_name("sim_root.py")
# What a container's command needs of the host: the checkout (an editable install) and the
# venv and Python it runs from (bound again where a volume hides them).
CODE = sorted({str(Path(__file__).resolve().parents[2]), sys.prefix, sys.base_prefix})
LOCK = Path("/run/lock/cube-clustersim.lock")  # held while a node picks its names
OWNERS = Path("/run/cube-clustersim")  # <prefix>: "pid start-time" of the process using it
# The node's names are in /etc/hosts (there is no DNS server): gRPC's native resolver reads
# it, its default c-ares one asks a DNS server first. Set for containers and clients alike.
RESOLVER = {"GRPC_DNS_RESOLVER": "native"}
# what the API server refuses to change in a StatefulSet
IMMUTABLE_STATEFULSET_FIELDS = (
    "selector",
    "serviceName",
    "podManagementPolicy",
    "volumeClaimTemplates",
)
_RUNS = itertools.count()


def require_root_network() -> str:
    """Why this machine cannot run a SimNode ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, mounts)"
    for tool in ("ip", "unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "needs overlayfs (each container's root)"
    return ""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=check)


def _reap_dead_nodes() -> None:
    """Remove what nodes of processes that are gone left behind (killed: no close()): their
    namespaces, hosts files and bridge, found by the prefix they recorded in OWNERS (their
    processes died with them: die_with_parent). Called under LOCK."""
    if not OWNERS.is_dir():
        return
    netns = _run("ip", "netns", "list").stdout.split()
    for record in OWNERS.iterdir():
        pid, _, started = record.read_text().partition(" ")
        with contextlib.suppress(ValueError):
            if same_process(int(pid), float(started)) is not None:
                continue  # a node in use
        prefix = record.name
        for name in netns:
            if name.startswith(f"{prefix}-"):
                _run("ip", "netns", "del", name, check=False)
                shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        _run("ip", "link", "del", f"{prefix}br", check=False)
        record.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# the rendered objects, as pods


@dataclass
class ContainerSpec:
    name: str
    command: list[str]
    env: dict[str, str]
    ports: dict[str, int]  # name -> containerPort
    mounts: list[tuple[str, str, bool]]  # (volume, mountPath, readOnly)
    probes: dict[str, dict[str, Any]]  # startupProbe / readinessProbe / livenessProbe
    read_only_root: bool
    user: int | None


@dataclass
class PodSpec:
    name: str
    namespace: str
    labels: dict[str, str]
    subdomain: str  # the headless Service of its StatefulSet
    containers: list[ContainerSpec]
    volumes: dict[str, dict[str, Any]]  # name -> volume source ({} for a claim template)
    grace: float
    fs_group: int | None
    test_hook: bool = False  # a `helm test` Pod: run by run_test_pods, not kept running
    revision: str = ""  # of its StatefulSet's pod template (annotations included)


def _secrets(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {
        d["metadata"]["name"]: {
            k: base64.b64decode(v).decode() for k, v in (d.get("data") or {}).items()
        }
        for d in docs
        if d["kind"] == "Secret"
    }


def _container(
    spec: dict[str, Any], secrets: dict[str, dict[str, str]], pod_sc: dict[str, Any]
) -> ContainerSpec:
    env = {}
    for entry in spec.get("env") or []:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
    security = spec.get("securityContext") or {}
    user = security.get("runAsUser", pod_sc.get("runAsUser"))
    return ContainerSpec(
        name=spec["name"],
        command=[*spec.get("command", []), *spec.get("args", [])],
        env=env,
        ports={
            p.get("name", str(p["containerPort"])): p["containerPort"]
            for p in spec.get("ports") or []
        },
        mounts=[
            (m["name"], m["mountPath"], bool(m.get("readOnly")))
            for m in spec.get("volumeMounts") or []
        ],
        probes={
            k: spec[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in spec
        },
        read_only_root=bool(security.get("readOnlyRootFilesystem")),
        user=user,
    )


def _is_hook(meta: dict[str, Any]) -> bool:
    return "helm.sh/hook" in (meta.get("annotations") or {})


def pods_of(docs: list[dict[str, Any]], include_tests: bool = False) -> list[PodSpec]:
    """The pods the objects ask for: each StatefulSet's replicas `<name>-<i>`, and bare Pods
    (`helm test` hooks only with `include_tests`)."""
    secrets = _secrets(docs)
    pods = []
    for doc in docs:
        meta = doc["metadata"]
        if doc["kind"] == "StatefulSet":
            template = doc["spec"]["template"]
            names = [f"{meta['name']}-{i}" for i in range(doc["spec"].get("replicas", 1))]
            subdomain = doc["spec"]["serviceName"]
            claims: dict[str, dict[str, str]] = {
                c["metadata"]["name"]: {} for c in doc["spec"].get("volumeClaimTemplates") or []
            }
        elif doc["kind"] == "Pod" and (include_tests or not _is_hook(meta)):
            template, names, subdomain, claims = doc, [meta["name"]], "", {}
        else:
            continue
        spec = template["spec"]
        pod_sc = spec.get("securityContext") or {}
        for name in names:
            pods.append(
                PodSpec(
                    name=name,
                    namespace=meta.get("namespace", "default"),
                    labels=dict(template["metadata"].get("labels") or {}),
                    subdomain=subdomain,
                    containers=[_container(c, secrets, pod_sc) for c in spec["containers"]],
                    volumes={**claims, **{v["name"]: v for v in spec.get("volumes") or []}},
                    grace=float(spec.get("terminationGracePeriodSeconds", 30)),
                    fs_group=pod_sc.get("fsGroup"),
                    test_hook=_is_hook(meta) and "test" in meta["annotations"]["helm.sh/hook"],
                    revision=hashlib.sha256(
                        json.dumps(template, sort_keys=True).encode()
                    ).hexdigest()[:10],
                )
            )
    return pods


# ---------------------------------------------------------------------------------------------
# namespaces


@dataclass
class Namespace:
    """A network namespace on the node's bridge: a pod's, or a client's."""

    name: str  # of the netns
    ip: str
    host_link: str  # the veth end on the bridge

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` in this namespace (with its /etc/hosts); it dies with the thread that
        starts it (die_with_parent)."""
        kwargs.setdefault("preexec_fn", die_with_parent)
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kwargs)

    def call(
        self, argv: Sequence[str], timeout: float = 60, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.name, *argv],
            capture_output=True, text=True, timeout=timeout, **kwargs,
        )  # fmt: skip


@dataclass
class Container:
    spec: ContainerSpec
    log: Path
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started: bool = False  # the startup probe passed (or there is none)
    ready: bool = False
    failures: dict[str, int] = field(default_factory=dict)  # probe -> consecutive failures
    next_probe: dict[str, float] = field(default_factory=dict)
    restart_at: float = 0.0
    backoff: float = 0.2
    held: bool = False  # a test stopped it: no restart until `release`


@dataclass
class Pod:
    spec: PodSpec
    ns: Namespace
    root: Path  # its volumes
    containers: dict[str, Container]
    stopped: bool = False
    # cut off from the other pods and clients, not from its node's kubelet, which still
    # reaches it: its probes (run from here, across the bridge) are paused, results kept
    cut: bool = False

    ready_since: float = 0.0  # monotonic time it became ready (0: not ready)

    @property
    def ready(self) -> bool:
        return all(c.ready for c in self.containers.values())

    def ready_for(self) -> float:
        """Seconds it has been ready (0 when it is not)."""
        return time.monotonic() - self.ready_since if self.ready and self.ready_since else 0.0

    @property
    def ip(self) -> str:
        return self.ns.ip


class SimNode:
    """One node running the rendered pods; see the module docstring."""

    def __init__(
        self,
        docs: list[dict[str, Any]],
        workdir: Path,
        host_paths: dict[str, Path] | None = None,
        restart_backoff: float = 0.2,
    ) -> None:
        self.docs = docs
        self.workdir = workdir
        self.host_paths = host_paths or {}  # a hostPath volume's path -> the directory to use
        self.restart_backoff = restart_backoff
        self.prefix = self.bridge = self.subnet = self.gateway = ""  # chosen by start()
        self.pods: dict[str, Pod] = {}
        self.secrets = _secrets(docs)
        self.namespaces: list[Namespace] = []
        self._ips = itertools.count(2)
        self._made_dirs: list[Path] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._kubelet: threading.Thread | None = None
        self.events: list[str] = []  # what the kubelet did, for failure messages
        self._users: dict[int, bool] = {}  # uid -> the venv's Python runs as it
        self.overrides: dict[str, dict[str, list[str]]] = {}  # netns -> name -> addresses

    # -- set-up --------------------------------------------------------------------------------
    def __enter__(self) -> SimNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """The bridge, every pod's namespace, the hosts files, then every container and the
        kubelet."""
        self._make_bridge()
        specs = pods_of(self.docs)
        for spec in specs:
            ns = self._namespace(spec.name)
            root = self.workdir / "pods" / spec.name
            containers = {c.name: Container(c, self._log(spec, c)) for c in spec.containers}
            self.pods[spec.name] = Pod(spec, ns, root, containers)
        self.write_hosts()
        for pod in self.pods.values():
            self._prepare_volumes(pod)
            for container in pod.containers.values():
                self._launch(pod, container)
        self._kubelet = threading.Thread(target=self._supervise, name="kubelet", daemon=True)
        self._kubelet.start()

    def _make_bridge(self) -> None:
        """The node's bridge, on a name prefix and a /16 no other node (of this run or
        another) uses: chosen and taken under a lock (flock, released if we die)."""
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (each holder keeps it for a few `ip` calls)
            _reap_dead_nodes()
            links = _run("ip", "-o", "link", "show").stdout
            used = set(re.findall(r"inet 10\.(\d+)\.", _run("ip", "-o", "-4", "addr").stdout))
            used |= set(re.findall(r"^10\.(\d+)\.", _run("ip", "-4", "route").stdout, re.M))
            netns = set(_run("ip", "netns", "list").stdout.split())
            taken = {f"cs{n}" for n in re.findall(r" cs(\d+)br:", links)}
            taken |= {n.split("-")[0] for n in netns if n.startswith("cs")}
            start = os.getpid() % 10000
            prefix = next(
                (f"cs{n}" for n in range(start, start + 10000) if f"cs{n}" not in taken), ""
            )  # (no more than 10000 nodes at once)
            octets = [o for o in range(16, 250) if str(o) not in used]
            if not octets:
                raise RuntimeError("no free 10.x.0.0/16 for a simulated node")
            self.prefix, self.bridge = prefix, f"{prefix}br"
            OWNERS.mkdir(parents=True, exist_ok=True)
            (OWNERS / prefix).write_text(f"{os.getpid()} {create_time(os.getpid())}")
            self.subnet = f"10.{octets[(os.getpid() + next(_RUNS)) % len(octets)]}"
            self.gateway = f"{self.subnet}.0.1"
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/16", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")

    def _namespace(self, name: str) -> Namespace:
        index = next(self._ips)
        ip = f"{self.subnet}.{index // 250}.{index % 250 + 2}"
        netns = f"{self.prefix}-{index}"
        host_link = f"{self.prefix}v{index}"
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", host_link, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "link", "set", host_link, "master", self.bridge, "up")
        _run("ip", "-n", netns, "addr", "add", f"{ip}/16", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        _run("ip", "-n", netns, "route", "add", "default", "via", self.gateway)
        namespace = Namespace(netns, ip, host_link)
        self.namespaces.append(namespace)
        return namespace

    def namespace(self, name: str) -> Namespace:
        """A client namespace on the bridge, resolving the cluster's names."""
        namespace = self._namespace(name)
        self.write_hosts()
        return namespace

    def dns(self) -> dict[str, list[str]]:
        """Name -> addresses, as the cluster DNS answers for headless Services (which publish
        not-ready addresses in this chart)."""
        names: dict[str, list[str]] = {}
        services = [d for d in self.docs if d["kind"] == "Service"]
        for service in services:
            meta = service["metadata"]
            selector = service["spec"].get("selector") or {}
            fqdn = f"{meta['name']}.{meta.get('namespace', 'default')}.svc.cluster.local"
            for pod in self.pods.values():
                if selector.items() <= pod.spec.labels.items():
                    names.setdefault(fqdn, []).append(pod.ip)
                    if pod.spec.subdomain == meta["name"]:
                        names[f"{pod.spec.name}.{fqdn}"] = [pod.ip]
        return names

    def write_hosts(self) -> None:
        """Every namespace's /etc/hosts: the cluster's names, then its own overrides."""
        names = self.dns()
        for namespace in self.namespaces:
            lines = ["127.0.0.1 localhost", "::1 localhost"]
            own = {**names, **self.overrides.get(namespace.name, {})}
            for name, addresses in sorted(own.items()):
                lines += [f"{address} {name}" for address in addresses]
            text = "\n".join(lines) + "\n"
            directory = Path("/etc/netns") / namespace.name
            if not directory.parent.exists():
                self._made_dirs.append(directory.parent)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text(text)

    def _prepare_volumes(self, pod: Pod) -> None:
        owner = pod.spec.fs_group
        for name, source in pod.spec.volumes.items():
            target = pod.root / "volumes" / name
            if "configMap" in source or "secret" in source:
                kind = "configMap" if "configMap" in source else "secret"
                data = (
                    self._config_map(source["configMap"]["name"])
                    if kind == "configMap"
                    else self.secrets[source["secret"]["secretName"]]
                )
                items = source[kind].get("items")
                if items is not None:  # only these keys, at these paths
                    data = {item["path"]: data[item["key"]] for item in items}
                target.mkdir(parents=True, exist_ok=True)
                for key, value in data.items():
                    (target / key).write_text(value)
            elif "hostPath" in source:
                continue  # bound from host_paths at launch
            elif not source or {"emptyDir", "persistentVolumeClaim"} & source.keys():
                target.mkdir(parents=True, exist_ok=True)  # ({}: a claim template's volume)
                if owner is not None:
                    os.chown(target, owner, owner)
            else:
                raise ValueError(f"pod {pod.spec.name}: volume {name}: {source} is not simulated")
        for container in pod.containers.values():
            container.log.parent.mkdir(parents=True, exist_ok=True)
            (pod.root / "roots" / container.spec.name).mkdir(parents=True, exist_ok=True)

    def _config_map(self, name: str) -> dict[str, str]:
        for doc in self.docs:
            if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == name:
                return dict(doc.get("data") or {})
        raise KeyError(f"no ConfigMap {name} in the rendered objects")

    def _source_of(self, pod: Pod, volume: str) -> Path:
        source = pod.spec.volumes[volume]
        if "hostPath" in source:
            path = source["hostPath"]["path"]
            return self.host_paths.get(path, Path(path))
        return pod.root / "volumes" / volume

    # -- containers ----------------------------------------------------------------------------
    def _launch(self, pod: Pod, container: Container) -> None:
        spec = container.spec
        root = {
            "root": str(pod.root / "roots" / spec.name),  # an empty directory of the pod
            "volumes": [(str(self._source_of(pod, v)), path, ro) for v, path, ro in spec.mounts],
            "expose": CODE,
            "read_only_root": spec.read_only_root,
            "user": spec.user if spec.user is not None and self._can_run_as(spec.user) else None,
        }
        command = [str(BIN / spec.command[0]), *spec.command[1:]]
        env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", **RESOLVER}
        env.update(spec.env)
        with open(container.log, "ab") as log:
            container.process = pod.ns.run(
                ["unshare", "--mount", "--propagation", "private", "--", sys.executable,
                 str(SIM_ROOT), json.dumps(root), "--", *command],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip
        container.started = "startupProbe" not in spec.probes
        container.ready = False
        container.failures.clear()
        container.next_probe.clear()
        for kind, probe in spec.probes.items():  # (liveness and readiness: after startup too)
            delay = float(probe.get("initialDelaySeconds", 0))
            container.next_probe[kind] = time.monotonic() + delay
        self.events.append(
            f"{time.monotonic():.1f} started {pod.spec.name}/{spec.name}"
            f" pid {container.process.pid}"
        )

    def _can_run_as(self, uid: int) -> bool:
        """Whether the venv's Python runs as `uid` here (in the image it does; on a machine
        whose Python lives under a private home it cannot, and containers run as root)."""
        if uid not in self._users:
            probe = subprocess.run(
                ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups",
                 "sh", "-c", f'exec "{sys.executable}" -c pass'],
                capture_output=True, timeout=30, cwd="/",
            )  # fmt: skip
            self._users[uid] = probe.returncode == 0
            if not self._users[uid]:
                self.events.append(f"runAsUser {uid} not honored: {sys.executable} unreachable")
        return self._users[uid]

    def _supervise(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                for pod in list(self.pods.values()):
                    if pod.stopped:
                        continue
                    for container in pod.containers.values():
                        with contextlib.suppress(Exception):
                            self._tend(pod, container)
                    if not pod.ready:
                        pod.ready_since = 0.0
                    elif not pod.ready_since:
                        pod.ready_since = time.monotonic()

    def _tend(self, pod: Pod, container: Container) -> None:
        now = time.monotonic()
        process = container.process
        if container.held:
            return
        if process is None:  # a new pod's container: started here, by the kubelet's thread
            self._launch(pod, container)
            return
        if process.poll() is not None:
            if container.restart_at == 0.0:
                container.restart_at = now + container.backoff
                container.ready = False
                self.events.append(
                    f"{now:.1f} {pod.spec.name}/{container.spec.name} exited {process.returncode}"
                )
            if now >= container.restart_at:
                container.restarts += 1
                container.backoff = min(container.backoff * 2, 5.0)
                container.restart_at = 0.0
                self._launch(pod, container)
            return
        if pod.cut:
            return
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.spec.probes.get(kind)
            if probe is None or (kind != "startupProbe" and not container.started):
                continue
            if kind == "startupProbe" and container.started:
                continue
            if now < container.next_probe.get(kind, 0.0):
                continue
            period = float(probe.get("periodSeconds", 10))
            # startup and readiness are probed at least once a second (pods get ready sooner);
            # liveness at its own period, as the kubelet does: a container is killed only after
            # failureThreshold x periodSeconds of failures, not after a few busy seconds of a
            # machine that runs every pod on two cores
            container.next_probe[kind] = now + (
                period if kind == "livenessProbe" else min(period, 1.0)
            )
            ok = self._probe(pod, container, probe)
            failures = 0 if ok else container.failures.get(kind, 0) + 1
            container.failures[kind] = failures
            threshold = int(probe.get("failureThreshold", 3))
            if kind == "startupProbe" and ok:
                container.started = True
            elif kind == "readinessProbe":
                container.ready = ok or (container.ready and failures < threshold)
            elif kind == "livenessProbe" and failures >= threshold:
                self.events.append(
                    f"{now:.1f} {pod.spec.name}/{container.spec.name} liveness failed"
                )
                self._signal(container, signal.SIGKILL)
            elif kind == "startupProbe" and failures >= threshold:
                self._signal(container, signal.SIGKILL)
        if "readinessProbe" not in container.spec.probes:
            container.ready = container.started

    def _probe(self, pod: Pod, container: Container, probe: dict[str, Any]) -> bool:
        def port_of(value: Any) -> int:
            return container.spec.ports[value] if isinstance(value, str) else int(value)

        timeout = float(probe.get("timeoutSeconds", 1))  # the kubelet's default: 1 s
        if "tcpSocket" in probe:
            try:
                with socket.create_connection(
                    (pod.ip, port_of(probe["tcpSocket"]["port"])), timeout
                ):
                    return True
            except OSError:
                return False
        if "grpc" in probe:
            address = f"{pod.ip}:{port_of(probe['grpc']['port'])}"
            status = health_status(address, timeout, probe["grpc"].get("service", ""))
            return status == health_pb2.HealthCheckResponse.SERVING
        if "httpGet" in probe:  # as the kubelet: 200-399 within the timeout, HTTPS unverified
            get = probe["httpGet"]
            port = port_of(get["port"])
            if get.get("scheme", "HTTP") == "HTTPS":
                context = ssl.create_default_context()
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                    pod.ip, port, timeout=timeout, context=context
                )
            else:
                connection = http.client.HTTPConnection(pod.ip, port, timeout=timeout)
            try:
                connection.request("GET", get.get("path", "/"))
                return 200 <= connection.getresponse().status < 400
            except (OSError, http.client.HTTPException):
                return False
            finally:
                connection.close()
        raise ValueError(f"probe {probe}: only tcpSocket, grpc and httpGet probes are simulated")

    def _signal(self, container: Container, sig: int) -> None:
        process = container.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, sig)  # by PID: the container's process itself

    # -- what tests do -------------------------------------------------------------------------
    def pod(self, name: str) -> Pod:
        return self.pods[name]

    def kill(self, pod: str, container: str, sig: int = signal.SIGKILL) -> int:
        """Signal one container (kill -9 by default); the kubelet restarts it. Its PID."""
        with self._lock:
            target = self.pods[pod].containers[container]
            assert target.process is not None
            self._signal(target, sig)
            return target.process.pid

    def kill_pod(self, pod: str) -> None:
        """kill -9 every container of a pod (a crashed pod); each is restarted."""
        for name in self.pods[pod].containers:
            self.kill(pod, name)

    def stop_pod(self, pod: str, timeout: float = 60) -> None:
        """The pod gone (SIGTERM, its grace, SIGKILL) and not started again until `start_pod`:
        e.g. the transfer's, deleted while its node drains."""
        self._stop_pod(self.pods[pod], timeout)

    def start_pod(self, pod: str) -> None:
        """A pod stopped by `stop_pod` created again: claims kept, emptyDir volumes empty."""
        self._restart_pod(self.pods[pod])

    def delete_pod(self, pod: str, timeout: float = 60) -> None:
        """As `kubectl delete pod`: SIGTERM, the grace period, SIGKILL; then the StatefulSet
        controller starts it again under the same name: its claims' volumes are kept, its
        emptyDir volumes start empty."""
        self._stop_pod(self.pods[pod], timeout)
        self._restart_pod(self.pods[pod])

    def _stop_pod(self, target: Pod, timeout: float = 60) -> None:
        """SIGTERM to every container, SIGKILL to those alive after the pod's grace period
        (at most `timeout`); none is restarted until `_restart_pod`."""
        with self._lock:
            for container in target.containers.values():
                container.held = True
                self._signal(container, signal.SIGTERM)
        deadline = time.monotonic() + min(target.spec.grace, timeout)
        for container in target.containers.values():
            if container.process is not None:
                try:
                    container.process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._signal(container, signal.SIGKILL)
                    container.process.wait(10)

    def _restart_pod(self, target: Pod) -> None:
        """Start a stopped pod again, as a new pod of the same name: fresh emptyDir volumes.
        The kubelet's thread starts its containers (a child dies with the thread that started
        it: not a test's or a rollout's, which end before the pod)."""
        for name, source in target.spec.volumes.items():
            if "emptyDir" in source:
                shutil.rmtree(target.root / "volumes" / name, ignore_errors=True)
        self._prepare_volumes(target)
        with self._lock:
            target.ready_since = 0.0
            for container in target.containers.values():
                container.process = None
                container.ready = False
                container.held = False
                container.backoff = self.restart_backoff
                container.restart_at = 0.0

    def apply(self, docs: list[dict[str, Any]], timeout: float = 120) -> list[str]:
        """`helm upgrade` to these objects, then what the controllers do about it, as in a
        cluster: the API server refuses a change to a StatefulSet's immutable fields
        (ValueError); each StatefulSet (podManagementPolicy Parallel) creates its new pods
        and deletes those past its replicas at once, then replaces every pod whose template
        changed one at a time, highest ordinal first, each only once the pods after it are
        ready (for minReadySeconds); the StatefulSets roll at the same time; ConfigMap volumes
        of the pods kept are rewritten (the kubelet syncs them). A replaced pod keeps its
        network namespace (its IP) and starts with empty emptyDir volumes. Returns what was
        done, in order; AssertionError when a rollout does not end within `timeout` s."""
        old_sets = {d["metadata"]["name"]: d for d in self.docs if d["kind"] == "StatefulSet"}
        new_sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
        for name in old_sets.keys() & new_sets.keys():
            for key in IMMUTABLE_STATEFULSET_FIELDS:
                if old_sets[name]["spec"].get(key) != new_sets[name]["spec"].get(key):
                    raise ValueError(
                        f"StatefulSet {name}: spec.{key} is immutable (the API server refuses"
                        " the upgrade)"
                    )
        if old_sets.keys() != new_sets.keys():
            raise ValueError("StatefulSets added or removed: not simulated (a shard count change)")
        specs = {spec.name: spec for spec in pods_of(docs)}
        done: list[str] = []
        with self._lock:
            self.docs = docs
            self.secrets = _secrets(docs)
            gone = [p for p in self.pods.values() if p.spec.subdomain and p.spec.name not in specs]
        for pod in gone:  # scaled down (Parallel: at once)
            self._stop_pod(pod)
            with self._lock:
                del self.pods[pod.spec.name]
            _run("ip", "link", "del", pod.ns.host_link, check=False)
            done.append(f"deleted {pod.spec.name}")
        created = []
        for name, spec in specs.items():
            if name not in self.pods:  # scaled up: new pods of the new template
                created.append(self._add_pod(spec))
                done.append(f"created {name}")
        self.write_hosts()  # (before the new pods start: `ip netns exec` binds their hosts)
        with self._lock:  # (for the pods kept: their ConfigMap and Secret files anew)
            for pod in self.pods.values():
                self._prepare_volumes(pod)
            for pod in created:  # (the kubelet's thread starts them)
                for container in pod.containers.values():
                    container.held = False
        rollouts = [
            threading.Thread(
                target=self._roll, args=(old_sets[name], new_sets[name], specs, done, timeout),
                name=f"rollout {name}", daemon=True,
            )
            for name in new_sets
        ]  # fmt: skip
        for thread in rollouts:
            thread.start()
        for thread in rollouts:
            thread.join(timeout + 30)
        problems = [e for e in done if e.startswith("stuck")]
        assert not problems and not any(t.is_alive() for t in rollouts), (
            f"{problems}\n{self.report()}"
        )
        return done

    def _roll(
        self,
        old: dict[str, Any],
        new: dict[str, Any],
        specs: dict[str, PodSpec],
        done: list[str],
        timeout: float,
    ) -> None:
        """One StatefulSet's rolling update (see `apply`)."""
        name = new["metadata"]["name"]
        ready_for = float(new["spec"].get("minReadySeconds", 0))
        deadline = time.monotonic() + timeout
        for ordinal in reversed(range(new["spec"].get("replicas", 1))):
            pod = self.pods[f"{name}-{ordinal}"]
            if pod.spec.revision != specs[pod.spec.name].revision:
                self._stop_pod(pod)
                with self._lock:
                    pod.spec = specs[pod.spec.name]
                    pod.containers = {  # held: `_restart_pod` starts them, not the kubelet
                        c.name: Container(c, self._log(pod.spec, c), held=True)
                        for c in pod.spec.containers
                    }
                self._restart_pod(pod)
                done.append(f"replaced {pod.spec.name}")
            available = lambda: pod.ready and pod.ready_for() >= ready_for  # noqa: E731, B023
            if not poll_until(available, max(0.0, deadline - time.monotonic()), 0.1):
                done.append(f"stuck: {pod.spec.name} not ready")
                return

    def _log(self, spec: PodSpec, container: ContainerSpec) -> Path:
        return self.workdir / "logs" / f"{spec.name}.{container.name}.log"

    def _add_pod(self, spec: PodSpec) -> Pod:
        """A new pod of a StatefulSet, its containers held (not started) until the caller
        launches them."""
        ns = self._namespace(spec.name)
        containers = {c.name: Container(c, self._log(spec, c), held=True) for c in spec.containers}
        pod = Pod(spec, ns, self.workdir / "pods" / spec.name, containers)
        self._prepare_volumes(pod)
        with self._lock:
            self.pods[spec.name] = pod
        return pod

    def resolve(self, namespace: Namespace, name: str, addresses: list[str]) -> None:
        """Make `name` resolve to `addresses` in `namespace` only (e.g. a relay in front of a
        replica, for one client)."""
        self.overrides.setdefault(namespace.name, {})[name] = addresses
        self.write_hosts()

    def run_test_pods(self, timeout: float = 60) -> dict[str, int]:
        """`helm test`: run each test hook Pod (restartPolicy Never) to its end; the exit code
        of each, by pod name (its containers in turn; the first failure counts)."""
        codes = {}
        for spec in pods_of(self.docs, include_tests=True):
            if not spec.test_hook:
                continue
            pod = Pod(spec, self._namespace(spec.name), self.workdir / "pods" / spec.name, {
                c.name: Container(c, self._log(spec, c)) for c in spec.containers
            })  # fmt: skip
            self.write_hosts()
            self._prepare_volumes(pod)
            code = 0
            for container in pod.containers.values():
                container.held = True  # not the kubelet's to restart
                self._launch(pod, container)
                assert container.process is not None
                try:
                    result = container.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._signal(container, signal.SIGKILL)
                    result = container.process.wait(10)
                code = code or result
            codes[spec.name] = code
        return codes

    def cut(self, pod: str) -> None:
        """Take the pod's network link down: partitioned from the other pods and the clients.
        Its kubelet would still reach it on its node, so its probes pause (see Pod.cut)."""
        with self._lock:
            self.pods[pod].cut = True
        _run("ip", "link", "set", self.pods[pod].ns.host_link, "down")

    def heal(self, pod: str) -> None:
        _run("ip", "link", "set", self.pods[pod].ns.host_link, "up")
        with self._lock:
            self.pods[pod].cut = False

    def wait_ready(self, pods: Sequence[str] | None = None, timeout: float = 60) -> None:
        names = list(pods or self.pods)
        if not poll_until(lambda: all(self.pods[n].ready for n in names), timeout, 0.1):
            waiting = [n for n in names if not self.pods[n].ready]
            raise AssertionError(f"not ready after {timeout}s: {waiting}\n{self.report()}")

    def report(self, lines: int = 20) -> str:
        """The kubelet's events and the end of every container's log (for failures)."""
        out = ["events:", *self.events[-40:]]
        for pod in self.pods.values():
            for container in pod.containers.values():
                text = container.log.read_text(errors="replace") if container.log.exists() else ""
                out.append(
                    f"--- {pod.spec.name}/{container.spec.name} (restarts {container.restarts})"
                )
                out += text.splitlines()[-lines:]
        return "\n".join(out)

    def containers(self) -> Iterator[tuple[Pod, Container]]:
        for pod in self.pods.values():
            for container in pod.containers.values():
                yield pod, container

    # -- tear-down -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the kubelet and every container (SIGTERM, then SIGKILL, by PID), then remove the
        namespaces, links, hosts files and mount points this node made."""
        self._stop.set()
        if self._kubelet is not None:
            self._kubelet.join(timeout=10)
        with self._lock:
            for _pod, container in self.containers():
                container.held = True
                self._signal(container, signal.SIGTERM)
            deadline = time.monotonic() + 10
            for _pod, container in self.containers():
                if container.process is None:
                    continue
                try:
                    container.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._signal(container, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        container.process.wait(10)
        for namespace in self.namespaces:
            _run("ip", "netns", "del", namespace.name, check=False)
            shutil.rmtree(Path("/etc/netns") / namespace.name, ignore_errors=True)
        _run("ip", "link", "del", self.bridge, check=False)
        if self.prefix:
            (OWNERS / self.prefix).unlink(missing_ok=True)
        for directory in sorted(self._made_dirs, key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()


# ---------------------------------------------------------------------------------------------
# by hand


def main(argv: Sequence[str] | None = None) -> int:
    """Render the chart with the given values and run it as a node until SIGINT or SIGTERM
    (or --seconds): pods, their IPs and a client namespace are printed, the rendered
    cube.conf is in the work directory; everything is removed at the end."""
    import argparse
    import tempfile

    import yaml

    started = time.monotonic()
    repo = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(prog="clustersim", description=main.__doc__)
    parser.add_argument("--chart", default=str(repo / "deploy" / "helm" / "cube"))
    parser.add_argument("--release", default="t")
    parser.add_argument("--namespace", default="ml")
    parser.add_argument("--values", action="append", default=[], help="a values file (repeat)")
    parser.add_argument("--set", action="append", default=[], help="key=value (repeat)")
    parser.add_argument(
        "--host_path", action="append", default=[],
        help="PATH=DIR: a hostPath volume's path -> a directory of yours (repeat)",
    )  # fmt: skip
    parser.add_argument("--workdir", default="", help="default: a new temporary directory")
    parser.add_argument("--seconds", type=float, default=3600.0, help="run at most this long")
    parser.add_argument("--ready_timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if why := require_root_network():
        print(f"clustersim: {why}", file=sys.stderr)
        return 2
    helm = [str(repo / ".tools" / "bin" / "helm"), "template", args.release, args.chart,
            "--namespace", args.namespace]  # fmt: skip
    helm += [a for v in args.values for a in ("--values", v)]
    helm += [a for v in args.set for a in ("--set", v)]
    rendered = subprocess.run(helm, capture_output=True, text=True, timeout=120)
    if rendered.returncode:
        print(f"clustersim: helm template: {rendered.stderr.strip()}", file=sys.stderr)
        return 2
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="clustersim-"))
    workdir.mkdir(parents=True, exist_ok=True)
    host_paths = {k: Path(v) for k, _, v in (h.partition("=") for h in args.host_path)}
    for conf in (d for d in docs if d["kind"] == "ConfigMap"):
        if "cube.conf" in (conf.get("data") or {}):
            (workdir / "cube.conf").write_text(conf["data"]["cube.conf"])
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    node = SimNode(docs, workdir / "node", host_paths=host_paths)
    try:
        node.start()
        client = node.namespace("client")
        for pod in node.pods.values():
            print(f"pod {pod.spec.name}: {pod.ip} (netns {pod.ns.name})", flush=True)
        print(f"client namespace {client.name} ({client.ip}), cube.conf {workdir / 'cube.conf'}:")
        print(f"  sudo ip netns exec {client.name} env GRPC_DNS_RESOLVER=native"
              f" {BIN / 'cube-cli'} --config_file {workdir / 'cube.conf'} --keys KEYS")  # fmt: skip
        print(f"logs: {workdir / 'node' / 'logs'}", flush=True)
        deadline = min(started + args.ready_timeout, started + args.seconds)
        while not stop.wait(1.0) and time.monotonic() < deadline:
            if all(p.ready for p in node.pods.values()):
                print("every pod is ready", flush=True)
                break
        else:
            if not stop.is_set():
                waiting = sorted(n for n, p in node.pods.items() if not p.ready)
                print(f"not ready after {args.ready_timeout} s: {waiting} (a new install"
                      " serves once a base is published)", flush=True)  # fmt: skip
        stop.wait(max(0.0, started + args.seconds - time.monotonic()))
    finally:
        node.close()
        print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
