"""The chart's pods on hosts of their own (tests/clustersim.py): one network namespace per pod
with its own IP on a bridge, cluster DNS names in /etc/hosts, volumes at their mountPaths, the
rendered command lines, probes and restarts as a kubelet does them. A client in another
namespace uses the rendered cube.conf.

Skipped, saying why, without root or iproute2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from clustersim import SimNode, require_root_network
from test_helm import HELM, render

from cube.donefile import append_line, format_line
from cube.processes import poll_until
from cube.seqfile import SequenceFileWriter
from cube.values import ValueColumn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(require_root_network()), reason=require_root_network() or "ok"),
    pytest.mark.skipif(not HELM.exists(), reason="helm comes from `make tools` (.tools/)"),
]

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


class Client:
    """tests/sim_client.py in a client namespace: one JSON request, one JSON answer."""

    def __init__(self, node: SimNode, conf: Path) -> None:
        self.conf = conf
        self.ns = node.namespace("client")
        self.process = self.ns.run(
            [sys.executable, str(Path(__file__).parent / "sim_client.py"), str(conf)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def ask(self, request: dict) -> dict:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def cluster(tmp_path):
    donefile = tmp_path / "donefile"
    donefile.mkdir()
    values = {
        "dict": {"name": "sim_dict", "shards": 2, "replicas": 2},
        "server": {"grace": 2, "inMem": False},
        "client": {"timeoutMs": 1000, "backupRequestMs": 100},
        "transfer": {
            "pollInterval": 0.5,
            "donefile": {"address": "/donefile", "volume": {"hostPath": {"path": "/srv/donefile"}}},
        },
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    docs = [d for d in yaml.safe_load_all(render("--values", str(tmp_path / "values.yaml"))) if d]
    conf = tmp_path / "cube.conf"
    cube_conf = next(d for d in docs if d["metadata"]["name"].endswith("-cube-conf"))
    conf.write_text(cube_conf["data"]["cube.conf"])
    node = SimNode(docs, tmp_path / "node", host_paths={"/srv/donefile": donefile})
    try:
        node.start()
        client = Client(node, conf)
        try:
            yield node, client, donefile
        finally:
            client.close()
    except BaseException:
        print(node.report())
        raise
    finally:
        node.close()


def shard_pods(node: SimNode) -> list[str]:
    return sorted(name for name in node.pods if "-shard-" in name)


def served(client: Client, keys: np.ndarray) -> dict:
    return client.ask({"seek": keys.tolist(), "dim": DIM})


def test_base_then_delta_reach_every_replica_across_hosts(cluster):
    node, client, donefile = cluster
    keys = np.arange(1, 2001, dtype=np.uint64)
    publish(donefile, BASE, keys, 1.0)
    node.wait_ready(shard_pods(node), WAIT)  # ready = serving a version
    answer = served(client, keys)
    assert answer.get("version") == BASE, answer
    np.testing.assert_array_equal(np.asarray(answer["values"], np.float32), table(keys, 1.0))

    changed = keys[::10]
    publish(donefile, DELTA, changed, 2.0, base=BASE)
    delta = f"{BASE}_{DELTA}"
    assert poll_until(lambda: served(client, keys).get("version") == delta, WAIT, 0.5), (
        served(client, keys),
        node.report(),
    )
    expected = table(keys, 1.0)
    expected[::10] = table(changed, 2.0)
    np.testing.assert_array_equal(np.asarray(served(client, keys)["values"], np.float32), expected)
    # every replica of every shard serves it, not only those the client happened to ask
    conf = json.loads(client.conf.read_text())
    for replica in range(2):
        only = [dict(conf[0], nodes=[{"ipport_list": node_["ipport_list"].split(",")[replica]
                                      .removeprefix("list://")}
                                     for node_ in conf[0]["nodes"]])]  # fmt: skip
        path = client.conf.with_name(f"replica{replica}.conf")
        path.write_text(json.dumps(only))
        single = Client(node, path)
        try:
            answer = served(single, keys)
        finally:
            single.close()
        assert answer.get("version") == delta, answer
        np.testing.assert_array_equal(np.asarray(answer["values"], np.float32), expected)
    for pod, container in node.containers():
        assert container.restarts == 0, (pod.spec.name, container.spec.name, node.report())
