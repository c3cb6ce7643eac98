"""The documentation keeps up with the code: every relative link resolves, and the reference
pages name every transfer.conf key, server and agent flag, agent command, and HTTP route the
code has."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from cube.agent.api import make_app as agent_app
from cube.agent.main import flag_set as agent_flags
from cube.protocol import COMMANDS
from cube.transfer.config import DEFAULT_KEYS, parse_config
from cube.transfer.http_api import build_api

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("bench/*.md"),
     *REPO.glob("examples/**/*.md")]
)  # fmt: skip
REFERENCE = REPO / "docs" / "reference"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    for target, _anchor in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.relative_to(REPO)}: broken link {target}"


def test_every_transfer_conf_key_is_documented() -> None:
    text = (REFERENCE / "transfer-conf.md").read_text()
    missing = [key for key in sorted(DEFAULT_KEYS) if f"`{key}`" not in text]
    assert not missing, f"docs/reference/transfer-conf.md lacks {missing}"


def test_every_server_flag_is_documented() -> None:
    from cube.server.main import FLAGS as server_flags

    text = (REFERENCE / "cube-server.md").read_text()
    missing = [f"--{name}" for name in server_flags.flags if f"`--{name}`" not in text]
    assert not missing, f"docs/reference/cube-server.md lacks {missing}"


def test_every_agent_flag_and_command_is_documented() -> None:
    text = (REFERENCE / "agent-api.md").read_text()
    missing = [f"--{name}" for name in agent_flags().flags if f"--{name}" not in text]
    missing += [command for command in COMMANDS if f"`{command}`" not in text]
    assert not missing, f"docs/reference/agent-api.md lacks {missing}"


def test_every_paddle_ps_flag_of_the_builder_is_documented() -> None:
    from cube.builder.cli import flag_set as builder_flags

    text = (REPO / "docs" / "INPUT_FORMATS.md").read_text()
    names = [n for n in builder_flags().flags if n.startswith("paddle_") or n == "input_format"]
    assert len(names) >= 8
    missing = [f"-{name}" for name in names if f"`-{name}" not in text]
    assert not missing, f"docs/INPUT_FORMATS.md lacks {missing}"


def _routes(app: web.Application) -> set[str]:
    paths = {route.resource.canonical for route in app.router.routes() if route.resource}
    return {path for path in paths if path.startswith(("/agent", "/dict", "/instance"))}


def test_every_http_route_is_documented(tmp_path: Path) -> None:
    conf = "[default]\ndict_name: d\nwget_port: 0\nshard_num: 1\n"
    conf += f"donefile_address: {tmp_path}\noutput_address: {tmp_path}\ntmp_address: {tmp_path}\n"
    conf += "[cube_agent]\nagent0_0: 127.0.0.1:1\ncube0_0: 127.0.0.1:2:/d\n"
    service = SimpleNamespace(cfg=parse_config(conf, "t.conf", tmp_path))
    # build_api reads only the service's cfg to lay out its routes
    transfer_app = build_api(service)  # type: ignore[arg-type]
    transfer_routes, agent_routes = _routes(transfer_app), _routes(agent_app([]))
    assert len(transfer_routes) >= 6 and len(agent_routes) >= 2  # the routes were found
    transfer = (REFERENCE / "transfer-api.md").read_text()
    missing = [path for path in sorted(transfer_routes) if path not in transfer]
    agent = (REFERENCE / "agent-api.md").read_text()
    missing += [path for path in sorted(agent_routes) if path not in agent]
    assert not missing, f"the HTTP reference pages lack {missing}"


HELM = REPO / ".tools" / "bin" / "helm"


@pytest.mark.slow
@pytest.mark.skipif(not HELM.exists(), reason="helm comes from `make tools` (.tools/)")
def test_deploy_md_renders_the_chart_offline(tmp_path: Path) -> None:
    """DEPLOY.md's offline render, run as written (its helm and chart paths made absolute):
    in a network namespace of its own where this machine allows one (no network at all),
    with an empty HOME (no chart repository configured)."""
    import os
    import shutil
    import subprocess

    text = (REPO / "docs" / "DEPLOY.md").read_text()
    section = text.split("### Rendering offline", 1)[1]
    block = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)[0]  # its first block
    assert "helm template" in block and "deploy/helm/cube" in block
    script = block.replace(".tools/bin/helm", str(HELM))
    script = script.replace("deploy/helm/cube", str(REPO / "deploy" / "helm" / "cube"))
    isolate = ["unshare", "--net"] if os.geteuid() == 0 and shutil.which("unshare") else []
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [*isolate, "bash", "-euc", script], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    kinds = re.findall(r"^kind: (\w+)$", (tmp_path / "emb.yaml").read_text(), re.MULTILINE)
    assert kinds.count("StatefulSet") == 5, kinds  # 4 shards + the transfer
    assert "Secret" not in kinds and "Pod" not in kinds, kinds  # auth.existingSecret, no test
