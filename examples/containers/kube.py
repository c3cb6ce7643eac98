"""The objects `helm template` rendered, as the pods a node would run: a small, strict translator.

It reads what the chart renders for a fresh install and nothing else. A field it does not know
raises `Unsupported` (naming the object and the field) instead of being skipped, so that what
runs is what was rendered. Fields it reads but that have no effect on one node with no API
server (scheduling, disruption budgets, resource requests, liveness probes, ...) are listed in
`Rendered.notes`, each with the reason.

Pure: no process, no file; examples/containers/podman.py runs the result.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


class Unsupported(ValueError):
    """A rendered object or field this translator does not run."""


@dataclass(frozen=True)
class FieldRef:
    """An env value the kubelet fills in: metadata.name, metadata.namespace or status.podIP."""

    path: str


@dataclass(frozen=True)
class Probe:
    """A readiness / liveness / startup probe, run from the node (the host)."""

    action: Literal["grpc", "tcp", "http"]
    port: int
    service: str = ""  # grpc: the health service asked
    path: str = ""  # http: the path asked
    scheme: Literal["HTTP", "HTTPS"] = "HTTP"
    period: float = 10.0
    timeout: float = 1.0
    failure_threshold: int = 3
    initial_delay: float = 0.0


@dataclass(frozen=True)
class Mount:
    volume: str
    path: str
    read_only: bool


@dataclass(frozen=True)
class Container:
    name: str
    image: str
    command: tuple[str, ...] | None  # None: the image's ENTRYPOINT
    args: tuple[str, ...] | None  # None: the image's CMD (when command is None too)
    env: tuple[tuple[str, str | FieldRef], ...]
    user: int | None  # None: the image's user
    group: int | None
    read_only_root: bool
    drop_all_capabilities: bool
    no_new_privileges: bool
    memory_limit: int | None  # bytes
    cpu_limit: float | None
    mounts: tuple[Mount, ...]
    ports: tuple[tuple[str, int], ...]  # (name, containerPort)
    readiness: Probe | None
    working_dir: str | None = None


@dataclass(frozen=True)
class Volume:
    """What a pod's volume is on the node: a directory of the pod (`dir`: emptyDir and claims
    from volumeClaimTemplates), files written from a ConfigMap or Secret (`files`, mounted
    read-only), or a directory of the host (`hostPath`)."""

    name: str
    kind: Literal["dir", "files", "hostPath"]
    files: tuple[tuple[str, bytes, int], ...] = ()  # (relative path, content, mode)
    host_path: str = ""


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    owner: str  # its StatefulSet
    subdomain: str  # the StatefulSet's serviceName
    labels: tuple[tuple[str, str], ...]
    containers: tuple[Container, ...]
    volumes: tuple[Volume, ...]
    fs_group: int | None
    grace: int  # terminationGracePeriodSeconds

    def container(self, name: str) -> Container:
        return next(c for c in self.containers if c.name == name)


@dataclass(frozen=True)
class Rendered:
    pods: tuple[Pod, ...]
    # the cluster DNS of headless Services: name -> pod names (resolved to IPs when known)
    dns: tuple[tuple[str, tuple[str, ...]], ...]
    config_maps: Mapping[str, Mapping[str, str]]
    secrets: Mapping[str, Mapping[str, bytes]]
    notes: tuple[str, ...] = field(default=())

    def pod(self, name: str) -> Pod:
        return next(p for p in self.pods if p.name == name)

    def hosts(self, ips: Mapping[str, str]) -> list[tuple[str, str]]:
        """(name, IP) lines of the cluster's names, given each pod's IP: what every pod's
        /etc/hosts gets (there is no DNS server)."""
        return [(name, ips[pod]) for name, pods in self.dns for pod in pods]


# ---------------------------------------------------------------------------------------------


def _only(obj: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise Unsupported(f"{where}: {', '.join(unknown)}: not understood by the translator")


def _ref(
    objects: Mapping[str, Mapping[str, Any]], kind: str, name: str, key: str, where: str
) -> Any:
    """objects[name][key] (a rendered ConfigMap's or Secret's); Unsupported when not rendered."""
    if name not in objects:
        raise Unsupported(f"{where}: {kind} {name} is not among the rendered objects")
    if key not in objects[name]:
        raise Unsupported(f"{where}: {kind} {name} has no key {key}")
    return objects[name][key]


def _quantity(text: object, where: str) -> float:
    """A Kubernetes quantity ("4Gi", "500m", "2") as a number (bytes, cores)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "T": 1e12, "m": 1e-3}  # fmt: skip
    value = str(text)
    for suffix, scale in units.items():
        if value.endswith(suffix):
            try:
                return float(value[: -len(suffix)]) * scale
            except ValueError:
                break
    try:
        return float(value)
    except ValueError:
        raise Unsupported(f"{where}: quantity {value!r}") from None


class _Translator:
    def __init__(self, docs: list[dict[str, Any]], cluster_domain: str, host_paths: set[str]):
        self.docs = docs
        self.domain = cluster_domain
        self.host_paths = host_paths
        self.notes: list[str] = []
        self.config_maps: dict[str, dict[str, str]] = {}
        self.secrets: dict[str, dict[str, bytes]] = {}

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # -- objects -------------------------------------------------------------------------------
    def run(self) -> Rendered:
        for doc in self.docs:
            kind, name = doc.get("kind"), doc["metadata"]["name"]
            if kind == "ConfigMap":
                _only(doc, ("apiVersion", "kind", "metadata", "data"), f"ConfigMap {name}")
                self.config_maps[name] = dict(doc.get("data") or {})
            elif kind == "Secret":
                _only(doc, ("apiVersion", "kind", "metadata", "type", "data", "stringData"),
                      f"Secret {name}")  # fmt: skip
                data = {k: base64.b64decode(v) for k, v in (doc.get("data") or {}).items()}
                data |= {k: v.encode() for k, v in (doc.get("stringData") or {}).items()}
                self.secrets[name] = data
        pods: list[Pod] = []
        services: list[dict[str, Any]] = []
        for doc in self.docs:
            kind, name = doc.get("kind"), doc["metadata"]["name"]
            where = f"{kind} {name}"
            if kind == "StatefulSet":
                pods += self.stateful_set(doc, where)
            elif kind == "Service":
                services.append(doc)
            elif kind == "ServiceAccount":
                _only(doc, ("apiVersion", "kind", "metadata", "automountServiceAccountToken"),
                      where)  # fmt: skip
                self.note(f"{where}: no API server here; the pods mount no token (checked)")
            elif kind == "PodDisruptionBudget":
                self.note(f"{where}: no evictions here (no API server), nothing to protect")
            elif kind not in ("ConfigMap", "Secret"):
                raise Unsupported(f"{where}: kind {kind} is not run by the translator")
        dns = [entry for doc in services for entry in self.service(doc, pods)]
        return Rendered(tuple(pods), tuple(dns), self.config_maps, self.secrets,
                        tuple(self.notes))  # fmt: skip

    def service(self, doc: dict[str, Any], pods: list[Pod]) -> list[tuple[str, tuple[str, ...]]]:
        """A headless Service's DNS names: <svc>.<ns>.svc.<domain> (every pod it selects) and,
        for the pods of the StatefulSet it governs, <pod>.<svc>.<ns>.svc.<domain>."""
        meta, spec = doc["metadata"], doc["spec"]
        where = f"Service {meta['name']}"
        _only(doc, ("apiVersion", "kind", "metadata", "spec"), where)
        _only(spec, ("clusterIP", "publishNotReadyAddresses", "selector", "ports"), where)
        if spec.get("clusterIP") != "None":
            raise Unsupported(f"{where}: only headless Services (clusterIP: None): no proxy here")
        if not spec.get("publishNotReadyAddresses"):
            raise Unsupported(
                f"{where}: names here are static /etc/hosts lines: they cannot leave out pods"
                " that are not ready (publishNotReadyAddresses: false)"
            )
        selector = spec.get("selector") or {}
        chosen = [p for p in pods if selector.items() <= dict(p.labels).items()]
        namespace = meta.get("namespace", "default")
        zone = f"{meta['name']}.{namespace}.svc.{self.domain}"
        names = [(zone, tuple(p.name for p in chosen))]
        names += [(f"{p.name}.{zone}", (p.name,)) for p in chosen if p.subdomain == meta["name"]]
        return names

    def stateful_set(self, doc: dict[str, Any], where: str) -> list[Pod]:
        meta, spec = doc["metadata"], doc["spec"]
        _only(doc, ("apiVersion", "kind", "metadata", "spec"), where)
        _only(
            spec,
            ("serviceName", "replicas", "podManagementPolicy", "updateStrategy",
             "minReadySeconds", "selector", "template", "volumeClaimTemplates",
             "persistentVolumeClaimRetentionPolicy"),
            where,
        )  # fmt: skip
        replicas = int(spec.get("replicas", 1))
        if spec.get("podManagementPolicy", "OrderedReady") != "Parallel" and replicas > 1:
            raise Unsupported(f"{where}: podManagementPolicy OrderedReady with {replicas} pods")
        self.note(f"{where}: updateStrategy, minReadySeconds and claim retention only act on"
                  " upgrades and deletions (a fresh install here)")  # fmt: skip
        template = spec["template"]
        _only(template, ("metadata", "spec"), f"{where} template")
        _only(template["metadata"], ("labels", "annotations"), f"{where} template metadata")
        labels = dict(template["metadata"].get("labels") or {})
        selector = spec["selector"]
        _only(selector, ("matchLabels",), f"{where} selector")
        if not selector["matchLabels"].items() <= labels.items():
            raise Unsupported(f"{where}: its selector does not match its pod template")
        claims: list[Volume] = []
        for claim in spec.get("volumeClaimTemplates") or []:
            _only(claim, ("metadata", "spec"), f"{where} volumeClaimTemplates")
            claims.append(Volume(claim["metadata"]["name"], "dir"))
            self.note(f"{where}: claim {claim['metadata']['name']!r}: a directory of the pod"
                      " (size, class and access modes are the provisioner's)")  # fmt: skip
        pod_spec = template["spec"]
        return [
            self.pod(
                f"{meta['name']}-{i}",
                meta.get("namespace", "default"),
                meta["name"],
                spec["serviceName"],
                labels,
                pod_spec,
                claims,
            )
            for i in range(replicas)
        ]

    # -- pods ----------------------------------------------------------------------------------
    def pod(
        self,
        name: str,
        namespace: str,
        owner: str,
        subdomain: str,
        labels: dict[str, str],
        spec: dict[str, Any],
        claims: list[Volume],
    ) -> Pod:
        where = f"pod {owner}"
        scheduling = ("affinity", "nodeSelector", "tolerations", "priorityClassName",
                      "topologySpreadConstraints")  # fmt: skip
        _only(
            spec,
            ("containers", "volumes", "securityContext", "serviceAccountName",
             "automountServiceAccountToken", "terminationGracePeriodSeconds", *scheduling),
            where,
        )  # fmt: skip
        for key in scheduling:
            if key in spec:
                self.note(f"{where}: {key}: one node here, nothing to schedule")
        if spec.get("automountServiceAccountToken") is not False:
            raise Unsupported(f"{where}: a service account token to mount (no API server here)")
        security = dict(spec.get("securityContext") or {})
        _only(security, ("runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "seccompProfile"),
              f"{where} securityContext")  # fmt: skip
        self.seccomp(security.get("seccompProfile"), where)
        volumes = [*claims, *(self.volume(v, where) for v in spec.get("volumes") or [])]
        containers = tuple(self.container(c, security, where) for c in spec["containers"])
        names = {v.name for v in volumes}
        for container in containers:
            for mount in container.mounts:
                if mount.volume not in names:
                    raise Unsupported(f"{where}: {container.name} mounts no volume {mount.volume}")
        ports = [p for c in containers for _, p in c.ports]
        if len(ports) != len(set(ports)):
            raise Unsupported(f"{where}: its containers' ports clash (one network): {ports}")
        return Pod(
            name=name,
            namespace=namespace,
            owner=owner,
            subdomain=subdomain,
            labels=tuple(sorted(labels.items())),
            containers=containers,
            volumes=tuple(volumes),
            fs_group=security.get("fsGroup"),
            grace=int(spec.get("terminationGracePeriodSeconds", 30)),
        )

    def seccomp(self, profile: dict[str, Any] | None, where: str) -> None:
        if profile is not None and profile != {"type": "RuntimeDefault"}:
            raise Unsupported(f"{where}: seccompProfile {profile} (only RuntimeDefault)")

    def volume(self, spec: dict[str, Any], where: str) -> Volume:
        name = spec["name"]
        where = f"{where} volume {name}"
        sources = set(spec) - {"name"}
        if sources == {"emptyDir"}:
            empty = spec["emptyDir"] or {}
            _only(empty, ("sizeLimit",), where)  # (a medium: Memory is refused)
            if "sizeLimit" in empty:
                self.note(f"{where}: sizeLimit is not enforced (the kubelet would evict)")
            return Volume(name, "dir")
        if sources == {"hostPath"}:
            host = spec["hostPath"]
            _only(host, ("path", "type"), where)
            if host["path"] not in self.host_paths:
                raise Unsupported(f"{where}: hostPath {host['path']} is not one given to run")
            if host.get("type", "") not in ("", "Directory"):
                raise Unsupported(f"{where}: hostPath type {host['type']}")
            return Volume(name, "hostPath", host_path=host["path"])
        if sources == {"configMap"} or sources == {"secret"}:
            source = spec.get("configMap") or spec["secret"]
            _only(source, ("name", "secretName", "items", "defaultMode"), where)
            kind, objects = ("ConfigMap", self.config_maps) if "configMap" in spec else (
                "Secret", self.secrets)  # fmt: skip
            ref = source.get("name") or source.get("secretName", "")
            if ref not in objects:
                raise Unsupported(f"{where}: {kind} {ref} is not among the rendered objects")
            mode = int(source.get("defaultMode", 0o644))
            items = source.get("items") or [{"key": k, "path": k} for k in objects[ref]]
            files = []
            for item in items:
                _only(item, ("key", "path"), where)
                data = _ref(objects, kind, ref, item["key"], where)
                files.append(
                    (item["path"], data if isinstance(data, bytes) else data.encode(), mode)
                )
            return Volume(name, "files", files=tuple(files))
        raise Unsupported(f"{where}: source {sorted(sources)}")

    def container(
        self, spec: dict[str, Any], pod_security: dict[str, Any], where: str
    ) -> Container:
        where = f"{where} container {spec['name']}"
        _only(
            spec,
            ("name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "ports",
             "readinessProbe", "livenessProbe", "startupProbe", "resources", "securityContext",
             "volumeMounts", "workingDir"),
            where,
        )  # fmt: skip
        if spec.get("imagePullPolicy", "IfNotPresent") not in ("IfNotPresent", "Never"):
            raise Unsupported(f"{where}: imagePullPolicy {spec['imagePullPolicy']} (no registry)")
        security = dict(spec.get("securityContext") or {})
        _only(
            security,
            ("allowPrivilegeEscalation", "readOnlyRootFilesystem", "runAsNonRoot", "runAsUser",
             "runAsGroup", "capabilities", "seccompProfile", "privileged"),
            f"{where} securityContext",
        )  # fmt: skip
        if security.get("privileged"):
            raise Unsupported(f"{where}: privileged")
        self.seccomp(security.get("seccompProfile"), where)
        capabilities = security.get("capabilities") or {}
        _only(capabilities, ("drop",), f"{where} capabilities")  # (an `add` is refused)
        if capabilities.get("drop", ["ALL"]) != ["ALL"]:
            raise Unsupported(f"{where}: capabilities.drop {capabilities['drop']} (only [ALL])")
        merged = {**pod_security, **security}
        user, group = merged.get("runAsUser"), merged.get("runAsGroup")
        if merged.get("runAsNonRoot") and (user is None or int(user) == 0):
            raise Unsupported(f"{where}: runAsNonRoot without a non-zero runAsUser to check")
        ports = tuple(
            (p.get("name", str(p["containerPort"])), int(p["containerPort"]))
            for p in spec.get("ports") or []
        )
        for port in spec.get("ports") or []:
            _only(port, ("name", "containerPort", "protocol"), f"{where} ports")
        limits = self.resources(spec.get("resources") or {}, where)
        for kind in ("livenessProbe", "startupProbe"):
            if kind in spec:
                self.probe(spec[kind], dict(ports), f"{where} {kind}")  # (checked, not run)
                self.note(f"{where}: {kind} is not run (nothing restarts a container by"
                          " itself here: the scenario restarts the one it kills)")  # fmt: skip
        readiness = spec.get("readinessProbe")
        return Container(
            name=spec["name"],
            image=spec["image"],
            command=tuple(spec["command"]) if "command" in spec else None,
            args=tuple(str(a) for a in spec["args"]) if "args" in spec else None,
            env=self.env(spec, where),
            user=None if user is None else int(user),
            group=None if group is None else int(group),
            read_only_root=bool(security.get("readOnlyRootFilesystem")),
            drop_all_capabilities="drop" in capabilities,
            no_new_privileges=security.get("allowPrivilegeEscalation") is False,
            memory_limit=int(limits["memory"]) if "memory" in limits else None,
            cpu_limit=limits.get("cpu"),
            mounts=tuple(self.mount(m, where) for m in spec.get("volumeMounts") or []),
            ports=ports,
            readiness=None if readiness is None else self.probe(readiness, dict(ports), where),
            working_dir=spec.get("workingDir"),
        )

    def resources(self, spec: dict[str, Any], where: str) -> dict[str, float]:
        _only(spec, ("requests", "limits"), f"{where} resources")
        if spec.get("requests"):
            self.note(f"{where}: resource requests only place pods (one node here)")
        limits = spec.get("limits") or {}
        _only(limits, ("memory", "cpu"), f"{where} resources.limits")
        return {k: _quantity(v, f"{where} limits.{k}") for k, v in limits.items()}

    def mount(self, spec: dict[str, Any], where: str) -> Mount:
        _only(spec, ("name", "mountPath", "readOnly"), f"{where} volumeMounts")
        return Mount(spec["name"], spec["mountPath"], bool(spec.get("readOnly")))

    def probe(self, spec: dict[str, Any], ports: dict[str, int], where: str) -> Probe:
        timing = {
            "periodSeconds": "period",
            "timeoutSeconds": "timeout",
            "failureThreshold": "failure_threshold",
            "initialDelaySeconds": "initial_delay",
        }
        _only(spec, ("grpc", "tcpSocket", "httpGet", *timing), where)
        kwargs: dict[str, Any] = {timing[k]: v for k, v in spec.items() if k in timing}

        def port_of(action: dict[str, Any]) -> int:
            port = action["port"]
            if isinstance(port, str):
                if port not in ports:
                    raise Unsupported(f"{where}: no port named {port}")
                port = ports[port]
            return int(port)

        if "grpc" in spec:
            _only(spec["grpc"], ("port", "service"), where)
            port = spec["grpc"]["port"]
            return Probe("grpc", int(port), service=spec["grpc"].get("service", ""), **kwargs)
        if "tcpSocket" in spec:
            _only(spec["tcpSocket"], ("port",), where)
            return Probe("tcp", port_of(spec["tcpSocket"]), **kwargs)
        if "httpGet" in spec:
            action = spec["httpGet"]
            _only(action, ("port", "path", "scheme"), where)
            scheme = action.get("scheme", "HTTP")
            if scheme not in ("HTTP", "HTTPS"):
                raise Unsupported(f"{where}: httpGet scheme {scheme}")
            path = action.get("path", "/")
            return Probe("http", port_of(action), path=path, scheme=scheme, **kwargs)
        raise Unsupported(f"{where}: a probe other than grpc, tcpSocket and httpGet")

    def env(self, spec: dict[str, Any], where: str) -> tuple[tuple[str, str | FieldRef], ...]:
        env: dict[str, str | FieldRef] = {}
        for source in spec.get("envFrom") or []:
            _only(source, ("secretRef", "configMapRef"), f"{where} envFrom")
            if "secretRef" in source:
                _only(source["secretRef"], ("name",), f"{where} envFrom")
                name = source["secretRef"]["name"]
                if name not in self.secrets:
                    raise Unsupported(f"{where}: Secret {name} is not among the rendered objects")
                env |= {k: v.decode() for k, v in self.secrets[name].items()}
            else:
                _only(source["configMapRef"], ("name",), f"{where} envFrom")
                name = source["configMapRef"]["name"]
                if name not in self.config_maps:
                    raise Unsupported(
                        f"{where}: ConfigMap {name} is not among the rendered objects"
                    )
                env |= self.config_maps[name]
        for entry in spec.get("env") or []:
            _only(entry, ("name", "value", "valueFrom"), f"{where} env")
            if "value" in entry:
                env[entry["name"]] = str(entry["value"])
                continue
            ref = entry["valueFrom"]
            _only(ref, ("secretKeyRef", "configMapKeyRef", "fieldRef"), f"{where} env")
            if "secretKeyRef" in ref:
                key = ref["secretKeyRef"]
                _only(key, ("name", "key"), f"{where} env")
                env[entry["name"]] = _ref(
                    self.secrets, "Secret", key["name"], key["key"], where
                ).decode()
            elif "configMapKeyRef" in ref:
                key = ref["configMapKeyRef"]
                _only(key, ("name", "key"), f"{where} env")
                env[entry["name"]] = _ref(
                    self.config_maps, "ConfigMap", key["name"], key["key"], where
                )
            else:
                _only(ref["fieldRef"], ("fieldPath", "apiVersion"), f"{where} env")
                path = ref["fieldRef"]["fieldPath"]
                if path not in ("metadata.name", "metadata.namespace", "status.podIP"):
                    raise Unsupported(f"{where}: env fieldRef {path}")
                env[entry["name"]] = FieldRef(path)
        return tuple(env.items())


def translate(
    docs: list[dict[str, Any]],
    cluster_domain: str = "cluster.local",
    host_paths: Iterable[str] = (),
) -> Rendered:
    """The pods of `docs` (what `helm template` rendered). `host_paths`: the hostPath volumes
    the caller maps to a directory of its own (any other hostPath is refused)."""
    return _Translator([d for d in docs if d], cluster_domain, set(host_paths)).run()


def resolve_env(container: Container, pod: Pod, ip: str) -> dict[str, str]:
    """The container's environment in `pod` at `ip` (fieldRefs filled in)."""
    fields = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "status.podIP": ip}
    return {k: fields[v.path] if isinstance(v, FieldRef) else v for k, v in container.env}
