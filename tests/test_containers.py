"""The Helm chart's pods in real containers (podman), from the project's image: the scenario of
examples/containers/demo.py (also `python -m examples.containers.demo`): a base and a patch
rolled out by the chart's cube-transfer to 2 shards x 2 replicas and read back through the SDK
from the rendered cube.conf; kill -9 of a server under lookups (none fails), its restart, and
the time until it serves again.

The scenario needs podman, root and helm (`make tools`), and is skipped, saying why, without
them; the image is built from this checkout (deploy/docker/images.py build). The tests of
the translator (examples/containers/kube.py) start no process and run everywhere."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import pytest

from examples.containers import demo
from examples.containers.kube import FieldRef, Unsupported, resolve_env, translate
from examples.containers.podman import engine_problem, ensure_image, images_module


@pytest.fixture(scope="session")
def image() -> str:
    """The project's image, built from this checkout; skips when there is no engine or no
    helm, fails when the image does not build."""
    problem = engine_problem()
    if problem:
        pytest.skip(f"no container engine for the chart's pods: {problem}")
    if not demo.helm().exists():
        pytest.skip("helm comes from `make tools` (.tools/bin/helm)")
    name = f"cube-py:{images_module().project_version()}"
    problem = ensure_image(name)
    assert not problem, problem
    return name


@pytest.mark.slow
@pytest.mark.timeout(3600, method="signal")  # (the image's build, when absent, is in it)
def test_the_charts_pods_in_containers(image: str, tmp_path: Path) -> None:
    report = demo.run(tmp_path)
    for line in report.lines():
        print(f"MEASURED {line}")
    assert report.kill_failed_lookups == 0 and report.kill_lookups >= 10
    assert report.values_checked == 20_000 + 25_000 + 25_000
    assert report.restart_serving_s < 30, report


# ---------------------------------------------------------------------------------------------
# the translator, on objects written here (no helm, no engine)


def _objects() -> list[dict[str, Any]]:
    """A StatefulSet of 2 pods as the chart renders its shards, its headless Service, a Secret
    and a ConfigMap."""
    pod = {
        "automountServiceAccountToken": False,
        "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "server",
                "image": "cube-py:0.1.0",
                "command": ["cube-server"],
                "args": ["--port=8000"],
                "env": [
                    {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}},
                    {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "PLAIN", "value": "1"},
                ],
                "ports": [{"name": "grpc", "containerPort": 8000}],
                "readinessProbe": {"grpc": {"port": 8000, "service": "cube.v1.CubeService"},
                                   "periodSeconds": 5},
                "resources": {"limits": {"memory": "4Gi"}, "requests": {"cpu": "1"}},
                "securityContext": {"readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "data", "mountPath": "/var/lib/cube"},
                                 {"name": "conf", "mountPath": "/etc/c", "readOnly": True}],
            }
        ],
        "volumes": [{"name": "data", "emptyDir": {}},
                    {"name": "conf", "configMap": {"name": "c"}}],
    }  # fmt: skip
    labels = {"app": "x", "shard": "0"}
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"},
         "data": {"t": base64.b64encode(b"sekrit").decode()}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"},
         "data": {"a.conf": "hello"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "namespace": "ml"},
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                  "selector": dict(labels)}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet",
         "metadata": {"name": "x", "namespace": "ml"},
         "spec": {"serviceName": "x", "replicas": 2, "podManagementPolicy": "Parallel",
                  "selector": {"matchLabels": dict(labels)},
                  "template": {"metadata": {"labels": dict(labels)}, "spec": pod}}},
    ]  # fmt: skip


def test_translator_reads_pods_env_volumes_and_names() -> None:
    rendered = translate(_objects())
    assert [p.name for p in rendered.pods] == ["x-0", "x-1"]
    pod = rendered.pod("x-1")
    server = pod.container("server")
    assert server.command == ("cube-server",) and server.args == ("--port=8000",)
    assert dict(server.env)["ME"] == FieldRef("metadata.name")
    assert resolve_env(server, pod, "10.0.0.7") == {
        "TOKEN": "sekrit", "ME": "x-1", "IP": "10.0.0.7", "PLAIN": "1"
    }  # fmt: skip
    assert (server.user, server.group, pod.fs_group) == (10001, 10001, 10001)
    assert server.read_only_root and server.drop_all_capabilities and server.no_new_privileges
    assert server.memory_limit == 4 << 30
    assert server.readiness is not None and server.readiness.service == "cube.v1.CubeService"
    volumes = {v.name: v for v in pod.volumes}
    assert volumes["data"].kind == "dir"
    assert volumes["conf"].files == (("a.conf", b"hello", 0o644),)
    assert rendered.hosts({"x-0": "10.0.0.6", "x-1": "10.0.0.7"}) == [
        ("x.ml.svc.cluster.local", "10.0.0.6"),
        ("x.ml.svc.cluster.local", "10.0.0.7"),
        ("x-0.x.ml.svc.cluster.local", "10.0.0.6"),
        ("x-1.x.ml.svc.cluster.local", "10.0.0.7"),
    ]
    assert any("resource requests" in note for note in rendered.notes)


def _changed(path: list[str | int], value: Any) -> list[dict[str, Any]]:
    docs = copy.deepcopy(_objects())
    target: Any = docs[3]
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return docs


POD = ["spec", "template", "spec"]
SERVER = [*POD, "containers", 0]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ([*SERVER, "lifecycle"], {"preStop": {}}, "lifecycle: not understood"),
        ([*SERVER, "imagePullPolicy"], "Always", "imagePullPolicy Always"),
        ([*SERVER, "securityContext", "capabilities"], {"add": ["NET_ADMIN"]}, "add: not"),
        ([*SERVER, "volumeMounts", 0, "subPath"], "x", "subPath: not understood"),
        ([*SERVER, "readinessProbe"], {"exec": {"command": ["true"]}}, "exec: not"),
        ([*SERVER, "env", 1, "valueFrom", "fieldRef", "fieldPath"], "spec.nodeName", "nodeName"),
        ([*POD, "volumes", 0], {"name": "data", "hostPath": {"path": "/etc"}}, "hostPath /etc"),
        ([*POD, "volumes", 0], {"name": "data", "emptyDir": {"medium": "Memory"}}, "medium"),
        ([*POD, "automountServiceAccountToken"], True, "service account token"),
        ([*POD, "initContainers"], [], "initContainers: not understood"),
        ([*POD, "securityContext", "seccompProfile"], {"type": "Unconfined"}, "seccompProfile"),
        (["spec", "podManagementPolicy"], "OrderedReady", "OrderedReady with 2 pods"),
        (["spec", "selector", "matchLabels", "app"], "y", "selector does not match"),
    ],
)
def test_translator_refuses_what_it_does_not_run(
    path: list[str | int], value: Any, message: str
) -> None:
    with pytest.raises(Unsupported, match=message):
        translate(_changed(path, value))


def test_translator_refuses_objects_it_does_not_run() -> None:
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": {"name": "p"}, "spec": {}}  # fmt: skip
    with pytest.raises(Unsupported, match="kind NetworkPolicy"):
        translate([*_objects(), policy])
    docs = _objects()
    docs[2]["spec"]["clusterIP"] = "10.0.0.1"
    with pytest.raises(Unsupported, match="only headless Services"):
        translate(docs)
    docs = _objects()
    docs[3]["spec"]["template"]["spec"]["volumes"][0] = {
        "name": "data", "hostPath": {"path": "/srv/x"}
    }  # fmt: skip
    assert translate(docs, host_paths=["/srv/x"]).pods[0].volumes[0].host_path == "/srv/x"
