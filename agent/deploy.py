"""What each command does on the instance: download, reload, enable, rollback, retention.

The shell around the pure parts: files under deploy_path, the fetcher, the server's control
service. Ordering rules that make a crash harmless:
- a download lands in `.part`, is verified, then renamed; extraction goes to a hidden temp dir
  that is renamed to `data/<version>/` only when complete (with CHAIN for a delta);
- `data/VERSION` changes only after the server has switched (enable / rollback);
- retention never deletes a version the server holds, the current chain, or one being worked on,
  and removes a version by renaming it out of sight first;
- a placed version whose files fail a check (a cheap one at download, the server's full one at
  load: DATA_LOSS) is removed the same way, unless the server holds it, and placed again by the
  next download from the verified tar in cube_data/ (its md5 re-checked) or fetched again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cube import remote
from cube.agent import __version__
from cube.agent.control import (
    STATUS_LOADING,
    ServerControl,
    ServerError,
    ServerStatus,
    ServerUnreachable,
)
from cube.agent.fetch import (
    FetchError,
    FetchPolicy,
    SourceRefused,
    check_source,
    fetch_file,
    fetch_md5,
    md5_source,
    source_basename,
)
from cube.agent.journal import Journal
from cube.agent.layout import (
    TMP_PREFIX,
    DeployLock,
    Layout,
    chain_is_valid,
    placed_versions,
    plan_retention,
    read_chain,
    read_version_file,
    write_version_file,
)
from cube.agent.metrics import AgentCounters, disk_space, tree_bytes
from cube.agent.tasks import Task, TaskFailed, TaskManager
from cube.agent.unpack import UnsafeTar, extract_shard_tar, shard_dirs
from cube.format import ShardFormatError
from cube.fsutil import atomic_write_json, atomic_write_text, file_md5, fsync_dir
from cube.layout import CHAIN_FILE, TABLES_FILE, LayoutError, base_of, chain_text, tar_name
from cube.protocol import (
    CORRUPT_VERSION,
    NO_SPACE,
    SERVER_COMMANDS,
    SUCCEEDED,
    BadRequest,
    Work,
    check_name,
)
from cube.security import TokenLike
from cube.shard import Shard

log = logging.getLogger("cube.agent")
DONE_MARKER = ".download_done"


@dataclass
class AgentConfig:
    deploy_path: Path
    server: str = "127.0.0.1:9000"  # the server's control port
    server_token: TokenLike = ""  # its --control_token
    keep: int = 2
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    reload_timeout: float = 1800.0  # one background load on the server
    control_timeout: float = 10.0  # any other control command
    status_timeout: float = 2.0  # the server probe inside GET /agent/status
    md5_from_source: bool = False  # a download without md5 fetches <source>.md5 (the original)
    sync_reply_timeout: float = 110.0  # the original transfer's commands: reply when done
    # downloads from peer agents (agent/peers.py): their sources (--peers) and the token sent
    peer_fetch: FetchPolicy | None = None
    peer_token: Callable[[], str] = lambda: ""
    disk_limit: int = 0  # bytes the deploy path may hold (an emptyDir's sizeLimit); 0: its fs


class Agent:
    """The agent of one instance (one cube-server and its deploy_path)."""

    def __init__(
        self,
        config: AgentConfig,
        control: ServerControl | None = None,
        counters: AgentCounters | None = None,
    ) -> None:
        self.config = config
        self.layout = Layout(config.deploy_path)
        self.lock = DeployLock(config.deploy_path)
        self.control = control or ServerControl(
            config.server, timeout=config.control_timeout, token=config.server_token
        )
        self.journal = Journal(self.layout.state_dir)
        self.versions: dict[str, dict[str, Any]] = {}
        self.tasks = TaskManager(
            self.journal,
            runners={
                "download": self._download,
                "reload": self._reload,
                "enable": self._enable,
                "rollback": self._rollback,
            },
            exclusive=set(SERVER_COMMANDS),
            still_done=self._still_done,
            expected_errors=(BadRequest, FetchError, UnsafeTar, ServerError, OSError),
            on_end=self._task_ended,
        )
        self.counters = counters or AgentCounters()  # shared by the instances of one process
        self.last_command: float | None = None  # monotonic time of the last command received
        self.recovery_status: Callable[[], dict[str, Any]] | None = None  # (agent/peers.py)

    def _task_ended(self, task: Task) -> None:
        finished = task.finished_at if task.finished_at is not None else task.started_at  # set
        seconds = max(0.0, finished - task.started_at)
        self.counters.task_ended(task.command, task.state == SUCCEEDED, task.reason, seconds)

    async def metrics_snapshot(self) -> dict[str, Any]:
        """What the metrics show (agent.metrics); the disk walk runs in a thread."""
        running: dict[str, int] = {}
        for task in self.tasks.running():
            running[task.command] = running.get(task.command, 0) + 1
        disk = {
            "data": await asyncio.to_thread(tree_bytes, self.layout.data_dir),
            "downloads": await asyncio.to_thread(tree_bytes, self.layout.downloads_dir),
        }
        capacity, available = await asyncio.to_thread(self.disk_space)
        return {
            "counters": self.counters.snapshot(),
            "running": running,
            "versions": len(self.versions),
            "disk": disk,
            "space": [{"deploy_path": str(self.layout.deploy_path), "capacity": capacity,
                       "available": available}],
        }  # fmt: skip

    def disk_space(self) -> tuple[int, int]:
        """(capacity, available) bytes of the deploy path (agent.metrics.disk_space, with
        --disk_limit). Blocking: it may walk the deploy path."""
        return disk_space(self.layout.deploy_path, self.config.disk_limit)

    # ---------------------------------------------------------------- lifecycle

    def open(self) -> None:
        """Make the directory this agent's (DeployLock: DeployPathTaken when another agent
        process manages it, or one it lies in or holds), create the layout, clear what a crash
        left half-done, load the journal. The lock comes first: clearing would remove another
        agent's extraction in progress."""
        self.layout.deploy_path.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        self.layout.create()
        self.journal.open()
        for entry in os.scandir(self.layout.data_dir):
            if entry.name.startswith(TMP_PREFIX) or entry.name.startswith(".VERSION.tmp-"):
                log.info("removing leftover %s", entry.path)
                _remove(Path(entry.path))
        self.versions = {
            v: info
            for v, info in self.journal.load_versions().items()
            if self.layout.version_dir(v).is_dir()
        }
        self.tasks.recover()

    async def close(self) -> None:
        await self.tasks.close()
        await self.control.close()
        self.lock.release()

    async def submit(self, work: Work) -> Task:
        self.last_command = time.monotonic()  # the transfer is at work: recovery waits
        if work.command == "download":
            self.check_download(work)
            if work.mode == "delta" and not work.chain:
                work = dataclasses.replace(work, chain=self.chain_over_current(work.version))
        return await self.tasks.submit(work.command, work.version, work.to_request())

    def chain_over_current(self, version: str) -> list[str]:
        """The chain of a delta sent without one (the original transfer's way): the enabled
        version's chain, then the delta, as the original server layered a patch over what it
        served. BadRequest when that version is on another base, or nothing is enabled."""
        placed = read_chain(self.layout, version)
        if len(placed) > 1:  # sent again: the chain it was placed with
            return placed
        current = read_version_file(self.layout)
        if not current:
            raise BadRequest(
                f"chain: delta {version} came without one and no version is enabled here to"
                " layer it over; send the base first, or the chain"
            )
        chain = [*read_chain(self.layout, current), version]
        if chain[0] != base_of(version):
            raise BadRequest(
                f"chain: delta {version} came without one, and the enabled version {current}"
                f" is on base {chain[0]}, not {base_of(version)}; send the chain"
            )
        return chain

    def check_download(self, work: Work) -> None:
        """BadRequest (400) for a download this deployment does not allow, before any fetch."""
        if not work.md5 and not self.config.md5_from_source:
            raise BadRequest(
                "md5: required (32 hex digits, the tar's md5); or start cube-agent with "
                "--md5_from_source to fetch <source>.md5 instead"
            )
        try:
            check_source(work.source, self.config.fetch.sources)
            if not work.md5:
                check_source(md5_source(work.source), self.config.fetch.sources)
        except SourceRefused as exc:
            raise BadRequest(str(exc)) from None

    # ---------------------------------------------------------------- status

    async def server_status(self) -> tuple[ServerStatus | None, str]:
        try:
            return await self.control.status(timeout=self.config.status_timeout), ""
        except ServerError as exc:
            return None, str(exc)

    async def status_json(self) -> dict[str, Any]:
        st, problem = await self.server_status()
        server: dict[str, Any] = {"address": self.config.server, "reachable": st is not None}
        if st is not None:
            server.update(st.to_json())
        else:
            server.update(cur_version="", bg_version="", status=None, message=problem)
        return {
            "status": "RUNNING",
            "version": __version__,
            "deploy_path": str(self.layout.deploy_path),
            "current": read_version_file(self.layout),
            "server": server,
            "versions": placed_versions(self.layout),
            "tasks": [t.to_json() for t in self.tasks.all()],
            **({"recovery": self.recovery_status()} if self.recovery_status else {}),
        }

    async def _still_done(self, task: Task, request: dict[str, Any]) -> bool:
        """Whether a succeeded task's effect is still there and is what `request`, a repeat
        of it, asks for (else the repeat re-runs it: a download of another tar under the
        same version name then fails, loudly, instead of answering the old success)."""
        if task.command == "download":
            version = task.version
            asked, done = request.get("md5"), task.request.get("md5")
            if asked and done and asked != done:
                return False
            return self.layout.version_dir(version).is_dir() and not await self._damaged(version)
        st, _ = await self.server_status()
        if st is None:
            return False
        if task.command == "reload":
            return st.holds(task.version)
        return st.cur_version == task.version and read_version_file(self.layout) == task.version

    # ---------------------------------------------------------------- download

    async def _download(self, task: Task, checkpoint: Callable[[], None]) -> str:
        """Fetch, verify and extract the version's tar into data/<version> (a copy already
        placed and intact is kept; a damaged one is placed again)."""
        req = task.request
        version, source = task.version, req["source"]
        want_md5: str = req.get("md5") or ""

        def phase(name: str, **extra: Any) -> None:
            task.progress.update(phase=name, **extra)
            checkpoint()

        dependents = await self._unless_placed(version, want_md5)
        if dependents is None:
            phase("placed")
            return f"version {version} is already placed at data/{version}"
        folder = self.layout.download_dir(req.get("shard_seq") or 0, version)
        folder.mkdir(parents=True, exist_ok=True)
        tar = folder / self._tar_name(source, req)
        marker = folder / DONE_MARKER
        if not want_md5:
            phase("md5")
            md5_file = tar.with_name(tar.name + ".md5")
            want_md5 = await fetch_md5(source, md5_file, self.config.fetch)
        if not await self._downloaded(tar, marker, want_md5):
            await self._fetch_verified(task, tar, marker, want_md5, phase)
        phase("extract")
        files = await self._extract(task, tar, marker)
        self.versions[version] = {
            "seq": self._next_seq(),
            "placed_at": round(time.time(), 3),
            "md5": want_md5,
            "size": tar.stat().st_size,
            "source": source,
            "mode": req.get("mode") or "base",
            "chain": req.get("chain") or [version],
            "files": files,
            # where the verified tar stays (served to peers that recover: agent/peers.py)
            "tar": str(tar.relative_to(self.layout.deploy_path)),
            "shard_seq": req.get("shard_seq") or 0,
            "dict_name": req.get("dict_name") or "",
        }
        self.journal.save_versions(self.versions)
        phase("placed")
        message = f"placed data/{version} ({len(files)} files, md5 {want_md5})"
        if dependents:
            message += (
                f"; the damaged copy it replaces took {', '.join(dependents)} (over it) along: "
                "send download again for them"
            )
        return message

    async def _unless_placed(self, version: str, want_md5: str) -> list[str] | None:
        """None when `version` is placed already and intact. Otherwise the versions removed
        with a damaged copy of it (placed over it), to be sent again; [] when it was not here."""
        if not self.layout.version_dir(version).is_dir():
            return []
        placed = self.versions.get(version, {})
        if want_md5 and placed.get("md5") and placed["md5"] != want_md5:
            raise TaskFailed(
                f"version {version} is already placed from a tar with md5 {placed['md5']}, "
                f"this request says {want_md5}; a version name is deployed only once"
            )
        damaged = await self._damaged(version)
        if not damaged:
            return None
        removed = await self._remove_damaged(version, damaged)
        if set(damaged) != {version}:  # other layers of its chain: they need their sources
            raise TaskFailed(_corrupt_message(damaged, removed), reason=CORRUPT_VERSION)
        log.warning("placing %s again: %s", version, damaged[version])
        return [v for v in removed if v != version]

    async def _fetch_verified(
        self, task: Task, tar: Path, marker: Path, want_md5: str, phase: Callable[..., None]
    ) -> None:
        """Fetch the source to `tar`.part (resuming), check its md5, then rename it to `tar`
        and write the marker that says it was verified."""
        source, size = task.request["source"], task.request.get("size")
        folder, part = tar.parent, tar.with_name(tar.name + ".part")
        self._check_space(folder, size, part)

        def progress(done: int, total: int | None) -> None:
            task.progress.update(bytes=done, total=total)

        have = part.stat().st_size if part.exists() else 0
        phase("download", bytes=have, total=size)
        policy, token = self.config.fetch, ""
        if task.request.get("peer"):  # set by agent/peers.py only (not a field of the API's)
            if self.config.peer_fetch is None:
                raise TaskFailed("a download from a peer, and no --peers")
            policy, token = self.config.peer_fetch, self.config.peer_token()
        cap = None if size is not None else (have + self.disk_space()[1]) // 2
        fetching = time.monotonic()
        got = await fetch_file(
            source,
            part,
            size=size,
            policy=policy,
            progress=progress,
            cap=cap,  # without a size, room for the tar and its extraction bounds it
            cap_why="half the free disk space; send size",
            token=token,
        )
        self.counters.step("fetch", time.monotonic() - fetching)
        self.counters.downloaded_bytes += max(0, got - have)
        phase("verify", bytes=got)
        verifying = time.monotonic()
        digest = await asyncio.to_thread(file_md5, part)
        self.counters.step("verify", time.monotonic() - verifying)
        if digest != want_md5:
            part.unlink(missing_ok=True)
            log.warning(
                "md5 of %s: %s (%d bytes), not %s", remote.redact(source), digest, got, want_md5
            )
            raise TaskFailed(  # not the digest got: it would tell about the fetched bytes
                f"md5 mismatch for {remote.redact(source)}: expected {want_md5}, the download"
                " differs; it was discarded and nothing was placed"
            )
        part.replace(tar)
        atomic_write_json(marker, {"md5": digest, "size": got, "source": source})

    async def _extract(self, task: Task, tar: Path, marker: Path) -> list[str]:
        """Extract the verified `tar` beside data/ and rename it to data/<version>; returns
        the files placed. An unsafe tar is deleted with its marker (fetching it again would
        bring the same bytes back)."""
        req, version = task.request, task.version
        vdir = self.layout.version_dir(version)
        tmp = self.layout.extract_dir(version)
        _remove(tmp)
        try:
            extracting = time.monotonic()
            files = await asyncio.to_thread(extract_shard_tar, tar, tmp, req.get("size"))
            self.counters.step("extract", time.monotonic() - extracting)
            if req.get("mode") == "delta":
                atomic_write_text(tmp / CHAIN_FILE, chain_text(req["chain"]))
            if vdir.exists():
                raise TaskFailed(f"data/{version} appeared while extracting; not replaced")
            os.rename(tmp, vdir)
            fsync_dir(self.layout.data_dir)
        except UnsafeTar:
            # the bytes match their md5, so fetching again would bring the same tar back
            for path in (tar, marker):
                path.unlink(missing_ok=True)
            raise
        finally:
            _remove(tmp)
        return files

    @staticmethod
    def _tar_name(source: str, req: dict[str, Any]) -> str:
        name = source_basename(source)
        try:
            return check_name("source file name", name)
        except BadRequest:
            return tar_name(req.get("dict_name") or "shard", req.get("shard_seq") or 0)

    @staticmethod
    async def _downloaded(tar: Path, marker: Path, md5: str) -> bool:
        """A verified tar from an earlier run (possibly before a restart) with this md5. Its
        bytes are hashed again: they are what a damaged version is placed again from, and the
        disk that damaged the version may have damaged them too (then they are fetched again)."""
        if not (tar.is_file() and marker.is_file()):
            return False
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if info.get("md5") != md5 or info.get("size") != tar.stat().st_size:
            return False
        if await asyncio.to_thread(file_md5, tar) == md5:
            return True
        log.warning("%s no longer has md5 %s: fetching it again", tar, md5)
        for path in (marker, tar):
            path.unlink(missing_ok=True)
        return False

    def _check_space(self, folder: Path, size: int | None, part: Path) -> None:
        """Refuse early when the tar and its extracted copy cannot fit (in the filesystem, and
        within --disk_limit: past an emptyDir's sizeLimit the kubelet evicts the pod)."""
        if not size:
            return
        have = part.stat().st_size if part.exists() else 0
        need = 2 * size - have
        capacity, free = self.disk_space()
        if need > free:
            limit = f" of --disk_limit {capacity}" if self.config.disk_limit > 0 else ""
            raise TaskFailed(
                f"not enough disk space in {folder}: need about {need} bytes "
                f"(tar + extracted), {free} free{limit}",
                reason=NO_SPACE,
            )

    def _next_seq(self) -> int:
        return 1 + max((int(v.get("seq", 0)) for v in self.versions.values()), default=0)

    # ---------------------------------------------------------------- peers

    async def peer_manifest(self) -> dict[str, Any]:
        """What a recovering peer may take from here (agent/peers.py): the version data/VERSION
        names (written only by a switch the transfer ordered), each layer of its chain with the
        md5 and size its tar had when the transfer sent it, and whether the server serves it.
        A layer whose verified tar is gone ends the list (the peer then asks another)."""
        current = read_version_file(self.layout)
        layers: list[dict[str, Any]] = []
        for version in read_chain(self.layout, current) if current else []:
            info, tar = self.versions.get(version), self.peer_tar(version)
            if info is None or tar is None:
                break
            layers.append({
                "version": version, "md5": info["md5"], "size": info["size"],
                "mode": info.get("mode") or "base", "tar": tar.name,
                "shard_seq": int(info.get("shard_seq") or 0),
                "dict_name": str(info.get("dict_name") or ""),
            })  # fmt: skip
        st, _ = await self.server_status()
        return {"current": current, "layers": layers, "serving": bool(st and st.cur_version
                == current and current)}  # fmt: skip

    def peer_tar(self, version: str, name: str = "") -> Path | None:
        """The verified tar of `version` kept in cube_data/ (its marker's md5 and size are the
        placed version's), when `version` is in the chain data/VERSION names (only committed
        versions are served) and, given `name`, it is the tar's name; else None."""
        current = read_version_file(self.layout)
        info = self.versions.get(version)
        if not current or info is None or version not in read_chain(self.layout, current):
            return None
        for tar in self._kept_tars(version, info):
            inside = tar.resolve().is_relative_to(self.layout.downloads_dir.resolve())
            if not inside or not tar.is_file() or (name and tar.name != name):
                continue
            try:
                marker = json.loads((tar.parent / DONE_MARKER).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            same = marker.get("md5") == info.get("md5") and marker.get("size") == info.get("size")
            if same and tar.stat().st_size == info.get("size"):
                return tar
        return None

    def _kept_tars(self, version: str, info: dict[str, Any]) -> list[Path]:
        """Where `version`'s tar may be: as its placement recorded, or (placed by an agent
        that did not record it) any file beside a download marker of that version."""
        if info.get("tar"):
            return [self.layout.deploy_path / str(info["tar"])]
        found = []
        for marker in self.layout.downloads_dir.glob(f"*/{version}/{DONE_MARKER}"):
            for name in os.listdir(marker.parent):
                if not name.startswith(".") and not name.endswith((".part", ".md5")):
                    found.append(marker.parent / name)
        return found

    # ---------------------------------------------------------------- server commands

    def _require_placed(self, version: str) -> Path:
        vdir = self.layout.version_dir(version)
        if not vdir.is_dir():
            raise TaskFailed(f"version {version} is not on disk (no data/{version}); download it")
        missing = [
            v for v in read_chain(self.layout, version) if not self.layout.version_dir(v).is_dir()
        ]
        if missing:
            names = " and ".join(missing)
            raise TaskFailed(
                f"version {version} is a delta over {names}, not on disk; download {names} first"
            )
        return vdir

    async def _reload(self, task: Task, checkpoint: Callable[[], None]) -> str:
        version = task.version
        self._require_placed(version)
        st = await self.control.status()
        if st.holds(version):
            return f"already loaded (cur {st.cur_version!r}, bg {st.bg_version!r})"
        task.progress.update(phase="load")
        checkpoint()
        st = await self._load(version, st)
        return f"loaded in background (cur {st.cur_version!r}, bg {st.bg_version!r})"

    async def _load(self, version: str, st: ServerStatus) -> ServerStatus:
        """bg_load_patch when the server serves a version of the delta's chain (the layers it
        already maps are reused), else bg_load_base (for a delta the server loads its CHAIN)."""
        chain = read_chain(self.layout, version)
        is_patch = len(chain) > 1 and st.cur_version in chain[:-1]
        cmd = "bg_load_patch" if is_patch else "bg_load_base"
        try:
            await self.control.cmd(
                cmd, version_path=f"/{version}", timeout=self.config.reload_timeout
            )
        except ServerError as exc:
            if exc.code != grpc.StatusCode.DATA_LOSS:
                raise
            raise await self._refused_as_corrupt(version, exc) from exc
        return await self.control.wait_for(version, slot="bg", timeout=self.config.reload_timeout)

    async def _refused_as_corrupt(self, version: str, exc: ServerError) -> TaskFailed:
        """The server found `version`'s files corrupt (DATA_LOSS): find the damaged layers with a
        full check, remove them and what depends on them so the next downloads place them again,
        and say so in the task's failure."""
        damaged = await self._damaged(version, verify=True)
        if not damaged:  # the server's check disagrees with ours: trust it, place it again
            damaged = {version: f"data/{version}: the cube-server says: {exc.details}"}
        refused = f"cube-server refused {version} as corrupt (DATA_LOSS)"
        try:
            removed = await self._remove_damaged(version, damaged)
        except TaskFailed as failure:
            return TaskFailed(f"{refused}: {failure}", failure.reason)
        return TaskFailed(f"{refused}: {_corrupt_message(damaged, removed)}", CORRUPT_VERSION)

    async def _switch_to(self, version: str, st: ServerStatus) -> ServerStatus:
        """Make the loaded `version` current (server `enable`), then rewrite data/VERSION."""
        if st.cur_version != version:
            await self.control.cmd("enable", version=version)
            st = await self.control.wait_for(
                version, slot="cur", timeout=self.config.control_timeout
            )
        if read_version_file(self.layout) != version:
            write_version_file(self.layout, version)
        return st

    async def _enable(self, task: Task, checkpoint: Callable[[], None]) -> str:
        version = task.version
        st = await self.control.status()
        if not st.holds(version):
            raise TaskFailed(
                f"version {version} is not loaded on the cube-server (cur "
                f"{st.cur_version!r}, bg {st.bg_version!r}); send reload first"
            )
        previous = st.cur_version
        st = await self._switch_to(version, st)
        deleted = await self.retain()
        message = f"serving {version}"
        if previous and previous != version:
            message += f" (previous {previous} kept loaded as the rollback target)"
        if deleted:
            message += f"; removed old versions {', '.join(deleted)}"
        return message

    async def _rollback(self, task: Task, checkpoint: Callable[[], None]) -> str:
        version = task.version
        st = await self.control.status()
        if not st.holds(version):
            self._require_placed(version)
            task.progress.update(phase="load")
            checkpoint()
            st = await self._load(version, st)
        task.progress.update(phase="enable")
        checkpoint()
        previous = st.cur_version
        await self._switch_to(version, st)
        return f"rolled back to {version} (was {previous!r})"

    # ---------------------------------------------------------------- placed files

    async def _damaged(self, version: str, verify: bool = False) -> dict[str, str]:
        """{layer: problem} for the layers of `version`'s chain on disk that cannot be served
        (a missing layer is not damage: a download brings it). Without `verify` the check is
        constant time per layer (headers, pairing, sizes, CHAIN); with it every byte is read
        (the section checksums the server checks at load)."""
        damaged = {}
        layers = [v for v in read_chain(self.layout, version) if v != version] + [version]
        for layer in layers:
            if self.layout.version_dir(layer).is_dir():
                problem = await asyncio.to_thread(self._layer_problem, layer, verify)
                if problem:
                    damaged[layer] = problem
        return damaged

    def _layer_problem(self, version: str, verify: bool) -> str | None:
        vdir = self.layout.version_dir(version)
        try:
            for directory in shard_dirs(vdir):  # a version of several tables: each table's
                Shard.open(directory, verify=verify).close()
        except ShardFormatError as exc:
            return str(exc).replace(f"{self.layout.deploy_path}/", "")
        except LayoutError as exc:
            return f"data/{version}/{TABLES_FILE}: {exc}"
        except OSError as exc:
            return f"data/{version}: {exc.strerror or type(exc).__name__}"
        info = self.versions.get(version, {})
        if (vdir / CHAIN_FILE).exists() or info.get("mode") == "delta":
            expected = info.get("chain")
            valid = chain_is_valid(self.layout, version)
            if not valid or (expected and read_chain(self.layout, version) != expected):
                return f"data/{version}/{CHAIN_FILE} is missing or not the chain it was placed with"
        return None

    def _in_use(self, st: ServerStatus, besides: str = "") -> set[str]:
        """Every layer the server maps (the chains of its cur and bg versions) or a running
        task may need (the chains of their versions; `besides`: not this version's task)."""
        versions = [st.cur_version, st.bg_version]
        versions += [t.version for t in self.tasks.running() if t.version != besides]
        used: set[str] = set()
        for version in versions:
            if version:
                used.update(read_chain(self.layout, version))
        return used

    async def _remove_damaged(self, version: str, damaged: dict[str, str]) -> list[str]:
        """Remove the damaged layers and the placed versions whose chain holds one (they cannot
        load without it); their tars stay in cube_data/. Never what the server holds or loads,
        nor a version another task works on: then TaskFailed says why nothing was removed."""
        what = "; ".join(damaged.values())
        st, problem = await self.server_status()
        if st is None:
            raise TaskFailed(
                f"{what}; not replaced: the cube-server cannot say whether it holds it ({problem})",
                reason=ServerUnreachable.reason,
            )
        if st.status == STATUS_LOADING:
            raise TaskFailed(f"{what}; not replaced while the cube-server is loading; retry")
        in_use = self._in_use(st, besides=version)
        blocked = sorted(set(damaged) & in_use)
        if blocked:
            raise TaskFailed(
                f"{what}; not replaced: the cube-server holds it or a task uses it "
                f"({', '.join(blocked)}); switch the server to another version first",
                reason=CORRUPT_VERSION,
            )
        over = {
            v for v in placed_versions(self.layout) if set(damaged) & {*read_chain(self.layout, v)}
        }
        doomed = over - in_use
        for name in sorted(doomed):
            log.warning("removing damaged or dependent version %s", name)
            self._unplace(name)
        self.journal.save_versions(self.versions)
        return sorted(doomed)

    # ---------------------------------------------------------------- retention

    def _newest_first(self, names: list[str]) -> list[str]:
        """Placement order from the journal; versions it does not know count as older."""

        def key(name: str) -> tuple[int, float]:
            info = self.versions.get(name)
            if info is not None:
                return (1, float(info.get("seq", 0)))
            try:
                return (0, self.layout.version_dir(name).stat().st_mtime)
            except OSError:
                return (0, 0.0)

        return sorted(names, key=key, reverse=True)

    async def retain(self) -> list[str]:
        """Delete versions beyond --keep that nothing protects; skipped when the server cannot
        say what it holds."""
        st, problem = await self.server_status()
        if st is None:
            log.warning("retention skipped: %s", problem)
            return []
        protected = self._in_use(st)
        current = read_version_file(self.layout)
        if current:
            protected.update(read_chain(self.layout, current))
        doomed = plan_retention(
            self._newest_first(placed_versions(self.layout)), self.config.keep, protected
        )
        for version in doomed:
            log.info("retention: removing version %s", version)
            self._delete_version(version)
        if doomed:
            self.journal.save_versions(self.versions)
        return doomed

    def _delete_version(self, version: str) -> None:
        """Remove a version and its downloads."""
        self._unplace(version)
        for shard_dir in self.layout.downloads_dir.iterdir():
            _remove(shard_dir / version)

    def _unplace(self, version: str) -> None:
        """Remove data/<version> (renamed out of sight first: never a half-deleted version) and
        forget it; its download in cube_data/ stays for placing it again."""
        vdir = self.layout.version_dir(version)
        if vdir.is_dir():
            hidden = self.layout.data_dir / f"{TMP_PREFIX}del-{version}-{os.getpid()}"
            os.rename(vdir, hidden)
            fsync_dir(self.layout.data_dir)
            _remove(hidden)
        self.versions.pop(version, None)


def _corrupt_message(damaged: dict[str, str], removed: list[str]) -> str:
    """What was damaged, what was removed, and what brings it back."""
    gone = ", ".join(f"data/{v}" for v in removed) or "nothing"
    return (
        f"{'; '.join(damaged.values())}; removed {gone}: send download again for "
        f"{', '.join(removed) or 'them'} (base first) to place them again (from the verified "
        "tar kept in cube_data/ when its md5 still matches, else it is re-downloaded)"
    )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
