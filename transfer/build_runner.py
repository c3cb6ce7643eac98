"""The build phase of a rollout: fetch a version's input, run cube-builder, check its tars.

`BuildRunner` owns what a build leaves on disk: the mirrored input (removed after the build),
the output directory (removed before a build starts: a killed build left half of it) and the
builder's pid file, so that a restarted transfer can stop a builder its predecessor left
running. It reads and fills a `VersionRecord`; the rollout state around it is the service's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import psutil

from cube import remote
from cube.donefile import paddle_save_of, paddlerec_relative_input
from cube.layout import output_dir_name, tar_name
from cube.remote import RemoteError, redact
from cube.transfer import build as builds
from cube.transfer.config import TransferConfig
from cube.transfer.donefile import (
    SourceUnavailable,
    is_url,
    mirror_input,
    resolve_input,
)
from cube.transfer.state import VersionRecord
from cube.transfer.upload import upload_outputs

log = logging.getLogger("cube.transfer")


class BuildFailed(Exception):
    """This version cannot be built or its output cannot be deployed; the message says why.
    `permanent`: the builder refused the input (a retry would fail the same way)."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class BuildRunner:
    def __init__(self, cfg: TransferConfig) -> None:
        self.cfg = cfg
        self.pid_file = cfg.tmp_address / "builder.pid"
        self.mirror_root = cfg.tmp_address / "input"

    def output_dir(self, rec: VersionRecord) -> Path:
        return self.cfg.output_address / output_dir_name(rec.depend, rec.id)

    async def build(self, rec: VersionRecord, reuse: bool = False) -> None:
        """Build `rec` into `output_dir(rec)` and record its shards (md5, size, counts) and
        metas in it; with `reuse`, take the build already there when it is complete and of
        this config (`_reuse`). BuildFailed when the input is unavailable, the builder fails
        or times out, or its output is not deployable."""
        cfg = self.cfg
        out_dir = self.output_dir(rec)
        if reuse and await asyncio.to_thread(self._reuse, rec, out_dir):
            return
        await asyncio.to_thread(shutil.rmtree, out_dir, ignore_errors=True)
        mirror = self.mirror_root / f"{cfg.dict_name}_{rec.version}"
        try:
            input_path = await self._fetch(self.build_input(rec.input), mirror, cfg.paddle_saves)
            delete_path = ""
            if rec.delete:
                delete_mirror = mirror.with_name(f"{mirror.name}_delete")
                delete_path = await self._fetch(rec.delete, delete_mirror)
            argv = builds.builder_argv(
                builds.resolve_command(cfg.buildtool_local),
                dict_name=cfg.dict_name,
                input_path=input_path,
                output_path=str(cfg.output_address),
                shard_num=cfg.shard_num,
                mode=rec.mode,
                cur_version=rec.id,
                depend_version=rec.depend,
                partitioner=cfg.partitioner,
                delete_path=delete_path,
                # an input not mirrored is fetched by the builder, within fetch_timeout too
                fetch_timeout=None if cfg.mirror_input else cfg.fetch_timeout,
                variable_width=cfg.variable_width,
                extra_flags=self.extra_flags,
            )
            ours = PurePosixPath(argv[0]).name == "cube-builder"  # (another tool: its flags)
            if ours and not any(f.lstrip("-").startswith("workers") for f in self.extra_flags):
                small = await asyncio.to_thread(builds.small_input, input_path)
                argv += ["-workers", "1"] if small else []
            try:
                await builds.run_builder(argv, cfg.build_timeout, self._note_builder)
            finally:
                self.pid_file.unlink(missing_ok=True)
            shards = await asyncio.to_thread(
                builds.check_outputs, out_dir, cfg.dict_name, cfg.shard_num, cfg.verify_output
            )
        except builds.BuildError as exc:
            raise BuildFailed(str(exc), exc.permanent) from exc
        except SourceUnavailable as exc:
            raise BuildFailed(str(exc)) from exc
        finally:
            await asyncio.to_thread(_remove_mirrors, self.mirror_root, mirror.name)
        metas = await asyncio.to_thread(
            builds.read_meta_infos, cfg.output_address, rec.id, rec.depend, range(cfg.shard_num)
        )
        self._record(rec, shards, metas)

    @property
    def extra_flags(self) -> tuple[str, ...]:
        """The builder's flags after the ones `builder_argv` sets: -input_format paddle_ps for
        a trainer's donefiles (source_format), then builder_flags."""
        paddle = ("-input_format", "paddle_ps") if self.cfg.donefile_format.paddle_saves else ()
        return (*paddle, *self.cfg.builder_flags)

    def build_input(self, source: str) -> str:
        """What the builder reads for a line's `input`: for parameter-server saves, the save
        directory when the line names a table's folder in it (Fleet's and PaddleRec's writers
        append `/000`, the first table's id: the builder finds the sparse table itself, by its
        files or -paddle_config, whatever its number); else the input as it is. A relative
        input of PaddleRec's donefiles is its trainer's (`paddlerec_input`). BuildFailed when
        it cannot be found."""
        if not self.cfg.paddle_saves:
            return source
        source = self.paddlerec_input(source)
        save = paddle_save_of(source)
        return save.save_dir if save is not None else source

    def paddlerec_input(self, source: str) -> str:
        """A relative input of PaddleRec's donefiles, which its trainer wrote relative to its
        working directory: resolved against `paddlerec_workdir` when set, else made relative
        to the donefile's directory when that is where the input says the trainer wrote them
        (cube.donefile.paddlerec_relative_input); BuildFailed saying why otherwise. Other
        inputs as they are (relative ones of other formats: to the donefile's directory)."""
        cfg = self.cfg
        if cfg.source_format != "paddlerec" or is_url(source) or source.startswith("/"):
            return source
        if cfg.paddlerec_workdir:
            return resolve_input(cfg.paddlerec_workdir, source)
        address = cfg.donefile_address
        folder = urlsplit(address).path if is_url(address) else address
        try:
            return paddlerec_relative_input(source, folder)
        except ValueError as exc:
            real = "" if is_url(address) else os.path.realpath(folder)
            if real and real != folder:  # read through a symbolic link: the real name
                with contextlib.suppress(ValueError):
                    return paddlerec_relative_input(source, real)
            raise BuildFailed(str(exc)) from None

    def _record(
        self, rec: VersionRecord, shards: list[builds.ShardOutput], metas: dict[str, str]
    ) -> None:
        rec.shards = {str(s.shard): shard_fields(s) for s in shards}
        rec.meta_infos.update(metas)

    def _reuse(self, rec: VersionRecord, out_dir: Path) -> bool:
        """Take the earlier build of this version (published again after a rollout that
        failed once agents had downloaded it): every replica must get the same tars, and an
        agent refuses another tar under a name it has placed. True when reused: its tars
        verify and its metas say this dict's shard count and partitioner. Blocking."""
        cfg = self.cfg
        if not out_dir.is_dir():
            return False
        try:
            shards = builds.check_outputs(out_dir, cfg.dict_name, cfg.shard_num, verify=True)
        except builds.BuildError as exc:
            log.info("version %s: not reusing %s (%s); building again", rec.version, out_dir, exc)
            return False
        metas = builds.read_meta_infos(cfg.output_address, rec.id, rec.depend, range(cfg.shard_num))
        for shard in shards:
            meta = json.loads(metas.get(str(shard.shard), "{}"))
            same = (
                meta.get("md5") == shard.md5
                and meta.get("shard_num") == cfg.shard_num
                and meta.get("partitioner") == cfg.partitioner
            )
            if not same:
                log.info("version %s: %s is another config's build", rec.version, out_dir)
                return False
        log.info("version %s: reusing its build in %s", rec.version, out_dir)
        self._record(rec, shards, metas)
        return True

    async def count_records(self, rec: VersionRecord) -> None:
        """Fill in the record counts and value widths of a version built before they were
        kept (a journal from an older transfer), read from its build output; nothing when
        they are known or the output is gone."""
        known = rec.count("records") is not None and rec.value_widths() is not None
        if known or not rec.output:
            return
        for shard in range(self.cfg.shard_num):
            tar = Path(rec.output) / tar_name(self.cfg.dict_name, shard)
            try:
                records, deleted, width = await asyncio.to_thread(builds.read_counts, tar)
            except builds.BuildError as exc:
                log.warning("cannot count the records of %s: %s", rec.version, exc)
                return
            counts: dict[str, int] = {"records": records, "deleted": deleted}
            if width is not None:
                counts["value_width"] = width
            rec.shards[str(shard)] = {**rec.shards.get(str(shard), {}), **counts}

    def reap_orphan(self) -> None:
        """Stop a builder a previous transfer left running (killed mid-build), if that pid is
        still the same process (its creation time matches)."""
        try:
            pid_text, created_text = self.pid_file.read_text().split()
            pid, created = int(pid_text), float(created_text)
        except (OSError, ValueError):
            return
        with contextlib.suppress(psutil.Error, OSError):
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 0.01:
                log.warning("stopping builder %d left running by a previous transfer", pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.pid_file.unlink(missing_ok=True)

    async def _fetch(self, source: str, mirror: Path, paddle_save: bool = False) -> str:
        """Where the builder finds the input: a local path itself; a URL mirrored into a local
        directory, or as it is with mirror_input: false. A parameter-server save
        (`paddle_save`) is mirrored with its empty files (they tell its layout), and only from
        s3:// or webhdfs:// (the HTTP/FTP mirror copies one directory's files, not a save's
        table folders)."""
        where = resolve_input(self.cfg.donefile_address, source)
        if not is_url(where) or where.startswith("file://"):
            path = Path(where.removeprefix("file://"))
            if not path.exists():
                raise SourceUnavailable(f"input {path} does not exist")
            return str(path)
        if not self.cfg.mirror_input and remote.scheme_of(where) in remote.SCHEMES:
            return where  # the builder fetches it itself (mirror_input: false)
        if paddle_save and remote.scheme_of(where) not in remote.SCHEMES:
            raise SourceUnavailable(
                f"input {redact(where)}: a parameter-server save is read from a local path, "
                "s3:// or webhdfs://, not over http(s) or ftp (its tables are folders)"
            )
        log.info("mirroring %s into %s", redact(where), mirror)
        timeout = self.cfg.fetch_timeout
        fetch = asyncio.to_thread(mirror_input, where, mirror, timeout, paddle_save)
        try:  # mirror_input bounds an object store's mirror itself; wait_for, an HTTP/FTP one
            await asyncio.wait_for(fetch, timeout)
        except TimeoutError:
            raise SourceUnavailable(
                f"input {redact(where)}: not mirrored within {self.cfg.fetch_timeout:g}s"
            ) from None
        return str(mirror)

    async def upload(self, rec: VersionRecord) -> None:
        """download_mode s3: copy the build of `rec` to upload_address (transfer/upload.py),
        within fetch_timeout. BuildFailed naming the object when an upload fails."""
        out_dir = Path(rec.output) if rec.output else self.output_dir(rec)
        log.info("uploading %s to %s", out_dir, redact(self.cfg.upload_address))
        try:
            await asyncio.to_thread(upload_outputs, self.cfg, out_dir, self.cfg.fetch_timeout)
        except RemoteError as exc:
            raise BuildFailed(str(exc)) from None

    def _note_builder(self, pid: int) -> None:
        """Remember the builder's pid, so a restarted transfer can stop an orphaned build."""
        with contextlib.suppress(psutil.Error, OSError):
            created = psutil.Process(pid).create_time()
            self.pid_file.write_text(f"{pid} {created}\n")


def shard_fields(shard: builds.ShardOutput) -> dict[str, Any]:
    """What a version record keeps of a built shard (md5, size, counts, value width; and each
    table's counts and width, for a version of several tables)."""
    fields: dict[str, Any] = {
        "md5": shard.md5, "size": shard.size, "records": shard.records, "deleted": shard.deleted
    }  # fmt: skip
    if shard.value_width is not None:
        fields["value_width"] = shard.value_width
    if shard.tables:  # a version of several tables: each table's counts and width
        fields["tables"] = {
            name: {"records": records, "deleted": deleted, "value_width": width}
            for name, records, deleted, width in shard.tables
        }
    return fields


def _remove_mirrors(root: Path, prefix: str) -> None:
    """Delete the mirrored inputs of one version (`<prefix>*` under `root`). Blocking."""
    for path in root.glob(f"{prefix}*"):
        shutil.rmtree(path, ignore_errors=True)
