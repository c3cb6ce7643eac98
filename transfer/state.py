"""The transfer's state and every decision about it, without I/O.

`TransferState` is what the journal persists: where each donefile was read up to, every version
seen (history, with its outcome and reason), what is live (version + delta chain), the deployment
in progress with its phase and per-instance progress, and the last known state of each instance.
The functions here decide what to do next (which line to build, which to refuse and why, whether a
phase met the quorum, how a lagging instance catches up, when a failed version is tried again);
the service carries them out.

Retries: a version whose rollout failed for a reason that may pass (replicas unreachable, an
input not there yet, a timeout) stays `failed` with `retry_at` set (`after_failure`, with the
`RetryPolicy`'s capped backoff), and `next_version` picks it again once that time has come, as
it would a pending line; until then it holds its place (its patches, and later patches of
its base, wait for it). It is abandoned, with the reason in `abandoned`, after the policy's
attempts, when a newer base supersedes it, when its line is published again (the new line is
the new attempt), or at once when retrying cannot help (the builder refused the input).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from cube.backoff import Backoff
from cube.donefile import BASE_FILE, BASE_FILES, PATCH_FILE, BadLine, DonefileEntry, paddle_save_of
from cube.layout import served_version, value_widths, width_change


class VersionStatus(StrEnum):
    """Where a version (a donefile line, or a rollback) stands."""

    PENDING = "pending"
    BUILDING = "building"
    DEPLOYING = "deploying"
    DOWNLOADED = "downloaded"
    RELOADED = "reloaded"
    FINISHED = "finished"
    FAILED = "failed"
    REFUSED = "refused"
    SKIPPED = "skipped"


class InstanceStatus(StrEnum):
    """Where a replica stands (the original's Instance.status)."""

    INIT = "Init"
    DOWNLOADING = "Downloading"
    DOWNLOAD_FAILED = "Download_Failed"
    DOWNLOAD_SUCC = "Download_Succ"
    RELOADING = "Reloading"
    RELOAD_FAILED = "Reload_Failed"
    RELOAD_SUCC = "Reload_Succ"
    ENABLING = "Enabling"
    ENABLE_FAILED = "Enable_Failed"
    ENABLE_SUCC = "Enable_Succ"
    ROLLING_BACK = "RollingBack"
    ROLLBACK_FAILED = "Rollback_Failed"
    ROLLBACK_SUCC = "Rollback_Succ"
    DEAD = "Dead"


class Phase(StrEnum):
    """A step of a rollout (a deploy walks BUILD to ENABLE; a rollback is one step)."""

    BUILD = "build"
    DOWNLOAD = "download"
    RELOAD = "reload"
    ENABLE = "enable"
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class PhaseRule:
    """One row of the rollout table: the phase a deploy goes to after this one, the version's
    status once it succeeded, the instance statuses while it runs / after it succeeded /
    after it failed on that instance, and the instance time fields it sets (start, done)."""

    next: Phase | None
    version_status: VersionStatus | None
    running: InstanceStatus | None
    succeeded: InstanceStatus | None
    failed: InstanceStatus | None
    times: tuple[str, str] | None = None


ROLLOUT: dict[Phase, PhaseRule] = {
    Phase.BUILD: PhaseRule(Phase.DOWNLOAD, VersionStatus.DEPLOYING, None, None, None),
    Phase.DOWNLOAD: PhaseRule(
        Phase.RELOAD,
        VersionStatus.DOWNLOADED,
        InstanceStatus.DOWNLOADING,
        InstanceStatus.DOWNLOAD_SUCC,
        InstanceStatus.DOWNLOAD_FAILED,
        ("download_start_time", "downloaded_time"),
    ),
    Phase.RELOAD: PhaseRule(
        Phase.ENABLE,
        VersionStatus.RELOADED,
        InstanceStatus.RELOADING,
        InstanceStatus.RELOAD_SUCC,
        InstanceStatus.RELOAD_FAILED,
        ("reload_start_time", "reloaded_time"),
    ),
    Phase.ENABLE: PhaseRule(
        None,
        VersionStatus.FINISHED,
        InstanceStatus.ENABLING,
        InstanceStatus.ENABLE_SUCC,
        InstanceStatus.ENABLE_FAILED,
        ("enable_start_time", "enabled_time"),
    ),
    Phase.ROLLBACK: PhaseRule(
        None,
        VersionStatus.FINISHED,
        InstanceStatus.ROLLING_BACK,
        InstanceStatus.ROLLBACK_SUCC,
        InstanceStatus.ROLLBACK_FAILED,
    ),
}

# The numbers JSON shows: the original's (VersionInfo.status, Instance.status_id) where it had
# one, ours after 100 (Dead = no agent).
VERSION_STATUS: dict[str, int] = {
    status: number
    for status, number in zip(VersionStatus, (10, 20, 30, 50, 70, 90, 110, 120, 130), strict=True)
}
INSTANCE_STATUS: dict[str, int] = {
    status: number
    for status, number in zip(
        InstanceStatus, (10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 250), strict=True
    )
}
PHASES = tuple(p.value for p in (Phase.BUILD, Phase.DOWNLOAD, Phase.RELOAD, Phase.ENABLE))
TERMINAL = (
    VersionStatus.FINISHED,
    VersionStatus.FAILED,
    VersionStatus.REFUSED,
    VersionStatus.SKIPPED,
)
FORMAT = 1


def now() -> float:
    return round(time.time(), 3)


@dataclass
class VersionRecord:
    """One donefile line's journey (or one rollback), as history shows it."""

    version: str  # served name: <base id> or <base id>_<patch id>
    depend: str
    id: str
    key: str
    mode: str  # base | delta | rollback
    input: str
    line: str  # "base.txt:3"
    delete: str = ""
    output: str = ""
    chain: list[str] = field(default_factory=list)
    status: str = "pending"
    message: str = ""
    create_time: float = 0.0
    finish_time: float = 0.0
    times: dict[str, float] = field(default_factory=dict)
    meta_infos: dict[str, str] = field(default_factory=dict)
    # shard -> {md5, size, records, deleted} (the counts from the shard's index header)
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    allow_shrink: bool = False  # the donefile line allows an empty or much smaller base
    attempts: int = 0  # rollouts of this record begun (1 once the first one starts)
    retry_at: float = 0.0  # failed, tried again at this time (0: no retry scheduled)
    last_error: str = ""  # why the last attempt failed (kept while the next one runs)
    abandoned: str = ""  # failed and never tried again: why

    @property
    def awaiting_retry(self) -> bool:
        """Failed, with another attempt scheduled (`retry_at`)."""
        return self.status == VersionStatus.FAILED and self.retry_at > 0

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL and not self.awaiting_retry

    def count(self, what: str) -> int | None:
        """Total `records` or `deleted` over the shards; None when a shard's count is unknown
        (a record from before counts were kept)."""
        counts = [shard.get(what) for shard in self.shards.values()]
        if not counts or any(not isinstance(c, int) for c in counts):
            return None
        return sum(counts)  # type: ignore[arg-type]

    def value_widths(self) -> frozenset[int] | None:
        """The value widths of its shards that hold values (cube.layout.value_widths); None
        when a shard's count or width is unknown (a record from before they were kept)."""
        pairs = []
        for shard in self.shards.values():
            records, width = shard.get("records"), shard.get("value_width")
            if not isinstance(records, int) or (records and not isinstance(width, int)):
                return None
            pairs.append((records, width or 0))
        return value_widths(pairs) if pairs else None

    def to_json(self) -> dict[str, Any]:
        """A copy sharing no mutable part with the record (taken on the event loop and
        encoded elsewhere); shallow copies, as asdict's deep copy is slow on big metas."""
        return {
            **vars(self),
            "chain": list(self.chain),
            "times": dict(self.times),
            "meta_infos": dict(self.meta_infos),
            "shards": {k: dict(v) for k, v in self.shards.items()},
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> VersionRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in obj.items() if k in known})


@dataclass
class InstanceState:
    """What the transfer last knew of one replica."""

    status: str = "Init"
    version: str = ""  # the version its server serves (last seen)
    bg_version: str = ""
    message: str = ""
    reachable: bool = False
    times: dict[str, float] = field(default_factory=dict)
    next_catch_up: float = 0.0  # reconciler backoff: no catch-up before this time
    catch_up_failures: int = 0  # consecutive failed catch-ups
    # the last failed catch-up step (kept until the instance serves the live version)
    failure_command: str = ""
    failure_version: str = ""
    failure_reason: str = ""  # the agent task's reason, e.g. corrupt_version
    failure_message: str = ""
    failed_at: float = 0.0

    def failed(self, step: Step, reason: str, message: str, at: float, retry_at: float) -> None:
        self.catch_up_failures += 1
        self.next_catch_up = retry_at
        self.failure_command, self.failure_version = step.command, step.version
        self.failure_reason, self.failure_message, self.failed_at = reason, message, at

    def progressed(self, phase: Phase, what: str, message: str, at: float) -> None:
        """A rollout command on this replica is `what` ("running", "ok", anything else:
        failed): its status and time fields as ROLLOUT says for `phase`."""
        rule = ROLLOUT[phase]
        start_key, done_key = rule.times or ("", "")
        if what == "running":
            self.status = rule.running or self.status
            if start_key:
                self.times[start_key] = at
        elif what == "ok":
            self.status = rule.succeeded or self.status
            if done_key:
                self.times[done_key] = at
        else:
            self.status = rule.failed or self.status
        self.message = message

    def recovered(self) -> None:
        """It serves the live version: no failure to show, no retry pending."""
        self.catch_up_failures = 0
        self.next_catch_up = 0.0
        self.failure_command = self.failure_version = ""
        self.failure_reason = self.failure_message = ""
        self.failed_at = 0.0


@dataclass
class Deployment:
    """The version being rolled out (or rolled back to); survives restarts."""

    kind: str  # deploy | rollback
    version: str
    phase: str  # build | download | reload | enable | rollback
    prev_version: str = ""
    prev_chain: list[str] = field(default_factory=list)
    committed: bool = False  # enable began: finish forward, or roll back explicitly
    targets: list[str] = field(default_factory=list)  # instance names still in the rollout
    results: dict[str, dict[str, str]] = field(default_factory=dict)  # phase -> inst -> "ok"|why
    started_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TransferState:
    dict_name: str = ""
    cursors: dict[str, int] = field(default_factory=lambda: {BASE_FILE: 0, PATCH_FILE: 0})
    history: list[VersionRecord] = field(default_factory=list)
    live_version: str = ""
    live_chain: list[str] = field(default_factory=list)
    live_since: float = 0.0
    deployment: Deployment | None = None
    instances: dict[str, InstanceState] = field(default_factory=dict)

    # -- persistence -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "dict_name": self.dict_name,
            "cursors": dict(self.cursors),
            "history": [r.to_json() for r in self.history],
            "live_version": self.live_version,
            "live_chain": list(self.live_chain),
            "live_since": self.live_since,
            "deployment": self.deployment.to_json() if self.deployment else None,
            "instances": {name: asdict(inst) for name, inst in self.instances.items()},
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TransferState:
        if obj.get("format") != FORMAT:
            raise ValueError(f"state format {obj.get('format')!r} is not {FORMAT}")
        dep = obj.get("deployment")
        return cls(
            dict_name=obj.get("dict_name", ""),
            cursors={BASE_FILE: 0, PATCH_FILE: 0, **obj.get("cursors", {})},
            history=[VersionRecord.from_json(r) for r in obj.get("history", [])],
            live_version=obj.get("live_version", ""),
            live_chain=list(obj.get("live_chain", [])),
            live_since=obj.get("live_since", 0.0),
            deployment=Deployment(**dep) if dep else None,
            instances={n: InstanceState(**i) for n, i in obj.get("instances", {}).items()},
        )

    # -- queries ---------------------------------------------------------------------------
    def record(self, version: str, include_rollbacks: bool = False) -> VersionRecord | None:
        """The latest record of a version (rollback entries excluded unless asked)."""
        for rec in reversed(self.history):
            if rec.version == version and (include_rollbacks or rec.mode != "rollback"):
                return rec
        return None

    @property
    def live_base(self) -> str:
        return self.live_chain[0] if self.live_chain else ""

    def trim_history(self, limit: int) -> None:
        """Forget the oldest terminal records beyond `limit` (never pending/live ones)."""
        excess = len(self.history) - limit
        if excess <= 0:
            return
        keep_names = set(self.live_chain)
        kept: list[VersionRecord] = []
        for rec in self.history:
            if excess > 0 and rec.terminal and rec.version not in keep_names:
                excess -= 1
                continue
            kept.append(rec)
        self.history = kept


# ----------------------------------------------------------------------------------------------
# donefile lines -> history


def version_name(entry: DonefileEntry) -> str:
    return served_version(entry.key, entry.id, entry.is_base)


def ingest(
    state: TransferState, parsed: list[DonefileEntry | BadLine], at: float
) -> list[tuple[str, str]]:
    """Turn newly read lines into history records. A malformed line becomes a failed record
    (with its reason); a line repeating a version that is pending, in progress or finished is
    ignored (a repeat of a failed one is a retry). Returns (level, message) log lines."""
    logs: list[tuple[str, str]] = []
    for item in parsed:
        if isinstance(item, BadLine):
            rec = VersionRecord(
                version="",
                depend="",
                id="",
                key="",
                mode="base" if item.file in BASE_FILES else "delta",
                input="",
                line=item.where,
                status="failed",
                message=f"malformed donefile line: {item.reason}",
                create_time=at,
                finish_time=at,
            )
            state.history.append(rec)
            logs.append(("error", rec.message))
            continue
        name = version_name(item)
        previous = state.record(name)
        if previous is not None and previous.awaiting_retry:  # the new line is the new attempt
            abandon(previous, f"its line was published again ({item.where})")
            logs.append(("info", f"{item.where}: version {name} published again: a new "
                                 f"attempt now, not the retry of {previous.line}"))  # fmt: skip
        elif previous is not None and previous.status not in ("failed", "refused", "skipped"):
            logs.append(
                ("warning", f"{item.where}: version {name} repeats {previous.line} "
                            f"({previous.status}); ignored")
            )  # fmt: skip
            continue
        state.history.append(
            VersionRecord(
                version=name,
                depend=item.key,
                id=item.id,
                key=item.key,
                mode="base" if item.is_base else "delta",
                input=item.input,
                delete=item.delete,
                line=item.where,
                create_time=at,
                times={"line_seen": at},
                allow_shrink=item.allow_shrink,
            )
        )
        logs.append(("info", f"{item.where}: new {'base' if item.is_base else 'patch'} {name}"))
    return logs


def finish(rec: VersionRecord, status: str, message: str, at: float) -> None:
    rec.status = status
    rec.message = message
    rec.finish_time = at


# ----------------------------------------------------------------------------------------------
# retries


@dataclass(frozen=True)
class RetryPolicy:
    """How often a failed version is tried again: up to `retries` more attempts, attempt n + 2
    `backoff.delay(n)` seconds after attempt n + 1 failed."""

    retries: int = 8
    backoff: Backoff = field(default_factory=lambda: Backoff(30.0, 600.0))

    @property
    def attempts(self) -> int:
        return self.retries + 1


def begin_attempt(rec: VersionRecord) -> None:
    """A rollout of `rec` starts (its first, or a retry: the last failure stays in
    `last_error`, not in the message of a version in progress)."""
    rec.attempts += 1
    rec.retry_at = 0.0
    rec.abandoned = rec.message = ""
    rec.finish_time = 0.0


def abandon(rec: VersionRecord, why: str) -> None:
    """No further attempt of the failed `rec`, for the reason `why` (shown with it)."""
    rec.retry_at = 0.0
    rec.abandoned = why


def requeue(state: TransferState, version: str, at: float) -> tuple[VersionRecord, bool]:
    """An operator's retry of the abandoned `version` (its latest record): it awaits a retry
    due at once, with a fresh round of attempts (`attempts` counts from 0 again), and
    `times["retry_requested"]` says when it was asked for. Returns the record and whether
    this call re-queued it: False when it is already on its way (pending, in progress, or
    awaiting a retry), so that asking twice is harmless. ValueError when there is no such
    version, or it cannot be retried: live or finished, refused or skipped (publish its line
    again), or a version the live table has moved past."""
    rec = state.record(version)
    if rec is None:
        raise ValueError(f"version {version!r} is not in the history")
    if not rec.terminal:  # pending, in progress, or awaiting a retry
        return rec, False  # already to be rolled out: nothing to do
    if rec.status != VersionStatus.FAILED:
        raise ValueError(
            f"version {version} is {rec.status}, not abandoned: only a failed version that "
            "will not be tried again can be retried"
            + (" (publish its line again)" if rec.status in ("refused", "skipped") else "")
        )
    problem = _moved_past(state, rec)
    if problem:
        raise ValueError(f"version {version} cannot be retried: {problem}")
    rec.abandoned = ""
    rec.attempts = 0
    rec.retry_at = max(at, 0.001)
    rec.times["retry_requested"] = at
    return rec, True


def _moved_past(state: TransferState, rec: VersionRecord) -> str:
    """Why the live table leaves no place for `rec` ("" when it has one): what next_version
    would refuse it for."""
    if rec.mode == "base":
        if state.live_base and int(rec.id) <= int(state.live_base):
            return f"the live base {state.live_base} is not older"
        return ""
    if not state.live_base:
        return f"no base is live (it needs {rec.key})"
    if rec.key != state.live_base:
        return f"it is a patch of base {rec.key}; the live base is {state.live_base}"
    if len(state.live_chain) > 1 and int(rec.id) <= int(state.live_chain[-1].split("_")[-1]):
        return f"the live delta {state.live_chain[-1]} is not older (deltas apply in order)"
    return ""


def after_failure(
    rec: VersionRecord, retryable: bool, final: str, policy: RetryPolicy, at: float
) -> str:
    """The attempt of `rec` just failed (its message says why): schedule the next one, or
    abandon it: when not `retryable` (`final` says why retrying cannot help) or its attempts
    are spent. Returns a line for the log."""
    rec.last_error = rec.message
    name = rec.version or rec.line
    if not retryable:
        abandon(rec, f"not retried: {final}")
    elif rec.attempts >= policy.attempts:
        abandon(rec, f"gave up after {rec.attempts} attempts")
    else:
        rec.retry_at = round(at + policy.backoff.delay(rec.attempts - 1), 3)
        return (f"version {name}: attempt {rec.attempts} of {policy.attempts} failed; next "
                f"attempt in {rec.retry_at - at:g}s")  # fmt: skip
    return f"version {name} abandoned ({rec.abandoned})"


def awaiting_retry(state: TransferState) -> list[VersionRecord]:
    return [r for r in state.history if r.awaiting_retry]


def _waiting(rec: VersionRecord) -> bool:
    """Pending, or failed with a retry scheduled: still to be rolled out."""
    return rec.status == VersionStatus.PENDING or rec.awaiting_retry


def _due(rec: VersionRecord, at: float) -> bool:
    return rec.status == VersionStatus.PENDING or rec.retry_at <= at


def _drop(rec: VersionRecord, status: str, message: str, at: float, logs: list[str]) -> None:
    """`rec` can no longer apply: a pending one ends `status` (skipped or refused), one
    awaiting a retry is abandoned (it stays failed, with its last error)."""
    if rec.awaiting_retry:
        abandon(rec, message)
        logs.append(f"{rec.line}: {rec.mode} {rec.version} abandoned: {message}")
    elif status == "skipped":
        finish(rec, status, message, at)
        logs.append(f"{rec.line}: base {rec.version} skipped: {message}")
    else:
        finish(rec, status, message, at)
        logs.append(f"{rec.line}: {message}")


def next_version(
    state: TransferState, at: float, paddle_saves: bool = False
) -> tuple[VersionRecord | None, list[str]]:
    """Choose the next record to build and deploy (pending, or failed and due for a retry);
    refuse, skip or abandon the ones that can no longer apply (each with its reason, returned
    for the log). None also while the one that goes next waits for its retry.

    Rules: the newest waiting base wins and supersedes older waiting bases and every waiting
    patch that does not belong to it; a base not newer than the live base is refused; a patch
    applies only on the live base, in order (its id above the chain's last), else it is refused;
    the patches after one awaiting its retry wait for it. With `paddle_saves` (inputs are
    parameter-server saves), a patch whose save is of another day than its base's is refused:
    a day's base follows the shrink, whose deletions no delta carries (`day_problem`).
    """
    logs: list[str] = []
    waiting = [r for r in state.history if _waiting(r)]
    bases = [r for r in waiting if r.mode == "base"]
    if bases:
        newest = max(bases, key=lambda r: int(r.id))
        for rec in bases:
            if rec is not newest:
                _drop(rec, "skipped", f"superseded by the newer base {newest.version}", at, logs)
        if state.live_base and int(newest.id) <= int(state.live_base):
            message = f"base {newest.version} is not newer than the live base {state.live_base}"
            _drop(newest, "refused", message, at, logs)
        else:
            for rec in waiting:
                if rec.mode == "delta" and rec.key != newest.version:
                    message = (f"patch {rec.version} is for base {rec.key}, which a newer base "
                               f"({newest.version}) replaces")  # fmt: skip
                    _drop(rec, "refused", message, at, logs)
            if not _due(newest, at):
                return None, logs  # it waits for its retry, and its patches with it
            newest.chain = [newest.version]
            return newest, logs
    for rec in waiting:
        if rec.mode != "delta" or not _waiting(rec):
            continue
        if not state.live_base:
            message = f"patch {rec.version}: no base is live (needs {rec.key})"
        elif rec.key != state.live_base:
            message = (f"patch {rec.version} is for base {rec.key}, but the live base is "
                       f"{state.live_base}")  # fmt: skip
        elif len(state.live_chain) > 1 and int(rec.id) <= int(state.live_chain[-1].split("_")[-1]):
            message = (f"patch {rec.version} is not newer than the live delta "
                       f"{state.live_chain[-1]} (deltas apply in order)")  # fmt: skip
        elif paddle_saves and (problem := day_problem(rec, state.record(state.live_base))):
            message = problem
        elif not _due(rec, at):
            return None, logs  # deltas apply in order: the later ones wait for this retry
        else:
            rec.chain = [*state.live_chain, rec.version]
            return rec, logs
        _drop(rec, "refused", message, at, logs)
    return None, logs


def day_problem(patch: VersionRecord, base: VersionRecord | None) -> str:
    """Why a parameter-server delta cannot apply on `base` ("" when it can, or when the paths
    do not tell): their saves are of different days (`<day>/delta-<n>` on `<day>/base`). A
    trainer saves a day's base after its shrink and the day's deltas after it; a delta holds
    the rows changed since the last save and no deletion, so on another day's base the keys
    that shrink deleted would stay served."""
    if base is None:
        return ""
    ours, theirs = paddle_save_of(patch.input), paddle_save_of(base.input)
    if ours is None or theirs is None or ours.day == theirs.day:
        return ""
    return (
        f"patch {patch.version} is a save of day {ours.day}, but its base {base.version} is "
        f"of day {theirs.day}: a delta applies on its own day's base (the base after the "
        "shrink; deltas carry no deletions)"
    )


# ----------------------------------------------------------------------------------------------
# quorum and catch-up


def quorum_shortfall(
    ok_instances: set[str], instances_by_shard: dict[int, list[str]], quorum: int
) -> list[str]:
    """Shards that do not have `quorum` instances in `ok_instances`, described; empty = quorum
    met everywhere (a shard with fewer replicas than `quorum` needs all of them)."""
    problems = []
    for shard, names in sorted(instances_by_shard.items()):
        have = sum(1 for n in names if n in ok_instances)
        need = min(quorum, len(names))
        if have < need:
            problems.append(f"shard {shard}: {have} of {len(names)} replicas ready, need {need}")
    return problems


@dataclass(frozen=True)
class Step:
    """One command for one instance: download/reload/enable `version` (or rollback to it)."""

    command: str
    version: str
    mode: str
    chain: tuple[str, ...]


def catch_up_plan(current: str, live_chain: list[str], on_disk: set[str]) -> list[Step]:
    """Commands that bring an instance serving `current` to the last version of `live_chain`.

    When the whole chain is already on its disk and `current` is not on the way to it, a
    `rollback` (the agent switches to the target or loads its CHAIN). Otherwise the chain
    versions it lacks are downloaded (from just after `current` when that is in the chain, else
    from the base), then the target is reloaded and enabled: the agent loads a delta on top of
    its predecessor or, from anywhere else, the whole CHAIN from disk. `on_disk` is the agent's
    `versions`: a copy its server refused as corrupt is quarantined and missing from it, so the
    next plan downloads it again.
    """
    if not live_chain or current == live_chain[-1]:
        return []
    target = live_chain[-1]
    mode = _mode(live_chain, target)
    chain = tuple(live_chain)
    if current in live_chain:
        start = live_chain.index(current) + 1
    elif current and on_disk.issuperset(live_chain):
        return [Step("rollback", target, mode, chain)]
    else:
        start = 0
    steps = [
        Step("download", version, _mode(live_chain, version), tuple(live_chain[: i + 1]))
        for i, version in enumerate(live_chain)
        if i >= start or version not in on_disk
    ]
    return [*steps, Step("reload", target, mode, chain), Step("enable", target, mode, chain)]


def _mode(chain: list[str], version: str) -> str:
    return "base" if chain and chain[0] == version else "delta"


# ----------------------------------------------------------------------------------------------
# guarding the live table


def live_records(state: TransferState) -> int | None:
    """A lower bound of the records the live version serves: its base's records minus every
    key its deltas delete (a delta's other records update or add keys, never remove any).
    None when a count is unknown."""
    base = state.record(state.live_base) if state.live_base else None
    if base is None:
        return None
    records = base.count("records")
    deleted = 0
    for name in state.live_chain[1:]:
        delta = state.record(name)
        count = delta.count("deleted") if delta else None
        if count is None:
            return None
        deleted += count
    return None if records is None else max(records - deleted, 0)


def shrink_refusal(
    rec: VersionRecord, live: int | None, max_shrink: float, allow_empty: bool
) -> str:
    """Why the built base `rec` must not replace a live version of `live` records ("" when it
    may): no records at all, or more than `max_shrink` of the live count lost. A delta may be
    empty; a line with `allow_shrink` is let through."""
    if rec.mode != "base" or rec.allow_shrink:
        return ""
    records = rec.count("records")
    how = 'publish the line again with "allow_shrink": true if this is intended'
    if records == 0 and not allow_empty:
        return (f"base {rec.version} has no records (empty input?); refused before download "
                f"(allow_empty_base is off): {how}")  # fmt: skip
    if records is None or not live or records >= live * (1.0 - max_shrink):
        return ""
    return (
        f"base {rec.version} has {records} records, {1 - records / live:.0%} fewer than the "
        f"live version's {live} (max_shrink {max_shrink:g}); refused before download: {how}, "
        "or raise max_shrink in transfer.conf"
    )


def width_refusal(state: TransferState, rec: VersionRecord, variable_width: bool) -> str:
    """Why the built delta `rec` must not go over the live chain ("" when it may): its values
    have another width than the chain's (cube.layout.width_change), and the dictionary is not
    declared variable-width. Nothing to compare when a width is unknown."""
    if rec.mode != "delta" or variable_width:
        return ""
    chain: set[int] = set()
    for name in state.live_chain:
        live = state.record(name)
        widths = live.value_widths() if live is not None else None
        if widths is None:
            return ""
        chain |= widths
    delta = rec.value_widths()
    change = width_change(chain, delta) if delta is not None else None
    if change is None:
        return ""
    return (
        f"delta {rec.version} has {change[1]}, the live version {state.live_version} (base "
        f"{state.live_base}) {change[0]}: clients reading {change[0]} would fail on every "
        "lookup; refused before download (set variable_width: true in transfer.conf if the "
        "dictionary's values may vary in width, and publish the line again)"
    )


class _Named(Protocol):
    @property
    def name(self) -> str: ...


def progress_recorder(state: TransferState, phase: Phase) -> Callable[[_Named, str, str], None]:
    """The progress callback of a rollout command (instance, what, message): noted in that
    instance's state as ROLLOUT says for `phase`."""

    def note(inst: _Named, what: str, message: str) -> None:
        state.instances[inst.name].progressed(phase, what, message, now())

    return note


def backoff_delay(failures: int, base: float = 5.0, cap: float = 300.0) -> float:
    """Seconds before the next try after `failures` in a row: base, 2 x base, ... up to cap
    (the exponent is bounded too: days of failures must not overflow a float)."""
    return Backoff(base, cap).delay(failures - 1)
