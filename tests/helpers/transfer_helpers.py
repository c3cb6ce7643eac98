"""Test doubles for cube-transfer: in-process fake agents speaking the docs/ROLLOUT.md API, and a
fake builder script writing tars the way cube-builder lays them out. The real-process tests
(test_transfer_e2e.py) use the real ones."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

Behavior = Callable[[str, str], "str | None"]  # (command, version) -> failure message or None


@dataclass
class FakeTask:
    command: str
    version: str
    state: str = "running"
    message: str = ""
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "version": self.version,
            "state": self.state,
            "message": self.message,
            "reason": self.reason,
            "started_at": 0,
            "finished_at": 0,
            "progress": {},
        }


@dataclass
class FakeAgent:
    """One cube-agent and the server beside it, reduced to the version bookkeeping."""

    name: str
    deploy_path: str = "/deploy"
    delay: float = 0.02
    behavior: Behavior | None = None
    cur: str = ""
    bg: str = ""
    on_disk: set[str] = field(default_factory=set)
    tasks: dict[tuple[str, str], FakeTask] = field(default_factory=dict)
    received: list[dict[str, Any]] = field(default_factory=list)
    switches: list[str] = field(default_factory=list)  # versions made current, in order
    port: int = 0
    runner: web.AppRunner | None = None
    token: str = ""
    events: list[tuple[str, str, str]] | None = None  # shared (agent, command, version) log
    busy_until: float = 0.0  # loop time until which every new command gets 409
    # versions whose placed copy is damaged: loading one fails with reason corrupt_version and
    # quarantines it (gone from disk and `versions`), as the real agent does on DATA_LOSS; a
    # new download places a good copy
    corrupt: set[str] = field(default_factory=set)

    def envelope(
        self, data: Any, message: str = "", success: str = "0", status: int = 200
    ) -> web.Response:
        return web.json_response(
            {"success": success, "message": message, "data": data}, status=status
        )

    async def handle_status(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self.envelope(None, "unauthorized", "255", 401)
        return self.envelope(
            {
                "status": "RUNNING",
                "version": "fake",
                "server": {
                    "address": "fake",
                    "cur_version": self.cur,
                    "bg_version": self.bg,
                    "status": 0,
                    "reachable": True,
                },
                "versions": sorted(self.on_disk),
                "tasks": [t.to_json() for t in self.tasks.values()],
            }
        )

    def _authorized(self, request: web.Request) -> bool:
        return not self.token or request.headers.get("Authorization") == f"Bearer {self.token}"

    async def handle_cmd(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self.envelope(None, "unauthorized", "255", 401)
        body = await request.json()
        command, version = body["command"], body["version"]
        if command == "task":
            task = self.tasks.get((body["task_command"], version))
            if task is None:
                return self.envelope(None, f"no task for {version}", "255", 404)
            return self.envelope(task.to_json())
        if body.get("deploy_path") and body["deploy_path"] != self.deploy_path:
            return self.envelope(None, "deploy_path is not mine", "255", 400)
        if asyncio.get_running_loop().time() < self.busy_until:
            return self.envelope(None, "busy: another command runs", "255", 409)
        self.received.append(body)
        if self.events is not None:
            self.events.append((self.name, command, version))
        task = self.tasks.get((command, version))
        done = task is not None and task.state == "succeeded" and self._effect(command, version)
        if task is not None and (task.state == "running" or done):
            return self.envelope(task.to_json())
        task = FakeTask(command, version)
        self.tasks[(command, version)] = task
        asyncio.get_running_loop().create_task(self._work(task, body))
        return self.envelope(task.to_json())

    async def _work(self, task: FakeTask, body: dict[str, Any]) -> None:
        await asyncio.sleep(self.delay)
        failure = self.behavior(task.command, task.version) if self.behavior else None
        loads = task.command in ("reload", "rollback") and self.cur != task.version
        if failure is None and loads and {task.version} <= self.corrupt & self.on_disk:
            self.corrupt.discard(task.version)
            self.on_disk.discard(task.version)
            task.reason = "corrupt_version"
            failure = f"cube-server {task.command} {task.version}: DATA_LOSS: checksum mismatch"
        if failure is None:
            failure = self._apply(task.command, task.version)
        task.state = "failed" if failure else "succeeded"
        task.message = failure or "ok"

    def _effect(self, command: str, version: str) -> bool:
        """Whether what a succeeded task did is still there (else the agent runs it again)."""
        if command == "download":
            return version in self.on_disk
        if command == "reload":
            return version in (self.cur, self.bg)
        return self.cur == version

    def _apply(self, command: str, version: str) -> str | None:
        if command == "download":
            self.on_disk.add(version)
        elif command == "reload":
            if version not in self.on_disk:
                return f"{version} is not on disk"
            if self.cur != version:
                self.bg = version
        elif command == "enable":
            if self.cur == version:
                return None
            if self.bg != version:
                return f"{version} is not loaded"
            self._switch(version)
        elif command == "rollback":
            if self.cur == version:
                return None
            if self.bg != version and version not in self.on_disk:
                return f"{version} is not on disk"
            self._switch(version)
        return None

    def _switch(self, version: str) -> None:
        self.cur, self.bg = version, self.cur
        self.switches.append(version)

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_get("/agent/status", self.handle_status)
        app.router.add_post("/agent/cmd", self.handle_cmd)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port or self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def transfer_conf(
    tmp: Path,
    agents: Sequence[Sequence[FakeAgent | tuple[int, int, str]]],
    *,
    wget_port: int,
    builder: str,
    mode: str = "base_delta",
    extra: str = "",
    donefile_address: str = "",
) -> str:
    """A transfer.conf for shard i / replica j served by `agents[i][j]` (a FakeAgent, or a tuple
    (agent_port, server_port, deploy_path))."""
    lines = [
        "[default]",
        "dict_name: test_dict",
        f"mode: {mode}",
        "download_mode: http",
        f"wget_port: {wget_port}",
        f"buildtool_local: {builder}",
        f"donefile_address: {donefile_address or tmp / 'donefile'}",
        f"output_address: {tmp / 'output'}",
        f"tmp_address: {tmp / 'tmp'}",
        f"shard_num: {len(agents)}",
        f"copy_num: {len(agents[0])}",
        "transfer_address: 127.0.0.1",
        extra,
        "[cube_agent]",
    ]
    for i, replicas in enumerate(agents):
        for j, agent in enumerate(replicas):
            if isinstance(agent, FakeAgent):
                agent_port, server_port, deploy = agent.port, 1000 + agent.port, agent.deploy_path
            else:
                agent_port, server_port, deploy = agent
            lines.append(f"agent{i}_{j}: 127.0.0.1:{agent_port}")
            lines.append(f"cube{i}_{j}: 127.0.0.1:{server_port}:{deploy}")
    return "\n".join(lines) + "\n"


FAKE_BUILDER = '''\
#!{python}
"""Writes <output>/<depend>_<cur>/<dict>_part<i>.tar(.md5) and meta_info like cube-builder; each
tar holds an index.cube that is only a real header (record and tombstone counts).
Input files steer it: FAIL -> exit 3 with a message; BADMD5 -> wrong md5; SLOW -> sleep 30;
RECORDS_<n> -> n records per shard (default 1000); DELETED_<n> -> n deleted keys per shard;
WIDTH_<n> -> values n bytes wide (default 16)."""
import hashlib, io, json, os, sys, tarfile, time
sys.path.insert(0, {root!r})
from cube.format import HEADER_SIZE, encode_header
args = sys.argv[1:]
opts = {{args[i].lstrip("-"): args[i + 1] for i in range(0, len(args) - 1)
        if args[i].startswith("-") and not args[i + 1].startswith("-")}}
inp = opts["input_path"]
if not os.path.isdir(inp):
    sys.exit(f"input_path {{inp}}: not a directory")
names = set(os.listdir(inp))
if "FAIL" in names:
    print("reading part-0: bad record at offset 42", file=sys.stderr)
    sys.exit(3)
if "SLOW" in names:
    time.sleep(30)
def counted(prefix, default):
    return next((int(n[len(prefix):]) for n in names if n.startswith(prefix)), default)
records, deleted = counted("RECORDS_", 1000), counted("DELETED_", 0)
width = counted("WIDTH_", 16)
out = os.path.join(opts["output_path"], f"{{opts['depend_version']}}_{{opts['cur_version']}}")
os.makedirs(out, exist_ok=True)
with open(os.path.join(opts["output_path"], "argv.log"), "a") as f:
    f.write(json.dumps(args) + "\\n")
for shard in range(int(opts["shard_num"])):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = encode_header("index", {{"record_count": records, "tombstone_count": deleted,
                                        "value_width": width,
                                        "file_size": HEADER_SIZE, "sections": {{}},
                                        "version": opts["cur_version"], "shard": shard}})
        info = tarfile.TarInfo("./index.cube")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    name = f"{{opts['dict_name']}}_part{{shard}}.tar"
    with open(os.path.join(out, name), "wb") as f:
        f.write(buf.getvalue())
    digest = hashlib.md5(buf.getvalue()).hexdigest()
    if "BADMD5" in names:
        digest = "0" * 32
    with open(os.path.join(out, name + ".md5"), "w") as f:
        f.write(f"{{digest}}  {{name}}\\n")
    meta_dir = os.path.join(opts["output_path"], "meta_info")
    os.makedirs(meta_dir, exist_ok=True)
    meta = {{"index_total_count": "1", "data_len_list": ["1"], "index_len_list": ["1"]}}
    path = f"{{opts['cur_version']}}_{{opts['depend_version']}}_{{shard}}_0.json"
    with open(os.path.join(meta_dir, path), "w") as f:
        json.dump(meta, f)
'''


def write_fake_builder(directory: Path) -> Path:
    path = directory / "fake-cube-builder"
    root = str(Path(__file__).resolve().parents[2])
    path.write_text(FAKE_BUILDER.format(python=sys.executable, root=root))
    os.chmod(path, 0o755)
    return path


def append_line(donefile_dir: Path, file: str, obj: dict[str, Any] | str) -> None:
    donefile_dir.mkdir(parents=True, exist_ok=True)
    text = obj if isinstance(obj, str) else json.dumps(obj)
    with open(donefile_dir / file, "a", encoding="utf-8") as f:
        f.write(text + "\n")


def make_input(root: Path, name: str, *markers: str) -> Path:
    path = root / "input" / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "part-00000").write_bytes(b"SEQ")
    for marker in markers:
        (path / marker).write_text(marker)
    return path


def write_table(path: Path, n: int, dim: int = 4, first_key: int = 1) -> Path:
    """A directory holding one SequenceFile of `n` records (keys first_key.., float32 x dim),
    as the real cube-builder reads it; n == 0 leaves one empty file (an input that lost its
    data upstream)."""
    import numpy as np

    from cube.seqfile import SequenceFileWriter
    from cube.values import ValueColumn

    path.mkdir(parents=True, exist_ok=True)
    if n == 0:
        (path / "part-00000").write_bytes(b"")
        return path
    keys = np.arange(first_key, first_key + n, dtype=np.uint64)
    values = np.arange(n * dim, dtype=np.float32).view(np.uint8)
    with SequenceFileWriter(path / "part-00000") as writer:
        writer.write_batch(keys, ValueColumn.fixed(values, dim * 4))
    return path


def dedent(text: str) -> str:
    return textwrap.dedent(text)
