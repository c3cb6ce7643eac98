"""The serving image as `make image` builds it (deploy/docker/Dockerfile, images.py) with the
engine that is here: its size and contents, the wheel it installs, and a read-only container
of it serving a shard with the shipped kernel, as a pod runs it.

Skipped where no container engine is installed (`make debs` installs podman)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
RUN_LIMITS = ["--ulimit", "nofile=8192:8192", "--ulimit", "nproc=4096:4096"]
SERVING_IMAGE_MAX_BYTES = 400_000_000  # issue 34: cube-server, cube-agent, cube-transfer


def load_images() -> ModuleType:
    path = REPO / "deploy" / "docker" / "images.py"
    spec = importlib.util.spec_from_file_location("cube_images", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


images = load_images()


@pytest.fixture(scope="module")
def engine() -> list[str]:
    if not (os.environ.get("CUBE_ENGINE") or shutil.which("podman") or shutil.which("docker")):
        pytest.skip("no container engine (make debs installs podman)")
    command: list[str] = images.engine()
    return command


@pytest.fixture(scope="module")
def image(engine: list[str]) -> str:
    """The serving image of this tree (the engine's layer cache makes a rebuild cheap)."""
    name: str = images.build("serving", None, images.BASE_IMAGE)
    return name


def in_image(engine: list[str], image: str, script: str) -> str:
    done = subprocess.run(
        [*engine, "run", "--rm", "--read-only", *RUN_LIMITS, image, "sh", "-c", script],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_serving_image_is_small_and_holds_no_build_tools(engine: list[str], image: str) -> None:
    inspected = json.loads(
        subprocess.run(
            [*engine, "image", "inspect", image], capture_output=True, check=True, timeout=60
        ).stdout
    )[0]
    assert inspected["Size"] <= SERVING_IMAGE_MAX_BYTES, inspected["Size"]
    assert inspected["Config"]["User"] == "10001:10001"
    found = in_image(
        engine,
        image,
        "for tool in gcc cc strip pip pip3; do command -v $tool; done;"
        " find /opt/cube -type d -name tests -path '*/site-packages/*';"
        " ls -d /root/.cache 2>/dev/null; id -u;"
        " cube-server --version; cube-agent --version; cube-transfer --version;"
        " cube-builder --version",
    )
    assert found.splitlines() == [
        "10001",
        "cube-server 0.1.0",
        "cube-agent 0.1.0",
        "cube-transfer 0.1.0",
        "cube-builder 0.1.0",
    ], found


def test_the_wheel_the_image_installs_ships_the_kernel(
    engine: list[str], image: str, tmp_path: Path
) -> None:
    """The image's own wheel (the Dockerfile's `wheel` stage, from the same layers) holds
    the compiled kernel; the Dockerfile's `kernel_cache --check` proves it loads."""
    wheel_image = images.build("wheel", None, images.BASE_IMAGE)
    name = f"cube-wheel-{os.getpid()}"
    subprocess.run([*engine, "create", "--name", name, wheel_image], check=True, timeout=60,
                   capture_output=True)  # fmt: skip
    try:
        subprocess.run([*engine, "cp", f"{name}:/dist", str(tmp_path)], check=True, timeout=60)
    finally:
        subprocess.run([*engine, "rm", "-f", name], capture_output=True, timeout=60)
    (wheel,) = (tmp_path / "dist").glob("cube_py-*.whl")
    assert wheel.name.endswith("-cp311-cp311-linux_x86_64.whl"), wheel.name
    kernel = [n for n in zipfile.ZipFile(wheel).namelist() if "/_numba_cache/" in n]
    for loop in ("_kernel_jit._seek_fixed", "_lane_jit.lane_pass", "_sdk_jit.group_keys"):
        assert any(n.startswith(f"cube/_numba_cache/{loop}-") for n in kernel), loop


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[tuple[Path, np.ndarray]]:
    """A data dir with one version of 10,000 keys whose 8-byte values are the keys."""
    from cube.index import build_table
    from cube.shard import write_shard
    from cube.values import ValueColumn

    keys = np.arange(1, 10_001, dtype=np.uint64) * 7919
    data = tmp_path / "data"
    values = ValueColumn.fixed(keys.view(np.uint8).copy(), 8)
    write_shard(data / "1700000000", build_table(keys), values, {"version": "1700000000"})
    (data / "VERSION").write_text("1700000000\n")
    subprocess.run(["chmod", "-R", "a+rwX", str(tmp_path)], check=True, timeout=60)
    yield data, keys


def test_a_read_only_container_serves_with_the_shipped_kernel(
    engine: list[str], image: str, shard: tuple[Path, np.ndarray]
) -> None:
    """As the chart runs it: read-only root, uid 10001, NUMBA_CACHE_DIR on a tmpfs, the data
    dir a volume. It loads the shipped kernel (nothing compiled) and answers every key."""
    from cube.client import CubeClient
    from cube.processes import SERVING, free_ports, health_status, poll_until

    data, keys = shard
    port, lane = free_ports(2)
    name = f"cube-image-test-{port}"
    started = time.monotonic()
    subprocess.run(
        [*engine, "run", "-d", "--name", name, "--network", "host", "--read-only",
         "--tmpfs", "/tmp", *RUN_LIMITS, "-v", f"{data}:/var/lib/cube/data", image,
         "cube-server", "--port", str(port), "--control_port", "0", "--tcp_ports", str(lane),
         "--data_dir", "/var/lib/cube/data"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        serving = poll_until(lambda: health_status(f"127.0.0.1:{port}") == SERVING, 60, 0.05)
        elapsed = time.monotonic() - started
        logs = subprocess.run([*engine, "logs", name], capture_output=True, text=True, timeout=60)
        text = logs.stdout + logs.stderr
        assert serving, text
        assert "loaded from its cache" in text and "compiled now" not in text, text
        with CubeClient([f"127.0.0.1:{port}"]) as client:
            answer = client.seek(keys)
        assert answer.found.all() and answer.version == "1700000000"
        assert np.array_equal(answer.column.as_rows().view(np.uint64).ravel(), keys)
        print(f"read-only container: SERVING {elapsed:.2f} s after `run`", file=sys.stderr)
    finally:
        subprocess.run([*engine, "rm", "-f", "-t", "5", name], capture_output=True, timeout=60)
