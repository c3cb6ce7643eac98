"""The Helm chart (deploy/helm/cube) and the image (deploy/docker/Dockerfile), offline: helm
lint, renders of seven configurations (defaults; 3 x 2 with tokens; names at Kubernetes' limits;
TLS; an S3 donefile; clients and Prometheus in other namespaces; every option set, in
deploy/helm/cube/ci) validated against the Kubernetes
1.27-1.32 schemas (kubernetes-validate) and a policy linter (checkov), hadolint on the
Dockerfile, and asserts on what the API server would not catch: names and labels past 63
characters, selectors that miss the pods, a PDB with both bounds, ports the NetworkPolicy
forgets, flags the commands do not take, configs our parsers refuse, what an upgrade from the
previous chart would have to change in place, values no template reads.

The tools come from `make tools` (.tools/); without them these tests are skipped, saying so.
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cube.agent.main import flag_set as agent_flags
from cube.client import cli as cube_cli
from cube.client.conf import parse_conf
from cube.flags import FlagSet
from cube.server.main import FLAGS as SERVER_FLAGS
from cube.server.main import check_flags
from cube.transfer.config import parse_config
from cube.transfer.main import flag_set as transfer_flags

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "cube"
CI = CHART / "ci"
TOOLS = REPO / ".tools"
HELM = TOOLS / "bin" / "helm"
VENV_BIN = TOOLS / "venv" / "bin"
NAMESPACE = "ml"
SECOND = CI / "3x2-tokens-values.yaml"
# the chart as released before (0.1.0, `helm package` of commit b3c7d55): upgrades start there
PREVIOUS_CHART = Path(__file__).parent / "data" / "charts" / "cube-0.1.0.tgz"
KUBERNETES_VERSIONS = ("1.27.0", "1.28.0", "1.29.0", "1.30.0", "1.31.0", "1.32.0")
LONGEST_RELEASE = "a-release-name-of-fifty-three-characters-helm-allows1"  # Helm's limit: 53
OPERATOR_APIS = (
    "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
    "--api-versions", "cert-manager.io/v1/Certificate",
)  # fmt: skip

pytestmark = [
    pytest.mark.skipif(
        not (HELM.exists() and (VENV_BIN / "checkov").exists()),
        reason="helm, kubernetes-validate, checkov and hadolint come from `make tools` (.tools/)",
    ),
    pytest.mark.slow,  # every test runs helm or a linter
]

COMMANDS: dict[str, FlagSet[Any]] = {  # each command's own flags type
    "cube-server": SERVER_FLAGS,
    "cube-agent": agent_flags(),
    "cube-transfer": transfer_flags(),
    "cube-cli": cube_cli.FLAGS,
}


@dataclass(frozen=True)
class Config:
    release: str
    values_file: Path | None
    operator_apis: bool = False  # render with the Prometheus Operator's and cert-manager's APIs

    def values_args(self) -> tuple[str, ...]:
        return ("--values", str(self.values_file)) if self.values_file else ()

    def args(self) -> tuple[str, ...]:
        return (*self.values_args(), *(OPERATOR_APIS if self.operator_apis else ()))

    def values(self) -> dict[str, Any]:
        """The values the chart sees: its defaults under the file's."""
        defaults = yaml.safe_load((CHART / "values.yaml").read_text())
        given = yaml.safe_load(self.values_file.read_text()) if self.values_file else {}
        return merged(defaults, given)


CONFIGS = {
    "default": Config("t", None),
    "3x2-tokens": Config("t", SECOND),
    "long-names": Config(LONGEST_RELEASE, CI / "long-names-values.yaml"),
    "tls": Config("t", CI / "tls-values.yaml"),
    "s3": Config("t", CI / "s3-values.yaml"),
    "cross-namespace": Config("t", CI / "cross-namespace-values.yaml", operator_apis=True),
    "full": Config("t", CI / "full-values.yaml", operator_apis=True),
}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of values: maps merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def render(*args: str, release: str = "t", chart: Path = CHART) -> str:
    done = helm("template", release, str(chart), "--namespace", NAMESPACE, *args)
    assert done.returncode == 0, done.stderr
    text: str = done.stdout
    return text


def objects(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in of_kind(docs, kind)}


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = (
        doc["spec"]["template"]["spec"] if doc["kind"] == "StatefulSet" else doc["spec"]
    )
    return spec


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, container) of every workload."""
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Pod"):
            for container in pod_spec(doc)["containers"]:
                yield doc, container


def component(doc: dict[str, Any]) -> str:
    name: str = doc["metadata"]["labels"]["app.kubernetes.io/component"]
    return name


def shard_sets(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shards' StatefulSets, in shard order."""
    sets = [d for d in of_kind(docs, "StatefulSet") if component(d) == "shard"]
    return sorted(sets, key=lambda d: int(d["metadata"]["labels"]["cube.shard"]))


def transfer_set(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [d for d in of_kind(docs, "StatefulSet") if component(d) == "transfer"]
    return found


def arg(container: dict[str, Any], flag: str) -> str:
    prefix = f"--{flag}="
    args: list[str] = container["args"]
    return next(a.removeprefix(prefix) for a in args if a.startswith(prefix))


def mounted_file(
    spec: dict[str, Any], container: dict[str, Any], path: str
) -> tuple[dict[str, Any], str]:
    """The volume that puts `path` in the container, and the key of it that is the file."""
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            return volume, path.removeprefix(prefix)
    raise AssertionError(f"{container['name']}: nothing mounted at {path}")


@dataclass
class Rendered:
    name: str
    config: Config
    docs: list[dict[str, Any]]
    path: Path
    values: dict[str, Any]


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Rendered]:
    out = {}
    folder = tmp_path_factory.mktemp("rendered")
    for name, config in CONFIGS.items():
        text = render(*config.args(), release=config.release)
        path = folder / f"{name}.yaml"
        path.write_text(text)
        out[name] = Rendered(name, config, objects(text), path, config.values())
    return out


@pytest.fixture(params=list(CONFIGS))
def rendered(request: pytest.FixtureRequest, renders: dict[str, Rendered]) -> Rendered:
    return renders[request.param]


def test_lint_strict() -> None:
    for config in CONFIGS.values():
        done = helm("lint", "--strict", str(CHART), *config.values_args())
        assert done.returncode == 0, (config, done.stdout + done.stderr)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_objects_validate_against_the_kubernetes_schemas(
    renders: dict[str, Rendered], version: str
) -> None:
    """Every configuration, every Kubernetes version the chart supports (kubeVersion >=1.27).
    The custom resources (ServiceMonitor, PrometheusRule, Certificate) have no schema here:
    their fields are asserted below."""
    done = subprocess.run(
        [str(VENV_BIN / "kubernetes-validate"), "--strict", "--no-warn", "-k", version,
         *(str(r.path) for r in renders.values())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_policy_linter_finds_nothing_unexplained(renders: dict[str, Rendered]) -> None:
    files = [arg for r in renders.values() for arg in ("-f", str(r.path))]
    done = subprocess.run(
        [str(VENV_BIN / "checkov"), "--skip-download", "--quiet", "--compact",
         "--framework", "kubernetes", "--config-file", str(CHART / ".checkov.yaml"), *files],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# names


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
REVISION_HASH = 10  # characters of the controller-revision-hash after "<statefulset>-"


def labels_of(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, str]]]:
    """Every label map an object carries or selects with: its own, its pod template's, its
    claim templates', its selectors', and those of its affinity terms."""

    def walk(node: Any, where: str) -> Iterator[tuple[str, dict[str, str]]]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("labels", "matchLabels") and isinstance(value, dict):
                    yield f"{where}.{key}", value
                elif key == "selector" and doc["kind"] == "Service":
                    yield f"{where}.selector", value
                else:
                    yield from walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, item in enumerate(node):
                yield from walk(item, f"{where}[{i}]")

    yield from walk(doc, doc["kind"])


def label_problems(where: str, labels: dict[str, str]) -> Iterator[str]:
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if len(name) > 63 or not LABEL_NAME.fullmatch(name):
            yield f"{where}: label name {key!r}"
        if prefix and (len(prefix) > 253 or not SUBDOMAIN.fullmatch(prefix)):
            yield f"{where}: label prefix {key!r}"
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.fullmatch(value):
            yield f"{where}: label {key}={value!r}"


def name_problems(docs: list[dict[str, Any]]) -> list[str]:
    """What the API server, the StatefulSet controller or the kubelet would refuse, or never
    manage to create, among the objects' names and labels."""
    problems = []
    for doc in docs:
        name = doc["metadata"]["name"]
        what = f"{doc['kind']} {name}"
        if len(name) > 253 or not SUBDOMAIN.fullmatch(name):
            problems.append(f"{what}: not a DNS subdomain")
        if doc["kind"] == "Service" and (len(name) > 63 or not DNS_1035.fullmatch(name)):
            problems.append(f"{what}: a Service name is a DNS label of at most 63")
        if doc["kind"] == "StatefulSet":
            # the pods' controller-revision-hash label is <name>-<hash>, at most 63
            if len(name) + 1 + REVISION_HASH > 63:
                problems.append(f"{what}: {len(name)} characters, pods never get created")
            last_pod = f"{name}-{doc['spec']['replicas'] - 1}"  # also a hostname and a label
            if len(last_pod) > 63 or not DNS_LABEL.fullmatch(last_pod):
                problems.append(f"{what}: pod {last_pod} is no DNS label")
            for claim in doc["spec"].get("volumeClaimTemplates", []):
                if len(f"{claim['metadata']['name']}-{last_pod}") > 253:
                    problems.append(f"{what}: claim names too long")
        for where, labels in labels_of(doc):
            problems += label_problems(f"{what} {where}", labels)
        for _doc, container in [(doc, c) for d, c in containers([doc])]:
            for port in container.get("ports", []):
                if len(port.get("name", "")) > 15:
                    problems.append(f"{what}: port name {port['name']}")
    return problems


def test_a_release_named_from_a_digit_renders_valid_names() -> None:
    """Issue 35 item 6: `helm install 1emb` made Services named 1emb-cube-shard-0, which the API
    server refuses (a Service name is a DNS-1035 label: a letter first). Now <name>-<release>."""
    docs = objects(render(release="1emb"))
    assert name_problems(docs) == []
    assert fullname(release="1emb") == "cube-1emb"
    assert fullname(release="1cube") == "cube-1cube"
    conf = client_conf(docs)
    assert "cube-1emb-shard-0-0.cube-1emb-shard-0.ml.svc.cluster.local:8000" in str(conf)


def test_workers_take_no_port_of_another_container() -> None:
    """Issue 35 item 6: `server.workers: 2` put worker 1 on port + 1, the agent's 8001 (the
    render failed). Now each worker's lookup and lane ports skip every port the pod uses:
    no two containers of a shard pod declare or are given the same port."""
    for workers in (2, 3):
        docs = objects(render("--set", f"server.workers={workers}"))
        for workload in shard_sets(docs):
            declared = [p["containerPort"] for c in pod_spec(workload)["containers"]
                        for p in c.get("ports", [])]  # fmt: skip
            server = next(c for c in pod_spec(workload)["containers"] if c["name"] == "cube-server")
            given = [int(p) for flag in ("worker_ports", "tcp_ports")
                     for p in arg(server, flag).split(",")]  # fmt: skip
            control = int(arg(server, "control_port"))
            given += [control + i for i in range(workers)] + [8001, 9100, 9101]  # agent, metrics
            assert len(declared) == len(set(declared)) and len(given) == len(set(given)), given
            assert set(declared) <= set(given)
            assert arg(server, "worker_ports").split(",")[:2] == ["8000", "8002"]
        conf = client_conf(docs)
        assert ":8001" not in json.dumps(conf) and ":8002" in json.dumps(conf)
    with pytest.raises(AssertionError, match=r"server\.port 8001 is taken"):  # said at once
        render("--set", "server.port=8001")


def test_the_transfer_has_a_disruption_budget_and_replicas_their_peers() -> None:
    """Issue 35 item 4: the one transfer gets a PodDisruptionBudget (a drain does not evict it
    mid-rollout by itself; an unready one may go), and each agent the names of its shard's
    replicas' agents to recover a version from; the NetworkPolicy lets agents reach them."""
    docs = objects(render("--set", "dict.replicas=3"))
    budget = named(docs, "PodDisruptionBudget")["t-cube-transfer"]["spec"]
    transfer_labels = transfer_set(docs)["spec"]["template"]["metadata"]["labels"]
    assert budget["minAvailable"] == 1 and budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert budget["selector"]["matchLabels"].items() <= transfer_labels.items()
    for shard, workload in enumerate(shard_sets(docs)):
        agent = next(c for c in pod_spec(workload)["containers"] if c["name"] == "cube-agent")
        peers = arg(agent, "peers").split(",")
        assert peers == [f"t-cube-shard-{shard}-{r}.t-cube-shard-{shard}.ml.svc.cluster.local:8001"
                         for r in range(3)]  # fmt: skip
        assert arg(agent, "transfer_address") == "t-cube-transfer.ml.svc.cluster.local:8009"
    shards = named(docs, "NetworkPolicy")["t-cube-shards"]["spec"]
    to_agents = [r for r in shards["egress"] if {p["port"] for p in r["ports"]} == {8001}]
    assert to_agents and to_agents[0]["to"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "shard"  # fmt: skip
    off = objects(render("--set", "transfer.podDisruptionBudget.enabled=false",
                         "--set", "agent.peerRecovery.enabled=false"))  # fmt: skip
    assert "t-cube-transfer" not in named(off, "PodDisruptionBudget")
    assert all("--peers" not in " ".join(c.get("args", [])) for _d, c in containers(off))
    single = objects(render("--set", "dict.replicas=1"))  # no peer to ask
    assert all("--peers" not in " ".join(c.get("args", [])) for _d, c in containers(single))


def test_names_and_labels_fit_kubernetes_limits(rendered: Rendered) -> None:
    """Issue 26 item 1: a 53-character release with 12 shards made 62-character StatefulSet
    names (no pod was ever created) and a 128-character dict name went verbatim into a
    label. Now every name and label fits, in every configuration."""
    assert name_problems(rendered.docs) == []
    if rendered.name == "long-names":
        sets = of_kind(rendered.docs, "StatefulSet")
        assert len(sets) == 13 and max(len(d["metadata"]["name"]) for d in sets) == 52
        label = rendered.docs[0]["metadata"]["labels"]["cube.dict"]
        assert len(label) <= 63 and rendered.values["dict"]["name"].startswith(label)


def fullname(*args: str, release: str = "t") -> str:
    docs = objects(render(*args, release=release))
    name: str = transfer_set(docs)["metadata"]["name"]
    return name.removesuffix("-transfer")


def test_name_overrides_and_long_names_stay_apart() -> None:
    assert fullname() == "t-cube"
    assert fullname(release="my-cube") == "my-cube"  # already says cube
    assert fullname("--set", "nameOverride=emb") == "t-emb"
    assert fullname("--set", "fullnameOverride=search") == "search"
    docs = objects(render("--set", "nameOverride=emb"))
    assert {d["metadata"]["labels"]["app.kubernetes.io/name"] for d in docs} == {"emb"}
    # cut to fit, and two long names that differ only past the cut still differ
    first, second = LONGEST_RELEASE, LONGEST_RELEASE[:-1] + "2"
    names = {fullname("--set", "dict.shards=100", release=r) for r in (first, second)}
    assert len(names) == 2 and all(len(n) == 52 - len("-shard-99") for n in names)
    assert len(fullname("--set", f"fullnameOverride={'x' * 63}")) == 52 - len("-transfer")
    # a name that fits is kept, as the previous chart made it (an upgrade renames nothing)
    assert fullname(release="r" * 38) == "r" * 38 + "-cube"


def test_one_statefulset_headless_service_and_pdb_per_shard(rendered: Rendered) -> None:
    docs, values = rendered.docs, rendered.values
    shards, replicas = values["dict"]["shards"], values["dict"]["replicas"]
    services, budgets = named(docs, "Service"), named(docs, "PodDisruptionBudget")
    sets = shard_sets(docs)
    assert [int(d["metadata"]["labels"]["cube.shard"]) for d in sets] == list(range(shards))
    budget_values = values["podDisruptionBudget"]
    for shard, workload in enumerate(sets):
        shard_name = workload["metadata"]["name"]
        assert shard_name.endswith(f"-shard-{shard}")
        service = services[shard_name]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["replicas"] == replicas
        assert workload["spec"]["serviceName"] == shard_name
        choosers = [workload["spec"]["selector"]["matchLabels"], service["spec"]["selector"]]
        if budget_values["enabled"]:
            budget = budgets[shard_name]
            choosers.append(budget["spec"]["selector"]["matchLabels"])
            bound = ("minAvailable", budget_values["minAvailable"])
            if budget_values["minAvailable"] == "":
                bound = ("maxUnavailable", budget_values["maxUnavailable"])
            assert budget["spec"] == {bound[0]: bound[1], "selector": budget["spec"]["selector"]}
        for chooser in choosers:
            assert chooser.items() <= labels.items(), (chooser, labels)  # selects the pods
            assert chooser["cube.shard"] == str(shard)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True  # agents of unready pods
        affinity = workload["spec"]["template"]["spec"]["affinity"]
        if values["server"]["affinity"]:
            assert affinity == values["server"]["affinity"]
        else:
            hard = "requiredDuringSchedulingIgnoredDuringExecution" in affinity["podAntiAffinity"]
            assert hard == (values["antiAffinity"] == "hard")
    assert len(of_kind(docs, "StatefulSet")) == shards + 1  # and the transfer
    for doc in docs:
        assert doc["metadata"]["namespace"] == NAMESPACE


def test_probes_ports_and_network_policy(rendered: Rendered) -> None:
    """Ready means serving at normal latency (gRPC health); with TLS on, the kubelet (which
    cannot speak TLS to a gRPC probe) asks it on the control port, plaintext and reached from
    the node only: no NetworkPolicy admits a pod to it."""
    docs, values = rendered.docs, rendered.values
    tls = values["tls"]["enabled"]
    policies = named(docs, "NetworkPolicy")
    shard_policy = next(p for n, p in policies.items() if n.endswith("-shards"))["spec"]
    open_ports = {p["port"] for rule in shard_policy["ingress"] for p in rule["ports"]}
    servers = [(d, c) for d, c in containers(docs) if c["name"] == "cube-server"]
    assert len(servers) == values["dict"]["shards"]
    for doc, container in servers:
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(arg(container, "port")) == declared["grpc"]
        lanes = [int(p) for p in arg(container, "tcp_ports").split(",")]  # pinned, 1 a worker
        workers = values["server"]["workers"]
        own = {n: [declared[n]] + [declared[f"{n}-{i}"] for i in range(1, workers)]
               for n in ("grpc", "lane")}  # fmt: skip
        assert lanes == own["lane"]
        if workers > 1:
            assert arg(container, "worker_ports") == ",".join(map(str, own["grpc"]))
        lookups = [r["ports"] for r in shard_policy["ingress"]
                   if any(p["port"] == declared["lane"] for p in r["ports"])]  # fmt: skip
        listed = [{(p["port"], p.get("endPort", p["port"])) for p in ports} for ports in lookups]
        assert {(p, p) for p in own["grpc"] + own["lane"]} in listed  # each port, no range
        control = int(arg(container, "control_port"))
        assert control not in open_ports  # control stays in the pod (and its node)
        assert arg(container, "control_host") == ("0.0.0.0" if tls else "127.0.0.1")
        ready = container["readinessProbe"]
        assert ready["grpc"] == {
            "port": control if tls else declared["grpc"],
            "service": "cube.v1.CubeService",
        }
        assert ("--tls_cert" in " ".join(container["args"])) == tls
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]
            timing = {k: v for k, v in probe.items() if k not in ("grpc", "tcpSocket")}
            assert timing == values["server"][kind], kind
        # alive: the event loop answers a health name that is SERVING with or without a
        # version, within the probe's timeout (a stuck loop is restarted)
        alive = {"port": control if tls else declared["grpc"], "service": "cube.Liveness"}
        assert container["startupProbe"]["grpc"] == alive
        assert container["livenessProbe"]["grpc"] == alive
        grace = float(arg(container, "grace"))
        assert doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace
    for _doc, container in containers(docs):  # agents and the transfer: GET /healthz, no token
        if container["name"] in ("cube-agent", "cube-transfer"):
            for kind in ("readinessProbe", "livenessProbe"):
                get = container[kind]["httpGet"]
                assert get["path"] == "/healthz" and get["scheme"] == ("HTTPS" if tls else "HTTP")
    # the `helm test` pod may look up, whatever networkPolicy.clientPodSelector admits
    (test_pod,) = of_kind(docs, "Pod")
    lookup_rule = next(
        r for r in shard_policy["ingress"] if values["server"]["port"] in
        {p["port"] for p in r["ports"]}
    )  # fmt: skip
    assert any(
        set(peer) == {"podSelector"}  # of the release's namespace
        and peer["podSelector"].get("matchLabels", {}).items()
        <= test_pod["metadata"]["labels"].items()
        for peer in lookup_rule["from"]
    )
    agent_port = values["agent"]["port"]
    agent_rule = next(
        r for r in shard_policy["ingress"] if {p["port"] for p in r["ports"]} == {agent_port}
    )
    transfer_only = agent_rule["from"][0]["podSelector"]["matchLabels"]
    assert transfer_only["app.kubernetes.io/component"] == "transfer"


def test_egress_is_only_what_each_component_needs(renders: dict[str, Rendered]) -> None:
    for rendered in renders.values():
        values, docs = rendered.values, rendered.docs
        policies = {n.rsplit("-", 1)[1]: p["spec"] for n, p in named(docs, "NetworkPolicy").items()}
        egress = values["networkPolicy"]["egress"]
        shards, transfer = policies["shards"], policies["transfer"]
        assert ("Egress" in shards["policyTypes"]) == egress["enabled"]
        if egress["enabled"]:
            dns, files, *extra = shards["egress"]
            assert {p["port"] for p in dns["ports"]} == {53} and "to" not in dns
            assert files["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == (
                "transfer"
            )
            assert [p["port"] for p in files["ports"]] == [values["transfer"]["filePort"]]
            if values["agent"]["peerRecovery"]["enabled"]:  # the shard's other agents
                peers, *extra = extra
                assert [p["port"] for p in peers["ports"]] == [values["agent"]["port"]]
                component = peers["to"][0]["podSelector"]["matchLabels"]
                assert component["app.kubernetes.io/component"] == "shard"
            assert extra == egress["shards"]
        limited = egress["enabled"] and bool(egress["transfer"] or egress["sources"])
        assert ("Egress" in transfer["policyTypes"]) == limited  # else open: unknown servers
        if limited:
            dns, agents, *extra = transfer["egress"]
            assert [p["port"] for p in agents["ports"]] == [values["agent"]["port"]]
            rules = len(egress["transfer"])
            assert extra[:rules] == egress["transfer"]
            assert extra[rules:] == [source_rule(s) for s in egress["sources"]]


def test_every_container_runs_a_command_line_our_commands_take(
    rendered: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each pod runs is what the commands parse: a flag typo in a template fails here,
    not in a cluster. (The pods have the control token in their environment; the TLS files
    are in their volumes: test_tls_reaches_every_hop.)"""
    from cube.security import TLSFiles
    from cube.server import main as server_main

    monkeypatch.setenv("CUBE_CONTROL_TOKEN", "from-the-secret")
    monkeypatch.setattr(server_main, "tls_files", lambda flags: TLSFiles())
    seen = set()
    for _doc, container in containers(rendered.docs):
        command = container.get("command", [""])[0]
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
        assert security["capabilities"] == {"drop": ["ALL"]}
        if command not in COMMANDS:  # a sidecar of the values
            assert container["name"] in {
                c["name"] for c in rendered.values["server"]["sidecars"]
            } | {c["name"] for c in rendered.values["transfer"]["sidecars"]}
            continue
        flags = COMMANDS[command].parse(container["args"])
        if command == "cube-server":
            check_flags(flags)
            server_main.fixed_ports(flags, server_main.worker_ports(flags))  # no overlap
            declared = {p["containerPort"] for p in container["ports"]}
            assert set(server_main.worker_ports(flags)) | set(server_main.lane_ports(flags)) <= (
                declared
            )
        seen.add(command)
    assert seen == set(COMMANDS)


def client_conf(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The data of the cube.conf ConfigMap (<fullname>-cube-conf)."""
    (found,) = [
        d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-cube-conf")
    ]
    data: dict[str, str] = found["data"]
    return data


def transfer_conf(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    """The transfer's parsed transfer.conf (its ConfigMap is named as its StatefulSet)."""
    name = transfer_set(docs)["metadata"]["name"]
    (found,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == name]
    return parse_config(found["data"]["transfer.conf"], "transfer.conf", tmp_path)


def test_rendered_configs_parse_and_name_the_replicas(rendered: Rendered, tmp_path: Path) -> None:
    docs, values = rendered.docs, rendered.values
    shards, replicas = values["dict"]["shards"], values["dict"]["replicas"]
    transfer_name = transfer_set(docs)["metadata"]["name"]
    cfg = transfer_conf(docs, tmp_path)
    conf = parse_conf(json.loads(client_conf(docs)["cube.conf"]))
    assert cfg.dict_name == conf.dict_name == values["dict"]["name"]
    assert cfg.shard_num == len(conf.shards) == shards and cfg.copy_num == replicas
    assert cfg.partitioner == conf.partitioner == values["dict"]["partitioner"]
    domain = f"{NAMESPACE}.svc.{values['clusterDomain']}"
    assert cfg.transfer_address == f"{transfer_name}.{domain}"
    assert cfg.donefile_address == values["transfer"]["donefile"]["address"]
    sets = shard_sets(docs)
    workers = values["server"]["workers"]
    for inst in cfg.instances:
        shard_name = sets[inst.shard]["metadata"]["name"]
        host = f"{shard_name}-{inst.replica}.{shard_name}.{domain}"
        assert inst.agent_address == f"{host}:{values['agent']['port']}"
        for worker in range(workers):  # each worker a replica of the shard for clients
            assert f"{host}:{values['server']['port'] + worker}" in conf.shards[inst.shard]
    assert len(cfg.instances) == shards * replicas
    assert all(len(replicas_) == replicas * workers for replicas_ in conf.shards)
    if rendered.name == "3x2-tokens":
        assert cfg.quorum == 1 and cfg.extra == {} and cfg.max_shrink == 0.3
    for config_map in of_kind(docs, "ConfigMap"):  # tokens reach pods from the Secret only
        assert "t0ken" not in json.dumps(config_map["data"])
    keys = [int(k) for k in client_conf(docs)["probe-keys.txt"].split()]
    assert keys == list(range(256))


def test_tokens_come_from_the_secret(rendered: Rendered) -> None:
    docs, values = rendered.docs, rendered.values
    secrets = of_kind(docs, "Secret")
    if values["auth"]["existingSecret"]:
        assert secrets == []
        secret_name = values["auth"]["existingSecret"]
    else:
        (secret,) = secrets
        assert set(secret["data"]) == {"agent-token", "api-token", "control-token"}
        secret_name = secret["metadata"]["name"]
    for _doc, container in containers(docs):
        for env in container.get("env", []):
            if env["name"].startswith("CUBE_") and env["name"].endswith("TOKEN"):
                assert set(env) == {"name", "valueFrom"}, env  # never a literal value
                assert env["valueFrom"]["secretKeyRef"]["name"] == secret_name


def test_values_schema_refuses_bad_values() -> None:
    for setting, complaint in (
        ("dict.shards=0", "dict.shards"),
        ("dict.replicas=0", "dict.replicas"),
        ("dict.partitioner=crc", "dict.partitioner"),
        ("agent.storage.type=hostPath", "agent.storage.type"),
        ("server.port=70000", "server.port"),
        ("dict.name=../etc", "dict.name"),
        ("dict.name=emb_", "dict.name"),  # no label value may end in '_', '-' or '.'
        ("dict.name=" + "e" * 129, "dict.name"),
        ("fullnameOverride=Cube_1", "fullnameOverride"),
        ("nameOverride=" + "n" * 64, "nameOverride"),
        ("podDisruptionBudget.maxUnavailable=0", "podDisruptionBudget.maxUnavailable"),
        ("server.readinessProbe.period=5", "server.readinessProbe"),
        ("tls.certManager.duration=90d", "tls.certManager.duration"),
        ("transfer.apiService.type=ExternalName", "transfer.apiService.type"),
        ("agent.storage.accessModes[0]=RWO", "agent.storage.accessModes"),
        ("nonsense=1", "nonsense"),
    ):
        done = helm("template", "t", str(CHART), "--set", setting)
        assert done.returncode != 0 and complaint in done.stderr, (setting, done.stderr)


def test_tls_needs_a_certificate() -> None:
    for settings, complaint in (
        (["tls.enabled=true"], "tls.existingSecret"),
        (["tls.enabled=true", "tls.existingSecret=a", "tls.certManager.enabled=true"], "not both"),
        (["tls.enabled=true", "tls.certManager.enabled=true"], "issuerRef.name"),
    ):
        args = [a for s in settings for a in ("--set", s)]
        done = helm("template", "t", str(CHART), *args)
        assert done.returncode != 0 and complaint in done.stderr, (settings, done.stderr)


def test_existing_secret_and_pvc_storage(tmp_path: Path) -> None:
    docs = objects(render("--set", "auth.existingSecret=mine", "--set", "agent.storage.type=pvc"))
    assert of_kind(docs, "Secret") == []
    shard = shard_sets(docs)[0]
    assert shard["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert all(v["name"] != "data" for v in shard["spec"]["template"]["spec"]["volumes"])
    for _doc, container in containers(docs):
        for env in container.get("env", []):
            assert env["valueFrom"]["secretKeyRef"]["name"] == "mine"


def rolling_checksums(*args: str) -> dict[str, dict[str, str]]:
    """The checksum annotations of each StatefulSet's pod template (component: shard or
    transfer): what makes a change roll its pods."""
    found: dict[str, dict[str, str]] = {}
    for doc in of_kind(objects(render(*args)), "StatefulSet"):
        annotations = doc["spec"]["template"]["metadata"].get("annotations") or {}
        sums = {k: v for k, v in annotations.items() if k.startswith("checksum/")}
        found[doc["metadata"]["name"]] = sums
    return found


def test_what_is_not_read_live_rolls_the_pods() -> None:
    """Issue 35 item 3: the processes read renewed certificates live, so the TLS Secret has
    no checksum (a renewed certificate rolls nothing); tokens reach them as environment
    variables, which a changed Secret does not update, so a pod-template checksum of the
    tokens a pod uses rolls the pods a token change concerns, and only those. Renders that
    change no token agree (the generated tokens are kept by upgrades: not hashed); the
    transfer's config and its object-store credentials roll the transfer."""
    base = rolling_checksums("--set", "dict.shards=2")
    assert rolling_checksums("--set", "dict.shards=2") == base  # random tokens: the same
    transfer, *shards = sorted(base, key=lambda name: not name.endswith("-transfer"))
    assert base[transfer].keys() == {"checksum/config", "checksum/tokens"}
    assert all(base[name].keys() == {"checksum/tokens"} for name in shards)
    with_tls = ("--set", "tls.enabled=true", "--set", "tls.existingSecret=cube-certs")
    tls = rolling_checksums("--set", "dict.shards=2", *with_tls)
    assert {name: sums.keys() for name, sums in tls.items()} == {
        name: sums.keys() for name, sums in base.items()
    }
    assert all(tls[name]["checksum/tokens"] == base[name]["checksum/tokens"] for name in base)
    for setting, rolled in (
        ("auth.agentToken=new", {transfer, *shards}),  # the agents' and the transfer's
        ("auth.apiToken=new", {transfer}),
        ("auth.controlToken=new", set(shards)),  # the servers' and their agents'
        ("auth.existingSecret=mine", {transfer, *shards}),
    ):
        after = rolling_checksums("--set", "dict.shards=2", "--set", setting)
        assert {name for name in base if after[name] != base[name]} == rolled, setting
        assert "new" not in json.dumps(after)
    store = rolling_checksums(
        "--set", "dict.shards=2", "--set", "transfer.objectStore.existingSecret=s3"
    )
    assert store[transfer].keys() == {"checksum/config", "checksum/tokens", "checksum/object-store"}
    assert all(store[name] == base[name] for name in shards)


# ---------------------------------------------------------------------------------------------
# TLS, object stores, every option


TLS_DIR = "/etc/cube-tls"


def test_tls_reaches_every_hop(renders: dict[str, Rendered], tmp_path: Path) -> None:
    """Issue 26 item 2: the certificate is mounted where each command's TLS flag or key names
    it (server, agent, transfer), cube.conf names the CA the `helm test` pod mounts, agents
    download from the transfer over https, and a cert-manager Certificate names every address
    clients and the transfer use."""
    for name in ("tls", "full"):
        docs, values = renders[name].docs, renders[name].values
        secret = values["tls"]["existingSecret"] or None
        seen = set()
        for doc, container in containers(docs):
            spec = pod_spec(doc)
            command = container.get("command", [""])[0]
            files: list[str] = []
            if command in ("cube-server", "cube-agent"):
                files = [arg(container, "tls_cert"), arg(container, "tls_key")]
            if command == "cube-agent":
                files.append(arg(container, "tls_ca"))
                assert arg(container, "allowed_sources").startswith("https://")
            if command == "cube-transfer":
                conf_map = next(v for v in spec["volumes"] if v["name"] == "config")
                cfg = transfer_conf(docs, tmp_path)
                files = [cfg.tls_cert, cfg.tls_key, cfg.agent_tls_ca]
                assert conf_map["configMap"]["name"] == doc["metadata"]["name"]
            if command == "cube-cli":
                conf = parse_conf(json.loads(client_conf(docs)["cube.conf"]))
                assert conf.tls_ca == f"{TLS_DIR}/ca.crt"
                files = [conf.tls_ca]
            for path in files:
                volume, key = mounted_file(spec, container, path)
                assert key in ("tls.crt", "tls.key", "ca.crt")
                secret = secret or volume["secret"]["secretName"]
                assert volume["secret"]["secretName"] == secret
                if command == "cube-cli":  # the test pod gets the CA, never the key
                    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
            if files:
                seen.add(command)
        assert seen == set(COMMANDS)
        if values["tls"]["certManager"]["enabled"]:
            (certificate,) = of_kind(docs, "Certificate")
            assert certificate["apiVersion"] == "cert-manager.io/v1"
            assert certificate["spec"]["secretName"] == secret
            assert certificate["spec"]["issuerRef"] == values["tls"]["certManager"]["issuerRef"]
            names = certificate["spec"]["dnsNames"]
            conf = parse_conf(json.loads(client_conf(docs)["cube.conf"]))
            hosts = [a.rsplit(":", 1)[0] for replicas in conf.shards for a in replicas]
            cfg = transfer_conf(docs, tmp_path)
            hosts.append(cfg.transfer_address)
            for host in hosts:  # a wildcard stands for one label, as TLS clients check it
                assert any(
                    fnmatch.fnmatch(host, n) and host.count(".") == n.count(".") for n in names
                ), host
        else:
            assert of_kind(docs, "Certificate") == []


def test_object_store_credentials_reach_the_transfer_only(
    renders: dict[str, Rendered], tmp_path: Path
) -> None:
    """Issue 26 item 3: an S3 donefile's credentials from a Secret of the operator's (or a
    role through the transfer's own service account), as the AWS_* environment botocore
    reads; the shard pods get neither."""
    docs, values = renders["s3"].docs, renders["s3"].values
    store = values["transfer"]["objectStore"]
    transfer = transfer_set(docs)
    spec = pod_spec(transfer)
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["AWS_ENDPOINT_URL"] == store["endpointUrl"]
    assert env["AWS_DEFAULT_REGION"] == store["region"]
    assert container["envFrom"] == [{"secretRef": {"name": store["existingSecret"]}}]
    accounts = named(docs, "ServiceAccount")
    account = accounts[spec["serviceAccountName"]]
    assert account["metadata"]["annotations"] == values["transfer"]["serviceAccount"]["annotations"]
    assert account["automountServiceAccountToken"] is False and not spec[
        "automountServiceAccountToken"]  # fmt: skip
    for shard in shard_sets(docs):
        shard_spec = pod_spec(shard)
        assert shard_spec["serviceAccountName"] != spec["serviceAccountName"]
        assert "annotations" not in accounts[shard_spec["serviceAccountName"]]["metadata"]
        for shard_container in shard_spec["containers"]:
            assert "envFrom" not in shard_container
            assert not any(e["name"].startswith("AWS_") for e in shard_container["env"])
    cfg = transfer_conf(docs, tmp_path)
    assert cfg.donefile_address == values["transfer"]["donefile"]["address"]


def leaves(schema: dict[str, Any], root: dict[str, Any], path: str = "") -> Iterator[str]:
    """The value paths the schema describes: where it stops listing properties (a probe's
    timing fields are one value, the probe's)."""
    if schema.get("$ref") == "#/definitions/probeTiming":
        yield path
        return
    if "$ref" in schema:
        schema = root["definitions"][schema["$ref"].rsplit("/", 1)[1]]
    if "properties" in schema and schema.get("additionalProperties") is False:
        for key, sub in schema["properties"].items():
            yield from leaves(sub, root, f"{path}.{key}" if path else key)
    else:
        yield path


def value_at(values: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        values = values[part]
    return values


def schema_leaves() -> list[str]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    return list(leaves(schema, schema))


def test_every_value_is_in_the_schema_and_the_deploy_table() -> None:
    """values.yaml sets nothing the schema does not describe (else helm lint fails) and the
    schema describes nothing values.yaml lacks; docs/DEPLOY.md's table names each value."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    paths = schema_leaves()
    for path in paths:
        value_at(defaults, path)  # KeyError: a value of the schema with no default
    table = (REPO / "docs" / "DEPLOY.md").read_text()
    missing = [path for path in paths if f"`{path}`" not in table]
    assert not missing, f"docs/DEPLOY.md's table of values lacks {missing}"


# Values the full configuration leaves at their defaults, and why (their effect is asserted
# elsewhere): the TLS switches need each other, and it uses a token Secret of its own.
SWITCHES = {"tls.enabled", "tls.existingSecret", "tls.certManager.enabled"}
TOKENS = {"auth.agentToken", "auth.apiToken", "auth.controlToken"}
# Values that take effect with another one set (in both renders compared), by path prefix:
# more workers need ports apart from the default agent port (8001); claim settings need
# claims; a mount path a volume; a Service, a monitor or a rule to be asked for.
COMPANIONS: dict[str, dict[str, Any]] = {  # values as --set-json takes them
    "server.workers": {"agent.port": 8500},
    "agent.storage.": {"agent.storage.type": "pvc"},
    "transfer.donefile.mountPath": {"transfer.donefile.volume": {"emptyDir": {}}},
    "transfer.apiService.": {"transfer.apiService.enabled": True},
    "metrics.serviceMonitor.": {"metrics.serviceMonitor.enabled": True},
    "metrics.prometheusRule.": {"metrics.prometheusRule.enabled": True},
    # TLS values other than the switches: over TLS from cert-manager
    "tls.": {"tls.enabled": True, "tls.certManager.enabled": True,
             "tls.certManager.issuerRef": {"name": "ca"}},
}  # fmt: skip


def set_json(settings: dict[str, Any]) -> tuple[str, ...]:
    return tuple(a for k, v in settings.items() for a in ("--set-json", f"{k}={json.dumps(v)}"))


def test_every_value_changes_what_is_rendered() -> None:
    """No value is read by no template: each value, set alone over the defaults to what the
    full configuration gives it (a switch it keeps on: off), renders something else than the
    defaults (with fixed tokens: random ones would differ anyway; with its COMPANIONS). Renders
    run 4 at a time."""
    from concurrent.futures import ThreadPoolExecutor

    full = CONFIGS["full"].values()
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    fixed = {"auth.agentToken": "a", "auth.apiToken": "b", "auth.controlToken": "c"}
    cases = []  # (path, the render without it, the render with it)
    for path in schema_leaves():
        if path in SWITCHES or path in TOKENS:
            continue
        given, default = value_at(full, path), value_at(defaults, path)
        if given == default and isinstance(default, bool):
            given = not default  # a switch the full configuration needs on: try it off
        assert given != default, f"ci/full-values.yaml leaves {path} as it is"
        companions = {k: v for prefix, c in COMPANIONS.items() if path.startswith(prefix)
                      for k, v in c.items() if k != path}  # fmt: skip
        base = (*OPERATOR_APIS, *set_json({**fixed, **companions}))
        cases.append((path, base, (*base, *set_json({path: given}))))
    bases = sorted({base for _, base, _ in cases})
    with ThreadPoolExecutor(4) as pool:
        baselines = dict(zip(bases, pool.map(lambda b: render(*b), bases), strict=True))
        changed = list(pool.map(lambda c: render(*c[2]), cases))
    quiet = [
        path
        for (path, base, _), text in zip(cases, changed, strict=True)
        if text == baselines[base]
    ]
    assert not quiet, f"values no template reads: {quiet}"


# ---------------------------------------------------------------------------------------------
# upgrades


IMMUTABLE = ("selector", "serviceName", "podManagementPolicy", "volumeClaimTemplates")


def test_an_upgrade_from_the_previous_chart_changes_nothing_kubernetes_keeps(
    tmp_path: Path,
) -> None:
    """Issue 26 item 6: `helm upgrade` from the previous chart (0.1.0) with the same values
    would be refused by the API server if a StatefulSet's immutable fields changed
    (selector, serviceName, podManagementPolicy, claim templates) or a Service's clusterIP:
    they are the same, as are the names of every object that holds state (tests/
    test_multihost.py then runs such an upgrade under load)."""
    for args in ((), ("--values", str(SECOND)), ("--set", "agent.storage.type=pvc")):
        before = objects(render(*args, chart=PREVIOUS_CHART))
        after = objects(render(*args))
        old_sets, new_sets = named(before, "StatefulSet"), named(after, "StatefulSet")
        assert old_sets.keys() == new_sets.keys()
        for name, old in old_sets.items():
            for field in IMMUTABLE:
                assert old["spec"].get(field) == new_sets[name]["spec"].get(field), (name, field)
        old_services, new_services = named(before, "Service"), named(after, "Service")
        assert old_services.keys() <= new_services.keys()
        for name, old in old_services.items():
            assert old["spec"]["clusterIP"] == new_services[name]["spec"]["clusterIP"]
        for kind in ("Secret", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"):
            added = {f"{fullname(*args)}-transfer"} if kind == "PodDisruptionBudget" else set()
            assert named(before, kind).keys() | added == named(after, kind).keys(), kind
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["version"] != "0.1.0"


# ---------------------------------------------------------------------------------------------
# what the chart offers besides


def test_prometheus_rule_is_the_alerts_file() -> None:
    """One source of truth: the chart's copy is deploy/prometheus/alerts.yml (Helm reads only
    files inside the chart), and the PrometheusRule holds its groups."""
    source = REPO / "deploy" / "prometheus" / "alerts.yml"
    assert (CHART / "files" / "alerts.yml").read_bytes() == source.read_bytes(), (
        "cp deploy/prometheus/alerts.yml deploy/helm/cube/files/alerts.yml"
    )
    assert (
        of_kind(objects(render("--set", "metrics.prometheusRule.enabled=true")), "PrometheusRule")
        == []
    )  # fmt: skip  (no Prometheus Operator API: none)
    docs = objects(render("--set", "metrics.prometheusRule.enabled=true", *OPERATOR_APIS))
    (rule,) = of_kind(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(source.read_text())


def test_icon_is_the_charts_svg() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    prefix = "data:image/svg+xml;base64,"
    assert chart["icon"].startswith(prefix)
    assert base64.b64decode(chart["icon"].removeprefix(prefix)) == (CHART / "icon.svg").read_bytes()


def notes(tmp_path: Path, *args: str) -> str:
    """NOTES.txt as `helm install` prints it (`helm template` skips it: a copy of the chart
    renders it into a ConfigMap)."""
    chart = tmp_path / "cube"
    shutil.copytree(CHART, chart)
    text = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "notes" }}' + text + "{{- end }}")
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include "notes" . | toJson }}}\n'
    )
    docs = objects(render(*args, "--show-only", "templates/notes.yaml", chart=chart))
    notes: str = docs[0]["data"]["notes"]
    return notes


def test_notes_say_how_to_reach_publish_and_watch(tmp_path: Path) -> None:
    text = notes(tmp_path)
    for expected in ("base.txt", "/donefile", "t-cube-cube-conf", "CubeClient.from_conf",
                     "port-forward svc/t-cube-transfer 8099", "t-cube-tokens", "helm test t",
                     "http://127.0.0.1:8099/", "cannot change with `helm upgrade`"):  # fmt: skip
        assert expected in text, expected
    text = notes(tmp_path / "tls", "--values", str(CI / "tls-values.yaml"))
    assert "https://127.0.0.1:8099/" in text and "/etc/cube-tls/ca.crt" in text


def test_notes_say_who_may_connect_and_how_to_admit_other_namespaces(tmp_path: Path) -> None:
    """Issue 35 item 2: NOTES.txt says whom the NetworkPolicies admit and shows the common
    cases (clients in another namespace with a copy of cube.conf, Prometheus in
    `monitoring`, the transfer's egress)."""
    text = notes(tmp_path)
    for expected in ("lookups (ports 8000, 8100): any pod of ml", "metrics: any pod of ml",
                     "kubernetes.io/metadata.name: serving", "--from-file=cube.conf",
                     "kubernetes.io/metadata.name: monitoring",
                     "The transfer's egress is open", "agents on 9101",
                     "the transfer on 9100"):  # fmt: skip
        assert expected in text, expected
    text = notes(tmp_path / "x", "--values", str(CI / "cross-namespace-values.yaml"),
                 *OPERATOR_APIS)  # fmt: skip
    for expected in ("no pod of ml but the helm test's, and the 2 peer(s) of networkPolicy.clients",
                     "metrics: no pod of ml, and networkPolicy.prometheus",
                     "ServiceMonitors t-cube-shard-* and t-cube-transfer",
                     "the chart's README, \"Alerts\""):  # fmt: skip
        assert expected in text, expected
    assert "egress is open" not in text


def test_dockerfile_lints_and_pins_the_project_version() -> None:
    dockerfile = REPO / "deploy" / "docker" / "Dockerfile"
    for path in (dockerfile, REPO / "examples" / "ctr" / "k8s" / "Dockerfile"):
        done = subprocess.run(
            [str(VENV_BIN / "hadolint"), str(path)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{path}: {done.stdout}{done.stderr}"
    text = dockerfile.read_text()
    version = next(
        line.split('"')[1]
        for line in (REPO / "pyproject.toml").read_text().splitlines()
        if line.startswith("version = ")
    )
    assert f"ARG CUBE_VERSION={version}" in text
    assert "USER 10001" in text and ":latest" not in text
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version


def scraped(docs: list[dict[str, Any]]) -> dict[str, set[int]]:
    """command -> the container ports a Prometheus scrapes through the ServiceMonitors: each
    endpoint's Service port, its targetPort by name in the containers of the pods the Service
    selects (asserted to be there)."""
    services = named(docs, "Service")
    pods = [d for d in of_kind(docs, "StatefulSet")]
    found: dict[str, set[int]] = {}
    for monitor in of_kind(docs, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services.values()
                      if selector.items() <= s["metadata"]["labels"].items()]  # fmt: skip
        chosen = [p for p in pods if service["spec"]["selector"].items()
                  <= p["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
        assert chosen, monitor["metadata"]["name"]
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            target = ports[endpoint["port"]]["targetPort"]
            assert endpoint["path"] == "/metrics"
            for workload in chosen:
                (container,) = [c for c in pod_spec(workload)["containers"]
                                if target in {p["name"] for p in c.get("ports", [])}]  # fmt: skip
                port = next(p["containerPort"] for p in container["ports"] if p["name"] == target)
                found.setdefault(container["command"][0], set()).add(port)
    return found


def test_every_process_exports_metrics_where_monitors_and_policies_look() -> None:
    """Issue 35 item 1: the server, the agent beside it and the transfer each serve /metrics
    (--metrics_port on every interface), declare the port, and are scraped: by the
    ServiceMonitors (a shard's: servers and agents; the transfer's), by annotations (the
    server's and the transfer's pods: one port a pod), through the NetworkPolicies."""
    docs = objects(render())
    assert of_kind(docs, "ServiceMonitor") == []  # no Prometheus Operator API: none
    policies = named(docs, "NetworkPolicy")
    open_ports = {
        name.rsplit("-", 1)[1]: {p["port"] for rule in policy["spec"]["ingress"]
                                 for p in rule["ports"]}
        for name, policy in policies.items()
    }  # fmt: skip
    ports = {"cube-server": 9100, "cube-agent": 9101, "cube-transfer": 9100}
    for doc, container in containers(docs):
        command = container.get("command", [""])[0]
        if command not in ports:
            continue
        declared = {p["containerPort"]: p["name"] for p in container["ports"]}
        port = int(arg(container, "metrics_port"))
        assert port == ports[command] and port in declared, command
        assert arg(container, "metrics_host") == "0.0.0.0"
        assert port in open_ports["transfer" if command == "cube-transfer" else "shards"]
        if command != "cube-agent":
            annotations = doc["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(port), command
    args = ("--set", "metrics.serviceMonitor.enabled=true",
            "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")  # fmt: skip
    docs = objects(render(*args))
    assert len(of_kind(docs, "ServiceMonitor")) == 3  # two shards, the transfer
    assert scraped(docs) == {command: {port} for command, port in ports.items()}
    moved = objects(render(*args, "--set", "agent.metricsPort=9500",
                           "--set", "transfer.metricsPort=9600"))  # fmt: skip
    assert scraped(moved) == {"cube-server": {9100}, "cube-agent": {9500}, "cube-transfer": {9600}}
    with pytest.raises(AssertionError, match=r"agent\.metricsPort 8001 is another port"):
        render("--set", "agent.metricsPort=8001")


def test_ctr_example_runs_its_predictor_beside_the_chart(tmp_path: Path) -> None:
    """examples/ctr/k8s: the chart with the example's values and the predictor's manifest
    validate, and fit together: the ConfigMap it mounts exists, the NetworkPolicy admits its
    pods to the lookup ports, its flags parse and name the chart's dictionary, and the trainer's
    volume is mounted at the same path in the transfer and the predictor."""
    from examples.ctr.predictor import flag_set as predictor_flags

    example = REPO / "examples" / "ctr" / "k8s"
    values = yaml.safe_load((example / "values.yaml").read_text())
    chart_text = helm("template", "ctr", str(CHART), "--namespace", NAMESPACE, "--values",
                      str(example / "values.yaml"))  # fmt: skip
    assert chart_text.returncode == 0, chart_text.stderr
    manifest = (example / "predictor.yaml").read_text()
    combined = tmp_path / "ctr.yaml"
    combined.write_text(chart_text.stdout + "\n---\n" + manifest)
    done = subprocess.run(
        [str(VENV_BIN / "kubernetes-validate"), "--strict", "-k", "1.30.0", str(combined)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    docs, mine = objects(chart_text.stdout), objects(manifest)
    deployment = of_kind(mine, "Deployment")[0]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    maps = {d["metadata"]["name"]: d["data"] for d in of_kind(docs, "ConfigMap")}
    conf_map = next(v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v)
    conf = parse_conf(json.loads(maps[conf_map]["cube.conf"]))
    flags = predictor_flags().parse(container["args"])
    assert flags.dict_name == conf.dict_name == values["dict"]["name"]
    policy = of_kind(docs, "NetworkPolicy")
    admitted = [
        rule for p in policy for rule in p["spec"].get("ingress", [])
        if any(src.get("podSelector", {}).get("matchLabels", {}).items()
               <= pod["metadata"]["labels"].items() for src in rule["from"])
        and {port["port"] for port in rule["ports"]} == {8000, 8100}
    ]  # fmt: skip
    assert admitted, "the NetworkPolicy does not let the predictor reach the lookup ports"
    transfer = next(d for d in of_kind(docs, "StatefulSet") if d["metadata"]["name"].endswith(
        "transfer"))  # fmt: skip
    claim = values["transfer"]["donefile"]["volume"]["persistentVolumeClaim"]["claimName"]
    claims = {v["name"]: v.get("persistentVolumeClaim", {}) for v in pod["spec"]["volumes"]}
    model_volume = next(name for name, source in claims.items() if source.get("claimName") == claim)
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == model_volume)
    transfer_mounts = [m["mountPath"] for c in transfer["spec"]["template"]["spec"]["containers"]
                       for m in c.get("volumeMounts", []) if m["name"] == "donefile"]  # fmt: skip
    assert transfer_mounts == [mount] and flags.model_dir.startswith(mount + "/")
    assert values["transfer"]["donefile"]["address"].startswith(mount + "/")
    service = of_kind(mine, "Service")[0]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


# ---------------------------------------------------------------------------------------------
# who may connect (issue 35 item 2) and the alerts' knobs (item 1)


def source_rule(source: dict[str, Any]) -> dict[str, Any]:
    """The egress rule a networkPolicy.egress.sources entry stands for."""
    if "cidr" in source:
        peer: dict[str, Any] = {"ipBlock": {"cidr": source["cidr"]}}
        if source.get("except"):
            peer["ipBlock"]["except"] = source["except"]
    else:
        peer = {k: source[k] for k in ("namespaceSelector", "podSelector") if k in source}
    return {"to": [peer], "ports": [{"protocol": "TCP", "port": p} for p in source["ports"]]}


def ingress_by_port(docs: list[dict[str, Any]], policy: str) -> dict[int, list[dict[str, Any]]]:
    """port -> the peers the policy `<fullname>-<policy>` admits to it."""
    spec = named(docs, "NetworkPolicy")[f"t-cube-{policy}"]["spec"]
    peers: dict[int, list[dict[str, Any]]] = {}
    for rule in spec["ingress"]:
        for port in rule["ports"]:
            peers.setdefault(port["port"], []).extend(rule["from"])
    return peers


SERVING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "serving"}},
           "podSelector": {"matchLabels": {"app": "predictor"}}}  # fmt: skip
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}  # fmt: skip
HELM_TEST = {"podSelector": {"matchLabels": {
    "app.kubernetes.io/name": "cube", "app.kubernetes.io/instance": "t",
    "app.kubernetes.io/component": "client"}}}  # fmt: skip


def test_network_policies_admit_clients_and_prometheus_of_other_namespaces() -> None:
    """Each case of the values, rendered, admits exactly whom it says: by default any pod of
    the release's namespace (lookups and every metrics port); `clients` and `prometheus` add
    peers of other namespaces (a namespaceSelector and a podSelector in one peer: both must
    match); null selectors leave the namespace's pods out (the `helm test` pod always may look
    up); `extraIngress` adds whole rules."""
    anyone: dict[str, Any] = {"podSelector": {}}
    docs = objects(render())
    shards, transfer = ingress_by_port(docs, "shards"), ingress_by_port(docs, "transfer")
    assert shards[8000] == shards[8100] == [anyone, HELM_TEST]
    assert shards[9100] == shards[9101] == transfer[9100] == [anyone]
    given = {"networkPolicy.clients": [SERVING], "networkPolicy.prometheus": MONITORING}
    docs = objects(render(*set_json(given)))
    shards, transfer = ingress_by_port(docs, "shards"), ingress_by_port(docs, "transfer")
    assert shards[8000] == shards[8100] == [anyone, SERVING, HELM_TEST]
    assert shards[9100] == shards[9101] == transfer[9100] == [anyone, MONITORING]
    only = {**given, "networkPolicy.clientPodSelector": None, "metrics.scraperPodSelector": None}
    docs = objects(render(*set_json(only)))
    shards, transfer = ingress_by_port(docs, "shards"), ingress_by_port(docs, "transfer")
    assert shards[8000] == [SERVING, HELM_TEST]
    assert shards[9100] == shards[9101] == transfer[9100] == [MONITORING]
    assert transfer[8099] == [anyone]  # the API: networkPolicy.apiPodSelector, as before
    nobody = {"metrics.scraperPodSelector": None}  # no scraper at all: no metrics rule
    shards = ingress_by_port(objects(render(*set_json(nobody))), "shards")
    assert 9100 not in shards and 9101 not in shards
    to_port = [{"protocol": "TCP", "port": 8000}]
    extra = {
        "networkPolicy.extraIngress.shards": [
            {"from": [{"ipBlock": {"cidr": "10.1.0.0/16"}}], "ports": to_port}
        ],
        "networkPolicy.extraIngress.transfer": [
            {"from": [MONITORING], "ports": [{"protocol": "TCP", "port": 8099}]}
        ],
    }
    docs = objects(render(*set_json(extra)))
    shards, transfer = ingress_by_port(docs, "shards"), ingress_by_port(docs, "transfer")
    assert {"ipBlock": {"cidr": "10.1.0.0/16"}} in shards[8000] and MONITORING in transfer[8099]
    done = helm("template", "t", str(CHART), "--set-json", 'networkPolicy.prometheus={"port": 1}')
    assert done.returncode != 0 and "networkPolicy.prometheus" in done.stderr


def test_egress_to_object_stores_and_webhdfs_by_address() -> None:
    """`networkPolicy.egress.sources` limits the transfer's egress to the addresses it reads
    donefiles and inputs from: a CIDR (with exceptions) and its ports, or the pods of a
    namespace; a source with both, or without ports, is refused."""
    sources: list[dict[str, Any]] = [
        {"cidr": "10.20.0.0/16", "except": ["10.20.9.0/24"], "ports": [443]},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "hadoop"}},
         "ports": [9870, 9864]},
    ]  # fmt: skip
    docs = objects(render(*set_json({"networkPolicy.egress.sources": sources})))
    spec = named(docs, "NetworkPolicy")["t-cube-transfer"]["spec"]
    assert "Egress" in spec["policyTypes"]
    assert spec["egress"][2:] == [source_rule(s) for s in sources]
    assert spec["egress"][2]["to"] == [
        {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.9.0/24"]}}
    ]
    off = objects(render(*set_json({"networkPolicy.egress.sources": sources,
                                    "networkPolicy.egress.enabled": False})))  # fmt: skip
    assert "Egress" not in named(off, "NetworkPolicy")["t-cube-transfer"]["spec"]["policyTypes"]
    for bad, complaint in (
        ({"cidr": "10.0.0.0/8", "podSelector": {}, "ports": [1]}, "a cidr and selectors"),
        ({"cidr": "10.0.0.0/8"}, "ports"),
        ({"ports": [443]}, "networkPolicy.egress.sources"),
        ({"cidr": "somewhere", "ports": [443]}, "cidr"),
    ):
        done = helm("template", "t", str(CHART), *set_json({"networkPolicy.egress.sources": [bad]}))
        assert done.returncode != 0 and complaint in done.stderr, (bad, done.stderr)


def rendered_rules(*args: str) -> dict[str, dict[str, Any]]:
    """alert name -> its rule in the rendered PrometheusRule."""
    docs = objects(render("--set", "metrics.prometheusRule.enabled=true", *OPERATOR_APIS, *args))
    (rule,) = of_kind(docs, "PrometheusRule")
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def test_each_alert_takes_its_for_threshold_and_labels_from_the_values() -> None:
    """Issue 35 item 1: `metrics.prometheusRule.alerts.<name>` sets an alert's `for`, its
    threshold (the number its expr ends with), its window (every [range] of its expr), more
    labels, or leaves it out; the rest stay
    as alerts.yml has them (one source). The schema names exactly the file's alerts."""
    source = yaml.safe_load((CHART / "files" / "alerts.yml").read_text())
    original = {r["alert"]: r for group in source["groups"] for r in group["rules"]}
    schema = json.loads((CHART / "values.schema.json").read_text())
    alerts = schema["properties"]["metrics"]["properties"]["prometheusRule"]["properties"]
    assert alerts["alerts"]["propertyNames"]["enum"] == list(original)
    overrides = {
        "CubeLookupP99High": {"for": "1m", "threshold": 0.002, "labels": {"severity": "page"}},
        "CubeNoNewVersion": {"threshold": 43200},
        "CubeAgentDiskFull": {"threshold": 0.25},
        "CubeReplicaNotServing": {"for": "30s"},
        "CubeRolloutStuck": {"enabled": False},
        "CubeVersionAbandoned": {"window": "20s"},
    }
    rules = rendered_rules(*set_json({"metrics.prometheusRule.alerts": overrides}))
    assert rules["CubeLookupP99High"]["for"] == "1m"
    assert rules["CubeLookupP99High"]["expr"].endswith(") > 0.002")
    assert rules["CubeLookupP99High"]["labels"] == {"severity": "page"}
    assert rules["CubeNoNewVersion"]["expr"] == (
        "time() - (cube_transfer_live_since_timestamp_seconds > 0) > 43200"
    )
    assert rules["CubeNoNewVersion"]["for"] == original["CubeNoNewVersion"]["for"]
    assert rules["CubeAgentDiskFull"]["expr"].endswith(" < 0.25")
    assert rules["CubeReplicaNotServing"]["for"] == "30s"
    assert "CubeRolloutStuck" not in rules
    assert rules["CubeVersionAbandoned"]["expr"] == original["CubeVersionAbandoned"][
        "expr"
    ].replace("[15m]", "[20s]")
    untouched = set(original) - set(overrides)
    assert {name: rules[name] for name in untouched} == {name: original[name] for name in untouched}
    for settings, complaint in (
        ({"CubeReplicaBehind": {"threshold": 2}}, "this alert has none"),
        ({"CubeReplicaNotServing": {"window": "20s"}}, "has no [range]"),
        ({"CubeLookupErrors": {"window": "a while"}}, "window"),
        ({"CubeNope": {"for": "1m"}}, "CubeNope"),
        ({"CubeLookupErrors": {"for": "soon"}}, "for"),
        ({"CubeLookupErrors": {"threshold": "1"}}, "threshold"),
    ):
        done = helm("template", "t", str(CHART), *OPERATOR_APIS,
                    *set_json({"metrics.prometheusRule.enabled": True,
                               "metrics.prometheusRule.alerts": settings}))  # fmt: skip
        assert done.returncode != 0 and complaint in done.stderr, (settings, done.stderr)
