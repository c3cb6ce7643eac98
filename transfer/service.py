"""The transfer itself: watch donefiles, build, roll out in phases, reconcile, roll back.

One asyncio task does the work under one lock (`cycle`): resume a deployment left by a previous
run, read new donefile lines, build and deploy pending versions one at a time, then bring lagging
instances to the live version. The HTTP API reads the same state and may ask for a rollback.

Rollout of a version (docs/ROLLOUT.md for the agent side):
1. build: input fetched (local path or mirrored), cube-builder run, tars checked (md5, members);
2. download on every instance, 3. reload (background load) on those that downloaded;
   after each, every shard must have `quorum` replicas that succeeded, else the version is
   aborted: nothing switched, every instance still serves the previous version;
4. commit (journaled), then enable on the loaded replicas. If a shard still ends below quorum,
   the replicas that switched are sent `rollback` to the previous version.
Replicas left behind (dead, lagging, failed) are caught up by the reconciler when they answer.
A version that failed is rolled out again later (`state.after_failure`, the config's
`retry_policy`) unless retrying cannot help; `next_version` picks it when it is due.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp

from cube.donefile import parse_line, split_complete_lines
from cube.protocol import CORRUPT_VERSION
from cube.security import TrustedCA
from cube.transfer import build as builds
from cube.transfer.agents import AgentClient, AgentRefused, AgentUnreachable, Outcome, run_phase
from cube.transfer.build_runner import BuildFailed, BuildRunner
from cube.transfer.config import TransferConfig
from cube.transfer.donefile import SourceUnavailable, donefile_urls, read_donefile
from cube.transfer.journal import Journal
from cube.transfer.metrics import RolloutCounters
from cube.transfer.reconcile import Reconciler
from cube.transfer.state import (
    ROLLOUT,
    Deployment,
    InstanceState,
    Phase,
    TransferState,
    VersionRecord,
    VersionStatus,
    after_failure,
    awaiting_retry,
    begin_attempt,
    finish,
    ingest,
    live_records,
    next_version,
    now,
    progress_recorder,
    quorum_shortfall,
    requeue,
    shrink_refusal,
    width_refusal,
)
from cube.transfer.views import work_for

log = logging.getLogger("cube.transfer")
_OUTPUT_DIR = re.compile(r"\d+_\d+")


class Busy(Exception):
    """A request that needs the work lock while a rollout holds it."""


class TransferService:
    def __init__(
        self,
        cfg: TransferConfig,
        poll_interval: float = 5.0,
        dead_timeout: float = 60.0,
        keep_outputs: int = 3,
        catch_up_backoff: float = 5.0,
    ) -> None:
        self.cfg = cfg
        self.poll_interval = poll_interval
        self.dead_timeout = dead_timeout
        self.keep_outputs = keep_outputs
        self.catch_up_backoff = catch_up_backoff  # first wait after a failed catch-up (doubles)
        self.journal = Journal(cfg.tmp_address)
        self.state = TransferState(dict_name=cfg.dict_name)
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.by_shard = {s: [i.name for i in cfg.shard_instances(s)] for s in range(cfg.shard_num)}
        self._session: aiohttp.ClientSession | None = None
        self.client: AgentClient | None = None
        self.reconciler: Reconciler | None = None
        self.builder = BuildRunner(cfg)
        self.retry_policy = cfg.retry_policy
        self._donefile_errors: dict[str, str] = {}
        self.rollout_counters = RolloutCounters()

    # -- lifecycle ---------------------------------------------------------------------------
    async def open(self) -> None:
        self.cfg.output_address.mkdir(parents=True, exist_ok=True)
        self.state = self.journal.load(self.cfg.dict_name)
        for inst in self.cfg.instances:
            self.state.instances.setdefault(inst.name, InstanceState())
        self.builder.reap_orphan()
        ca = self.cfg.agent_tls_ca
        self._session = aiohttp.ClientSession()
        self.client = AgentClient(
            self._session,
            self.cfg.agent_token_source(),
            scheme="https" if ca else "http",
            trust=TrustedCA(ca) if ca else None,  # followed as it is renewed
        )
        self.reconciler = Reconciler(
            self.cfg, self.client, self.journal, self.dead_timeout, self.catch_up_backoff
        )
        try:
            builds.resolve_command(self.cfg.buildtool_local)
        except builds.BuildError as exc:
            log.warning("%s (builds will fail until it exists)", exc)
        log.info(
            "watching donefiles %s",
            ", ".join(donefile_urls(self.cfg.donefile_address, self.donefile_names)),
        )
        if self.state.deployment:
            log.info(
                "resuming %s of %s at phase %s",
                self.state.deployment.kind,
                self.state.deployment.version,
                self.state.deployment.phase,
            )
        log.info("live version: %s", self.state.live_version or "(none)")

    async def close(self) -> None:
        if self._session:
            await self._session.close()
            self._session = None
        await asyncio.to_thread(self.journal.close)

    async def save(self) -> None:
        """Persist the state (before acting on what changed); the writing is off the loop."""
        self.state.trim_history(self.cfg.history_limit)
        await self.journal.persist(self.state)

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop` is set; every cycle is bounded by the configured timeouts."""
        while not stop.is_set():
            try:
                async with self.lock:
                    await self.cycle()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("transfer cycle failed; retrying in %gs", self.poll_interval)
            self.wake.clear()
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.wake.wait())]
            _, pending = await asyncio.wait(
                waiters, timeout=self.poll_interval, return_when=asyncio.FIRST_COMPLETED
            )
            for waiter in pending:
                waiter.cancel()

    async def cycle(self) -> None:
        if self.state.deployment:
            await self.resume()
        before = {id(r) for r in awaiting_retry(self.state)}
        await self.poll_donefiles()
        while True:
            rec, logs = next_version(self.state, now(), self.cfg.paddle_saves)
            for line in logs:
                log.warning("%s", line)
                self.journal.event("refused", message=line)
            self._count_abandoned(before)
            if logs:
                await self.save()
            if rec is None:
                break
            await self.start_deploy(rec)
            before = {id(r) for r in awaiting_retry(self.state)}
        await self.reconcile()

    def _count_abandoned(self, before: set[int]) -> None:
        """Count the versions that awaited a retry (`before`) and were abandoned since."""
        for rec in self.state.history:
            if id(rec) in before and not rec.awaiting_retry and rec.abandoned:
                self.rollout_counters.abandoned += 1
                before.discard(id(rec))

    # -- donefiles ---------------------------------------------------------------------------
    @property
    def donefile_names(self) -> list[str]:
        """The donefiles this mode reads: the base file (base.txt, or source_format's), and
        the patch file with base_delta."""
        fmt = self.cfg.donefile_format
        return [fmt.base_file] + ([fmt.patch_file] if self.cfg.mode == "base_delta" else [])

    async def poll_donefiles(self) -> None:
        changed = False
        for name in self.donefile_names:
            try:
                text = await read_donefile(self.cfg.donefile_address, name)
            except SourceUnavailable as exc:
                self.rollout_counters.donefile_errors += 1
                if self._donefile_errors.get(name) != str(exc):
                    log.warning("donefile not readable: %s", exc)
                self._donefile_errors[name] = str(exc)
                continue
            self._donefile_errors.pop(name, None)
            lines = split_complete_lines(text)
            cursor = self.state.cursors.get(name, 0)
            if len(lines) < cursor:
                log.warning(
                    "%s shrank from %d to %d lines; reading it again from the start "
                    "(versions already live or pending are ignored)",
                    name,
                    cursor,
                    len(lines),
                )
                cursor = 0
            if len(lines) == cursor:
                continue
            fmt = self.cfg.donefile_format
            parsed = [
                parse_line(name, cursor + i + 1, text, fmt) for i, text in enumerate(lines[cursor:])
            ]
            for level, message in ingest(self.state, [p for p in parsed if p], now()):
                getattr(log, level)("%s", message)
                self.journal.event("line", level=level, message=message)
            self.state.cursors[name] = len(lines)
            changed = True
        if changed:
            await self.save()

    # -- rollout ------------------------------------------------------------------------------
    async def start_deploy(self, rec: VersionRecord) -> None:
        begin_attempt(rec)
        if rec.attempts > 1:
            self.rollout_counters.retries += 1
            log.info("%s %s: attempt %d of %d (the last one failed: %s)", rec.mode, rec.version,
                     rec.attempts, self.retry_policy.attempts, rec.last_error)  # fmt: skip
            self.journal.event("retry", version=rec.version, attempt=rec.attempts)
        self.state.deployment = Deployment(
            kind="deploy",
            version=rec.version,
            phase="build",
            prev_version=self.state.live_version,
            prev_chain=list(self.state.live_chain),
            targets=[inst.name for inst in self.cfg.instances],
            started_at=now(),
        )
        rec.status = VersionStatus.BUILDING
        await self.save()
        self.journal.event("deploy_start", version=rec.version, line=rec.line)
        await self.resume()

    async def resume(self) -> None:
        dep = self.state.deployment
        assert dep is not None
        if dep.kind == "rollback":
            await self._resume_rollback(dep)
            return
        rec = self.state.record(dep.version)
        if rec is None:
            log.error("deployment of %s has no history record; dropping it", dep.version)
            self.state.deployment = None
            await self.save()
            return
        try:
            while dep.phase != Phase.ENABLE:
                phase = Phase(dep.phase)
                if not await self._deploy_step(phase, rec, dep):
                    return
                rule = ROLLOUT[phase]
                assert rule.next is not None and rule.version_status is not None
                rec.status = rule.version_status
                dep.phase = rule.next
                if rule.next == Phase.ENABLE:  # every shard has its quorum loaded: commit
                    dep.committed = True
                await self.save()
                if dep.committed and phase == Phase.RELOAD:
                    self.journal.event("commit", version=rec.version, targets=dep.targets)
            await self._enable(rec, dep)
        except _Abort as exc:
            await self._fail(rec, str(exc), exc.final)

    async def _deploy_step(self, phase: Phase, rec: VersionRecord, dep: Deployment) -> bool:
        """Run one phase of a deploy before the switch (ROLLOUT says what comes next); False
        when the version stops here without failing (refused)."""
        if phase == Phase.BUILD:
            await self._build(rec)
            refusal = shrink_refusal(
                rec, live_records(self.state), self.cfg.max_shrink, self.cfg.allow_empty_base
            ) or width_refusal(self.state, rec, self.cfg.variable_width)
            if refusal:
                await self._end(rec, VersionStatus.REFUSED, refusal)
                return False
            if self.cfg.download_mode == "s3":  # agents download the tars from upload_address
                try:
                    await self.builder.upload(rec)
                except BuildFailed as exc:
                    raise _Abort(str(exc)) from exc
        elif phase == Phase.DOWNLOAD:
            await self._phase(rec, dep, "download")
        elif phase == Phase.RELOAD:
            if rec.mode == "delta":
                await self._drop_lagging(dep)
            await self._phase(rec, dep, "reload")
        return True

    async def _fail(self, rec: VersionRecord, message: str, final: str = "") -> None:
        """`rec` failed; `final` says why retrying cannot help ("": it may be retried)."""
        await self._end(rec, VersionStatus.FAILED, message, final)

    async def _end(self, rec: VersionRecord, status: str, message: str, final: str = "") -> None:
        """End the deployment of `rec` without it going live: `failed` (retried later as the
        retry policy says, unless `final` says why that cannot help), or `refused` (the build
        is fine but must not replace the live table); the reason is in its record, the
        journal and the log."""
        at = now()
        finish(rec, status, message, at)
        self.rollout_counters.ended("aborted" if status == VersionStatus.FAILED else "refused")
        retry = ""
        if status == VersionStatus.FAILED:
            retry = after_failure(rec, not final, final, self.retry_policy, at)
            self.rollout_counters.abandoned += 1 if rec.abandoned else 0
        self.state.deployment = None
        await self.save()
        event = "deploy_failed" if status == "failed" else "deploy_refused"
        self.journal.event(event, version=rec.version, message=message, attempt=rec.attempts,
                           retry_at=rec.retry_at, abandoned=rec.abandoned)  # fmt: skip
        log.error("version %s %s: %s", rec.version or rec.line, status, message)
        if retry:
            log.warning("%s", retry)
        await self._prune_outputs()

    async def _build(self, rec: VersionRecord) -> None:
        rec.times["build_start"] = now()
        rec.output = str(self.builder.output_dir(rec))
        await self.save()
        # published again after a rollout that failed once agents had downloaded it: the
        # same tars again (a version name is built once), when the build is still there
        # (also this record's own earlier attempt, when this is a retry)
        downloaded = any(
            r.version == rec.version and "downloaded" in r.times for r in self.state.history
        )
        try:
            await self.builder.build(rec, reuse=downloaded)
        except BuildFailed as exc:
            final = "the builder refused this input; publish the line again once it is fixed"
            raise _Abort(str(exc), final if exc.permanent else "") from exc
        rec.times["built"] = now()
        for inst in self.cfg.instances:
            self.state.instances[inst.name].times["builded_time"] = rec.times["built"]
        self.journal.event("built", version=rec.version, shards=rec.shards)
        log.info("built %s in %.1fs: %s records, %s deleted keys", rec.version,
                 rec.times["built"] - rec.times["build_start"], rec.count("records"),
                 rec.count("deleted"))  # fmt: skip
        for name in self.state.live_chain:  # the live side of the shrink check
            if (live := self.state.record(name)) is not None:
                await self.builder.count_records(live)

    async def _run(
        self, phase: str, names: list[str], rec: VersionRecord, timeout: float
    ) -> dict[str, Outcome]:
        assert self.client is not None
        instances = [self.cfg.instance(n) for n in names]
        note = progress_recorder(self.state, Phase(phase))
        outcomes = await run_phase(
            self.client,
            instances,
            lambda inst: work_for(self.cfg, inst, phase, rec),
            timeout,
            self.cfg.retries,
            note,
            self.dead_timeout,
        )
        for inst in instances:
            outcome = outcomes[inst.name]
            note(inst, "ok" if outcome.ok else "failed", outcome.message)
            if not outcome.ok:
                log.warning(
                    "%s %s on %s failed: %s", phase, rec.version, inst.name, outcome.message
                )
        return outcomes

    async def _phase(self, rec: VersionRecord, dep: Deployment, phase: str) -> None:
        timeout = {"download": self.cfg.download_timeout, "reload": self.cfg.reload_timeout}[phase]
        log.info("%s %s on %d instances", phase, rec.version, len(dep.targets))
        outcomes = await self._run(phase, dep.targets, rec, timeout)
        if phase == "reload":
            outcomes.update(await self._repair_corrupt(rec, outcomes, timeout))
        dep.results[phase] = _result_summary(outcomes)
        dep.targets = [n for n in dep.targets if outcomes[n].ok]
        rec.times[{"download": "downloaded", "reload": "reloaded"}[phase]] = now()
        shortfall = quorum_shortfall(set(dep.targets), self.by_shard, self.cfg.quorum)
        if shortfall:
            failures = {n: o.message for n, o in outcomes.items() if not o.ok}
            failures.update(dep.results.get("lagging", {}) if phase == "reload" else {})
            reasons = "; ".join(f"{n}: {why}" for n, why in sorted(failures.items()))
            raise _Abort(
                f"{phase} did not reach quorum {self.cfg.quorum} ({', '.join(shortfall)}); "
                f"nothing was switched. {reasons}"
            )
        await self.save()

    async def _repair_corrupt(
        self, rec: VersionRecord, outcomes: dict[str, Outcome], timeout: float
    ) -> dict[str, Outcome]:
        """Replicas whose server refused their copy as corrupt (the agent quarantined it)
        download it again and reload once more; their new outcomes."""
        corrupt = sorted(n for n, o in outcomes.items() if o.reason == CORRUPT_VERSION)
        if not corrupt:
            return {}
        log.warning("%s: corrupt copy on %s; downloading it again", rec.version, corrupt)
        self.journal.event("corrupt_version", version=rec.version, instances=corrupt)
        downloads = await self._run("download", corrupt, rec, self.cfg.download_timeout)
        again = [n for n in corrupt if downloads[n].ok]
        reloads = await self._run("reload", again, rec, timeout) if again else {}
        return {**{n: downloads[n] for n in corrupt if n not in again}, **reloads}

    async def _drop_lagging(self, dep: Deployment) -> None:
        """A delta loads on top of what a server holds: only servers on the previous live
        version take part; the others catch up later through the reconciler."""
        assert self.client is not None
        lagging: dict[str, str] = {}
        for name in list(dep.targets):
            try:
                info = await self.client.status(self.cfg.instance(name))
            except (AgentUnreachable, AgentRefused):
                continue  # it may come back during the phase; the agent checks the chain too
            server = info.get("server") or {}
            if server.get("reachable") and server.get("cur_version") != dep.prev_version:
                lagging[name] = (
                    f"serves {server.get('cur_version')!r}, the delta needs {dep.prev_version!r}"
                )
        if lagging:
            log.warning("lagging instances skip this delta: %s", lagging)
            dep.results["lagging"] = lagging
            dep.targets = [n for n in dep.targets if n not in lagging]

    async def _enable(self, rec: VersionRecord, dep: Deployment) -> None:
        log.info("enable %s on %d instances", rec.version, len(dep.targets))
        enabled, failure = await self._switch("enable", dep, rec, self.cfg.enable_timeout)
        if failure:
            await self._fail(rec, failure)
            return
        at = now()
        rec.times["enabled"] = at
        live_on = f"live on {len(enabled)} of {len(self.cfg.instances)} instances"
        finish(rec, VersionStatus.FINISHED, live_on, at)
        self.rollout_counters.ended("committed", rec.times, at)
        self.state.live_version = rec.version
        self.state.live_chain = list(rec.chain)
        self.state.live_since = at
        self.state.deployment = None
        await self.save()
        self.journal.event("live", version=rec.version, chain=rec.chain, instances=sorted(enabled))
        log.info(
            "version %s is live (%d/%d instances; %.1fs after its line was seen)",
            rec.version,
            len(enabled),
            len(self.cfg.instances),
            at - rec.times.get("line_seen", at),
        )
        await self._prune_outputs()
        self.wake.set()  # reconcile the ones left behind soon

    async def _switch(
        self, phase: str, dep: Deployment, rec: VersionRecord, timeout: float
    ) -> tuple[set[str], str]:
        """Run a switching phase (enable, rollback) on the targets: the instances that switched,
        and, when they fall short of quorum, why (after sending the switched ones back to the
        previous live version); "" when quorum was reached."""
        outcomes = await self._run(phase, dep.targets, rec, timeout)
        dep.results[phase] = _result_summary(outcomes)
        switched = {n for n, o in outcomes.items() if o.ok}
        shortfall = quorum_shortfall(switched, self.by_shard, self.cfg.quorum)
        if not shortfall:
            return switched, ""
        reasons = "; ".join(f"{n}: {o.message}" for n, o in sorted(outcomes.items()) if not o.ok)
        message = f"{phase} did not reach quorum ({', '.join(shortfall)}): {reasons}"
        message += await self._return_to_previous(dep, sorted(switched))
        return switched, message

    async def _return_to_previous(self, dep: Deployment, switched: list[str]) -> str:
        """Send the switched instances back to the previous live version; a note for the log."""
        prev = self.state.record(dep.prev_version)
        if not switched:
            return "; no instance had switched"
        if prev is None:
            return "; there is no previous version to return to"
        outcomes = await self._run("rollback", switched, prev, self.cfg.enable_timeout)
        failed = [n for n, o in outcomes.items() if not o.ok]
        if failed:
            return (f"; returned {len(switched) - len(failed)} instances to {prev.version}, "
                    f"{', '.join(failed)} still to be reconciled")  # fmt: skip
        return f"; the {len(switched)} switched instances are back on {prev.version}"

    # -- rollback ----------------------------------------------------------------------------
    def _refuse_during_a_deployment(self) -> None:
        dep = self.state.deployment
        if dep is not None:
            raise Busy(f"busy: {dep.kind} of {dep.version} (phase {dep.phase}); try again later")

    async def rollback(self, version: str, lock_timeout: float = 30.0) -> VersionRecord:
        """Make `version` (an earlier live version, still on the agents' disks) live again."""
        self._refuse_during_a_deployment()  # at once, without waiting for the lock
        try:  # the worker may hold the lock for a status round or a catch-up: wait a little
            await asyncio.wait_for(self.lock.acquire(), timeout=lock_timeout)
        except TimeoutError:
            raise Busy(f"busy for more than {lock_timeout:g}s; try again later") from None
        try:
            self._refuse_during_a_deployment()  # one may have begun while we waited
            target = self.state.record(version)
            if target is None or target.status != VersionStatus.FINISHED:
                raise ValueError(f"version {version!r} was never live here; cannot roll back to it")
            if version == self.state.live_version:
                raise ValueError(f"version {version} is already live")
            rec = VersionRecord(
                version=target.version,
                depend=target.depend,
                id=target.id,
                key=target.key,
                mode="rollback",
                input=target.input,
                output=target.output,
                line="api",
                chain=list(target.chain),
                status="deploying",
                create_time=now(),
                times={"requested": now()},
                shards=dict(target.shards),
            )
            self.state.history.append(rec)
            self.state.deployment = Deployment(
                kind="rollback",
                version=version,
                phase="rollback",
                prev_version=self.state.live_version,
                prev_chain=list(self.state.live_chain),
                targets=[inst.name for inst in self.cfg.instances],
                started_at=now(),
            )
            await self.save()
            self.journal.event("rollback_start", version=version, prev=self.state.live_version)
            await self._resume_rollback(self.state.deployment)
            return rec
        finally:
            self.lock.release()

    async def retry(self, version: str) -> tuple[VersionRecord, bool]:
        """Roll out the abandoned `version` again (`state.requeue`: ValueError when it cannot
        be): journaled before the answer, so a restart keeps it; the worker is woken to take
        it (after the rollout in progress, if any). Returns its record and whether this call
        re-queued it (False: it already was)."""
        rec, requeued = requeue(self.state, version, now())
        if requeued:
            await self.save()
            self.journal.event("retry_requested", version=rec.version, line=rec.line)
            log.info("version %s: retry requested over the API (%s)", version, rec.last_error)
            self.wake.set()
        return rec, requeued

    async def _resume_rollback(self, dep: Deployment) -> None:
        rec = next(
            (
                r
                for r in reversed(self.state.history)
                if r.mode == "rollback" and r.version == dep.version
            ),
            None,
        )
        target = self.state.record(dep.version)
        if rec is None or target is None:
            self.state.deployment = None
            await self.save()
            return
        log.info("rollback to %s on %d instances", dep.version, len(dep.targets))
        timeout = self.cfg.reload_timeout + self.cfg.enable_timeout
        switched, failure = await self._switch("rollback", dep, target, timeout)
        if failure:
            finish(rec, VersionStatus.FAILED, failure, now())
            self.rollout_counters.ended("rollback_failed")
            self.state.deployment = None
            await self.save()
            log.error("rollback to %s failed: %s", dep.version, failure)
            return
        at = now()
        finish(rec, VersionStatus.FINISHED, f"rolled back on {len(switched)} instances", at)
        self.rollout_counters.ended("rolled_back", at=at)
        self.state.live_version = target.version
        self.state.live_chain = list(target.chain)
        self.state.live_since = at
        self.state.deployment = None
        await self.save()
        self.journal.event("live", version=target.version, chain=target.chain, rollback=True)
        log.info("rolled back to %s", target.version)
        self.wake.set()

    # -- reconciler --------------------------------------------------------------------------
    async def reconcile(self) -> None:
        """Bring the replicas that answer to the live version (transfer/reconcile.py)."""
        assert self.reconciler is not None
        if await self.reconciler.run(self.state):
            await self.save()

    # -- housekeeping ------------------------------------------------------------------------
    async def _prune_outputs(self) -> None:
        """Keep the build outputs agents may still need (chains of the last few live versions
        and any deployment in progress); remove the others (in a thread: tars are big)."""
        keep: set[str] = set()
        finished = [
            r
            for r in self.state.history
            if r.status == VersionStatus.FINISHED and r.mode != "rollback"
        ]
        for rec in [
            *finished[-self.keep_outputs :],
            *[self.state.record(v) for v in self.state.live_chain],
        ]:
            if rec is None:
                continue
            for name in rec.chain:
                chained = self.state.record(name)
                if chained and chained.output:
                    keep.add(Path(chained.output).name)
        dep = self.state.deployment
        if dep and (rec := self.state.record(dep.version)) and rec.output:
            keep.add(Path(rec.output).name)
        # failed after agents downloaded them: kept to be deployed again as they are
        downloaded = [
            r
            for r in self.state.history
            if r.status == VersionStatus.FAILED and "downloaded" in r.times and r.output
        ]
        keep.update(Path(r.output).name for r in downloaded[-self.keep_outputs :])
        # to be retried: the retry takes the same tars when agents downloaded them
        keep.update(Path(r.output).name for r in downloaded if r.awaiting_retry)
        await asyncio.to_thread(_remove_outputs, self.cfg.output_address, keep)

    def metrics_snapshot(self) -> dict[str, Any]:
        """What the metrics show, taken on the event loop (transfer.metrics)."""
        dep = self.state.deployment
        waiting = awaiting_retry(self.state)
        return {
            "dict": self.cfg.dict_name,
            "live_version": self.state.live_version,
            "live_since": self.state.live_since,
            "phase": dep.phase if dep is not None else "",
            "rollout_started": dep.started_at if dep is not None else 0.0,
            "counters": self.rollout_counters.snapshot(),
            "retry": {
                "awaiting": len(waiting),
                "next_at": min((r.retry_at for r in waiting), default=0.0),
            },
            "instances": {
                name: {
                    "status": str(inst.status),
                    "version": inst.version,
                    "reachable": inst.reachable,
                    "catch_up_failures": inst.catch_up_failures,
                }
                for name, inst in self.state.instances.items()
            },
        }

    # -- queries used by the HTTP API (arguments validated there) -------------------------------
    async def register_meta(self, version: str, depend: str, shard: int, meta: str) -> None:
        """Store a shard's builder meta in its version (the original's register call).
        LookupError when no such version is known."""
        target = None
        for rec in reversed(self.state.history):
            if rec.mode != "rollback" and rec.id == version and rec.depend == depend:
                target = rec
                break
        if target is None:
            raise LookupError(f"no version {version} (depend {depend}) is known")
        target.meta_infos[str(shard)] = meta
        await self.save()

    async def meta_info(self, version: str, depend: str, shard: int) -> str | None:
        """A shard's meta: registered or recorded at its build, else the builder's file."""
        for rec in reversed(self.state.history):
            same = rec.mode != "rollback" and rec.id == version and rec.depend == depend
            if same and str(shard) in rec.meta_infos:
                return rec.meta_infos[str(shard)]
        text = await asyncio.to_thread(
            builds.read_meta_infos, self.cfg.output_address, version, depend, [shard]
        )
        return text.get(str(shard))


def _remove_outputs(root: Path, keep: set[str]) -> None:
    """Delete the build output directories under `root` not named in `keep`. Blocking."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        is_output = entry.is_dir(follow_symlinks=False) and _OUTPUT_DIR.fullmatch(entry.name)
        if is_output and entry.name not in keep:
            shutil.rmtree(entry.path, ignore_errors=True)
            log.info("removed old build output %s", entry.path)


class _Abort(Exception):
    """Stop this version's rollout; the message is its failure reason. `final`: why trying
    the version again cannot help ("": it may be retried)."""

    def __init__(self, message: str, final: str = "") -> None:
        super().__init__(message)
        self.final = final


def _result_summary(outcomes: dict[str, Outcome]) -> dict[str, str]:
    """instance -> "ok" or why it failed, as a deployment's results record a phase."""
    return {name: ("ok" if o.ok else o.message) for name, o in outcomes.items()}
