"""cube-builder on Spark beside the local builder, on the same input.

    python -m bench.spark_build --keys 10000000,40000000 --files 8 --width 40 --shards 8

For each size: Cube-dialect input of `--keys` distinct records (`bench.scale`'s generator) in
`--files` files, then the real `cube-builder` twice on it with the same flags: the local
engine (`-workers 2`) and `-engine spark -spark_master local[N]`. Wall time, records/s, the
CPU of each command's process tree, Spark's task counts and shuffled bytes per record (from its
summary line), and whether the two outputs are identical (every tar's md5 and every meta_info
file compared). Everything lives under one temp directory, removed at the end. Prints one JSON
object (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.scale import builder_command, check_space, write_input

VERSION = 1_700_000_000
_SPARK_LINE = re.compile(
    r"spark: (\d+) map tasks, (\d+) shard tasks, ([\d.]+) shuffled bytes/record"
)


def run_engine(
    input_dir: Path, output: Path, shards: int, engine_flags: list[str]
) -> dict[str, Any]:
    args = [
        *builder_command(),
        "-dict_name=bench",
        f"-input_path={input_dir}",
        f"-output_path={output}",
        f"-shard_num={shards}",
        "-only_build=false",
        f"-cur_version={VERSION}",
        *engine_flags,
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"cube-builder {engine_flags} failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = {
        "wall_s": round(wall, 2),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
    }
    found = _SPARK_LINE.search(done.stdout)
    if found:
        result["map_tasks"] = int(found.group(1))
        result["shard_tasks"] = int(found.group(2))
        result["shuffled_bytes_per_record"] = float(found.group(3))
    return result


def output_signature(output: Path) -> dict[str, str]:
    """Every tar's md5 file and every meta_info file, by relative path (the md5 covers the
    shard files inside the tar)."""
    paths = [*output.rglob("*.tar.md5"), *(output / "meta_info").glob("*.json")]
    return {str(p.relative_to(output)): p.read_text() for p in sorted(paths)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default="10000000", help="comma-separated input sizes")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--width", type=int, default=40)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--dir", default=None, help="where to put the temp directory")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="cube-spark-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        for count in (int(k) for k in args.keys.split(",")):
            check_space(root, count, args.width)
            input_dir = root / f"input-{count}"
            started = time.perf_counter()
            write_input(input_dir, count, args.width, args.files)
            generated = time.perf_counter() - started
            local = run_engine(input_dir, root / "local", args.shards, ["-workers=2", "-quiet"])
            spark = run_engine(
                input_dir,
                root / "spark",
                args.shards,
                ["-engine=spark", f"-spark_master={args.master}",
                 "-spark_conf=spark.ui.enabled=false,spark.driver.memory=4g"],
            )  # fmt: skip
            identical = output_signature(root / "local") == output_signature(root / "spark")
            for engine in (local, spark):
                engine["records_per_s"] = round(count / engine["wall_s"])
            runs.append(
                {
                    "records": count,
                    "input_s": round(generated, 1),
                    "local": local,
                    "spark": spark,
                    "spark_vs_local": round(local["wall_s"] / spark["wall_s"], 2),
                    "identical": identical,
                }
            )
            print(json.dumps(runs[-1]), flush=True)
            for path in (input_dir, root / "local", root / "spark"):
                shutil.rmtree(path, ignore_errors=True)
    report = {"files": args.files, "width": args.width, "shards": args.shards,
              "master": args.master, "runs": runs}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(run["identical"] for run in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
