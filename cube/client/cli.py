"""cube-cli: send batches of keys to a dict and print latency percentiles and throughput.

    cube-cli --config_file cube.conf --keys keys.txt --dict test_dict --batch 500 \\
             --thread_num 4 [--requests 1000] [--print_output] [--timeout ms] [--retry n]
             [--tls_ca ca.pem [--tls_server_name name]]

`cube-cli retry VERSION --transfer HOST:PORT` asks a cube-transfer to roll out an abandoned
version again (cube/client/transfer_cmd.py).

Like the original's tool: every thread sends `--requests` batches of `--batch` keys, cycling
through the key file (one decimal key per line). Unlike it, QPS is total requests over the
wall time of the whole run (all threads), and keys/s is reported too. Exit status: 0 when
every request succeeded, 1 when some failed, 2 on bad flags, config or key file.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from cube.client._base import ClientOptions
from cube.client._core import PROTOCOLS, SeekResult
from cube.client._transport import SyncTransport
from cube.client.errors import CubeError, DictNotChosenError, ShardUnavailableError
from cube.client.options import WireProtocol
from cube.client.sync import CubeClient
from cube.flags import FlagError, FlagSet, flag, run_cli


@dataclass(frozen=True)
class CliFlags:
    """cube-cli's flags."""

    config_file: str = flag("./cube.conf", "cube.conf (JSON array of dicts)", metavar="PATH")
    keys: str = flag("keys", "key file: one decimal uint64 key per line")
    dict: str = flag("", "dict to query (optional when the conf has one dict)")
    table: str = flag("", "the table to query, in a dict whose versions hold several")
    batch: int = flag(500, "keys per request")
    thread_num: int = flag(1, "client threads")
    requests: int = flag(1000, "requests per thread")
    print_output: bool = flag(False, "print key:value (hex) for every key looked up")
    timeout: int | None = flag(
        None, "timeout of a whole call in ms (default: the conf's timeout)", metavar="MS"
    )
    retry: int | None = flag(None, "retries (default: the conf's)")
    tls_ca: str | None = flag(
        None,
        "PEM CA bundle: TLS to servers started with --tls_cert (default: the conf's tls_ca;"
        " none there: plaintext)",
    )
    tls_server_name: str | None = flag(
        None, "the name the servers' certificates carry (default: the conf's tls_server_name)"
    )
    protocol: str = flag("fast", "fast (cube.v1) or original (rec.mcube)", choices=tuple(PROTOCOLS))


FLAGS = FlagSet(
    "cube-cli",
    "Look up batches of keys in a Cube dict and report latency and QPS.",
    spec=CliFlags,
)

PERCENTILES = (50, 80, 90, 99, 99.9)


def read_keys(path: str) -> np.ndarray:
    """Keys of a key file; a bad line is named by number."""
    try:
        lines = Path(path).read_text().split("\n")
    except OSError as exc:
        raise FlagError(f"--keys {path}: {exc.strerror or exc}") from None
    tokens = [line.strip() for line in lines]
    numbered = [(i + 1, t) for i, t in enumerate(tokens) if t]
    if not numbered:
        raise FlagError(f"--keys {path}: no keys in the file")
    try:
        return np.array([t for _, t in numbered], dtype=np.uint64)
    except (ValueError, OverflowError):
        pass
    for number, token in numbered:
        if not token.isdigit() or int(token) >= 2**64:
            raise FlagError(f"--keys {path}: line {number}: {token!r} is not a uint64 key")
    raise FlagError(f"--keys {path}: cannot read keys")


def summarize(
    latencies_us: np.ndarray, failed: np.ndarray, keys_per_request: int, wall_s: float
) -> str:
    """The report: request counts, latency avg and percentiles (µs) of the requests that
    succeeded (none when all failed), requests/s over all threads and keys/s answered."""
    count = int(latencies_us.shape[0])
    errors = int(failed.sum())
    lines = [f"requests {count} (failed {errors}), wall {wall_s:.3f} s"]
    succeeded = latencies_us[~failed]
    if succeeded.shape[0]:
        marks = np.percentile(succeeded, PERCENTILES)
        parts = [f"avg {succeeded.mean():.0f}"] + [
            f"p{p:g} {v:.0f}" for p, v in zip(PERCENTILES, marks, strict=True)
        ]
        parts.append(f"max {succeeded.max():.0f}")
        lines.append("latency us: " + " ".join(parts))
    qps = count / wall_s if wall_s > 0 else 0.0
    keys_s = succeeded.shape[0] * keys_per_request / wall_s if wall_s > 0 else 0.0
    lines.append(f"qps {qps:.1f} requests/s, {keys_s:.0f} keys/s answered")
    return "\n".join(lines)


def format_batch(result: SeekResult) -> str:
    """--print_output lines as the original's cube_cli.cpp printed them: `key:K value:HEX`,
    and `key:K value:` for a key the dict does not hold (its empty value), as for an empty
    value (the SDK's `found` tells them apart)."""
    lines = []
    for key, value in zip(result.keys.tolist(), result.values, strict=True):
        lines.append(f"key:{key} value:{(value or b'').hex().upper()}")
    return "\n".join(lines) + "\n"


def describe_failure(exc: CubeError) -> str:
    """A failed request in the CLI's words: for an unavailable shard, how many tries and the
    last error, rather than the SDK's full attempt list."""
    if isinstance(exc, ShardUnavailableError):
        parts = []
        for shard, attempts in exc.failures.items():
            last = f"; last: {attempts[-1]!r}" if attempts else ""
            parts.append(f"shard {shard} failed on {len(attempts)} tries{last}")
        return "; ".join(parts)
    return str(exc)


def run(argv: Sequence[str]) -> int:
    flags = FLAGS.parse(argv)
    _check_flags(flags)
    keys = read_keys(flags.keys)
    try:
        client = CubeClient.from_conf(flags.config_file, flags.dict or None, **_overrides(flags))
    except DictNotChosenError as exc:
        print(f"error: {DictNotChosenError(exc.source, exc.names, 'pass --dict')}", file=sys.stderr)
        return 2
    except CubeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    batch, per_thread = flags.batch, flags.requests
    latencies = np.zeros((flags.thread_num, per_thread), dtype=np.float64)
    failed = np.zeros((flags.thread_num, per_thread), dtype=bool)
    print_lock = threading.Lock()
    first_error: list[str] = []
    output_closed = threading.Event()  # `cube-cli --print_output | head`: stop, quietly

    def worker(thread: int) -> None:
        offset = thread * batch * per_thread
        window = np.arange(batch, dtype=np.int64)
        for request in range(per_thread):
            if output_closed.is_set():
                return
            batch_keys = keys[(offset + request * batch + window) % keys.shape[0]]
            started = time.perf_counter()
            try:
                result = client.seek(batch_keys, table=flags.table)
            except CubeError as exc:
                latencies[thread, request] = (time.perf_counter() - started) * 1e6
                failed[thread, request] = True
                if not first_error:
                    first_error.append(describe_failure(exc))
                continue
            latencies[thread, request] = (time.perf_counter() - started) * 1e6
            if flags.print_output:
                text = format_batch(result)
                with print_lock:
                    try:
                        sys.stdout.write(text)
                        sys.stdout.flush()
                    except BrokenPipeError:
                        output_closed.set()
                        return

    with client:
        client.wait_ready(timeout_s=1.0)  # warm-up only: dead replicas show up as errors
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(flags.thread_num)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    if output_closed.is_set():
        raise BrokenPipeError  # the reader is gone: no report to write (see run_cli)
    errors = int(failed.sum())
    print(
        f"cube-cli: dict {client.dict_name!r}, {client.shard_num} shards, batch {batch},"
        f" {flags.thread_num} threads x {per_thread} requests"
    )
    print(summarize(latencies.reshape(-1), failed.reshape(-1), batch, wall))
    if errors:
        print(f"error: {errors} requests failed; first: {first_error[0]}", file=sys.stderr)
        return 1
    return 0


def _check_flags(flags: CliFlags) -> None:
    for name, value in (
        ("batch", flags.batch),
        ("thread_num", flags.thread_num),
        ("requests", flags.requests),
    ):
        if value < 1:
            raise FlagError(f"--{name} must be >= 1, got {value}")
    if flags.timeout is not None and flags.timeout < 1:
        raise FlagError(f"--timeout must be >= 1 (ms), got {flags.timeout}")
    if flags.retry is not None and flags.retry < 0:
        raise FlagError(f"--retry must be >= 0, got {flags.retry}")


def _overrides(flags: CliFlags) -> ClientOptions[SyncTransport]:
    """The client options the flags set over cube.conf's."""
    overrides: ClientOptions[SyncTransport] = {
        "protocol": cast(WireProtocol, flags.protocol)  # one of PROTOCOLS: the flag's choices
    }
    if flags.timeout is not None:
        overrides["timeout"] = flags.timeout / 1000.0  # --timeout is in ms, as the original's
    if flags.retry is not None:
        overrides["retry"] = flags.retry
    if flags.tls_ca is not None:
        overrides["tls_ca"] = flags.tls_ca
    if flags.tls_server_name is not None:
        overrides["tls_server_name"] = flags.tls_server_name
    return overrides


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["retry"]:  # cube-cli retry VERSION: the transfer's POST /dict/retry
        from cube.client import transfer_cmd

        return run_cli(transfer_cmd.run, args[1:])
    return run_cli(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
