"""Recovery from peers: an agent that starts with no version gets its shard's current version
from another replica's agent, so that a pod restarted empty serves again while the transfer is
down (docs/DEPLOY.md, "Recovery without the transfer").

A peer agent states its version chain (`GET /agent/peer/manifest`: data/VERSION, which only
a switch the transfer ordered writes, so a version the transfer committed; each layer's tar
md5 and size as the transfer sent them) and serves the verified tars it keeps
(`GET /agent/peer/tar/<version>/<name>`), both behind the agents' token. The recovering agent
runs its ordinary tasks on them: `download` (the size bounds the fetch, the md5 the peer
stated is checked, the tar is unpacked by agent/unpack.py), `reload`, `enable`. So a peer is
trusted only as far as the md5 it states: a tar that does not match is refused as a
transfer's would be.

The transfer is preferred: while it answers (a TCP connect to --transfer_address) or has sent
a command lately, the agent waits --peer_wait seconds for it first. Whatever the agent placed
from a peer is the same tar under the same version name as the transfer's, so the transfer's
own `download` of it later is answered as done (same md5), and its reconciler finds the replica
on the live version: nothing to fight over.

The decisions (`decide`, `choose`, `parse_manifest`) are pure; `PeerRecovery` is the loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from cube.backoff import Backoff
from cube.layout import base_of, is_name
from cube.protocol import SUCCEEDED
from cube.security import client_context

if TYPE_CHECKING:
    from cube.agent.deploy import Agent
    from cube.agent.tasks import Task

log = logging.getLogger("cube.agent")

MANIFEST_PATH = "/agent/peer/manifest"
TAR_PATH = "/agent/peer/tar"
MAX_LAYERS = 1000  # a chain longer than this is no peer's honest answer
MAX_TAR_BYTES = 1 << 44  # 16 TiB: a stated size past it is refused before any fetch
_MD5 = re.compile(r"[0-9a-f]{32}")


class Step(enum.Enum):
    DONE = "done"  # a version is current here: nothing to recover
    WAIT = "wait"  # the transfer is (or may soon be) doing it, or a backoff runs
    RECOVER = "recover"  # ask the peers now


@dataclass(frozen=True)
class Layer:
    """One version of a peer's chain: its tar as the transfer sent it."""

    version: str
    md5: str
    size: int
    mode: str  # base | delta
    tar: str  # the tar's file name
    shard_seq: int
    dict_name: str


@dataclass(frozen=True)
class Manifest:
    """What a peer agent serves: its current version, the chain to it, whether its server
    serves it now."""

    peer: str  # host:port of its agent
    current: str
    layers: tuple[Layer, ...]  # base first, ending with `current`
    serving: bool

    @property
    def chain(self) -> list[str]:
        return [layer.version for layer in self.layers]


def parse_manifest(peer: str, data: object) -> Manifest | str:
    """A peer's manifest, checked: names that are version names, a chain of one base and its
    deltas in order ending with the current version, md5s of 32 hex digits, sizes within
    MAX_TAR_BYTES, tar names that are names. Otherwise why not (never the peer's text)."""
    if not isinstance(data, dict):
        return "the manifest is not a JSON object"
    current, layers, serving = data.get("current"), data.get("layers"), data.get("serving")
    if current == "" or current is None:
        return "it has no version"
    if not is_name(current):
        return "its current version is not a version name"
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_LAYERS:
        return "its chain is missing, or too long"
    parsed: list[Layer] = []
    for i, item in enumerate(layers):
        layer = _layer(item, delta=i > 0)
        if layer is None:
            return f"layer {i} of its chain is malformed"
        parsed.append(layer)
    base = parsed[0].version
    if base_of(base) != base or any(base_of(layer.version) != base for layer in parsed[1:]):
        return "its chain is not one base and its deltas"
    if len({layer.version for layer in parsed}) != len(parsed) or parsed[-1].version != current:
        return "its chain does not end with its current version"
    shards = {(layer.shard_seq, layer.dict_name) for layer in parsed}
    if len(shards) != 1:
        return "its chain's layers are of different shards"
    return Manifest(peer, current, tuple(parsed), serving is True)


def _layer(item: object, delta: bool) -> Layer | None:
    if not isinstance(item, dict):
        return None
    version, md5, size, tar = (item.get(k) for k in ("version", "md5", "size", "tar"))
    shard, dict_name = item.get("shard_seq"), item.get("dict_name") or ""
    if not (is_name(version) and is_name(tar) and isinstance(md5, str) and _MD5.fullmatch(md5)):
        return None
    if not (type(size) is int and 0 < size <= MAX_TAR_BYTES and type(shard) is int):
        return None
    if shard < 0 or not (dict_name == "" or is_name(dict_name)):
        return None
    mode = "delta" if delta else "base"
    if item.get("mode") != mode:
        return None
    return Layer(version, md5, size, mode, tar, shard, dict_name)


def choose(manifests: Sequence[Manifest]) -> Manifest | None:
    """The peer to recover from: the version most peers hold (a rollout's switch may leave two
    for a moment; each is one the transfer committed), ties to the longer chain then the later
    name; among its holders, one whose server serves it."""
    if not manifests:
        return None
    holders: dict[tuple[str, ...], list[Manifest]] = {}
    for manifest in manifests:
        holders.setdefault(tuple(manifest.chain), []).append(manifest)

    def rank(chain: tuple[str, ...]) -> tuple[int, int, int, str]:
        group = holders[chain]
        return (len(group), sum(m.serving for m in group), len(chain), chain[-1])

    best = max(holders, key=rank)
    return max(holders[best], key=lambda m: m.serving)


@dataclass
class RecoveryState:
    """The recovery loop's memory; `decide` and `failed` are its rules (times: monotonic)."""

    started: float
    peer_wait: float  # seconds the transfer gets first, while it answers or commands
    backoff: Backoff = field(default_factory=lambda: Backoff(1.0, 30.0))
    attempts: int = 0
    next_try: float = 0.0
    state: str = "waiting"  # waiting | recovering | failed | recovered | not needed
    message: str = ""
    peer: str = ""
    version: str = ""
    took: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "attempts": self.attempts,
            "message": self.message,
            "peer": self.peer,
            "version": self.version,
            "took": self.took,
        }


def decide(
    rec: RecoveryState,
    now: float,
    has_version: bool,
    last_command: float | None,
    transfer_answers: bool,
) -> Step:
    """What the loop does now. A current version here: done. The transfer commanded within
    `peer_wait` s, or answers and the agent started less than `peer_wait` s ago: wait for it.
    A failed attempt's backoff: wait. Otherwise: recover from the peers."""
    if has_version:
        return Step.DONE
    if last_command is not None and now - last_command < rec.peer_wait:
        return Step.WAIT
    if transfer_answers and now - rec.started < rec.peer_wait:
        return Step.WAIT
    if now < rec.next_try:
        return Step.WAIT
    return Step.RECOVER


def failed(rec: RecoveryState, now: float, message: str) -> float:
    """Note a failed attempt; the seconds until the next (the backoff doubles, capped)."""
    rec.attempts += 1
    delay = rec.backoff.delay(rec.attempts - 1)
    rec.next_try = now + delay
    rec.state, rec.message = "failed", message
    return delay


class RecoveryFailed(Exception):
    """One attempt that did not end with the version served; the message says why."""


@dataclass(frozen=True)
class PeerConfig:
    """--peers and what goes with it."""

    peers: tuple[str, ...]  # host:port of every agent of the shard (itself too: skipped)
    token: Callable[[], str] = lambda: ""  # the agents' token now (theirs is the same)
    scheme: str = "http"  # https when the agents serve TLS
    tls_ca: str = ""
    peer_wait: float = 30.0
    transfer_address: str = ""  # host:port; answering = the transfer may do it itself
    io_timeout: float = 5.0  # one manifest request, one connect check
    poll: float = 1.0  # seconds between decisions

    def others(self, hostname: str) -> list[str]:
        """The peers but this pod (its hostname is the first label of its name)."""
        return [p for p in self.peers if p.split(".", 1)[0].rsplit(":", 1)[0] != hostname]


def token_text(token: object) -> str:
    """The token to send of a command's token: a string, or an object whose `value` is one
    (cube.security's reloading token)."""
    value = getattr(token, "value", token)
    return value if isinstance(value, str) else ""


def tcp_answers(address: str, timeout: float) -> bool:
    """Whether host:port accepts a TCP connection within `timeout` s."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout):
            return True
    except (OSError, ValueError):
        return False


class PeerRecovery:
    """The loop: until a version is current here, decide; recover when the rules say so."""

    def __init__(
        self,
        agent: Agent,
        config: PeerConfig,
        clock: Callable[[], float] = time.monotonic,
        hostname: str | None = None,
    ) -> None:
        self.agent = agent
        self.config = config
        self.clock = clock
        self.peers = config.others(hostname if hostname is not None else socket.gethostname())
        self.state = RecoveryState(started=clock(), peer_wait=config.peer_wait)

    async def run(self) -> None:
        """Until done (or cancelled); every wait is `poll` s, every attempt bounded by the
        agent's download and reload timeouts."""
        from cube.agent.layout import read_version_file

        if read_version_file(self.agent.layout):
            self.state.state = "not needed"
            return
        log.info("no version here: recovering from peers %s unless the transfer does it",
                 ", ".join(self.peers) or "(none)")  # fmt: skip
        while True:
            answers = bool(self.config.transfer_address) and await asyncio.to_thread(
                tcp_answers, self.config.transfer_address, self.config.io_timeout
            )
            now = self.clock()
            has_version = bool(read_version_file(self.agent.layout))
            step = decide(self.state, now, has_version, self.agent.last_command, answers)
            if step is Step.DONE:
                if self.state.state != "recovered":
                    self.state.state = "not needed"
                return
            if step is Step.RECOVER:
                started = self.clock()
                self.state.state, self.state.message = "recovering", ""
                try:
                    await self.recover_once()
                except RecoveryFailed as exc:
                    delay = failed(self.state, self.clock(), str(exc))
                    log.warning("recovery from peers failed (attempt %d): %s; next in %gs",
                                self.state.attempts, exc, delay)  # fmt: skip
                else:
                    self.state.took = round(self.clock() - started, 3)
                    self.state.state = "recovered"
                    log.info("recovered %s from peer %s in %.2f s", self.state.version,
                             self.state.peer, self.state.took)  # fmt: skip
                    return
            await asyncio.sleep(self.config.poll)

    async def manifests(self) -> tuple[list[Manifest], list[str]]:
        """Every peer's checked manifest, and why each other peer gave none."""
        timeout = aiohttp.ClientTimeout(total=self.config.io_timeout)
        ssl = client_context(self.config.tls_ca) if self.config.scheme == "https" else None
        token = self.config.token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        got: list[Manifest] = []
        problems: list[str] = []
        connector = aiohttp.TCPConnector(ssl=ssl) if ssl is not None else None
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def one(peer: str) -> None:
                url = f"{self.config.scheme}://{peer}{MANIFEST_PATH}"
                try:
                    async with session.get(url, headers=headers, allow_redirects=False) as reply:
                        if reply.status != 200:
                            problems.append(f"{peer}: HTTP {reply.status}")
                            return
                        body = await reply.json(content_type=None)
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    problems.append(f"{peer}: {type(exc).__name__}")
                    return
                data = body.get("data") if isinstance(body, dict) else None
                parsed = parse_manifest(peer, data)
                if isinstance(parsed, str):
                    problems.append(f"{peer}: {parsed}")
                else:
                    got.append(parsed)

            await asyncio.gather(*(one(peer) for peer in self.peers))
        return got, problems

    async def recover_once(self) -> None:
        """Ask the peers, then download every layer of the chosen chain from its peer, reload
        and enable it, as the transfer's catch-up would."""
        manifests, problems = await self.manifests()
        chosen = choose(manifests)
        if chosen is None:
            raise RecoveryFailed(f"no peer has a version ({'; '.join(problems) or 'no peers'})")
        self.state.peer, self.state.version = chosen.peer, chosen.current
        cfg = self.agent.config
        chain = chosen.chain
        for i, layer in enumerate(chosen.layers):
            request = {
                "mode": layer.mode,
                "dict_name": layer.dict_name,
                "shard_seq": layer.shard_seq,
                "source": f"{self.config.scheme}://{chosen.peer}{TAR_PATH}/{layer.version}/"
                f"{layer.tar}",
                "md5": layer.md5,
                "size": layer.size,
                "chain": chain[: i + 1] if layer.mode == "delta" else [],
                "peer": chosen.peer,  # (set here only: the API's requests cannot carry it)
            }
            await self._run("download", layer.version, request, cfg.fetch.timeout + 60)
        ask = {"mode": chosen.layers[-1].mode, "peer": chosen.peer, "chain": chain}
        await self._run("reload", chosen.current, ask, cfg.reload_timeout + 60)
        await self._run("enable", chosen.current, ask, cfg.control_timeout * 3 + 60)

    async def _run(self, command: str, version: str, request: dict[str, Any], limit: float) -> None:
        from cube.agent.tasks import TaskBusy

        try:
            task: Task = await self.agent.tasks.submit(command, version, request)
        except TaskBusy as exc:  # the transfer is at work: it has the say
            raise RecoveryFailed(f"{command} {version}: {exc}") from None
        await self.agent.tasks.wait_for(task, limit)
        if task.state != SUCCEEDED:
            raise RecoveryFailed(f"{command} {version} from {request.get('peer')}: {task.message}")
