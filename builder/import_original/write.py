"""cube-import, writing: each shard of each version converted in a worker process (a file cut
short under it kills the worker with SIGBUS, not the import: `convert_shard`) and packed as
cube-builder packs its own; every target staged, then all published at once
(docs/ARCHITECTURE.md, cube-import).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cube.builder.build import (
    BuildConfig,
    BuildError,
    Workspace,
    _Pool,
    abort_active_builds,
    package_shard,
    shard_header_meta,
    write_meta_infos,
)
from cube.builder.import_original.base import _STOP_SIGNALS, KEY_FORMAT, ImportError_, warn
from cube.builder.import_original.discover import Inventory
from cube.builder.import_original.files import _Files, mapped
from cube.builder.import_original.plan import Plan, Version
from cube.builder.meta import META_DIR, ShardOutput, meta_info_name
from cube.fsutil import atomic_write_text, fsync_dir
from cube.index import build_table
from cube.layout import (
    CHAIN_FILE,
    VERSION_FILE,
    chain_text,
    parse_version,
    version_text,
)
from cube.original_format import (
    Layer,
    OriginalValues,
    read_layer,
)
from cube.shard_writer import write_shard


@dataclass
class Totals:
    records: int = 0  # index records read (duplicates included)
    shards: int = 0
    versions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _ShardTask:
    """One shard of one version to convert, as a worker process gets it."""

    files: _Files
    layer: Layer
    config: BuildConfig
    shard: int
    directory: Path
    sync: bool


def convert_shard(
    pool: _Pool,
    files: _Files,
    layer: Layer,
    config: BuildConfig,
    shard: int,
    directory: Path,
    totals: Totals,
    sync: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One shard of one version written into `directory` (index.cube + data.cube); returns the
    index header fields and the meta stored in the headers.

    The original's files are mapped and read in a worker process (`pool`, isolated), never in
    this one. A mapped file that another process cuts short (a file being rewritten on NFS, a
    live deployment's) turns the next read of a missing page into SIGBUS, which kills the
    process: Python cannot recover from it (the faulting instruction runs again; a handler
    would run only after the C code returned), so this process would die with its staging
    folders in the output. The alternatives fall short: reading instead of mapping would hold
    the data files in memory (values are gathered in hash order, at random over files of up
    to 1 GiB) or cost a read per record; a read lease (what cube-server does,
    cube/server/guard.py) is granted only to the file's owner on a local filesystem (not on
    NFS, nor on another user's deployment), and would hold up the deployment's own writer.
    So a SIGBUS kills the worker only, and this process, which owns the staging, says which
    file changed (and from which offset it is gone: `_Files.changed`) and removes what it
    staged. A file changed between its check and its mapping is refused by the worker."""
    task = _ShardTask(files, layer, config, shard, directory, sync)
    try:
        [(header, meta, records)] = pool.run(_convert_task, [task], _ignore, _ignore)
    except BrokenProcessPool:
        what = files.changed() or (
            f"{files.where}: the process reading it was killed (out of memory? a signal?)"
        )
        raise ImportError_(f"{what}; nothing was published") from None
    totals.records += records
    totals.shards += 1
    return header, meta


def _ignore(_value: object) -> None:
    """A progress report nobody reads."""


def _convert_task(
    task: _ShardTask, _on_bytes: object = None
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """In the worker process: map, read and check the layer, write the shard; returns the
    index header fields, the meta and the count of records read. Each array is let go as
    soon as it has served."""
    layer, config, shard = task.layer, task.config, task.shard
    meta = shard_header_meta(config, shard, (KEY_FORMAT,))
    try:
        with mapped(task.files) as arrays:
            if layer.index_files:
                records = read_layer(
                    layer,
                    {k: arrays[f"index.{k}"] for k in layer.index_files},
                    {j: arrays[f"data.{j}"] for j in layer.data_files},
                    shard,
                    config.shard_num,
                )
                keys, values = records.keys, records.values
                del records
            else:
                none = np.empty(0, np.uint32)
                keys, values = np.empty(0, np.uint64), OriginalValues([], none, none, none)
            built = build_table(keys)
            count = int(keys.shape[0])
            del keys
            header = write_shard(task.directory, built, values, meta, sync=task.sync)
            del built, values
    except ImportError_ as exc:  # the pool sends back the message of a BuildError as it is
        raise BuildError(str(exc)) from None
    return header, meta, count


def _config(version: Version, dict_name: str, output: Path, shard_num: int) -> BuildConfig:
    return BuildConfig(
        dict_name=dict_name,
        output_path=output,
        shard_num=shard_num,
        mode="base" if version.is_base else "delta",
        cur_version=version.cur,
        depend_version=version.depend,
        partitioner="mod",
        key_format="auto",
        workers=1,
    )


@dataclass
class _State:
    """What a signal handler must know: whether targets are being renamed (the signals are
    blocked then; one that reaches the handler anyway waits) or all were."""

    publishing: bool = False
    published: bool = False
    deferred: int = 0


_state = _State()


@contextlib.contextmanager
def staged(targets: Sequence[tuple[BuildConfig, str | None]]) -> Iterator[list[Workspace]]:
    """A workspace for every target (config, target name), all created (each target checked
    absent) before the block runs; what is not published is removed at the end, as the
    builder's (abort_active_builds removes it on a signal)."""
    workspaces: list[Workspace] = []
    try:
        for config, name in targets:
            try:
                workspaces.append(Workspace(config, name))
            except BuildError as exc:
                raise ImportError_(str(exc)) from None
        yield workspaces
    finally:
        for workspace in workspaces:
            workspace.close()


def publish(workspaces: Sequence[Workspace], finish: Callable[[], None]) -> list[Path]:
    """Rename every staged version into place, then `finish` (meta_info, VERSION), with SIGINT
    and SIGTERM blocked; if anything fails, the targets already renamed are removed again."""
    published: list[Path] = []
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    _state.publishing = True
    try:
        try:
            for workspace in workspaces:
                published.append(workspace.publish())
            finish()
        except BaseException:
            for target in published:
                shutil.rmtree(target, ignore_errors=True)
            for parent in {target.parent for target in published}:
                with contextlib.suppress(OSError):
                    fsync_dir(parent)
            raise
        _state.published = True
    finally:
        _state.publishing = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    if _state.deferred:
        _terminate(_state.deferred, None)
    return published


def write_build_outputs(
    plan: Plan,
    inventory: Inventory,
    dict_name: str,
    output: Path,
    shard_num: int,
    totals: Totals,
) -> list[Path]:
    """Every version as cube-builder's output under `output`; all staged, then published."""
    versions = [version for family in plan.families for version in family]
    for version in versions:
        missing = [s for s in range(shard_num) if (version.original, s) not in plan.layers]
        if missing:
            raise ImportError_(
                f"version {version.original} has no shard {missing[0]} of {shard_num}: a build "
                "output needs every shard (a deployment holds one: import it with -data_dir)"
            )
    configs = [_config(version, dict_name, output, shard_num) for version in versions]
    outputs: list[list[ShardOutput]] = [[] for _ in versions]
    with (
        staged([(config, None) for config in configs]) as workspaces,
        _Pool(1, isolate=True) as pool,
    ):
        for version, config, workspace, done in zip(
            versions, configs, workspaces, outputs, strict=True
        ):
            for shard in range(shard_num):
                name = config.shard_name(shard)
                directory = workspace.staging / name
                header, meta = convert_shard(
                    pool,
                    plan.files[(version.original, shard)],
                    plan.layers[(version.original, shard)],
                    config,
                    shard,
                    directory,
                    totals,
                    sync=False,
                )
                done.append(
                    package_shard(header, directory, workspace.staging / f"{name}.tar", meta)
                )
            totals.versions.append(config.version_dir_name)
        meta_dir = output / META_DIR
        metas = [
            meta_dir / meta_info_name(config.cur_version, config.depend_version, shard)
            for config in configs
            for shard in range(shard_num)
        ]
        new_metas = [path for path in metas if not os.path.lexists(path)]

        def write_metas() -> None:
            try:
                for config, done in zip(configs, outputs, strict=True):
                    write_meta_infos(config, done, (KEY_FORMAT,))
            except BaseException:
                for path in new_metas:
                    path.unlink(missing_ok=True)
                raise

        return publish(workspaces, write_metas)


def _pick_family(plan: Plan, inventory: Inventory) -> tuple[list[Version], str]:
    """-data_dir: the family of the version the deployment served (else the newest base's),
    and the version to name in VERSION."""
    if plan.served:
        for family in plan.families:
            for version in family:
                if plan.served in (version.original, version.served):
                    return family, version.served
        raise ImportError_(
            f"{inventory.served_from} names version {plan.served}, whose files were not found"
        )
    family = plan.families[-1]
    if len(plan.families) > 1:
        warn(f"several bases found; importing the newest, {family[0].served}, and its patches")
    return family, family[-1].served


def write_data_dir(
    plan: Plan,
    inventory: Inventory,
    dict_name: str,
    data_dir: Path,
    shard_num: int,
    shard: int,
    totals: Totals,
) -> tuple[list[Path], str]:
    """One shard's versions as a cube-server data directory: `<version>/` (+ CHAIN for a
    patch), then VERSION. Every version is staged first, and all are renamed in when all are
    done."""
    family, serve = _pick_family(plan, inventory)
    version_file = data_dir / VERSION_FILE
    if version_file.is_file():
        named = parse_version(version_file.read_text(encoding="utf-8", errors="replace"))
        if named and named != serve:
            raise ImportError_(
                f"{version_file} names {named}; refusing to change what that server loads at "
                f"start to {serve} (import into an empty directory)"
            )
    configs = [_config(version, dict_name, data_dir, shard_num) for version in family]
    targets = [(config, version.served) for config, version in zip(configs, family, strict=True)]
    with staged(targets) as workspaces, _Pool(1, isolate=True) as pool:
        chain: list[str] = []
        for version, config, workspace in zip(family, configs, workspaces, strict=True):
            chain.append(version.served)
            convert_shard(
                pool,
                plan.files[(version.original, shard)],
                plan.layers[(version.original, shard)],
                config,
                shard,
                workspace.staging,
                totals,
                sync=True,
            )
            if not version.is_base:
                atomic_write_text(workspace.staging / CHAIN_FILE, chain_text(chain))
            shutil.rmtree(workspace.spill, ignore_errors=True)  # not part of a version
            fsync_dir(workspace.staging)
            totals.versions.append(version.served)

        def write_version() -> None:
            fsync_dir(data_dir)
            atomic_write_text(version_file, version_text(serve))

        return publish(workspaces, write_version), serve


def _terminate(signum: int, _frame: Any) -> None:
    if _state.publishing:  # blocked meanwhile, but delivered to another thread: after it
        _state.deferred = signum
        return
    abort_active_builds()  # the staged versions: removed
    done = "the import was published before" if _state.published else "nothing was published"
    os.write(2, f"error: stopped by signal {signum}; {done}\n".encode())
    os._exit(128 + signum)
