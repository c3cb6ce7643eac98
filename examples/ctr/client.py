"""Replay held-out samples against the predictor: AUC (overall and per version), QPS, latency.

    python -m examples.ctr.client --url http://127.0.0.1:8400 --data ROOT/heldout/20261123/0100

Samples go out in batches of `--batch` with `--concurrency` requests in flight, for one pass over
the data (or `--repeat` passes). Each answer names the version it came from; the AUC is reported
for all answers and for each version.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from cube.flags import FlagError, Flags, FlagSet, run_cli
from cube.security import token_from
from examples.ctr.model import auc
from examples.ctr.predictor import TOKEN_ENV
from examples.ctr.samples import parse_lines


@dataclass
class Replay:
    """Answers in sample order, with the version and latency of the request of each."""

    labels: np.ndarray
    ctr: np.ndarray
    versions: list[str]  # per sample
    latencies: list[float] = field(default_factory=list)  # per request, seconds
    errors: list[str] = field(default_factory=list)
    missing_features: int = 0
    features: int = 0
    seconds: float = 0.0

    @property
    def answered(self) -> np.ndarray:
        answered: np.ndarray = np.array(self.versions) != ""
        return answered

    def auc(self, version: str | None = None) -> float:
        mask = self.answered if version is None else np.array(self.versions) == version
        return auc(self.labels[mask], self.ctr[mask])

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies) * 1e3 if self.latencies else np.zeros(1)
        versions = sorted(set(v for v in self.versions if v))
        return {
            "samples": int(self.labels.shape[0]),
            "answered": int(self.answered.sum()),
            "requests": len(self.latencies),
            "errors": len(self.errors),
            "auc": self.auc(),
            "auc_by_version": {v: self.auc(v) for v in versions},
            "qps": len(self.latencies) / self.seconds if self.seconds else 0.0,
            "samples_per_s": float(self.answered.sum()) / self.seconds if self.seconds else 0.0,
            "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)),
            "missing_features": self.missing_features,
            "features": self.features,
        }


def read_samples(path: Path) -> list[str]:
    """Lines of a file, or of every part-* file of a directory."""
    files = sorted(path.glob("part-*")) if path.is_dir() else [path]
    lines: list[str] = []
    for file in files:
        lines.extend(line for line in file.read_text(encoding="ascii").splitlines() if line)
    return lines


async def replay(
    url: str,
    lines: Sequence[str],
    batch: int = 100,
    concurrency: int = 4,
    token: str = "",
    timeout: float = 10.0,
) -> Replay:
    """Send `lines` in batches; errors are recorded (their samples stay unanswered)."""
    labels = parse_lines(lines, where="sample", first_line=0).labels
    out = Replay(labels, np.full(len(lines), np.nan), [""] * len(lines))
    starts = list(range(0, len(lines), batch))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for start in starts:
        queue.put_nowait(start)

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            start = queue.get_nowait()
            chunk = list(lines[start : start + batch])
            began = time.monotonic()
            try:
                async with session.post(f"{url}/predict", json={"samples": chunk}) as response:
                    body = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                out.errors.append(f"samples {start}..: {type(exc).__name__}: {exc}")
                continue
            out.latencies.append(time.monotonic() - began)
            if response.status != 200:
                out.errors.append(f"samples {start}..: HTTP {response.status}: {body.get('error')}")
                continue
            out.ctr[start : start + len(chunk)] = body["ctr"]
            out.versions[start : start + len(chunk)] = [body["version"]] * len(chunk)
            out.missing_features += body["missing_features"]
            out.features += body["features"]

    began = time.monotonic()
    limits = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=limits) as session:
        await asyncio.gather(*(worker(session) for _ in range(max(1, concurrency))))
    out.seconds = time.monotonic() - began
    return out


def flag_set() -> FlagSet[Flags]:
    return (
        FlagSet("python -m examples.ctr.client", "Replay held-out samples against the predictor.")
        .add("url", str, "http://127.0.0.1:8400", "the predictor")
        .add("data", str, "", "a held-out split directory or a sample file", required=True)
        .add("batch", int, 100, "samples per request")
        .add("concurrency", int, 4, "requests in flight")
        .add("repeat", int, 1, "passes over the data")
        .add("token", str, "", f"bearer token (or env {TOKEN_ENV})")
        .add("json", bool, False, "print the summary as JSON")
    )


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    if flags.batch < 1 or flags.concurrency < 1 or flags.repeat < 1:
        raise FlagError("--batch, --concurrency and --repeat must be >= 1")
    lines = read_samples(Path(flags.data)) * flags.repeat
    if not lines:
        raise FlagError(f"--data {flags.data}: no samples")
    token = token_from(flags.token, TOKEN_ENV)
    result = asyncio.run(replay(flags.url, lines, flags.batch, flags.concurrency, token))
    summary = result.summary()
    if flags.json:
        print(json.dumps(summary, indent=1))
    else:
        print(
            f"{summary['answered']:,}/{summary['samples']:,} samples answered in "
            f"{summary['requests']:,} requests ({summary['errors']} errors): AUC "
            f"{summary['auc']:.4f}, {summary['qps']:.0f} requests/s "
            f"({summary['samples_per_s']:,.0f} samples/s), p50 {summary['p50_ms']:.1f} ms, "
            f"p99 {summary['p99_ms']:.1f} ms, {summary['missing_features']:,} of "
            f"{summary['features']:,} features missing"
        )
        for version, value in summary["auc_by_version"].items():
            print(f"  version {version}: AUC {value:.4f}")
        for error in result.errors[:5]:
            print(f"  error: {error}")
    return 0 if not result.errors else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
