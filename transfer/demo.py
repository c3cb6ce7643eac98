"""cube-demo (`make demo`): the whole pipeline on this machine, in a few minutes at most.

1. a sample embedding table (1M random feature ids, float32 x 16, fixed seed) written as Cube
   SequenceFiles, as a trainer would dump it;
2. a local cluster (cube-local: transfer, 2 shards x 2 replicas of agent + server);
3. a donefile line -> the transfer builds, downloads, loads and enables it everywhere;
4. lookups through the SDK (cube.conf written by cube-local), checked against the table;
5. a patch (changed vectors, new ids, deletions) -> rolled out the same way, checked again;
6. the status table, then a clean shutdown (always: also on errors and Ctrl-C).
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cube.donefile import BASE_FILE, PATCH_FILE, append_line, format_line
from cube.flags import FlagError, FlagSet, flag, run_cli

if TYPE_CHECKING:
    from cube.client import CubeClient
    from cube.transfer.local import Cluster

MARKER = ".cube-demo"


@dataclass(frozen=True)
class DemoFlags:
    """cube-demo's flags."""

    dir: str = flag(".demo", "work directory (wiped first)", metavar="DIR")
    ids: int = flag(1_000_000, "feature ids (rows) in the sample table")
    dim: int = flag(16, "float32 values per row")
    seed: int = flag(20190731, "random seed of the table")
    files: int = flag(4, "SequenceFiles the table is split into")
    shards: int = flag(2, "shards")
    replicas: int = flag(2, "replicas per shard")
    timeout: float = flag(150.0, "seconds each rollout may take")
    base_port: int = flag(0, "first port of the cluster (0: any free ports)")


def flag_set() -> FlagSet[DemoFlags]:
    return FlagSet(
        "cube-demo",
        "Build a sample table, roll it out to a local cluster, look it up.",
        spec=DemoFlags,
    )


def say(text: str = "") -> None:
    print(text, flush=True)


def sample_table(count: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` distinct random uint64 ids (shuffled) and a float32 (count, dim) table."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**63, size=count + count // 50 + 16, dtype=np.uint64))
    keys = rng.permutation(keys)[:count]
    if keys.shape[0] < count:
        raise RuntimeError("not enough distinct ids drawn")  # cannot happen at 2^63
    values = rng.standard_normal((count, dim), dtype=np.float32)
    return keys, values


def write_seqfiles(directory: Path, keys: np.ndarray, values: np.ndarray, files: int) -> None:
    from cube.seqfile import SequenceFileWriter
    from cube.values import ValueColumn

    directory.mkdir(parents=True, exist_ok=True)
    width = values.shape[1] * 4
    for part, (k, v) in enumerate(
        zip(np.array_split(keys, files), np.array_split(values, files), strict=True)
    ):
        column = ValueColumn.fixed(np.ascontiguousarray(v).view(np.uint8).reshape(-1), width)
        with SequenceFileWriter(directory / f"part-{part:05d}", dialect="cube") as writer:
            writer.write_batch(k, column)


def fresh_dir(path: Path) -> None:
    """Wipe `path`, but only a directory this demo made (or an empty / missing one)."""
    if path.exists():
        if not path.is_dir():
            raise FlagError(f"--dir {path}: exists and is not a directory")
        if any(path.iterdir()) and not (path / MARKER).exists():
            raise FlagError(f"--dir {path}: not empty and not a cube-demo directory; not wiping")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).write_text("made by cube-demo; wiped by the next run\n")


def timeline(record: dict[str, Any]) -> str:
    times = record.get("times") or {}
    seen = times.get("line_seen")
    if not seen:
        return ""
    steps = [("built", "build"), ("downloaded", "download"), ("reloaded", "load"),
             ("enabled", "enable")]  # fmt: skip
    parts, last = [], seen
    for key, label in steps:
        if key in times:
            parts.append(f"{label} {times[key] - last:.1f}s")
            last = times[key]
    return ", ".join(parts)


def run(argv: Sequence[str]) -> int:
    """The six steps of the module docstring; the cluster always comes down at the end."""
    flags = flag_set().parse(argv)
    if flags.ids < 100 or flags.dim < 1 or flags.files < 1:
        raise FlagError("--ids must be >= 100, --dim and --files >= 1")
    from cube.client import CubeClient
    from cube.transfer.local import LocalError

    started = time.monotonic()
    work = Path(flags.dir).resolve()
    fresh_dir(work)
    donefile = work / "donefile"
    donefile.mkdir()
    table = _write_base(flags, work)
    cluster: Cluster | None = None

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        cluster = _start_cluster(flags, work, donefile)
        served = _roll_out_base(cluster, flags, donefile, table)
        rng = np.random.default_rng(flags.seed + 1)
        with CubeClient.from_conf(cluster.cube_conf) as client:
            _look_up(client, flags, table, rng)
            _patch(client, cluster, flags, work, donefile, table, rng)
        say("== 6. status")
        say(cluster.status_table())
        say(f"\ndone in {time.monotonic() - started:.1f}s; base line -> served in {served:.1f}s")
        return 0
    except KeyboardInterrupt:
        say("\ninterrupted")
        return 130
    except (LocalError, DemoError) as exc:
        say(f"\nerror: {exc}")
        if cluster is not None:
            say(f"logs: {cluster.dir / 'logs'}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if cluster is not None:
            say("== shutting down the cluster")
            for line in cluster.down():
                say(f"   {line}")


@dataclass(frozen=True)
class _Table:
    """The sample table and where its base was written."""

    keys: np.ndarray
    values: np.ndarray
    base_id: int
    base_input: Path


def _write_base(flags: DemoFlags, work: Path) -> _Table:
    """Step 1: the sample table, written as the base's SequenceFiles."""
    say(f"== 1. sample table: {flags.ids:,} ids x float32[{flags.dim}] (seed {flags.seed})")
    t = time.monotonic()
    keys, values = sample_table(flags.ids, flags.dim, flags.seed)
    base_id = int(time.time())
    base_input = work / "input" / str(base_id) / "base"
    write_seqfiles(base_input, keys, values, flags.files)
    size = sum(p.stat().st_size for p in base_input.iterdir())
    say(f"   {flags.files} SequenceFiles, {size / 2**20:.1f} MiB in {base_input} "
        f"({time.monotonic() - t:.1f}s)")  # fmt: skip
    return _Table(keys, values, base_id, base_input)


def _start_cluster(flags: DemoFlags, work: Path, donefile: Path) -> Cluster:
    """Step 2: the local cluster (cube-local up)."""
    from cube.transfer.local import ClusterSpec, up

    say(f"== 2. local cluster: {flags.shards} shards x {flags.replicas} replicas")
    t = time.monotonic()
    spec = ClusterSpec(
        dir=work / "cluster",
        shards=flags.shards,
        replicas=flags.replicas,
        donefile=donefile,
        base_port=flags.base_port,
        dim=flags.dim,
        poll_interval=0.5,
    )
    cluster = up(spec)
    say(f"   up in {time.monotonic() - t:.1f}s; transfer API {cluster.transfer_url}; "
        f"SDK config {cluster.cube_conf}")  # fmt: skip
    return cluster


def _roll_out_base(cluster: Cluster, flags: DemoFlags, donefile: Path, table: _Table) -> float:
    """Step 3: the base's donefile line, then wait until every replica serves it; returns the
    seconds that took."""
    base_id = table.base_id
    say(f"== 3. donefile line for base {base_id} -> build, download, load, enable")
    t = time.monotonic()
    line = format_line(str(base_id), str(base_id), str(table.base_input))
    append_line(donefile / BASE_FILE, line)
    say(f"   {donefile / BASE_FILE}: {line}")
    cluster.wait_version(str(base_id), flags.timeout)
    served = time.monotonic() - t
    record = _record(cluster, str(base_id))
    say(f"   served by every replica {served:.1f}s after the donefile line "
        f"({timeline(record)})")  # fmt: skip
    return served


def _look_up(client: CubeClient, flags: DemoFlags, table: _Table, rng: np.random.Generator) -> None:
    """Step 4: a few ids and an unknown one, then a batch, checked against the table."""
    keys, values = table.keys, table.values
    n_batch = min(10_000, flags.ids)
    say("== 4. lookups through the SDK")
    probe = rng.choice(keys.shape[0], size=5, replace=False)
    missing = np.uint64(0)  # ids are drawn from 1 .. 2^63
    wanted = np.append(keys[probe], missing)
    result = client.seek(wanted)
    got = client.get_embeddings(wanted, dim=flags.dim)
    say(f"   seek({len(wanted)} ids) -> version {result.version}, "
        f"found {result.found.tolist()}")  # fmt: skip
    for key, row in zip(wanted, got, strict=True):
        say(f"   {int(key):>20d}: {np.array2string(row[:4], precision=3)} ...")
    _check(np.array_equal(got[:-1], values[probe]), "values differ from the table")
    _check(not result.found[-1] and not got[-1].any(), "the unknown id was found")
    batch = rng.choice(keys.shape[0], size=n_batch, replace=False)
    many = client.get_embeddings(keys[batch], dim=flags.dim)
    _check(np.array_equal(many, values[batch]), f"a {n_batch:,}-id batch differs")
    say(f"   checked: 5 ids + a {n_batch:,}-id batch equal the table, "
        "the unknown id is a miss")  # fmt: skip


@dataclass(frozen=True)
class _PatchPlan:
    """Which rows of the table a patch changes or deletes, and what it writes."""

    changed: np.ndarray  # rows changed or deleted
    changed_rows: np.ndarray
    deleted_rows: np.ndarray
    new_keys: np.ndarray
    keys: np.ndarray  # the patch's keys: changed rows, then new ids
    values: np.ndarray


def _patch(
    client: CubeClient,
    cluster: Cluster,
    flags: DemoFlags,
    work: Path,
    donefile: Path,
    table: _Table,
    rng: np.random.Generator,
) -> None:
    """Step 5: a patch written, rolled out, shown and checked."""
    n_changed, n_deleted = min(1000, flags.ids // 10), min(100, flags.ids // 20)
    say(f"== 5. a patch: {n_changed:,} changed vectors, 100 new ids, "
        f"{n_deleted} deletions")  # fmt: skip
    keys = table.keys
    base_id, patch_id = table.base_id, table.base_id + 100
    changed = rng.choice(keys.shape[0], size=n_changed + n_deleted, replace=False)
    new_keys = np.arange(1, 101, dtype=np.uint64) * np.uint64(2**63 // 101) + np.uint64(7)
    patch_keys = np.concatenate([keys[changed[n_deleted:]], new_keys])
    patch_values = rng.standard_normal((patch_keys.shape[0], flags.dim), dtype=np.float32)
    plan = _PatchPlan(
        changed, changed[n_deleted:], changed[:n_deleted], new_keys, patch_keys, patch_values
    )
    patch_input = work / "input" / str(patch_id) / "patch"
    write_seqfiles(patch_input, plan.keys, plan.values, 1)
    delete_file = work / "input" / str(patch_id) / "delete.txt"
    delete_file.write_text("".join(f"{int(k)}\n" for k in keys[plan.deleted_rows]))
    version = f"{base_id}_{patch_id}"
    t = time.monotonic()
    line = format_line(str(patch_id), str(base_id), str(patch_input), str(delete_file))
    append_line(donefile / PATCH_FILE, line)
    cluster.wait_version(version, flags.timeout)
    say(f"   {version} served by every replica {time.monotonic() - t:.1f}s after its "
        f"line ({timeline(_record(cluster, version))})")  # fmt: skip
    _show_patch(client, flags, table, plan)
    _check_patch(client, flags, table, plan)


def _show_patch(client: CubeClient, flags: DemoFlags, table: _Table, plan: _PatchPlan) -> None:
    """A few changed, new and deleted ids, before and after the patch."""
    keys, values, changed_rows = table.keys, table.values, plan.changed_rows
    show = np.concatenate([keys[changed_rows[:3]], plan.new_keys[:1], keys[plan.deleted_rows[:2]]])
    after = client.seek(show)
    emb = client.get_embeddings(show, dim=flags.dim)
    say(f"   version {after.version}:")
    before = dict(zip(keys[changed_rows[:3]].tolist(), values[changed_rows[:3]],
                      strict=True))  # fmt: skip
    for key, row, found in zip(show.tolist(), emb, after.found.tolist(), strict=True):
        if key in before:
            say(f"   {key:>20d}: {np.array2string(before[key][:3], precision=3)} -> "
                f"{np.array2string(row[:3], precision=3)} ...")  # fmt: skip
        elif found:
            say(f"   {key:>20d}: new {np.array2string(row[:3], precision=3)} ...")
        else:
            say(f"   {key:>20d}: deleted (miss)")


def _check_patch(client: CubeClient, flags: DemoFlags, table: _Table, plan: _PatchPlan) -> None:
    """Changed, new and deleted ids are served as the patch wrote them, the others unchanged."""
    keys, n_deleted = table.keys, plan.deleted_rows.shape[0]
    check_keys = np.concatenate([plan.keys, keys[plan.deleted_rows]])
    check = client.get_embeddings(check_keys, dim=flags.dim)
    expected = np.concatenate([plan.values, np.zeros((n_deleted, flags.dim), np.float32)])
    _check(np.array_equal(check, expected), "the patch is not served as written")
    untouched = np.setdiff1d(np.arange(keys.shape[0]), plan.changed)[:1000]
    same = client.get_embeddings(keys[untouched], dim=flags.dim)
    _check(np.array_equal(same, table.values[untouched]), "untouched ids changed")
    say("   checked: changed, new, deleted and untouched ids are all as written")


class DemoError(RuntimeError):
    """A check of the demo that failed."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise DemoError(message)


def _record(cluster: Any, version: str, timeout: float = 5.0) -> dict[str, Any]:
    """The transfer's history record of `version`, once it is finished (servers switch a moment
    before the transfer hears back from every agent)."""
    deadline = time.monotonic() + timeout
    found: dict[str, Any] = {}
    while True:
        for rec in reversed(cluster.history()):
            if rec.get("version") == version and rec.get("mode") != "rollback":
                found = rec
                break
        if found.get("status_str") == "finished" or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
