"""Turn measured levels into figures, tables (Markdown, the seed's shape plus more), JSON and a
plot. Pure except `write_outputs`/`plot`, which write files (temp name + rename)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cube.bench.runner import LevelResult


def summarize(level: LevelResult) -> dict[str, Any]:
    """One table row: the seed's columns (threads, batch, avg latency, QPS) and ours."""
    a, cfg = level.attempt, level.config
    requests = max(a.requests, 1)
    lat_us = a.latencies_ns / 1e3 if a.requests else np.zeros(1)
    qps = a.requests / a.window if a.window > 0 else 0.0
    return {
        "threads": cfg.concurrency,
        "batch": cfg.batch,
        "avg_us": round(float(lat_us.mean()), 1),
        "p50_us": round(float(np.percentile(lat_us, 50)), 1),
        "p99_us": round(float(np.percentile(lat_us, 99)), 1),
        "qps": round(qps, 1),
        "keys_per_s": round(qps * cfg.batch),
        "server_cpu_us_per_req": round(a.cpu["servers"] / requests * 1e6, 1),
        "client_cpu_us_per_req": round(a.cpu["client"] / requests * 1e6, 1),
        # keys answered per second of server CPU: comparable across batch sizes and targets
        "keys_per_server_cpu_s": round(a.requests * cfg.batch / a.cpu["servers"])
        if a.cpu["servers"] > 0
        else 0,
        "server_cores": round(a.cpu["servers"] / a.window, 2),
        "client_cores": round(a.cpu["client"] / a.window, 2),
        "other_load": round(a.other_load, 2),
        "irq_cores": round(a.cpu["irq"] / a.window, 2),
        "requests": a.requests,
        "misses": a.misses,
        "seconds": round(a.window, 2),
        "tries": len(level.attempts),
        "disturbed": level.disturbed,
    }


def ratios(rows: dict[str, list[dict[str, Any]]], base: str = "redis") -> list[dict[str, Any]]:
    """QPS of every other target over `base`'s, per concurrency level both ran."""
    if base not in rows:
        return []
    base_qps = {r["threads"]: r["qps"] for r in rows[base]}
    out = []
    for threads in sorted(base_qps):
        entry: dict[str, Any] = {"threads": threads, f"{base}_qps": base_qps[threads]}
        for name, target_rows in rows.items():
            if name == base:
                continue
            for r in target_rows:
                if r["threads"] == threads and base_qps[threads] > 0:
                    entry[f"{name}/{base}"] = round(r["qps"] / base_qps[threads], 2)
        out.append(entry)
    return out


_COLUMNS = [
    ("threads", "threads"),
    ("batch", "batch"),
    ("avg latency (µs)", "avg_us"),
    ("QPS", "qps"),
    ("p50 (µs)", "p50_us"),
    ("p99 (µs)", "p99_us"),
    ("keys/s", "keys_per_s"),
    ("server CPU µs/req", "server_cpu_us_per_req"),
    ("keys/server CPU-s", "keys_per_server_cpu_s"),
    ("client CPU µs/req", "client_cpu_us_per_req"),
    ("other load (cores)", "other_load"),
    ("tries", "tries"),
]


def _cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key, "")  # (a column added later: rows of older results lack it)
    if key == "other_load" and row.get("disturbed"):
        return f"{value} ⚠"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:g}"
    if isinstance(value, int) and key in ("keys_per_s", "requests", "keys_per_server_cpu_s"):
        return f"{value:,}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    head = "| " + " | ".join(title for title, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---:" for _ in _COLUMNS) + "|"
    body = ["| " + " | ".join(_cell(r, key) for _, key in _COLUMNS) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def markdown(result: dict[str, Any], plot_name: str | None) -> str:
    """The whole report as Markdown (what goes to results.md)."""
    lines = _header_lines(result)
    for name, target in result["targets"].items():
        lines += _target_lines(name, target)
    for name, reason in result.get("skipped", {}).items():
        lines += [f"## {name}: skipped", "", reason, ""]
    if result.get("ratios"):
        lines += _ratio_lines(result["ratios"])
    lines += _disturbance_lines(result)
    if plot_name:
        lines += [f"![throughput and p99 latency against concurrency]({plot_name})", ""]
    return "\n".join(lines)


def _header_lines(result: dict[str, Any]) -> list[str]:
    """The command, the settings in a sentence, the machine and the versions."""
    s = result["settings"]
    return [
        "# cube-bench results",
        "",
        f"`{result['command']}`",
        "",
        f"{s['keys']:,} keys, values of {s['value_size']} bytes"
        + (f" (float32 embeddings, dim {s['dim']})" if s["dim"] else "")
        + (
            " derived from the keys (bench.keyspace)"
            if s.get("dataset") == "derived"
            else ("" if s["dim"] else " (random bytes)")
        )
        + (f", {s['distribution']} draws" if s.get("distribution", "uniform") != "uniform" else "")
        + f", batch {s['batch']}, {s['client']} clients, fresh random keys every request, "
        + (
            f"{s['requests']} requests per level"
            if s["requests"]
            else f"{s['duration']} s per level"
        )
        + f" after {s['warmup']} s of warm-up. Started {result['started']}.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in result["machine"].items()),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        "",
    ]


def _target_lines(name: str, target: dict[str, Any]) -> list[str]:
    """One target's section: how it was built, started and loaded, and its table."""
    lines = [f"## {name}", ""]
    if target.get("build_command"):
        lines += [
            f"Build ({target.get('build_seconds', '?')} s): `{target['build_command']}`",
            "",
        ]
    if target.get("command"):
        lines += [f"Server: `{target['command']}`", ""]
    if target.get("load_seconds") is not None:
        how = f" ({target['load_note']})" if target.get("load_note") else ""
        lines += [f"Loaded in {target['load_seconds']} s{how}.", ""]
    if target.get("notes"):
        lines += [f"{target['notes']}", ""]
    lines += [markdown_table(target["levels"]), ""]
    return lines


def _ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The throughput ratios between targets, one row per concurrency level."""
    names = [k for k in rows[0] if "/" in k]
    lines = [
        "## Throughput ratios",
        "",
        "| threads | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    lines += [
        f"| {r['threads']} | " + " | ".join(f"{r.get(n, '-')}" for n in names) + " |" for r in rows
    ]
    lines.append("")
    return lines


def _disturbance_lines(result: dict[str, Any]) -> list[str]:
    """Which levels were repeated or stayed disturbed, and what the columns mean."""
    s = result["settings"]
    disturbed = [
        f"{name} C={r['threads']}"
        for name, t in result["targets"].items()
        for r in t["levels"]
        if r["disturbed"]
    ]
    repeated = [
        f"{name} C={r['threads']} ({r['tries']} tries)"
        for name, t in result["targets"].items()
        for r in t["levels"]
        if r["tries"] > 1
    ]
    return [
        "## Disturbances",
        "",
        f"A level counts as disturbed when other processes (or hypervisor steal) used more than "
        f"{s['max_other_load']} cores during it; it is then run again, at most "
        f"{s['max_repeats']} more times, and the least disturbed try is kept. Before every try "
        f"cube-bench waits up to {s.get('quiet_wait', 0)} s for the machine to be quiet.",
        "",
        f"- repeated: {', '.join(repeated) if repeated else 'none'}",
        f"- still disturbed (marked ⚠): {', '.join(disturbed) if disturbed else 'none'}",
        "",
        "Columns: *server CPU µs/req* is utime+stime of the server process(es) (every worker) "
        "over the measured window divided by the requests answered in it; *client CPU* the "
        "same for the benchmark process; *other load* the cores used meanwhile by everything "
        "else on the machine.",
        "",
    ]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput and p99 latency against concurrency, one line per target (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_qps, ax_p99) = plt.subplots(1, 2, figsize=(10, 4), dpi=90)
    marked = False
    for name, target in result["targets"].items():
        levels = target["levels"]
        threads = [r["threads"] for r in levels]
        qps = [r["qps"] for r in levels]
        p99 = [r["p99_us"] / 1e3 for r in levels]
        line = ax_qps.plot(threads, qps, marker="o", label=name)[0]
        ax_p99.plot(threads, p99, marker="o", label=name, color=line.get_color())
        bad = [i for i, r in enumerate(levels) if r.get("disturbed")]
        for ax, ys in ((ax_qps, qps), (ax_p99, p99)):
            if bad:  # levels other processes disturbed even after the reruns
                ax.scatter(
                    [threads[i] for i in bad], [ys[i] for i in bad], s=140, facecolors="none",
                    edgecolors="red", label=None if marked else "disturbed", zorder=3,
                )  # fmt: skip
        marked = marked or bool(bad)
    s = result["settings"]
    ax_qps.set(
        xlabel=f"concurrent clients ({s['client']})",
        ylabel=f"requests/s (batch {s['batch']})",
        title="throughput",
    )
    ax_p99.set(
        xlabel=f"concurrent clients ({s['client']})", ylabel="ms (log scale)", title="p99 latency"
    )
    ax_p99.set_yscale("log")
    levels = sorted({r["threads"] for t in result["targets"].values() for r in t["levels"]})
    for ax in (ax_qps, ax_p99):
        ax.set_xticks(levels)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend()
    ax_qps.set_ylim(bottom=0)
    fig.suptitle(
        f"{s['keys']:,} keys, {s['value_size']} B values, batch {s['batch']}, fresh random keys",
        fontsize=10,
    )
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()


def write_outputs(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """results.json, results.md and results.png in `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "results.json",
        "markdown": out_dir / "results.md",
        "plot": out_dir / "results.png",
    }
    plot(result, paths["plot"])
    _write_atomic(paths["json"], (json.dumps(result, indent=2) + "\n").encode())
    _write_atomic(paths["markdown"], markdown(result, paths["plot"].name).encode())
    return paths
