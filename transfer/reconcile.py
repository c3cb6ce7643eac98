"""The reconciler: bring every replica that answers to the live version.

After each cycle the transfer asks every agent what its server serves. A replica on another
version (it was dead during a rollout, it lagged behind a delta, a catch-up failed) gets the
steps `catch_up_plan` decides (download what its disk lacks, reload the base and the deltas,
enable). A failed catch-up is shown on /instance/status and in the journal, and retried after a
bounded exponential backoff; the replica is never left reporting success it did not have.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from cube.protocol import RUNNING
from cube.transfer.agents import AgentClient, AgentRefused, AgentUnreachable, Outcome, drive
from cube.transfer.config import Instance, TransferConfig
from cube.transfer.journal import Journal
from cube.transfer.state import (
    ROLLOUT,
    InstanceStatus,
    Phase,
    Step,
    TransferState,
    backoff_delay,
    catch_up_plan,
    now,
    progress_recorder,
)
from cube.transfer.views import work_for

log = logging.getLogger("cube.transfer")
StatusMap = dict[str, dict[str, Any] | None]  # instance name -> agent status, None if silent


def silence_level(answered: bool, at: float, grace_until: float) -> int:
    """How loud an agent that does not answer is: INFO while the cluster may still be starting
    (it has not answered since this transfer started, and the grace, --dead_timeout from the
    start, has not passed), WARNING after that or once it had answered."""
    return logging.INFO if not answered and at < grace_until else logging.WARNING


class Reconciler:
    def __init__(
        self,
        cfg: TransferConfig,
        client: AgentClient,
        journal: Journal,
        dead_timeout: float,
        catch_up_backoff: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.journal = journal
        self.dead_timeout = dead_timeout
        self.catch_up_backoff = catch_up_backoff  # first wait after a failed catch-up (doubles)
        self.clock = clock
        self.grace_until = clock() + dead_timeout  # agents still starting: no warning before
        self.answered: set[str] = set()  # instances whose agent answered since the start
        self.noted: dict[str, int] = {}  # the level an agent's silence was logged at

    async def refresh(self, state: TransferState) -> StatusMap:
        """Every agent's status (None when it does not answer), noted in `state`."""

        async def one(inst: Instance) -> dict[str, Any] | None:
            try:
                return await self.client.status(inst)
            except (AgentUnreachable, AgentRefused) as exc:
                known = state.instances[inst.name]
                level = silence_level(inst.name in self.answered, self.clock(), self.grace_until)
                first = known.reachable or known.status != InstanceStatus.DEAD
                if first or self.noted.get(inst.name, level) < level:  # once, and once louder
                    starting = (
                        " (not answering yet: still starting?)" if level < logging.WARNING else ""
                    )
                    log.log(level, "instance %s: %s%s", inst.name, exc, starting)
                    self.noted[inst.name] = level
                known.reachable = False
                known.status = InstanceStatus.DEAD
                known.message = str(exc)
                return None

        infos = await asyncio.gather(*(one(inst) for inst in self.cfg.instances))
        out: StatusMap = {}
        for inst, info in zip(self.cfg.instances, infos, strict=True):
            out[inst.name] = info
            if info is None:
                continue
            self.answered.add(inst.name)
            self.noted.pop(inst.name, None)
            known = state.instances[inst.name]
            server = info.get("server") or {}
            known.reachable = bool(server.get("reachable"))
            known.version = str(server.get("cur_version") or "")
            known.bg_version = str(server.get("bg_version") or "")
            if known.status == InstanceStatus.DEAD:
                known.status = InstanceStatus.INIT
                known.message = ""
            if not known.reachable:
                known.message = f"server {inst.server_address} unreachable"
        return out

    async def run(self, state: TransferState) -> bool:
        """Refresh, then catch up every replica that answers, is off the live version, has
        no task running and is not waiting out a backoff. True when any catch-up ran (the
        state then has news to persist)."""
        infos = await self.refresh(state)
        chain = state.live_chain
        if not chain:
            return False
        jobs = []
        at = now()
        for inst in self.cfg.instances:
            info = infos[inst.name]
            known = state.instances[inst.name]
            if info is None or not known.reachable:
                continue
            if known.version == chain[-1]:
                if known.catch_up_failures or known.status.endswith("_Failed"):
                    known.status = InstanceStatus.ENABLE_SUCC  # it serves the live version
                known.recovered()
                continue
            if any(t.get("state") == RUNNING for t in info.get("tasks") or []):
                continue
            if at < known.next_catch_up:
                continue
            plan = catch_up_plan(known.version, chain, set(info.get("versions") or []))
            jobs.append(self._catch_up(state, inst, plan))
        if jobs:
            await asyncio.gather(*jobs)
        return bool(jobs)

    async def _catch_up(self, state: TransferState, inst: Instance, plan: list[Step]) -> None:
        known = state.instances[inst.name]
        log.info(
            "instance %s serves %r, live is %s: catching up (%s)",
            inst.name,
            known.version,
            state.live_version,
            ", ".join(f"{s.command} {s.version}" for s in plan),
        )
        for step in plan:
            rec = state.record(step.version)
            if rec is None:  # history trimmed past a live version: cannot happen, but say so
                why = f"catch-up: no record of {step.version}"
                self._failed(state, inst, step, Outcome(False, why))
                return
            timeout = {
                "download": self.cfg.download_timeout,
                "reload": self.cfg.reload_timeout,
                "enable": self.cfg.enable_timeout,
            }.get(step.command, self.cfg.reload_timeout + self.cfg.enable_timeout)
            fields = work_for(self.cfg, inst, step.command, rec)
            if step.mode == "delta":
                fields["chain"] = list(step.chain)
            note = progress_recorder(state, Phase(step.command))
            outcome = await drive(
                self.client, inst, fields, timeout, self.cfg.retries, note, self.dead_timeout
            )
            note(inst, "ok" if outcome.ok else "failed", outcome.message)
            if not outcome.ok:
                self._failed(state, inst, step, outcome)
                return
        known.recovered()
        known.version = state.live_version
        self.journal.event("caught_up", instance=inst.name, version=state.live_version)
        log.info("instance %s caught up to %s", inst.name, state.live_version)

    def _failed(self, state: TransferState, inst: Instance, step: Step, outcome: Outcome) -> None:
        """Record a failed catch-up where /instance/status, the journal and the log show it,
        and when to try again (bounded exponential backoff). A corrupt copy was quarantined by
        the agent, so the next plan downloads it again."""
        known = state.instances[inst.name]
        at = now()
        delay = backoff_delay(known.catch_up_failures + 1, self.catch_up_backoff)
        known.failed(step, outcome.reason, outcome.message, at, at + delay)
        if not known.status.endswith("_Failed"):
            known.status = ROLLOUT[Phase(step.command)].failed or InstanceStatus.DEAD
        known.message = outcome.message
        log.warning("catch-up of %s failed %d time(s) in a row at %s %s (%s%s); next try in %gs",
                    inst.name, known.catch_up_failures, step.command, step.version,
                    outcome.message, f", {outcome.reason}" if outcome.reason else "",
                    delay)  # fmt: skip
        self.journal.event(
            "catch_up_failed",
            instance=inst.name,
            command=step.command,
            version=step.version,
            reason=outcome.reason,
            message=outcome.message,
            failures=known.catch_up_failures,
            next_retry=known.next_catch_up,
        )
