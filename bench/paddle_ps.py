"""Conversion rate of `cube-builder -input_format paddle_ps`: a synthetic parameter-server save
of CtrCommonAccessor + adagrad rows (D=8: key and 13 numbers, written as Paddle writes them,
6 significant digits), parsed alone per core, then built end to end.

    python -m bench.paddle_ps --rows 10000000 --parts 8 [--gzip] [--workers 1,2]

Prints the parse-only rate on one core (compiled parser; the numpy fallback on a slice), and
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
    keys = rng.choice(np.uint64(1) << np.uint64(63), rows, replace=False).astype(np.uint64)
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


def parse_rate(root: Path, compiled: bool, limit_bytes: int) -> tuple[float, int]:
    """Rows per second of decompressing (when gzip) and parsing up to `limit_bytes` of text
    in 4 MiB chunks, in this process (one core)."""
    value = ValueSpec()
    rows = 0
    seconds = 0.0
    done = 0
    for path in sorted((root / "000").iterdir()):
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as stream:
            carry = b""
            while done < limit_bytes:
                started = time.perf_counter()
                block = stream.read(4 << 20)
                if not block:
                    break
                data = carry + block
                cut = data.rfind(b"\n") + 1
                carry = data[cut:]
                parsed = parse_rows(memoryview(data)[:cut], LAYOUT, value, str(path), 1, compiled)
                seconds += time.perf_counter() - started
                rows += int(parsed.keys.shape[0])
                done += cut
        if done >= limit_bytes:
            break
    return rows / seconds, rows


def build(root: Path, output: Path, workers: int) -> dict[str, float]:
    flags = ["-dict_name", "emb", "-input_path", str(root), "-output_path", str(output),
             "-shard_num", "2", "-input_format", "paddle_ps", "-paddle_accessor", "ctr_common",
             "-paddle_dim", "8", "-paddle_optimizer", "adagrad", "-workers", str(workers),
             "-quiet"]  # fmt: skip
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
        compiled, counted = parse_rate(root / "save", True, 512 << 20)
        numpy_rate, numpy_rows = parse_rate(root / "save", False, 16 << 20)
        print(f"parse only, one core: compiled {compiled / 1e6:.2f}M rows/s ({counted} rows), "
              f"numpy {numpy_rate / 1e6:.2f}M rows/s ({numpy_rows} rows)")  # fmt: skip
        for workers in (int(w) for w in args.workers.split(",")):
            output = root / f"out{workers}"
            result = build(root / "save", output, workers)
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
