"""The translated pods (examples/containers/kube.py) on podman: one podman pod per Kubernetes
pod (one network namespace, its own IP on a bridge network of the run, the cluster's names as
/etc/hosts lines, no DNS server), each container with the rendered command line, environment,
user, read-only root, dropped capabilities and volumes.

Everything it makes is named `<prefix>-...` (unique per run) and labelled with the prefix:
`close()` removes the pods, their containers, the network, the pause image and the pods'
directories by name, also after a failure halfway.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from cube.processes import create_time, health_status, same_process
from examples.containers.kube import Container, Pod, Probe, Rendered, resolve_env

REPO = Path(__file__).resolve().parents[2]
IMAGES_PY = REPO / "deploy" / "docker" / "images.py"
LABEL = "io.cube.containers"  # its value: the run's prefix
OWNER = "io.cube.containers.owner"  # "<pid> <start time>" of the process of the run
# What `podman run` needs on these machines (the engine's default, 1048576 open files, is
# refused by the kernel of some sandboxes).
ULIMITS = ("nofile=8192:8192", "nproc=4096:4096")
SERVING = 1


def images_module() -> ModuleType:
    """deploy/docker/images.py (engine(), image_exists(), build(), project_version())."""
    spec = importlib.util.spec_from_file_location("cube_images", IMAGES_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine() -> list[str]:
    command: list[str] = images_module().engine()
    return command


def engine_problem() -> str:
    """Why this machine cannot run the pods ("" when it can)."""
    try:
        command = engine()
    except SystemExit as exc:
        return str(exc)
    if Path(command[0]).name != "podman":
        return (
            f"needs podman (pods: one network namespace for several containers), not {command[0]}"
        )
    if os.geteuid() != 0:
        return "needs root (rootful podman: volumes owned by the pods' fsGroup, static IPs)"
    done = subprocess.run([*command, "info"], capture_output=True, text=True, timeout=120)
    if done.returncode:
        return f"`{' '.join(command)} info` failed: {done.stderr.strip()[-300:]}"
    return ""


def ensure_image(name: str, log: Callable[[str], None] = print) -> str:
    """ "" once image `name` is built from this checkout (`images.py build`: the engine's
    layer cache makes it quick when nothing changed, and a stale image is never run), else
    why it could not be."""
    images = images_module()
    log(f"image {name}: building it from this checkout (deploy/docker/images.py build)")
    done = subprocess.run(
        [sys.executable, str(IMAGES_PY), "build", "--tag", name],
        capture_output=True, text=True, timeout=3600, check=False,
    )  # fmt: skip
    if done.returncode or not images.image_exists(engine(), name):
        tail = (done.stdout + done.stderr).strip()[-1500:]
        return (
            f"image {name} could not be built (images.py build exited {done.returncode}):\n{tail}"
        )
    return ""


@dataclass
class RunningPod:
    pod: Pod
    ip: str
    name: str  # the podman pod's
    started: dict[str, float] = field(default_factory=dict)  # container -> monotonic start


class PodmanCluster:
    """The rendered pods on podman; see the module docstring.

    with PodmanCluster(rendered, workdir, {"/srv/donefile": Path(...)}) as cluster:
        cluster.start()
        cluster.wait_ready("t-cube-transfer-0", timeout=60)
    """

    def __init__(
        self,
        rendered: Rendered,
        workdir: Path,
        host_paths: dict[str, Path] | None = None,
        prefix: str = "",
        timeout: float = 120.0,
    ) -> None:
        self.rendered = rendered
        self.host_paths = host_paths or {}
        self.prefix = prefix or f"cubect-{os.getpid()}-{os.urandom(3).hex()}"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-", dir=workdir))
        self.timeout = timeout  # of one engine command
        self.engine = engine()
        self.network = f"{self.prefix}-net"
        self.pause_image = f"localhost/{self.prefix}-pause:latest"
        self.pods: dict[str, RunningPod] = {}
        self.made: list[tuple[str, str]] = []  # (kind, name) in creation order
        owner = f"{os.getpid()} {create_time(os.getpid())}"
        self.labels = ["--label", f"{LABEL}={self.prefix}", "--label", f"{OWNER}={owner}"]

    def __enter__(self) -> PodmanCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine ----------------------------------------------------------------------------
    def podman(
        self, *args: str, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*self.engine, *args], capture_output=True, text=True, timeout=self.timeout,
            check=False, env=env,
        )  # fmt: skip
        if check and done.returncode:
            raise RuntimeError(f"podman {' '.join(args[:3])} ...: {done.stderr.strip()[-800:]}")
        return done

    # -- set-up --------------------------------------------------------------------------------
    def start(self) -> None:
        """The network, the pause image, every pod and its containers (started); first, what
        runs whose process is gone left behind (killed: no close())."""
        self.reap()
        self._network()
        ips = self._addresses()
        self._pause_image()
        hosts = self.rendered.hosts(ips)
        for pod in self.rendered.pods:
            self._pod(pod, ips[pod.name], hosts)
        for running in self.pods.values():
            for container in running.pod.containers:
                self._container(running, container)

    def _network(self) -> None:
        self.podman("network", "create", *self.labels, self.network)
        self.made.append(("network", self.network))

    def _addresses(self) -> dict[str, str]:
        """A static IP of the network for each pod (10 and up: below is the gateway's)."""
        info = json.loads(self.podman("network", "inspect", self.network).stdout)[0]
        subnet = ipaddress.ip_network(info["subnets"][0]["subnet"])
        hosts = list(subnet.hosts())[9:]
        if len(hosts) < len(self.rendered.pods):
            raise RuntimeError(f"network {subnet}: too small for {len(self.rendered.pods)} pods")
        return {pod.name: str(ip) for pod, ip in zip(self.rendered.pods, hosts, strict=False)}

    def _pause_image(self) -> None:
        """The pods' infra container: the project's image sleeping, as an unprivileged user
        (podman's own pause image needs catatonit, which not every host has)."""
        image = self.rendered.pods[0].containers[0].image
        context = self.workdir / "pause"
        context.mkdir()
        (context / "Containerfile").write_text(
            f'FROM {image}\nUSER 65534:65534\nENTRYPOINT ["sleep", "infinity"]\nCMD []\n'
        )
        self.podman("build", "--pull=never", *self.labels, "-q", "-t", self.pause_image,
                    str(context))  # fmt: skip
        self.made.append(("image", self.pause_image))

    def _pod(self, pod: Pod, ip: str, hosts: list[tuple[str, str]]) -> None:
        name = f"{self.prefix}-{pod.name}"
        # the infra container takes its limits from the engine's configuration only
        conf = self.workdir / "containers.conf"
        if not conf.exists():
            limits = ", ".join(f'"{u}"' for u in ULIMITS)
            conf.write_text(f"[containers]\ndefault_ulimits = [{limits}]\n")
        args = ["pod", "create", "--name", name, *self.labels,
                "--network", self.network, "--ip", ip, "--hostname", pod.name,
                "--infra-image", self.pause_image, "--infra-name", f"{name}-infra",
                "--dns", "none"]  # fmt: skip
        for host, address in hosts:
            args += ["--add-host", f"{host}:{address}"]
        self.made.append(("pod", name))
        self.podman(*args, env={**os.environ, "CONTAINERS_CONF": str(conf)})
        self.podman("pod", "start", name)
        self.pods[pod.name] = RunningPod(pod, ip, name)
        self._volumes(pod)

    def pod_dir(self, pod: str) -> Path:
        return self.workdir / "pods" / pod

    def _volumes(self, pod: Pod) -> None:
        """Each volume as a directory of the pod: emptyDir and claims empty, owned by the pod's
        fsGroup (setgid, group-writable, as the kubelet makes them); ConfigMap and Secret
        files written (mode defaultMode, group fsGroup); hostPath: the directory given."""
        group = pod.fs_group if pod.fs_group is not None else 0
        for volume in pod.volumes:
            path = self.pod_dir(pod.name) / "volumes" / volume.name
            if volume.kind == "hostPath":
                continue
            path.mkdir(parents=True)
            os.chown(path, 0, group)
            path.chmod(0o2777 if volume.kind == "dir" else 0o755)
            for relative, content, mode in volume.files:
                file = path / relative
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_bytes(content)
                os.chown(file, 0, group)
                file.chmod(mode)

    def _source(self, pod: Pod, volume: str) -> Path:
        spec = next(v for v in pod.volumes if v.name == volume)
        if spec.kind == "hostPath":
            return self.host_paths[spec.host_path]
        return self.pod_dir(pod.name) / "volumes" / volume

    def container_name(self, pod: str, container: str) -> str:
        return f"{self.prefix}-{pod}-{container}"

    def _container(self, running: RunningPod, container: Container) -> None:
        pod = running.pod
        name = self.container_name(pod.name, container.name)
        env = resolve_env(container, pod, running.ip)
        env_file = self.pod_dir(pod.name) / f"{container.name}.env"
        if any("\n" in f"{k}{v}" for k, v in env.items()):
            raise RuntimeError(f"{name}: an env value with a newline (no --env-file line)")
        env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        env_file.chmod(0o600)  # (tokens: not on podman's command line, which ps shows)
        args = ["run", "-d", "--pod", running.name, "--name", name, "--pull=never",
                *self.labels, "--env-file", str(env_file),
                "--stop-timeout", str(pod.grace)]  # fmt: skip
        for limit in ULIMITS:
            args += ["--ulimit", limit]
        if container.user is not None:
            args += ["--user", f"{container.user}:{container.group or container.user}"]
        if pod.fs_group is not None:
            args += ["--group-add", str(pod.fs_group)]
        if container.read_only_root:
            args += ["--read-only", "--read-only-tmpfs=false"]  # (no tmpfs podman would add)
        if container.drop_all_capabilities:
            args += ["--cap-drop", "ALL"]
        if container.no_new_privileges:
            args += ["--security-opt", "no-new-privileges"]
        if container.memory_limit is not None:
            args += ["--memory", str(container.memory_limit)]
        if container.cpu_limit is not None:
            args += ["--cpus", str(container.cpu_limit)]
        if container.working_dir:
            args += ["--workdir", container.working_dir]
        for mount in container.mounts:
            source = self._source(pod, mount.volume)
            # ConfigMap and Secret volumes are read-only, whatever the mount says (as on a node)
            files = next(v.kind == "files" for v in pod.volumes if v.name == mount.volume)
            args += ["-v", f"{source}:{mount.path}{':ro' if mount.read_only or files else ''}"]
        if container.command is not None:
            args += ["--entrypoint", json.dumps(list(container.command))]
        args += [container.image, *(container.args or ())]
        self.made.append(("container", name))
        running.started[container.name] = time.monotonic()
        self.podman(*args)

    # -- what a test does to it ----------------------------------------------------------------
    def ip(self, pod: str) -> str:
        return self.pods[pod].ip

    def kill(self, pod: str, container: str) -> None:
        """SIGKILL to the container's process (it stays stopped until `restart`)."""
        self.podman("kill", "--signal", "KILL", self.container_name(pod, container))

    def restart(self, pod: str, container: str) -> float:
        """Start the stopped container again, with the pod's volumes as they are (as a kubelet
        restarts a container); the monotonic time it was started."""
        started = time.monotonic()
        self.pods[pod].started[container] = started
        self.podman("start", self.container_name(pod, container))
        return started

    def running(self, pod: str, container: str) -> bool:
        done = self.podman("inspect", "--format", "{{.State.Running}}",
                           self.container_name(pod, container), check=False)  # fmt: skip
        return done.stdout.strip() == "true"

    def probe(self, pod: str, probe: Probe) -> bool:
        """One probe from the node (here: the host), as a kubelet runs it."""
        address = f"{self.ip(pod)}:{probe.port}"
        if probe.action == "grpc":
            return health_status(address, probe.timeout, probe.service) == SERVING
        if probe.action == "http":  # as a kubelet: 200-399 passes; HTTPS not verified
            url = f"{probe.scheme.lower()}://{address}{probe.path}"
            context = None
            if probe.scheme == "HTTPS":
                context = ssl.create_default_context()
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            try:
                with urllib.request.urlopen(url, timeout=probe.timeout, context=context) as answer:
                    return 200 <= int(answer.status) < 400
            except (OSError, ValueError):
                return False
        with contextlib.suppress(OSError):
            socket.create_connection((self.ip(pod), probe.port), probe.timeout).close()
            return True
        return False

    def ready(self, pod: str, containers: Sequence[str] = ()) -> bool:
        """Every container (or those named) running and passing its readiness probe."""
        spec = self.pods[pod].pod
        return all(
            c.readiness is None or self.probe(pod, c.readiness)
            for c in spec.containers
            if not containers or c.name in containers
        )

    def logs(self, pod: str, container: str, lines: int = 40, since: float = 0.0) -> str:
        """The container's last log lines (those after the Unix time `since`, when given)."""
        window = ["--since", f"{since:.3f}"] if since else []
        done = self.podman("logs", "--tail", str(lines), *window,
                           self.container_name(pod, container), check=False)  # fmt: skip
        return (done.stdout + done.stderr).strip()

    def report(self, lines: int = 30) -> str:
        """Each container's state and last log lines (for a failure)."""
        out = []
        for running in self.pods.values():
            for container in running.pod.containers:
                state = "running" if self.running(running.pod.name, container.name) else "stopped"
                out.append(f"--- {running.pod.name}/{container.name} ({state}, {running.ip})")
                out.append(self.logs(running.pod.name, container.name, lines))
        return "\n".join(out)

    # -- tear-down -----------------------------------------------------------------------------
    def close(self) -> None:
        """Remove what this run made, by name (and whatever carries its label), then its
        directories. Each removal is tried (one that fails or hangs does not stop the rest)."""
        labelled = f"label={LABEL}={self.prefix}"
        pods = {n for kind, n in self.made if kind == "pod"}
        pods |= set(self._quiet("pod", "ps", "--filter", labelled, "--format", "{{.Name}}"))
        for name in sorted(pods):
            self._quiet("pod", "rm", "-f", "-t", "0", name)
        containers = {n for kind, n in self.made if kind == "container"}
        containers |= set(self._quiet("ps", "-a", "--filter", labelled, "--format", "{{.Names}}"))
        for name in sorted(containers):
            self._quiet("rm", "-f", "-t", "0", name)
        if ("network", self.network) in self.made:
            self._quiet("network", "rm", "-f", self.network)
        if ("image", self.pause_image) in self.made:
            self._quiet("rmi", "-f", self.pause_image)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _quiet(self, *args: str) -> list[str]:
        """The words of a command's output; [] when it failed or timed out."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.podman(*args, check=False).stdout.split()
        return []

    def reap(self) -> None:
        """Remove the objects of runs whose process is gone (by their labels)."""
        dead: set[str] = set()
        for kind in (["pod", "ps"], ["ps", "-a"], ["network", "ls"], ["images"]):
            listed = self.podman(*kind, "--filter", f"label={LABEL}", "--format", "json",
                                 check=False).stdout  # fmt: skip
            for entry in json.loads(listed or "[]"):
                labels = entry.get("Labels") or entry.get("labels") or {}
                pid, _, started = str(labels.get(OWNER, "0 0")).partition(" ")
                with contextlib.suppress(ValueError):
                    if same_process(int(pid), float(started)) is None:
                        dead.add(labels[LABEL])
        for prefix in sorted(dead):
            labelled = f"label={LABEL}={prefix}"
            for name in self._quiet("pod", "ps", "--filter", labelled, "--format", "{{.Name}}"):
                self._quiet("pod", "rm", "-f", "-t", "0", name)
            for name in self._quiet("ps", "-a", "--filter", labelled, "--format", "{{.Names}}"):
                self._quiet("rm", "-f", "-t", "0", name)
            for name in self._quiet("network", "ls", "--filter", labelled, "--format",
                                    "{{.Name}}"):  # fmt: skip
                self._quiet("network", "rm", "-f", name)
            for image in self._quiet("images", "--filter", labelled, "-q"):
                self._quiet("rmi", "-f", image)

    def leftovers(self) -> list[str]:
        """What of this run still exists in the engine (nothing after close())."""
        labelled = f"label={LABEL}={self.prefix}"
        found = []
        for kind in (["pod", "ps"], ["ps", "-a"], ["network", "ls"], ["images"]):
            listed = self.podman(*kind, "--filter", labelled, "-q", check=False).stdout.split()
            found += [f"{kind[0]} {x}" for x in listed]
        return found
