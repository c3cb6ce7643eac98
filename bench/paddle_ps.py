"""Conversion rate of `cube-builder -input_format paddle_ps`: a synthetic parameter-server save
of CtrCommonAccessor + adagrad rows (D=8: key and 13 numbers, written as Paddle writes them,
6 significant digits), parsed alone per core, then built end to end.

    python -m bench.paddle_ps --rows 10000000 --parts 8 [--gzip] [--workers 1,2] [--shards 2]

Prints the reading rate on one core in rows per CPU second (read, gunzip, compiled parser: the
builder's reader; the numpy parser on a slice), and
for each -workers value the whole build's wall time, CPU time (parent and workers), rows per
second, rows per CPU second, and the largest resident set of the builder's processes.
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cube.builder.paddle_ps import table_batches
from cube.paddle_ps import ACCESSORS, SGD_RULES, TableLayout, ValueSpec, parse_rows

LAYOUT = TableLayout(ACCESSORS["ctr_common"], 8, SGD_RULES["adagrad"], SGD_RULES["adagrad"])
BLOCK_ROWS = 200_000


def row_block(rng: np.random.Generator) -> list[str]:
    """BLOCK_ROWS rows' numbers as Paddle prints them ('%g': 6 significant digits), without
    their keys: slot, unseen_days, delta_score, show, click, embed_w, embed_g2sum, 5 embedx_w,
    embedx_g2sum."""
    n = BLOCK_ROWS
    show = rng.integers(0, 3000, n)
    columns = [
        rng.integers(0, 30, n),
        rng.integers(0, 5, n),
        np.round(rng.exponential(5, n), 1),
        show,
        np.floor(show * rng.random(n)),
        rng.normal(0, 0.01, n),
        np.abs(rng.normal(0, 1, n)),
        *(rng.normal(0, 0.01, n) * 10.0 ** rng.integers(-4, 1, n) for _ in range(5)),
        np.abs(rng.normal(0, 1, n)),
    ]
    rows = np.stack([np.asarray(c, dtype=np.float64) for c in columns], axis=1).tolist()
    return [" ".join(f"{v:g}" for v in row) for row in rows]


def write_save(root: Path, rows: int, parts: int, compress: bool) -> int:
    """<root>/000/part-000-<shard>[.gz] (the table) and <root>/001/part-000.gz (a dense part);
    returns the table's text bytes."""
    rng = np.random.default_rng(25)
    block = row_block(rng)
    keys = rng.integers(0, 2**64 - 1, rows, dtype=np.uint64)  # repeats: ~none in 2^64
    (root / "000").mkdir(parents=True)
    (root / "001").mkdir()
    with gzip.open(root / "001" / "part-000.gz", "wt") as dense:
        dense.write("0.1 0 0\n" * 100)
    text_bytes = 0
    per_part = -(-rows // parts)
    for part in range(parts):
        lo, hi = part * per_part, min(rows, (part + 1) * per_part)
        name = root / "000" / f"part-000-{part:05d}{'.gz' if compress else ''}"
        with gzip.open(name, "wb", compresslevel=6) if compress else open(name, "wb") as out:
            for start in range(lo, hi, BLOCK_ROWS):
                chunk = keys[start : min(hi, start + BLOCK_ROWS)].tolist()
                text = "".join(f"{k} {block[i]}\n" for i, k in enumerate(chunk)).encode()
                out.write(text)
                text_bytes += len(text)
    return text_bytes


def parse_rate(root: Path, limit_bytes: int) -> tuple[float, int]:
    """Rows per CPU second of what a build's reader does with the table's files (read,
    decompress when gzip, parse with the compiled parser, values to bytes: the builder's
    `table_batches`, 4 MiB batches), up to `limit_bytes` of files, in this process: one core,
    CPU time so that other load on the machine does not count."""
    parse_rows(b"1 0 0 0 1 1 0.5 0.1\n", LAYOUT, ValueSpec(), "warm", 1, True)  # numba's load
    rows = 0
    started = time.process_time()
    done = 0
    for path in sorted((root / "000").iterdir()):
        for keys, _, _ in table_batches(str(path), LAYOUT, ValueSpec(), 4 << 20):
            rows += int(keys.shape[0])
        done += path.stat().st_size
        if done >= limit_bytes:
            break
    return rows / (time.process_time() - started), rows


def numpy_rate(root: Path, limit_bytes: int) -> tuple[float, int]:
    """The same for the numpy parser alone, on the first `limit_bytes` of text."""
    path = sorted((root / "000").iterdir())[0]
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as stream:
        data = stream.read(limit_bytes)
    data = data[: data.rfind(b"\n") + 1]
    started = time.process_time()
    rows = parse_rows(data, LAYOUT, ValueSpec(), str(path), 1, False).keys.shape[0]
    return rows / (time.process_time() - started), int(rows)


def build(root: Path, output: Path, workers: int, shards: int) -> dict[str, float]:
    flags = ["-dict_name", "emb", "-input_path", str(root), "-output_path", str(output),
             "-shard_num", str(shards), "-input_format", "paddle_ps", "-paddle_accessor",
             "ctr_common", "-paddle_dim", "8", "-paddle_optimizer", "adagrad", "-workers",
             str(workers), "-quiet"]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cube.builder.cli", *flags], capture_output=True, text=True,
        timeout=3600,
    )  # fmt: skip
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"cube-builder failed: {done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "max_rss_mb": after.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--parts", type=int, default=8, help="part files (table shards)")
    parser.add_argument("--gzip", action="store_true", help="gzip parts (save modes 0 and 3)")
    parser.add_argument("--workers", default="1,2", help="-workers values to build with")
    parser.add_argument("--shards", type=int, default=2, help="-shard_num of the builds")
    parser.add_argument("--dir", default="", help="where to write (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cube-paddle-bench-", dir=args.dir or None))
    try:
        started = time.monotonic()
        text = write_save(root / "save", args.rows, args.parts, args.gzip)
        size = sum(p.stat().st_size for p in (root / "save" / "000").iterdir())
        print(f"save: {args.rows} rows, {text / 1e6:.0f} MB of text, {size / 1e6:.0f} MB on disk"
              f" ({'gzip' if args.gzip else 'plain'}), written in "
              f"{time.monotonic() - started:.0f} s")  # fmt: skip
        os.sync()
        compiled, counted = parse_rate(root / "save", 512 << 20)
        slow, slow_rows = numpy_rate(root / "save", 16 << 20)
        print(f"read and parse, one core: compiled {compiled / 1e6:.2f}M rows per CPU second "
              f"({counted} rows), numpy {slow / 1e6:.2f}M ({slow_rows} rows)")  # fmt: skip
        for workers in (int(w) for w in args.workers.split(",")):
            output = root / f"out{workers}"
            result = build(root / "save", output, workers, args.shards)
            print(
                f"build -workers {workers}: {result['wall']:.2f} s wall, {result['cpu']:.2f} s "
                f"CPU, {args.rows / result['wall'] / 1e6:.2f}M rows/s, "
                f"{args.rows / result['cpu'] / 1e6:.2f}M rows per CPU second, largest RSS "
                f"{result['max_rss_mb']:.0f} MB"
            )
            shutil.rmtree(output)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
