"""Talking to cube-agents (docs/ROLLOUT.md): commands, task polls, status, and driving one
command on one instance to an outcome within a deadline and a retry budget.

Every request has its own timeout; a long command (download, reload, ...) is started with one
POST and then polled, so a slow download never hits an HTTP timeout. A repeated command is safe:
the agent returns the existing task, restarts a failed one, never redoes a succeeded one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp

from cube.protocol import (
    CORRUPT_VERSION,
    FAILED,
    QUERY_COMMAND,
    SERVER_UNREACHABLE,
    SUCCEEDED,
    TaskReport,
    Work,
    read_envelope,
)
from cube.security import Token, TokenLike, TrustedCA
from cube.transfer.config import Instance

log = logging.getLogger("cube.transfer.agents")
MAX_ANSWER = 4 << 20  # bytes of one agent answer (a status lists its tasks: far less)


def said(value: Any, default: str, limit: int = 1000) -> str:
    """A message from an agent as text for a reason or a log: one line, at most `limit`
    characters (it ends up in the history every API client reads)."""
    text = " ".join(str(value).split()) if value else ""
    return (text[:limit] + ("..." if len(text) > limit else "")) or default


class AgentUnreachable(Exception):
    """No answer (connection refused, timeout, not JSON): the agent may come back."""


class AgentRefused(Exception):
    """The agent answered with an error envelope (bad request, unknown task, unauthorized, or
    409: busy with another command on that version or on its server)."""

    def __init__(self, message: str, http_status: int = 0) -> None:
        super().__init__(message)
        self.http_status = http_status


@dataclass
class Outcome:
    ok: bool
    message: str
    reason: str = ""  # the failed task's reason (e.g. CORRUPT_VERSION), "" otherwise


class AgentClient:
    """HTTP calls to agents: `https` when they serve TLS (trusting `trust`, the transfer's
    agent_tls_ca, as the file is when a request starts: new connections verify against a
    renewed bundle), with the agent token as a bearer header (a token file's as it is now)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        token: TokenLike = "",
        request_timeout: float = 10.0,
        scheme: str = "http",
        trust: TrustedCA | None = None,
    ) -> None:
        self.session = session
        self.token = token if isinstance(token, Token) else Token(token)
        self.request_timeout = request_timeout
        self.scheme = scheme
        self.trust = trust

    async def _request(self, inst: Instance, method: str, path: str, body: Any = None) -> Any:
        url = f"{self.scheme}://{inst.agent_address}{path}"
        token = self.token.value
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        # the session pools connections by context: a renewed bundle's makes new ones
        ssl = self.trust.context() if self.trust is not None else True
        try:
            async with self.session.request(
                method, url, json=body, headers=headers, timeout=timeout, ssl=ssl
            ) as resp:
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > MAX_ANSWER:  # a broken or hostile peer: do not buffer it all
                        raise AgentUnreachable(
                            f"agent {inst.agent_address}: answer over {MAX_ANSWER} bytes"
                        )
                try:
                    envelope = json.loads(raw)
                except ValueError as exc:
                    raise AgentUnreachable(f"agent {inst.agent_address}: HTTP {resp.status}, "
                                           f"not JSON") from exc  # fmt: skip
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise AgentUnreachable(
                f"agent {inst.agent_address}: {type(exc).__name__}: {exc}".rstrip(": ")
            ) from exc
        reply = read_envelope(envelope)
        if reply is None:
            raise AgentUnreachable(f"agent {inst.agent_address}: answer is not an envelope")
        if not reply.ok:
            raise AgentRefused(
                f"agent {inst.agent_address}: {said(reply.message, 'error')} "
                f"(success={reply.success}, HTTP {resp.status})",
                resp.status,
            )
        return reply.data

    async def status(self, inst: Instance) -> dict[str, Any]:
        # the instance by its deploy_path: one agent may serve several (as the original's)
        query = urlencode({"deploy_path": inst.deploy_path})
        data = await self._request(inst, "GET", f"/agent/status?{query}")
        if not isinstance(data, dict):
            raise AgentUnreachable(f"agent {inst.agent_address}: status without data")
        return data

    async def submit(self, inst: Instance, fields: dict[str, Any]) -> dict[str, Any]:
        data = await self._request(inst, "POST", "/agent/cmd", fields)
        if not isinstance(data, dict) or TaskReport.from_json(data) is None:
            raise AgentRefused(f"agent {inst.agent_address}: {fields['command']} returned no task")
        return data

    async def task(self, inst: Instance, command: str, version: str) -> dict[str, Any]:
        body = Work(
            QUERY_COMMAND, version, task_command=command, deploy_path=inst.deploy_path
        ).to_json()
        data = await self._request(inst, "POST", "/agent/cmd", body)
        if not isinstance(data, dict) or TaskReport.from_json(data) is None:
            raise AgentRefused(f"agent {inst.agent_address}: no task {command} {version}")
        return data


async def _server_down(client: AgentClient, inst: Instance) -> bool:
    """Whether the agent answers but says its cube-server does not."""
    try:
        status = await client.status(inst)
    except (AgentUnreachable, AgentRefused):
        return False
    server = status.get("server") or {}
    return server.get("reachable") is False


ProgressFn = Callable[[Instance, str, str], None]  # (instance, "running"|"ok"|"failed", message)


async def drive(
    client: AgentClient,
    inst: Instance,
    fields: dict[str, Any],
    timeout: float,
    retries: int,
    progress: ProgressFn | None = None,
    dead_timeout: float | None = None,
    poll: float = 0.1,
    max_poll: float = 1.0,
) -> Outcome:
    """Run one command on one agent until it succeeded, failed `retries + 1` times, failed
    with reason corrupt_version (at once: the caller must download again), or `timeout`
    seconds passed. An unreachable agent is waited for (it may be restarting) and the
    command re-sent when it answers; that does not use up a retry, but an agent silent for
    `dead_timeout` seconds in a row is given up on (so one dead replica does not hold a phase
    for its whole timeout)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    run = _Drive(client, inst, fields, retries, dead_timeout, poll, max_poll, loop.time)
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return run.outcome(f"timed out after {timeout:g}s ({run.last})")
        try:
            task = await run.ask(progress)
        except AgentUnreachable as exc:
            step: Outcome | float | None = run.unreachable(exc)
        except AgentRefused as exc:
            step = run.refused(exc)
        else:
            step = await run.answered(task)
        if isinstance(step, Outcome):
            return step
        if step is not None:
            await asyncio.sleep(min(step, max(remaining, 0.0)))


class _Drive:
    """The state of one `drive`: each answer (or its absence) gives either the Outcome or the
    seconds to wait before asking again (None: at once)."""

    def __init__(
        self,
        client: AgentClient,
        inst: Instance,
        fields: dict[str, Any],
        retries: int,
        dead_timeout: float | None,
        poll: float,
        max_poll: float,
        clock: Callable[[], float],
    ) -> None:
        self.client, self.inst, self.fields = client, inst, fields
        self.command, self.version = fields["command"], fields["version"]
        self.retries, self.dead_timeout, self.max_poll, self.clock = (
            retries, dead_timeout, max_poll, clock,
        )  # fmt: skip
        self.failures = 0
        self.submitted = False
        self.last = "no answer yet"
        self.delay = poll
        self.silent_since: float | None = None  # the agent does not answer
        self.server_down_since: float | None = None  # the agent answers, its server does not

    def outcome(self, why: str, reason: str = "") -> Outcome:
        return Outcome(False, f"{self.command} {self.version}: {why}", reason)

    async def ask(self, progress: ProgressFn | None) -> dict[str, Any]:
        """Submit the command (again) or poll its task."""
        if self.submitted:
            return await self.client.task(self.inst, self.command, self.version)
        task = await self.client.submit(self.inst, self.fields)
        self.submitted = True
        if progress:
            progress(self.inst, "running", "")
        return task

    def unreachable(self, exc: AgentUnreachable) -> Outcome | float:
        self.last = str(exc)
        self.submitted = False
        if self.silent_since is None:
            self.silent_since = self.clock()
        if self.dead_timeout is not None and self.clock() - self.silent_since >= self.dead_timeout:
            return self.outcome(f"agent silent for {self.dead_timeout:g}s ({self.last})")
        return 1.0

    def refused(self, exc: AgentRefused) -> Outcome | float | None:
        self.silent_since = None
        self.last = str(exc)
        if self.submitted:  # the agent lost the task (restarted with no journal?): send it again
            self.submitted = False
            return None
        if exc.http_status == 409:  # busy with another command: wait for it, no retry spent
            return 1.0
        self.failures += 1
        if self.failures > self.retries:
            return self.outcome(self.last)
        return 1.0

    async def answered(self, task: dict[str, Any]) -> Outcome | float:
        self.silent_since = None
        command, version = self.command, self.version
        if task.get("command") not in (None, command) or task.get("version") not in (None, version):
            self.submitted = False  # an answer about another task; ask again
            return self.delay
        state = task.get("state")
        if state == SUCCEEDED:
            return Outcome(True, said(task.get("message"), "ok"))
        if state == FAILED:
            return await self.failed(task)
        delay = self.delay
        self.delay = min(delay * 1.5, self.max_poll)
        return delay

    async def failed(self, task: dict[str, Any]) -> Outcome | float:
        self.last = said(task.get("message"), "failed")
        self.submitted = False
        if self.last.startswith("interrupted"):  # the agent restarted mid-task: just resume it
            return self.delay
        if task.get("reason") == CORRUPT_VERSION:  # the copy is gone: re-sending is useless
            return self.outcome(self.last, CORRUPT_VERSION)
        # The server was unreachable (the task says so, or the agent does now): it may be
        # restarting, so wait as for a silent agent, without spending a retry. The task's
        # own reason counts even if the server is back by the time we ask the agent.
        if task.get("reason") == SERVER_UNREACHABLE or await _server_down(self.client, self.inst):
            if self.server_down_since is None:
                self.server_down_since = self.clock()
            dead = self.dead_timeout
            if dead is None or self.clock() - self.server_down_since < dead:
                return 1.0
            self.last = f"{self.last} (its server has not answered for {dead:g}s)"
        else:
            self.server_down_since = None
        self.failures += 1
        if self.failures > self.retries:
            return self.outcome(self.last)
        log.warning("%s on %s failed (%s); retry %d of %d", self.command, self.inst.name,
                    self.last, self.failures, self.retries)  # fmt: skip
        return 1.0 * self.failures


async def run_phase(
    client: AgentClient,
    instances: list[Instance],
    fields_for: Callable[[Instance], dict[str, Any]],
    timeout: float,
    retries: int,
    progress: ProgressFn | None = None,
    dead_timeout: float | None = None,
) -> dict[str, Outcome]:
    """One command on many instances at once; instance name -> outcome."""
    outcomes = await asyncio.gather(
        *(
            drive(client, inst, fields_for(inst), timeout, retries, progress, dead_timeout)
            for inst in instances
        )
    )
    return {inst.name: outcome for inst, outcome in zip(instances, outcomes, strict=True)}
