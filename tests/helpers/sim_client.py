"""A Cube client for tests that runs in another network namespace (tests/helpers/clustersim.py): it
reads one JSON request per line on stdin and answers one JSON line on stdout.

    {"seek": [1, 2, 3], "dim": 4}      -> {"version": "...", "found": [...], "values": [[...]]}
                                          or {"error": "..."}
    {"load": [1, 2, 3], "seconds": 5, "dim": 4}
        -> lookups without pause for that long: {"calls", "errors": [...], "versions":
           {version: calls}, "mixed": n (answers whose version was None), "p50_ms", "p99_ms"}

    python tests/helpers/sim_client.py CUBE_CONF
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from cube.client import CubeClient, CubeError


def seek(client: CubeClient, keys: list[int], dim: int) -> dict[str, Any]:
    result = client.seek(np.asarray(keys, dtype=np.uint64))
    rows = result.column.as_rows() if result.width else None
    values = [] if rows is None else rows.view(np.float32).reshape(len(keys), -1)[:, :dim].tolist()
    return {"version": result.version, "found": result.found.tolist(), "values": values}


def load(client: CubeClient, keys: list[int], seconds: float) -> dict[str, Any]:
    batch = np.asarray(keys, dtype=np.uint64)
    errors: list[str] = []
    versions: dict[str, int] = {}
    latencies = []
    mixed = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            result = client.seek(batch)
        except CubeError as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        latencies.append(time.perf_counter() - started)
        if result.version is None:
            mixed += 1
        else:
            versions[result.version] = versions.get(result.version, 0) + 1
    marks = np.percentile(latencies, [50, 99]) * 1000 if latencies else [0.0, 0.0]
    return {
        "calls": len(latencies) + len(errors),
        "errors": errors[:20],
        "error_count": len(errors),
        "versions": versions,
        "mixed": mixed,
        "p50_ms": float(marks[0]),
        "p99_ms": float(marks[1]),
        "max_ms": max(latencies, default=0.0) * 1000,
    }


def main(conf: str) -> int:
    with CubeClient.from_conf(conf) as client:
        client.wait_ready(timeout_s=10.0)  # connections up before the first timed call
        for line in sys.stdin:
            request = json.loads(line)
            try:
                if "seek" in request:
                    answer = seek(client, request["seek"], request.get("dim", 0))
                else:
                    answer = load(client, request["load"], request["seconds"])
            except CubeError as exc:
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
