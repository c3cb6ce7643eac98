"""Scale check: build an N-key table of fixed-width values on this box and look keys up in it.

    python -m bench.scale --keys 100000000 --width 64          # the 100M x 64 B check
    python -m bench.scale --keys 1000000 --width 64            # the same at 1M, to compare

Steps, each timed (all files under one temp directory, removed at the end, even on error):
1. input: `--files` Cube-dialect SequenceFiles of `--keys` records. Key i is fmix64(i ^ salt)
   (distinct, random-looking) and its value is the key's 8 bytes repeated, so any looked-up
   value can be checked without keeping the keys.
2. build: the real `cube-builder` command (`-shard_num --shards -job_mode base -quiet`): wall time,
   records/s and the CPU of the builder's processes.
3. size: index bytes per key (the `index.cube` files; values are `--width` bytes a key on top).
4. lookups: every shard opened with `Shard.open(path, populate=True)`; then `--batches` batches
   of `--batch` fresh random keys of the table (drawn before the clock), each routed to its
   shard, looked up (`Shard.lookup`) and its values gathered (`ShardStack.gather_fixed`), as a
   server would per request; median / p90 / p99 µs per batch after `--warmup` batches (with one
   shard, also the lookup and the gather apart). Values are checked against the keys for every
   batch.

The disk must hold the input (about keys x (width + 16) bytes), the shards and their tars (twice
keys x (width + ~14) bytes) at once; the script checks the free space first. Prints one JSON
object (also written to --out when given).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from cube import kernel, wire
from cube.bench.keyspace import keys_of, values_of
from cube.routing import shard_of
from cube.seqfile import SequenceFileWriter
from cube.shard import Shard, ShardStack
from cube.values import ValueColumn

ROOT = Path(__file__).resolve().parents[1]
_CHUNK = 1 << 20  # records generated per write


def write_input(directory: Path, count: int, width: int, files: int) -> None:
    directory.mkdir(parents=True)
    bounds = np.linspace(0, count, files + 1).astype(np.int64)
    for number in range(files):
        with SequenceFileWriter(directory / f"part-{number:05d}") as writer:
            for start in range(int(bounds[number]), int(bounds[number + 1]), _CHUNK):
                ids = np.arange(start, min(start + _CHUNK, int(bounds[number + 1])))
                keys = keys_of(ids)
                rows = np.ascontiguousarray(values_of(keys, width))
                writer.write_batch(keys, ValueColumn.fixed(rows.reshape(-1), width))


def builder_command() -> list[str]:
    script = Path(sys.executable).parent / "cube-builder"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cube.builder.cli"]


def run_build(input_dir: Path, output: Path, shards: int) -> dict[str, float]:
    args = [
        *builder_command(),
        "-dict_name=scale",
        f"-input_path={input_dir}",
        f"-output_path={output}",
        f"-shard_num={shards}",
        "-job_mode=base",
        "-quiet",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"cube-builder failed: {done.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def shard_dirs(output: Path) -> list[Path]:
    (version,) = [p for p in output.iterdir() if p.name != "meta_info"]
    dirs = [p for p in version.iterdir() if p.is_dir()]
    return sorted(dirs, key=lambda p: int(p.name.rsplit("_part", 1)[1]))


def measure_lookups(
    shards: list[Shard], count: int, width: int, batch: int, batches: int, warmup: int, seed: int
) -> dict[str, Any]:
    """µs per batch: route, Shard.lookup and gather per shard, values in request order."""
    stacks = [ShardStack([shard]) for shard in shards]
    partitioner = str(shards[0].meta.get("partitioner", "mod"))
    rng = np.random.default_rng(seed)
    total = warmup + batches
    drawn = keys_of(rng.integers(0, count, (total, batch)))
    times = np.empty(total, dtype=np.float64)
    probes = np.zeros(total, dtype=np.float64)  # the lookup part alone (one shard only)
    out = np.empty((batch, width), dtype=np.uint8)
    for number in range(total):
        keys = drawn[number]
        started = time.perf_counter_ns()
        if len(stacks) == 1:
            result = stacks[0].lookup(keys)
            probes[number] = time.perf_counter_ns() - started
            out = stacks[0].gather_fixed(result)
            found = result.found
        else:
            owners = shard_of(keys, len(stacks), partitioner)
            found = np.zeros(batch, dtype=bool)
            for index, stack in enumerate(stacks):
                mine = np.flatnonzero(owners == index)
                if mine.shape[0]:
                    result = stack.lookup(keys[mine])
                    out[mine] = stack.gather_fixed(result)
                    found[mine] = result.found
        times[number] = time.perf_counter_ns() - started
        if not found.all() or not np.array_equal(out, values_of(keys, width)):
            raise AssertionError(f"batch {number}: wrong answer (a key missing or a bad value)")
    measured = times[warmup:] / 1000.0
    report = {
        "batch": batch,
        "batches": batches,
        "median_us": float(np.median(measured)),
        "p90_us": float(np.percentile(measured, 90)),
        "p99_us": float(np.percentile(measured, 99)),
        "ns_per_key": float(np.median(measured)) * 1000.0 / batch,
    }
    if len(stacks) == 1:  # where it goes: the probe (Shard.lookup) and the value gather
        probe = probes[warmup:] / 1000.0
        report["lookup_median_us"] = float(np.median(probe))
        report["gather_median_us"] = float(np.median(measured - probe))
        report["seek_fixed_median_us"] = _measure_seek_fixed(shards[0], count, width, drawn, seed)
        report["lane_pass_median_us"] = _measure_lane_pass(shards[0], count, width, seed)
    return report


def _measure_lane_pass(shard: Shard, count: int, width: int, seed: int) -> float:
    """Median µs of CPU per 1000-key request of what cube-server's TCP lane runs per frame: one
    compiled pass from request bytes to answer frame (cube.kernel.LanePass), on fresh batches
    (time.process_time over 256 frames at a time). Every answer is checked."""
    target = kernel.lane_target([(shard.kernel_table, shard.values)], width, "scale", width)
    lane = kernel.LanePass([""], 1 << 26, 1 << 20, 1 << 30, (1, 1000))
    rng = np.random.default_rng(seed + 2)
    frames, batches = [], []
    for _ in range(2048):
        keys = keys_of(rng.integers(0, count, 1000))
        body = wire.encode_seek_request(keys, request_id=1)
        frame = np.frombuffer(len(body).to_bytes(4, "little") + body, dtype=np.uint8)
        frames.append(kernel.read_only(frame))
        batches.append(keys)
    bounds = (0, 0, 0, 1 << 40, 1 << 40)
    per_frame = []
    for start in range(0, len(frames), 256):
        began = time.process_time()
        for frame in frames[start : start + 256]:
            lane.run(frame, 0, frame.shape[0], target, bounds)
        per_frame.append((time.process_time() - began) / 256 * 1e6)
        # (the answer frame: u32 length, u8 status, the SeekResponse)
        answer = wire.decode_seek_response(lane.out[5 : int(lane.result[1])].tobytes(), 1000)
        if not answer.found.all() or not np.array_equal(
            answer.column.as_rows(), values_of(batches[start + 255], width)
        ):
            raise AssertionError(f"lane pass frame {start + 255}: wrong answer")
    return float(np.median(per_frame[1:]))


def _measure_seek_fixed(
    shard: Shard, count: int, width: int, drawn: np.ndarray, seed: int
) -> float:
    """Median µs per batch of what cube-server runs per request on one layer of fixed-width
    values: the fused compiled lookup + gather (cube.kernel.seek_fixed), on fresh batches."""
    words = kernel.value_words(shard.values.as_rows())
    rng = np.random.default_rng(seed + 1)
    fresh = keys_of(rng.integers(0, count, drawn.shape))
    times = np.empty(fresh.shape[0], dtype=np.float64)
    for number, keys in enumerate(fresh):
        started = time.perf_counter_ns()
        found, out, _misses = kernel.seek_fixed(shard.kernel_table, words, keys, width)
        times[number] = time.perf_counter_ns() - started
        if not found.all() or not np.array_equal(out, values_of(keys, width)):
            raise AssertionError(f"seek_fixed batch {number}: wrong answer")
    return float(np.median(times[fresh.shape[0] // 10 :])) / 1000.0


def check_space(directory: Path, count: int, width: int) -> None:
    need = count * (width + 16) + 2 * count * (width + 16) + (256 << 20)
    free = shutil.disk_usage(directory).free
    if free < need:
        raise SystemExit(
            f"{directory}: {free / 1e9:.1f} GB free, the check needs about {need / 1e9:.1f} GB"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000_000)
    parser.add_argument("--width", type=int, default=64, help="value bytes per key")
    parser.add_argument("--shards", type=int, default=2, help="-shard_num of the build")
    parser.add_argument("--files", type=int, default=0, help="input files (default: ~1 GB each)")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tmp", default=tempfile.gettempdir(), help="where the files go")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument(
        "--hugepage",
        action="store_true",
        help="open the shards as cube-server --huge_pages does (2 MiB mappings where the"
        " kernel has them; the default opens them without)",
    )
    args = parser.parse_args(argv)
    files = args.files or max(1, args.keys * (args.width + 16) // (1 << 30))
    base = Path(args.tmp)
    check_space(base, args.keys, args.width)
    work = Path(tempfile.mkdtemp(prefix="cube-scale-", dir=base))
    report: dict[str, Any] = {
        "hugepage": args.hugepage,
        "keys": args.keys,
        "width": args.width,
        "shards": args.shards,
        "input_files": files,
        "cpus": os.cpu_count(),
        "kernel": os.environ.get("CUBE_KERNEL", "compiled"),
    }
    try:
        started = time.perf_counter()
        write_input(work / "input", args.keys, args.width, files)
        report["input_s"] = time.perf_counter() - started
        report["input_bytes"] = sum(p.stat().st_size for p in (work / "input").iterdir())
        os.sync()  # the input on disk first: its writeback would compete with the build's
        build = run_build(work / "input", work / "output", args.shards)
        build["records_per_s"] = args.keys / build["wall_s"]
        report["build"] = build
        dirs = shard_dirs(work / "output")
        index_bytes = sum((d / "index.cube").stat().st_size for d in dirs)
        data_bytes = sum((d / "data.cube").stat().st_size for d in dirs)
        report["index_bytes_per_key"] = index_bytes / args.keys
        report["data_bytes_per_key"] = data_bytes / args.keys
        os.sync()
        started = time.perf_counter()
        shards = [Shard.open(d, populate=True, huge_pages=args.hugepage) for d in dirs]
        report["open_populate_s"] = time.perf_counter() - started
        report["file_pmd_mapped_mb"] = sum(s.pmd_mapped_bytes() for s in shards) / (1 << 20)
        try:
            report["lookup"] = measure_lookups(
                shards, args.keys, args.width, args.batch, args.batches, args.warmup, args.seed
            )
        finally:
            for shard in shards:
                shard.close()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
