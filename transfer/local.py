"""cube-local: a whole Cube cluster (transfer, agents, servers) on loopback, in one command.

    cube-local up --shards 2 --replicas 2 --donefile DIR [--create_donefile_dir]
                  [--dir .local-cluster] [--base_port N] [--metrics]
                  [--source_format paddle_fleet --paddle_config FILE] [--builder_flags F]
    cube-local status [--dir .local-cluster] [--json]
    cube-local wait --version V [--timeout 120] [--dir .local-cluster]
    cube-local restart --name agent0_1 [--dir .local-cluster]
    cube-local down [--dir .local-cluster] [--timeout 10]

`up` checks that --donefile is a directory (--create_donefile_dir creates it), writes
`transfer.conf` (the original's format) and `cube.conf` (`ipport_list`, for the SDK
and cube-cli) into --dir, starts one cube-server + cube-agent per replica (the server's
data_dir is the agent's deploy_path/data) and one cube-transfer watching --donefile, records
every PID (with its start time and command line) in --dir/cluster.json, and returns once each
answers its health check. `down` stops exactly those processes: SIGTERM, then SIGKILL after
--timeout. Ports: --base_port N gives the transfer N (API) and N+1 (files), then a block
from N+10 to the servers, agents and control ports (and with --metrics every process's
metrics port), each recorded in cluster.json; without it free ports are picked.
--metrics turns on every process's Prometheus endpoint (`--metrics_port`, on 127.0.0.1).

Tokens: the agents' token (env CUBE_TOKEN, or `--agent_token`) and the transfer API's (env
CUBE_API_TOKEN, or `--api_token`) are written into transfer.conf (mode 0600), handed to the
agents through their environment (never on a command line: cluster.json records those), and
read back from transfer.conf by status, wait and restart for their own requests.

Inputs: --source_format (transfer.conf `source_format`) names who writes the donefiles:
`seqfile` (base.txt / patch.txt of SequenceFiles) or a PaddlePaddle trainer (`paddle_fleet`,
`paddlerec`), whose parameter-server saves the transfer builds with `-input_format paddle_ps`;
their row layout comes from --paddle_config (the trainer's PSParameter text, made absolute) or
from the layout flags in --builder_flags (transfer.conf `builder_flags`: more cube-builder
flags, e.g. `-paddle_accessor ctr_common -paddle_dim 8 -paddle_optimizer adagrad`). `up`
refuses a combination the builder would refuse at every build, before anything starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from cube.donefile import DONEFILE_FORMATS
from cube.flags import CommandSet, FlagSet, flag, run_cli
from cube.processes import (
    create_time,
    free_port,
    health_status,
    log_tail,
    poll_until,
    same_process,
    spawn,
    terminate,
)
from cube.routing import PARTITIONERS
from cube.transfer.config import (
    MODES,
    ConfigError,
    Instance,
    TransferConfig,
    load_config,
    paddle_layout_missing,
    parse_config,
    render_config,
)
from cube.transfer.donefile import SourceUnavailable, ensure_donefile_dir

CLUSTER_FILE = "cluster.json"
CONF_FILE = "transfer.conf"
DICT_NAME = "test_dict"
TOKEN_ENV = "CUBE_TOKEN"  # the agents' token (cube-agent and cube-transfer read it too)
API_TOKEN_ENV = "CUBE_API_TOKEN"


class LocalError(RuntimeError):
    """Something cube-local cannot do; the message says what and where to look."""


@dataclass
class Proc:
    """One process of the cluster, as cluster.json records it."""

    name: str  # transfer, server0_1, agent0_1
    role: str
    argv: list[str]
    log: str
    port: int
    pid: int = 0
    create_time: float = 0.0
    shard: int = -1
    replica: int = -1
    metrics_port: int = 0  # its /metrics (cube-local up --metrics), 0: off

    def process(self) -> psutil.Process | None:
        """The live process this record started (None if gone or the PID was reused)."""
        return same_process(self.pid, self.create_time)


def _instance_state(row: dict[str, Any], agent_answered: bool) -> str:
    """The STATE column: the transfer's status of the replica, except where it lags behind
    what cube-local sees itself: a replica whose processes run but that the transfer has not
    reached yet (just started, or restarted) is "starting", not the transfer's "Dead"."""
    state = row["state"]
    if not row["agent_up"]:
        return "agent down"
    if not agent_answered or state in ("", "Dead"):
        return "starting"
    return str(state)


@dataclass
class ClusterSpec:
    dir: Path
    shards: int
    replicas: int
    donefile: Path
    dict_name: str = DICT_NAME
    base_port: int = 0
    dim: int = 0
    mode: str = "base_delta"
    quorum: int = 0
    poll_interval: float = 1.0
    partitioner: str = "mod"
    phase_timeout: float = 120.0
    dead_timeout: float = 20.0
    source_format: str = "seqfile"  # transfer.conf source_format (cube.donefile.DONEFILE_FORMATS)
    builder_flags: tuple[str, ...] = ()  # transfer.conf builder_flags
    transfer_args: list[str] = field(default_factory=list)
    server_args: list[str] = field(default_factory=list)
    agent_args: list[str] = field(default_factory=list)
    transfer_overrides: dict[str, Any] = field(default_factory=dict)  # TransferConfig fields
    create_donefile_dir: bool = False  # a missing --donefile directory is an error otherwise
    metrics: bool = False  # every process with --metrics_port (Proc.metrics_port)


def command(name: str) -> str:
    """A console script of this project: next to this Python first (the venv), then PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    raise LocalError(f"{name} not found next to {sys.executable} nor on PATH (pip install -e .)")


def plan_ports(shards: int, replicas: int, base_port: int, metrics: bool = False) -> dict[str, int]:
    """name -> port for every listener of the cluster (with `metrics`, also
    `metrics_<process name>` for each process's Prometheus endpoint)."""
    names = ["transfer", "files"]
    for i in range(shards):
        for j in range(replicas):
            names += [f"server{i}_{j}", f"agent{i}_{j}", f"control{i}_{j}"]
    if metrics:
        names += [f"metrics_{name}" for name in names if not name.startswith(("files", "control"))]
    if base_port:
        if base_port + 10 + len(names) - 2 > 65535:
            raise LocalError(f"--base_port {base_port} leaves too few ports")
        ports = {"transfer": base_port, "files": base_port + 1}
        for k, name in enumerate(names[2:]):
            ports[name] = base_port + 10 + k
        return ports
    picked: dict[str, int] = {}
    while len(picked) < len(names):
        port = free_port()
        if port not in picked.values():
            picked[names[len(picked)]] = port
    return picked


def cluster_config(spec: ClusterSpec, ports: dict[str, int]) -> TransferConfig:
    root = spec.dir.resolve()
    instances = tuple(
        Instance(
            shard=i,
            replica=j,
            agent_host="127.0.0.1",
            agent_port=ports[f"agent{i}_{j}"],
            server_host="127.0.0.1",
            server_port=ports[f"server{i}_{j}"],
            deploy_path=str(root / "instances" / f"{i}_{j}"),
        )
        for i in range(spec.shards)
        for j in range(spec.replicas)
    )
    cfg = TransferConfig(
        dict_name=spec.dict_name,
        mode=spec.mode,
        download_mode="http",
        wget_port=ports["files"],
        buildtool_local=command("cube-builder"),
        donefile_address=str(spec.donefile.resolve()),
        output_address=root / "transfer" / "output",
        tmp_address=root / "transfer" / "tmp",
        shard_num=spec.shards,
        copy_num=spec.replicas,
        transfer_address="127.0.0.1",
        instances=instances,
        quorum=spec.quorum or spec.replicas,
        download_timeout=spec.phase_timeout,
        reload_timeout=spec.phase_timeout,
        enable_timeout=min(spec.phase_timeout, 60.0),
        partitioner=spec.partitioner,
        agent_token=os.environ.get(TOKEN_ENV, ""),
        api_token=os.environ.get(API_TOKEN_ENV, ""),
        source_format=spec.source_format,
        builder_flags=spec.builder_flags,
    )
    return dataclasses.replace(cfg, **spec.transfer_overrides)


def check_inputs(cfg: TransferConfig) -> None:
    """LocalError for inputs the builder would refuse at every build: parameter-server saves
    without their row layout, or -paddle_* flags for SequenceFiles."""
    if cfg.paddle_saves:
        missing = paddle_layout_missing(cfg.builder_flags)
        if missing:
            raise LocalError(
                f"--source_format {cfg.source_format} reads parameter-server saves, whose row "
                "layout cube-builder needs: pass --paddle_config FILE (the trainer's "
                f"fleet_desc.prototxt), or --builder_flags with {', '.join(missing)}"
            )
    elif any(f.lstrip("-").startswith("paddle_") for f in cfg.builder_flags if f[:1] == "-"):
        raise LocalError(
            "--paddle_config and the -paddle_* builder flags are for parameter-server saves: "
            "add --source_format paddle_fleet or paddlerec (or -input_format paddle_ps to "
            "--builder_flags)"
        )


def child_env(role: str, agent_token: str) -> dict[str, str]:
    """The environment of a process of the cluster: ours without CUBE_TOKEN (transfer.conf
    is the transfer's only source), plus the agents' token for an agent."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    if role == "agent" and agent_token:
        env[TOKEN_ENV] = agent_token
    return env


def cube_conf(cfg: TransferConfig, dim: int = 0) -> list[dict[str, Any]]:
    """The SDK's cube.conf for the cluster (`ipport_list`: every replica of a shard)."""
    entry: dict[str, Any] = {
        "dict_name": cfg.dict_name,
        "shard": cfg.shard_num,
        "dup": cfg.copy_num,
        "timeout": 1000,
        "retry": 3,
        "backup_request": 100,
        "type": "ipport_list",
        "load_balancer": "rr",
        "partitioner": cfg.partitioner,
        "nodes": [
            {"ipport_list": "list://" + ",".join(i.server_address for i in cfg.shard_instances(s))}
            for s in range(cfg.shard_num)
        ],
    }
    if dim:
        entry["dim"] = dim
    return [entry]


def _replica_proc(role: str, inst: Instance, port: int, argv: list[str], logs: Path) -> Proc:
    """The record of a replica's server or agent: named `<role><shard>_<replica>`, logging to
    `<name>.log` in `logs`."""
    name = f"{role}{inst.name}"
    return Proc(
        name=name,
        role=role,
        argv=argv,
        log=str(logs / f"{name}.log"),
        port=port,
        shard=inst.shard,
        replica=inst.replica,
    )


def _processes(spec: ClusterSpec, cfg: TransferConfig, ports: dict[str, int]) -> list[Proc]:
    root = spec.dir.resolve()
    logs = root / "logs"
    servers = [
        _replica_proc(
            "server",
            inst,
            inst.server_port,
            [
                command("cube-server"),
                "--port",
                str(inst.server_port),
                "--data_dir",
                str(Path(inst.deploy_path) / "data"),
                "--dict_name",
                cfg.dict_name,
                "--shard",
                str(inst.shard),
                "--partitioner",
                cfg.partitioner,
                "--control_port",
                str(ports[f"control{inst.name}"]),
                *spec.server_args,
            ],
            logs,
        )
        for inst in cfg.instances
    ]
    agents = [
        _replica_proc(
            "agent",
            inst,
            inst.agent_port,
            [
                command("cube-agent"),
                "-P",
                str(inst.agent_port),
                "--deploy_path",
                inst.deploy_path,
                "--server",
                f"127.0.0.1:{ports[f'control{inst.name}']}",
                *spec.agent_args,
            ],
            logs,
        )
        for inst in cfg.instances
    ]
    procs = servers + agents
    procs.append(
        Proc(
            name="transfer",
            role="transfer",
            argv=[
                command("cube-transfer"),
                "-p",
                str(ports["transfer"]),
                "--config",
                str(root / CONF_FILE),
                "--poll_interval",
                f"{spec.poll_interval:g}",
                "--dead_timeout",
                f"{spec.dead_timeout:g}",
                *spec.transfer_args,
            ],
            log=str(logs / "transfer.log"),
            port=ports["transfer"],
        )
    )
    for proc in procs if spec.metrics else ():
        proc.metrics_port = ports[f"metrics_{proc.name}"]
        proc.argv += ["--metrics_port", str(proc.metrics_port)]
    return procs


# ---------------------------------------------------------------------------------------------
# processes


def start(proc: Proc, cwd: Path, agent_token: str = "") -> None:
    Path(proc.log).parent.mkdir(parents=True, exist_ok=True)
    env = child_env(proc.role, agent_token)
    proc.pid = spawn(proc.argv, proc.log, append=True, cwd=cwd, env=env).pid
    proc.create_time = create_time(proc.pid)


def stop(procs: Sequence[Proc], timeout: float = 10.0) -> list[str]:
    """SIGTERM the given processes (only those still the ones we started), SIGKILL whatever is
    left after `timeout`. Returns a line per process for the user."""
    alive = {p.name: p.process() for p in procs}
    lines = [f"{p.name}: not running" for p in procs if alive[p.name] is None]
    handles = [h for h in alive.values() if h is not None]
    killed = {h.pid for h in terminate(handles, timeout, kill_timeout=5)}
    for proc in procs:
        if alive[proc.name] is not None:
            how = "killed (SIGKILL)" if proc.pid in killed else "stopped"
            lines.append(f"{proc.name}: {how} (pid {proc.pid})")
    return lines


def http_json(url: str, body: Any = None, timeout: float = 2.0, token: str = "") -> Any:
    """GET (or POST `body` as JSON) `url` and return the answer's JSON, error answers
    included; `token` goes in an Authorization header."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    if data:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"null")


@dataclass(frozen=True)
class Tokens:
    """The tokens of a cluster (from its transfer.conf): the agents' and the transfer API's."""

    agent: str = ""
    api: str = ""

    def of(self, role: str) -> str:
        return {"agent": self.agent, "transfer": self.api}.get(role, "")


def healthy(proc: Proc, tokens: Tokens = Tokens()) -> bool:
    try:
        if proc.role == "server":
            return health_status(f"127.0.0.1:{proc.port}") is not None
        path = "/agent/status" if proc.role == "agent" else "/dict/info"
        url = f"http://127.0.0.1:{proc.port}{path}"
        reply = http_json(url, timeout=1.0, token=tokens.of(proc.role))
        return isinstance(reply, dict) and reply.get("success") == "0"
    except (OSError, ValueError):
        return False


def wait_healthy(procs: Sequence[Proc], timeout: float, tokens: Tokens = Tokens()) -> None:
    pending = list(procs)

    def none_exited() -> None:
        for proc in pending:
            if proc.process() is None:
                tail = log_tail(proc.log)
                raise LocalError(f"{proc.name} exited at start; see {proc.log}:\n{tail}")

    def all_healthy() -> bool:
        pending[:] = [p for p in pending if not healthy(p, tokens)]
        return not pending

    if not poll_until(all_healthy, timeout, 0.1, check=none_exited):
        names = ", ".join(p.name for p in pending)
        raise LocalError(f"not healthy within {timeout:g}s: {names}; see {pending[0].log}")


# ---------------------------------------------------------------------------------------------
# the cluster


@dataclass
class Cluster:
    dir: Path
    dict_name: str
    shards: int
    replicas: int
    transfer_port: int
    processes: list[Proc]
    created: float = 0.0
    dim: int = 0

    @property
    def cube_conf(self) -> Path:
        return self.dir / "cube.conf"

    @property
    def transfer_url(self) -> str:
        return f"http://127.0.0.1:{self.transfer_port}"

    def proc(self, name: str) -> Proc:
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise LocalError(f"no process {name!r} in {self.dir / CLUSTER_FILE}")

    def save(self) -> None:
        data = {**asdict(self), "dir": str(self.dir)}
        tmp = self.dir / f".{CLUSTER_FILE}.tmp"
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.dir / CLUSTER_FILE)

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Cluster:
        path = Path(directory) / CLUSTER_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise LocalError(f"no cluster in {directory} ({path} does not exist)") from None
        except ValueError as exc:
            raise LocalError(f"{path}: not JSON ({exc})") from None
        data["dir"] = Path(data["dir"])
        data["processes"] = [Proc(**p) for p in data["processes"]]
        return cls(**data)

    def alive(self) -> list[Proc]:
        return [p for p in self.processes if p.process() is not None]

    def down(self, timeout: float = 10.0) -> list[str]:
        order = sorted(self.processes, key=lambda p: ("transfer", "agent", "server").index(p.role))
        lines = stop(order, timeout)
        (self.dir / CLUSTER_FILE).unlink(missing_ok=True)
        return lines

    @property
    def tokens(self) -> Tokens:
        """The cluster's tokens, from its transfer.conf (read once)."""
        if not hasattr(self, "_tokens"):
            try:
                cfg = load_config(self.dir / CONF_FILE)
            except ConfigError as exc:
                raise LocalError(f"cannot read the cluster's tokens: {exc}") from None
            self._tokens = Tokens(cfg.agent_token, cfg.api_token)
        return self._tokens

    def restart(self, name: str, timeout: float = 30.0) -> Proc:
        """Start `name` again with its recorded command line (stopping it first if running)."""
        proc = self.proc(name)
        stop([proc], timeout=10.0)
        start(proc, self.dir, self.tokens.agent)
        self.save()
        wait_healthy([proc], timeout, self.tokens)
        return proc

    def api(self, path: str, body: Any = None, timeout: float = 2.0) -> Any:
        """The transfer API's answer (JSON) to GET `path`, or POST `body`, with its token."""
        return http_json(self.transfer_url + path, body, timeout, self.tokens.api)

    # -- what is served --------------------------------------------------------------------
    def instance_rows(self) -> list[dict[str, Any]]:
        """One row per replica: addresses, process states, the version its server serves."""
        transfer_view: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(OSError, ValueError):
            reply = self.api("/instance/status")
            for inst in reply.get("data") or []:
                transfer_view[f"{inst['shard']}_{inst.get('replica', 0)}"] = inst
        rows = []
        for i in range(self.shards):
            for j in range(self.replicas):
                name = f"{i}_{j}"
                server, agent = self.proc(f"server{name}"), self.proc(f"agent{name}")
                row: dict[str, Any] = {
                    "instance": name,
                    "server": f"127.0.0.1:{server.port}",
                    "agent": f"127.0.0.1:{agent.port}",
                    "server_up": server.process() is not None,
                    "agent_up": agent.process() is not None,
                    "version": "",
                    "bg_version": "",
                    "state": transfer_view.get(name, {}).get("status", ""),
                    "serving": False,  # its server answers at its normal latency (ready)
                }
                answered = False
                if row["agent_up"]:
                    with contextlib.suppress(OSError, ValueError):
                        url = f"http://127.0.0.1:{agent.port}/agent/status"
                        status = http_json(url, token=self.tokens.agent)
                        answered = True
                        srv = (status.get("data") or {}).get("server") or {}
                        row["version"] = srv.get("cur_version") or ""
                        row["serving"] = bool((srv.get("detail") or {}).get("serving"))
                        row["bg_version"] = srv.get("bg_version") or ""
                        if not srv.get("reachable"):
                            row["state"] = "server unreachable"
                row["state"] = _instance_state(row, answered)
                rows.append(row)
        return rows

    def transfer_info(self) -> dict[str, Any]:
        try:
            reply = self.api("/dict/info")
        except (OSError, ValueError):
            return {}
        return reply.get("data") or {}

    def history(self) -> list[dict[str, Any]]:
        try:
            return self.api("/dict/deploy/history").get("data") or []
        except (OSError, ValueError):
            return []

    def status_table(self) -> str:
        info = self.transfer_info()
        transfer = self.proc("transfer")
        lines = [
            f"dict {self.dict_name}: {self.shards} shards x {self.replicas} replicas; "
            f"live version {info.get('live_version') or '-'}; transfer "
            f"{'up' if transfer.process() else 'DOWN'} at {self.transfer_url}",
        ]
        dep = info.get("deployment")
        if dep:
            lines.append(f"deploying {dep['version']} (phase {dep['phase']})")
        for rec in info.get("awaiting_retry") or []:
            when = time.strftime("%H:%M:%S", time.localtime(rec["retry_at"]))
            lines.append(f"retrying {rec['version']} at {when} (attempt {rec['attempts'] + 1} "
                         f"of {rec['max_attempts']}); last error: {rec['last_error']}")  # fmt: skip
        header = ("INSTANCE", "SERVER", "AGENT", "PROCESSES", "VERSION", "BG_VERSION", "STATE")
        rows = [header]
        for row in self.instance_rows():
            procs = f"server {'up' if row['server_up'] else 'DOWN'}, agent " + (
                "up" if row["agent_up"] else "DOWN"
            )
            rows.append(
                (
                    row["instance"],
                    row["server"],
                    row["agent"],
                    procs,
                    row["version"] or "-",
                    row["bg_version"] or "-",
                    row["state"] or "-",
                )
            )
        widths = [max(len(str(r[c])) for r in rows) for c in range(len(header))]
        for r in rows:
            lines.append(
                "  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
            )
        scraped = [f"{p.name} {p.metrics_port}" for p in self.processes if p.metrics_port]
        if scraped:
            lines.append("metrics (http://127.0.0.1:PORT/metrics): " + ", ".join(scraped))
        return "\n".join(lines)

    def wait_version(self, version: str, timeout: float, poll: float = 0.3) -> float:
        """Block until every replica's server serves `version` and the transfer reports it
        live; seconds waited. LocalError on timeout, or at once when the transfer reports the
        version failed."""
        started = time.monotonic()

        def served() -> bool:
            rows = self.instance_rows()
            everywhere = bool(rows) and all(r["version"] == version and r["serving"] for r in rows)
            return everywhere and self.transfer_info().get("live_version") == version

        def stop_if_failed() -> None:  # its latest record ended without a retry to come
            rec: dict[str, Any] = next(
                (r for r in reversed(self.history()) if r.get("version") == version), {}
            )
            if rec.get("status_str") in ("failed", "refused") and not rec.get("retry_at"):
                raise LocalError(f"version {version} {rec['status_str']}: {rec.get('message')}")

        if not poll_until(served, timeout, poll, check=stop_if_failed):
            raise LocalError(
                f"version {version} not served everywhere within {timeout:g}s\n"
                + self.status_table()
            )
        return time.monotonic() - started


def _write_private(path: Path, text: str) -> None:
    """Write `path` readable by its owner only (mode 0600 from the start), via a temp file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def up(spec: ClusterSpec, health_timeout: float = 60.0) -> Cluster:
    """Write the configs, start every process, wait until all answer. On failure whatever was
    started is stopped again."""
    spec.dir.mkdir(parents=True, exist_ok=True)
    root = spec.dir.resolve()
    try:
        existing: Cluster | None = Cluster.load(root)
    except LocalError:
        existing = None
    if existing is not None and existing.alive():
        raise LocalError(f"a cluster is already running in {root}; run cube-local down first")
    if spec.shards < 1 or spec.replicas < 1:
        raise LocalError("--shards and --replicas must be >= 1")
    ports = plan_ports(spec.shards, spec.replicas, spec.base_port, spec.metrics)
    cfg = cluster_config(spec, ports)
    try:  # a typo would be watched, empty, forever
        ensure_donefile_dir(cfg.donefile_address, spec.create_donefile_dir)
    except SourceUnavailable as exc:
        how = "" if spec.create_donefile_dir else "; create it, or pass --create_donefile_dir"
        raise LocalError(f"--donefile {spec.donefile}: {exc}{how}") from None
    for inst in cfg.instances:
        (Path(inst.deploy_path) / "data").mkdir(parents=True, exist_ok=True)
    check_inputs(cfg)
    try:
        conf_text = render_config(cfg)
        parse_config(conf_text, str(root / CONF_FILE), root)  # as the transfer will read it
    except ConfigError as exc:
        raise LocalError(str(exc)) from None
    _write_private(root / CONF_FILE, conf_text)  # it holds the tokens
    (root / "cube.conf").write_text(json.dumps(cube_conf(cfg, spec.dim), indent=1) + "\n")
    cluster = Cluster(
        dir=root,
        dict_name=spec.dict_name,
        shards=spec.shards,
        replicas=spec.replicas,
        transfer_port=ports["transfer"],
        processes=_processes(spec, cfg, ports),
        created=time.time(),
        dim=spec.dim,
    )
    try:
        for proc in cluster.processes:  # all at once: each waits for what it talks to
            start(proc, root, cfg.agent_token)
        cluster.save()
        wait_healthy(cluster.processes, health_timeout, cluster.tokens)
    except BaseException:
        stop([p for p in reversed(cluster.processes) if p.pid], timeout=5.0)
        (root / CLUSTER_FILE).unlink(missing_ok=True)
        raise
    return cluster


# ---------------------------------------------------------------------------------------------
# command line


@dataclass(frozen=True)
class UpFlags:
    """cube-local up's flags."""

    donefile: str = flag(
        "", "donefile directory the transfer watches", required=True, metavar="DIR"
    )
    create_donefile_dir: bool = flag(False, "create --donefile when it does not exist")
    shards: int = flag(2, "shards")
    replicas: int = flag(2, "replicas per shard")
    dir: str = flag(
        ".local-cluster", "cluster directory (configs, data, logs, PIDs)", metavar="DIR"
    )
    base_port: int = flag(0, "first port of the cluster's port block (0: pick free ports)")
    metrics: bool = flag(
        False, "Prometheus metrics of every process (--metrics_port), listed by up and status"
    )
    dim: int = flag(0, "embedding dimension, recorded in cube.conf for tools")
    dict_name: str = flag(DICT_NAME, "dictionary name")
    mode: str = flag("base_delta", "what the transfer rolls out", choices=MODES)
    quorum: int = flag(0, "replicas per shard that must load before a switch (0: all)")
    poll_interval: float = flag(1.0, "transfer donefile poll interval (s)")
    partitioner: str = flag("mod", "key to shard rule", choices=PARTITIONERS)
    phase_timeout: float = flag(120.0, "transfer phase timeout (s)")
    timeout: float = flag(60.0, "seconds to wait for every process to be healthy")
    agent_token: str = flag("", f"the agents' token (default: env {TOKEN_ENV})")
    api_token: str = flag("", f"the transfer API's token (default: env {API_TOKEN_ENV})")
    source_format: str = flag(
        "seqfile",
        "who writes the donefiles (transfer.conf source_format): seqfile: base.txt, patch.txt "
        "naming SequenceFiles; paddle_fleet, paddlerec: a PaddlePaddle trainer's, naming "
        "parameter-server saves (built with -input_format paddle_ps; their layout: "
        "--paddle_config)",
        choices=tuple(DONEFILE_FORMATS),
    )
    paddle_config: str = flag(
        "",
        "parameter-server saves: the trainer's PSParameter text (fleet_desc.prototxt; local, "
        "s3:// or webhdfs://), passed to cube-builder -paddle_config",
        metavar="FILE",
    )
    builder_flags: str = flag(
        "",
        "more cube-builder flags (transfer.conf builder_flags), split as a shell would, e.g. "
        "'-paddle_accessor ctr_common -paddle_dim 8 -paddle_optimizer adagrad' (give absolute "
        "paths: the builder runs in --dir)",
        metavar="FLAGS",
    )


@dataclass(frozen=True)
class DirFlags:
    """What every cube-local command but up takes: the cluster's directory."""

    dir: str = flag(".local-cluster", "cluster directory (of cube-local up --dir)", metavar="DIR")


@dataclass(frozen=True)
class StatusFlags(DirFlags):
    json: bool = flag(False, "print JSON (the transfer's info and the instance rows)")


@dataclass(frozen=True)
class WaitFlags(DirFlags):
    version: str = flag(
        "", "version to wait for (a base, or <base>_<delta>)", required=True, metavar="VERSION"
    )
    timeout: float = flag(120.0, "seconds to wait at most (then exit 1)")


@dataclass(frozen=True)
class RestartFlags(DirFlags):
    name: str = flag("", "server<i>_<j>, agent<i>_<j> or transfer", required=True, metavar="NAME")


@dataclass(frozen=True)
class DownFlags(DirFlags):
    timeout: float = flag(10.0, "seconds after SIGTERM before SIGKILL")


_UP_HELP = (
    "Start a cluster on loopback that rolls out what --donefile announces.\n"
    "A cube-server and a cube-agent per shard replica and a cube-transfer watching\n"
    "--donefile; cube.conf (for clients) and transfer.conf are written into --dir.\n"
    f"Tokens: env {TOKEN_ENV} for the agents, {API_TOKEN_ENV} for the transfer API."
)


def _builder_flags(flags: UpFlags) -> tuple[str, ...]:
    """--builder_flags split as a shell would, after -paddle_config from --paddle_config (a
    local file made absolute: the transfer runs in --dir)."""
    try:
        extra = tuple(shlex.split(flags.builder_flags))
    except ValueError as exc:
        raise LocalError(f"--builder_flags: {exc}") from None
    if not flags.paddle_config:
        return extra
    config = flags.paddle_config
    if "://" not in config:
        config = str(Path(config).resolve())
    return ("-paddle_config", config, *extra)


def _run_up(flags: UpFlags) -> int:
    spec = ClusterSpec(
        dir=Path(flags.dir),
        shards=flags.shards,
        replicas=flags.replicas,
        donefile=Path(flags.donefile),
        dict_name=flags.dict_name,
        base_port=flags.base_port,
        dim=flags.dim,
        mode=flags.mode,
        quorum=flags.quorum,
        poll_interval=flags.poll_interval,
        partitioner=flags.partitioner,
        phase_timeout=flags.phase_timeout,
        create_donefile_dir=flags.create_donefile_dir,
        metrics=flags.metrics,
        source_format=flags.source_format,
        builder_flags=_builder_flags(flags),
        transfer_overrides={
            name: value
            for name, value in (("agent_token", flags.agent_token), ("api_token", flags.api_token))
            if value
        },
    )
    cluster = up(spec, flags.timeout)
    print(f"cluster up in {cluster.dir}: transfer {cluster.transfer_url}, "
          f"cube.conf {cluster.cube_conf}")  # fmt: skip
    print(cluster.status_table())
    return 0


def _run_down(flags: DownFlags) -> int:
    for line in Cluster.load(flags.dir).down(flags.timeout):
        print(line)
    return 0


def _run_status(flags: StatusFlags) -> int:
    cluster = Cluster.load(flags.dir)
    if flags.json:
        print(json.dumps({"info": cluster.transfer_info(), "instances": cluster.instance_rows()}))
    else:
        print(cluster.status_table())
    return 0


def _run_wait(flags: WaitFlags) -> int:
    waited = Cluster.load(flags.dir).wait_version(flags.version, flags.timeout)
    print(f"version {flags.version} served by every replica ({waited:.1f}s)")
    return 0


def _run_restart(flags: RestartFlags) -> int:
    proc = Cluster.load(flags.dir).restart(flags.name)
    print(f"{proc.name} restarted (pid {proc.pid})")
    return 0


COMMANDS = (
    CommandSet("cube-local", "A whole Cube cluster on loopback, for trying Cube and for tests.")
    .add("up", FlagSet("cube-local up", _UP_HELP, spec=UpFlags), _run_up)
    .add(
        "status",
        FlagSet(
            "cube-local status",
            "Show each process (running, starting, dead) and the version each replica serves.",
            spec=StatusFlags,
        ),
        _run_status,
    )
    .add(
        "wait",
        FlagSet("cube-local wait", "Wait until every replica serves --version.", spec=WaitFlags),
        _run_wait,
    )
    .add(
        "restart",
        FlagSet(
            "cube-local restart",
            "Restart one process of the cluster by its name.",
            spec=RestartFlags,
        ),
        _run_restart,
    )
    .add(
        "down",
        FlagSet(
            "cube-local down",
            "Stop every process of the cluster (SIGTERM, then SIGKILL).",
            spec=DownFlags,
        ),
        _run_down,
    )
)


def run(argv: Sequence[str]) -> int:
    try:
        return COMMANDS.run(argv)
    except LocalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
