"""What each command does on the instance: download, reload, enable, rollback, retention.

The shell around the pure parts: files under deploy_path, the fetcher, the server's control
service. Ordering rules that make a crash harmless:
- a download lands in `.part`, is verified, then renamed; extraction goes to a hidden temp dir
  that is renamed to `data/<version>/` only when complete (with CHAIN for a delta);
- `data/VERSION` changes only after the server has switched (enable / rollback);
- retention never deletes a version the server holds, the current chain, or one being worked on,
  and removes a version by renaming it out of sight first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import __version__
from agent.control import ServerControl, ServerError, ServerStatus
from agent.fetch import FetchError, FetchPolicy, fetch_file, fetch_md5, source_basename
from agent.journal import Journal
from agent.layout import (
    CHAIN_FILE,
    TMP_PREFIX,
    BadRequest,
    Layout,
    chain_text,
    check_name,
    placed_versions,
    plan_retention,
    read_chain,
    read_version_file,
    write_version_file,
)
from agent.tasks import Task, TaskFailed, TaskManager
from agent.unpack import UnsafeTar, extract_shard_tar
from agent.work import SERVER_COMMANDS, Work
from cube.fsutil import atomic_write_json, atomic_write_text, file_md5, fsync_dir

log = logging.getLogger("cube.agent")
DONE_MARKER = ".download_done"


@dataclass
class AgentConfig:
    deploy_path: Path
    server: str = "127.0.0.1:8000"
    keep: int = 2
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    reload_timeout: float = 1800.0  # one background load on the server
    control_timeout: float = 10.0  # any other control command
    status_timeout: float = 2.0  # the server probe inside GET /agent/status


class Agent:
    """The agent of one instance (one cube-server and its deploy_path)."""

    def __init__(self, config: AgentConfig, control: ServerControl | None = None) -> None:
        self.config = config
        self.layout = Layout(config.deploy_path)
        self.control = control or ServerControl(config.server, timeout=config.control_timeout)
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
        )

    # ---------------------------------------------------------------- lifecycle

    def open(self) -> None:
        """Create the layout, clear what a crash left half-done, load the journal."""
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

    async def submit(self, work: Work) -> Task:
        return await self.tasks.submit(work.command, work.version, work.to_request())

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
        }

    async def _still_done(self, task: Task) -> bool:
        """Whether a succeeded task's effect is still there (else a repeat re-runs it)."""
        if task.command == "download":
            return self.layout.version_dir(task.version).is_dir()
        st, _ = await self.server_status()
        if st is None:
            return False
        if task.command == "reload":
            return st.holds(task.version)
        return st.cur_version == task.version and read_version_file(self.layout) == task.version

    # ---------------------------------------------------------------- download

    async def _download(self, task: Task, checkpoint: Callable[[], None]) -> str:
        req = task.request
        version, source = task.version, req["source"]
        vdir = self.layout.version_dir(version)
        want_md5: str = req.get("md5") or ""

        def phase(name: str, **extra: Any) -> None:
            task.progress.update(phase=name, **extra)
            checkpoint()

        if vdir.is_dir():
            placed = self.versions.get(version, {})
            if want_md5 and placed.get("md5") and placed["md5"] != want_md5:
                raise TaskFailed(
                    f"version {version} is already placed from a tar with md5 {placed['md5']}, "
                    f"this request says {want_md5}; a version name is deployed only once"
                )
            phase("placed")
            return f"version {version} is already placed at data/{version}"

        folder = self.layout.download_dir(req.get("shard_seq") or 0, version)
        folder.mkdir(parents=True, exist_ok=True)
        tar = folder / self._tar_name(source, req)
        part = tar.with_name(tar.name + ".part")
        marker = folder / DONE_MARKER

        if not want_md5:
            phase("md5")
            want_md5 = await fetch_md5(source, tar.with_name(tar.name + ".md5"), self.config.fetch)
        size = req.get("size")
        if not self._downloaded(tar, marker, want_md5):
            self._check_space(folder, size, part)

            def progress(done: int, total: int | None) -> None:
                task.progress.update(bytes=done, total=total)

            phase("download", bytes=part.stat().st_size if part.exists() else 0, total=size)
            got = await fetch_file(
                source, part, size=size, policy=self.config.fetch, progress=progress
            )
            phase("verify", bytes=got)
            digest = await asyncio.to_thread(file_md5, part)
            if digest != want_md5:
                part.unlink(missing_ok=True)
                raise TaskFailed(
                    f"md5 mismatch for {source}: expected {want_md5}, got {digest} "
                    f"({got} bytes); the download was discarded and nothing was placed"
                )
            part.replace(tar)
            atomic_write_json(marker, {"md5": digest, "size": got, "source": source})

        phase("extract")
        tmp = self.layout.extract_dir(version)
        _remove(tmp)
        try:
            files = await asyncio.to_thread(extract_shard_tar, tar, tmp)
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

        self.versions[version] = {
            "seq": self._next_seq(),
            "placed_at": round(time.time(), 3),
            "md5": want_md5,
            "size": tar.stat().st_size,
            "source": source,
            "mode": req.get("mode") or "base",
            "chain": req.get("chain") or [version],
            "files": files,
        }
        self.journal.save_versions(self.versions)
        phase("placed")
        return f"placed data/{version} ({len(files)} files, md5 {want_md5})"

    @staticmethod
    def _tar_name(source: str, req: dict[str, Any]) -> str:
        name = source_basename(source)
        try:
            return check_name("source file name", name)
        except BadRequest:
            return f"{req.get('dict_name') or 'shard'}_part{req.get('shard_seq') or 0}.tar"

    @staticmethod
    def _downloaded(tar: Path, marker: Path, md5: str) -> bool:
        """A verified tar from an earlier run (possibly before a restart) with this md5."""
        if not (tar.is_file() and marker.is_file()):
            return False
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return info.get("md5") == md5 and info.get("size") == tar.stat().st_size

    @staticmethod
    def _check_space(folder: Path, size: int | None, part: Path) -> None:
        """Refuse early when the tar and its extracted copy cannot fit."""
        if not size:
            return
        have = part.stat().st_size if part.exists() else 0
        need = 2 * size - have
        free = shutil.disk_usage(folder).free
        if need > free:
            raise TaskFailed(
                f"not enough disk space in {folder}: need about {need} bytes "
                f"(tar + extracted), {free} free"
            )

    def _next_seq(self) -> int:
        return 1 + max((int(v.get("seq", 0)) for v in self.versions.values()), default=0)

    # ---------------------------------------------------------------- server commands

    def _require_placed(self, version: str) -> Path:
        vdir = self.layout.version_dir(version)
        if not vdir.is_dir():
            raise TaskFailed(f"version {version} is not on disk (no data/{version}); download it")
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
        await self.control.cmd(cmd, version_path=f"/{version}", timeout=self.config.reload_timeout)
        return await self.control.wait_for(version, slot="bg", timeout=self.config.reload_timeout)

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
        protected: set[str] = set()
        for version in (st.cur_version, st.bg_version, read_version_file(self.layout)):
            if version:
                protected.update(read_chain(self.layout, version))
        protected.update(t.version for t in self.tasks.running())
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
        vdir = self.layout.version_dir(version)
        hidden = self.layout.data_dir / f"{TMP_PREFIX}del-{version}-{os.getpid()}"
        os.rename(vdir, hidden)  # out of sight first: never a half-deleted version
        fsync_dir(self.layout.data_dir)
        _remove(hidden)
        for shard_dir in self.layout.downloads_dir.iterdir():
            _remove(shard_dir / version)
        self.versions.pop(version, None)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
