"""The Helm chart (deploy/helm/cube) and the image (deploy/docker/Dockerfile), offline: helm
lint, renders of two configurations validated against the Kubernetes schemas
(kubernetes-validate) and a policy linter (checkov), hadolint on the Dockerfile, and asserts on
what the API server would not catch: selectors that miss the pods, a PDB with both bounds,
ports the NetworkPolicy forgets, flags the commands do not take, configs our parsers refuse.

The tools come from `make tools` (.tools/); without them these tests are skipped, saying so.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cube.agent.main import flag_set as agent_flags
from cube.client import cli as cube_cli
from cube.client.conf import parse_conf
from cube.server.main import FLAGS as SERVER_FLAGS
from cube.server.main import check_flags
from cube.transfer.config import parse_config
from cube.transfer.main import flag_set as transfer_flags

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "cube"
TOOLS = REPO / ".tools"
HELM = TOOLS / "bin" / "helm"
VENV_BIN = TOOLS / "venv" / "bin"
NAMESPACE = "ml"
SECOND = CHART / "ci" / "3x2-tokens-values.yaml"

pytestmark = pytest.mark.skipif(
    not (HELM.exists() and (VENV_BIN / "checkov").exists()),
    reason="helm, kubernetes-validate, checkov and hadolint come from `make tools` (.tools/)",
)

COMMANDS = {
    "cube-server": SERVER_FLAGS,
    "cube-agent": agent_flags(),
    "cube-transfer": transfer_flags(),
    "cube-cli": cube_cli.FLAGS,
}


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def render(*args: str) -> str:
    done = helm("template", "t", str(CHART), "--namespace", NAMESPACE, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def objects(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict, dict]]:
    """(object, container) of every workload."""
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Pod"):
            spec = doc["spec"]["template"]["spec"] if doc["kind"] == "StatefulSet" else doc["spec"]
            for container in spec["containers"]:
                yield doc, container


def arg(container: dict, flag: str) -> str:
    prefix = f"--{flag}="
    return next(a.removeprefix(prefix) for a in container["args"] if a.startswith(prefix))


CONFIGS = {"default": (), "3x2-tokens": ("--values", str(SECOND))}


@pytest.fixture(scope="module", params=list(CONFIGS))
def rendered(request, tmp_path_factory) -> tuple[str, list[dict[str, Any]], Path]:
    text = render(*CONFIGS[request.param])
    path = tmp_path_factory.mktemp("rendered") / f"{request.param}.yaml"
    path.write_text(text)
    return request.param, objects(text), path


def test_lint_strict():
    for values in ((), ("--values", str(SECOND))):
        done = helm("lint", "--strict", str(CHART), *values)
        assert done.returncode == 0, done.stdout + done.stderr


def test_objects_validate_against_the_kubernetes_schemas(rendered):
    _name, _docs, path = rendered
    for version in ("1.27.0", "1.30.0"):
        done = subprocess.run(
            [str(VENV_BIN / "kubernetes-validate"), "--strict", "-k", version, str(path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr


def test_policy_linter_finds_nothing_unexplained(rendered):
    _name, _docs, path = rendered
    done = subprocess.run(
        [str(VENV_BIN / "checkov"), "--skip-download", "--quiet", "--compact",
         "--framework", "kubernetes", "--config-file", str(CHART / ".checkov.yaml"),
         "-f", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_one_statefulset_headless_service_and_pdb_per_shard(rendered):
    name, docs, _path = rendered
    shards = 3 if name == "3x2-tokens" else 2
    replicas = 2
    sets = {d["metadata"]["name"]: d for d in of_kind(docs, "StatefulSet")}
    services = {d["metadata"]["name"]: d for d in of_kind(docs, "Service")}
    budgets = {d["metadata"]["name"]: d for d in of_kind(docs, "PodDisruptionBudget")}
    for shard in range(shards):
        shard_name = f"t-cube-shard-{shard}"
        workload, service, budget = sets[shard_name], services[shard_name], budgets[shard_name]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["replicas"] == replicas
        assert workload["spec"]["serviceName"] == shard_name
        choosers = (
            workload["spec"]["selector"]["matchLabels"],
            service["spec"]["selector"],
            budget["spec"]["selector"]["matchLabels"],
        )
        for chooser in choosers:
            assert chooser.items() <= labels.items(), (chooser, labels)  # selects the pods
            assert chooser["cube.shard"] == str(shard)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True  # agents of unready pods
        assert budget["spec"] == {"maxUnavailable": 1, "selector": budget["spec"]["selector"]}
        affinity = workload["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        hard = "requiredDuringSchedulingIgnoredDuringExecution" in affinity
        assert hard == (name == "3x2-tokens")
    assert len(of_kind(docs, "StatefulSet")) == shards + 1  # and the transfer
    for doc in docs:
        assert doc["metadata"]["namespace"] == NAMESPACE


def test_probes_ports_and_network_policy(rendered):
    _name, docs, _path = rendered
    policies = {d["metadata"]["name"]: d for d in of_kind(docs, "NetworkPolicy")}
    shard_policy = policies["t-cube-shards"]["spec"]["ingress"]
    open_ports = {p["port"] for rule in shard_policy for p in rule["ports"]}
    for doc, container in containers(docs):
        if container["name"] != "cube-server":
            continue
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(arg(container, "port")) == declared["grpc"]
        assert int(arg(container, "tcp_ports")) == declared["lane"]  # the lane port is pinned
        assert {declared["grpc"], declared["lane"]} <= open_ports
        assert arg(container, "control_host") == "127.0.0.1"  # control stays in the pod
        assert int(arg(container, "control_port")) not in open_ports
        ready = container["readinessProbe"]["grpc"]
        assert ready == {"port": declared["grpc"], "service": "cube.v1.CubeService"}
        assert "tcpSocket" in container["startupProbe"]
        assert "tcpSocket" in container["livenessProbe"]
        grace = float(arg(container, "grace"))
        assert doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace
    agent_rule = next(r for r in shard_policy if {p["port"] for p in r["ports"]} == {8001})
    assert agent_rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "transfer"
    )


def test_every_container_runs_a_command_line_our_commands_take(rendered):
    """What each pod runs is what the commands parse: a flag typo in a template fails here,
    not in a cluster."""
    _name, docs, _path = rendered
    seen = set()
    for _doc, container in containers(docs):
        (command,) = container["command"]
        flags = COMMANDS[command].parse(container["args"])
        if command == "cube-server":
            check_flags(flags)
        seen.add(command)
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
        assert security["capabilities"] == {"drop": ["ALL"]}
    assert seen == set(COMMANDS)


def test_rendered_configs_parse_and_name_the_replicas(rendered, tmp_path):
    name, docs, _path = rendered
    shards, dict_name = (3, "ctr_embeddings") if name == "3x2-tokens" else (2, "embeddings")
    maps = {d["metadata"]["name"]: d["data"] for d in of_kind(docs, "ConfigMap")}
    cfg = parse_config(maps["t-cube-transfer"]["transfer.conf"], "transfer.conf", tmp_path)
    assert cfg.dict_name == dict_name and cfg.shard_num == shards and cfg.copy_num == 2
    assert cfg.transfer_address == f"t-cube-transfer.{NAMESPACE}.svc.cluster.local"
    conf = parse_conf(json.loads(maps["t-cube-cube-conf"]["cube.conf"]))
    assert conf.dict_name == dict_name and len(conf.shards) == shards
    for inst in cfg.instances:
        host = f"t-cube-shard-{inst.shard}-{inst.replica}.t-cube-shard-{inst.shard}"
        assert inst.agent_address == f"{host}.{NAMESPACE}.svc.cluster.local:8001"
        assert f"{host}.{NAMESPACE}.svc.cluster.local:8000" in conf.shards[inst.shard]
    if name == "3x2-tokens":
        assert cfg.partitioner == conf.partitioner == "murmur3" and cfg.quorum == 1
        assert cfg.extra == {} and cfg.max_shrink == 0.3
    for text in maps.values():  # tokens reach pods from the Secret only
        assert "t0ken" not in json.dumps(text)
    keys = [int(k) for k in maps["t-cube-cube-conf"]["probe-keys.txt"].split()]
    assert keys == list(range(256))


def test_tokens_come_from_the_secret(rendered):
    _name, docs, _path = rendered
    (secret,) = of_kind(docs, "Secret")
    assert set(secret["data"]) == {"agent-token", "api-token", "control-token"}
    for _doc, container in containers(docs):
        for env in container.get("env", []):
            assert set(env) == {"name", "valueFrom"}, env  # never a literal value
            assert env["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_values_schema_refuses_bad_values():
    for setting, complaint in (
        ("dict.shards=0", "dict.shards"),
        ("dict.replicas=0", "dict.replicas"),
        ("dict.partitioner=crc", "dict.partitioner"),
        ("agent.storage.type=hostPath", "agent.storage.type"),
        ("server.port=70000", "server.port"),
        ("dict.name=../etc", "dict.name"),
        ("nonsense=1", "nonsense"),
    ):
        done = helm("template", "t", str(CHART), "--set", setting)
        assert done.returncode != 0 and complaint in done.stderr, (setting, done.stderr)


def test_existing_secret_and_pvc_storage(tmp_path):
    docs = objects(render("--set", "auth.existingSecret=mine", "--set", "agent.storage.type=pvc"))
    assert of_kind(docs, "Secret") == []
    shard = next(d for d in of_kind(docs, "StatefulSet") if d["metadata"]["name"].endswith("-0"))
    assert shard["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert all(v["name"] != "data" for v in shard["spec"]["template"]["spec"]["volumes"])
    for _doc, container in containers(docs):
        for env in container.get("env", []):
            assert env["valueFrom"]["secretKeyRef"]["name"] == "mine"


def test_dockerfile_lints_and_pins_the_project_version():
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


def test_metrics_port_annotations_and_service_monitor():
    docs = objects(render())
    assert of_kind(docs, "ServiceMonitor") == []  # no Prometheus Operator API: none
    policy = next(
        d for d in of_kind(docs, "NetworkPolicy") if d["metadata"]["name"].endswith("-shards")
    )
    open_ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    for doc, container in containers(docs):
        if container["name"] != "cube-server":
            continue
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(arg(container, "metrics_port")) == declared["metrics"] in open_ports
        annotations = doc["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(declared["metrics"])
    docs = objects(
        render("--set", "metrics.serviceMonitor.enabled=true",
               "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
    )  # fmt: skip
    monitors = of_kind(docs, "ServiceMonitor")
    services = {d["metadata"]["name"]: d for d in of_kind(docs, "Service")}
    assert len(monitors) == 2
    for monitor in monitors:
        service = services[monitor["metadata"]["name"]]
        assert (
            monitor["spec"]["selector"]["matchLabels"].items()
            <= service["metadata"]["labels"].items()
        )
        assert monitor["spec"]["endpoints"][0]["port"] in {
            p["name"] for p in service["spec"]["ports"]
        }


def test_ctr_example_runs_its_predictor_beside_the_chart(tmp_path):
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
