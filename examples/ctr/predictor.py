"""CTR prediction service: sparse part from Cube, dense part of the same version, HTTP JSON.

    python -m examples.ctr.predictor --cube_conf cube.conf --model_dir OUT/models --port 8400

    POST /predict   {"samples": ["1 0 123:1 456:2 ...", "789:1 ...", ...]}
                 -> {"version": "1795392000_1795395600", "ctr": [0.31, ...],
                     "features": 24, "missing_features": 3}
    GET /status     versions answered, dense parameters loaded, readiness, counters (JSON)
    GET /metrics    the same for Prometheus
    GET /health     200 while the process runs (liveness)
    GET /ready      200 when it can answer at its normal latency, else 503 with the reason:
                    a serving replica of every Cube shard reached, a version answered and its
                    dense part loaded (readiness; rechecked every second)

A request's feature ids go to Cube in one batched lookup (the distinct ids); the SDK answers a
batch from one version on every shard, and the predictor runs the MLP saved with that same
version (`dense.npz` of the model whose id ends the version's name; for the Paddle trainer's
versions its inference model, `dnn_plugin/`, with paddle.inference: paddle_dense.py), so no
prediction mixes the embeddings of one version with the dense part of another while a rollout
switches shards. A
version whose dense part is not there is an error (503), never an answer from another version.
Features Cube does not have pool as zero vectors and are counted in `missing_features`.

A model of several tables (the Paddle trainer's DeepFM: first-order weights and embeddings, the
tables `001` and `000` of each version) is served with `--tables 000,001`: the request's ids
are looked up in every table in one SDK call (`seek_tables`), answered by one version for all
of them (a version is served only once all its tables are loaded), each table's rows pooled per
sample and slot, and the dense part of that version takes one pooled input per table (its
layout.json names the table of each).

Off loopback the service needs `--token` (or env CTR_PREDICTOR_TOKEN; clients send
`Authorization: Bearer <token>`) or an explicit `--insecure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from cube.client import AsyncCubeClient, CubeError, SeekResult
from cube.flags import FlagError, Flags, FlagSet, run_cli
from cube.security import SecurityError, bearer_token, require_token, token_from, token_matches
from examples.ctr.model import Dense, pool
from examples.ctr.paddle_dense import PaddleDense
from examples.ctr.samples import SampleError, parse_lines
from examples.ctr.store import load_dense

TOKEN_ENV = "CTR_PREDICTOR_TOKEN"
MAX_BODY_BYTES = 8 << 20
log = logging.getLogger("ctr.predictor")


class PredictError(Exception):
    """A request the predictor cannot answer; `status` is the HTTP status to send."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DenseCache:
    """Dense parameters by version, the most recent `capacity` kept. Loading happens in a thread
    (file I/O), once per version even when many requests want it at the same time."""

    def __init__(self, models_root: Path, capacity: int = 8) -> None:
        self.models_root = models_root
        self.capacity = capacity
        self._loaded: OrderedDict[str, Dense | PaddleDense] = OrderedDict()
        self._loading: dict[str, asyncio.Future[Dense | PaddleDense]] = {}

    async def get(self, version: str) -> Dense | PaddleDense:
        if (dense := self._loaded.get(version)) is not None:
            self._loaded.move_to_end(version)
            return dense
        if (pending := self._loading.get(version)) is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self._load, version))
            self._loading[version] = pending
            pending.add_done_callback(lambda _: self._loading.pop(version, None))
        dense = await asyncio.shield(pending)
        self._loaded[version] = dense
        while len(self._loaded) > self.capacity:
            self._loaded.popitem(last=False)
        return dense

    def _load(self, version: str) -> Dense | PaddleDense:
        try:
            return load_dense(self.models_root, version)[0]
        except (OSError, ValueError, ImportError) as exc:
            raise PredictError(
                503,
                f"no usable dense parameters for version {version} in {self.models_root}: {exc}",
            ) from None

    def versions(self) -> list[str]:
        return list(self._loaded)


class Readiness:
    """Whether the predictor's dependencies let it answer at its normal latency: for every
    Cube shard a replica that made first contact (connected, routing checked, serving), a
    lookup answered by one version, and that version's dense part loaded. `check` is run by
    a background task every second; `/ready` reports its last result."""

    def __init__(
        self, client: AsyncCubeClient, dense: DenseCache, tables: Sequence[str] = ()
    ) -> None:
        self.client = client
        self.dense = dense
        self.tables = tuple(tables)
        self.reason = "not checked yet"

    @property
    def ready(self) -> bool:
        return not self.reason

    async def check(self, timeout_s: float) -> str:
        """The reason the predictor is not ready ("" when it is), also kept in `reason`."""
        self.reason = await self._why_not(timeout_s)
        return self.reason

    async def _why_not(self, timeout_s: float) -> str:
        late = set(await self.client.wait_ready(timeout_s))
        for shard, replicas in enumerate(self.client.shards):
            if all(replica in late for replica in replicas):
                return f"no replica of Cube shard {shard} is ready ({', '.join(replicas)})"
        try:
            probe = np.arange(max(64, 4 * len(self.client.shards)), dtype=np.uint64)
            # keys of every shard, most likely; in every table the predictor looks up
            answers = await lookup(self.client, probe, self.tables)
        except CubeError as exc:
            return f"a Cube lookup failed: {exc}"
        version = answers[0].version
        if version is None or any(a.version != version for a in answers):
            return "the Cube lookup was not answered by one version"
        try:
            await self.dense.get(version)
        except PredictError as exc:
            return str(exc)
        return ""


async def lookup(
    client: AsyncCubeClient, keys: np.ndarray, tables: Sequence[str]
) -> list[SeekResult]:
    """`keys` in each of `tables` with one SDK call (every answer from one version), or in the
    version's one table when `tables` is empty."""
    if not tables:
        return [await client.seek(keys)]
    return await client.seek_tables([(table, keys) for table in tables])


def dense_tables(dense: Dense | PaddleDense) -> list[tuple[str, int]]:
    """The (table, width) each input of a dense part pools ("": the version's one table)."""
    return dense.tables if isinstance(dense, PaddleDense) else [("", dense.dim)]


class Predictor:
    def __init__(
        self,
        client: AsyncCubeClient,
        models_root: Path,
        max_samples: int = 10_000,
        tables: Sequence[str] = (),
    ) -> None:
        self.client = client
        self.tables = tuple(tables)  # () : the version's one table
        self.dense = DenseCache(models_root)
        self.readiness = Readiness(client, self.dense, self.tables)
        self.max_samples = max_samples
        self.by_version: dict[str, int] = {}
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ctr_predict_requests", "requests by outcome", ["code"], registry=self.registry
        )
        self.samples = Counter("ctr_predict_samples", "samples predicted", registry=self.registry)
        self.features = Counter(
            "ctr_predict_features", "features looked up", registry=self.registry
        )
        self.missing = Counter(
            "ctr_predict_missing_features", "features Cube did not have", registry=self.registry
        )
        self.latency = Histogram(
            "ctr_predict_seconds",
            "request latency",
            registry=self.registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
        )

    async def predict(self, lines: Sequence[str]) -> dict[str, Any]:
        if len(lines) > self.max_samples:
            raise PredictError(413, f"{len(lines)} samples; at most {self.max_samples} a request")
        try:
            samples = parse_lines(lines, where="sample", first_line=0)
        except SampleError as exc:
            raise PredictError(400, str(exc)) from None
        if not len(samples):
            return {"version": None, "ctr": [], "features": 0, "missing_features": 0}
        if not samples.feasigns.shape[0]:  # the version, and so the dense part, comes from Cube
            raise PredictError(400, f"none of the {len(samples)} samples has a feature")
        unique, inverse = np.unique(samples.feasigns, return_inverse=True)
        try:
            answers = await lookup(self.client, unique, self.tables)
        except CubeError as exc:
            raise PredictError(503, f"embedding lookup failed: {exc}") from None
        version = answers[0].version
        if version is None or any(a.version != version for a in answers):
            raise PredictError(503, "the lookup was not answered by one version")
        results = dict(zip(self.tables or ("",), answers, strict=True))
        dense = await self.dense.get(version)
        pooled = []
        absent = np.zeros(unique.shape[0], dtype=bool)  # not in some table the model pools
        try:
            for table, dim in dense_tables(dense):
                if (result := results.get(table)) is None:
                    raise PredictError(
                        503,
                        f"version {version}: its dense part pools table "
                        f"{table or '(the one table)'}, which this predictor does not look up "
                        f"(--tables {','.join(self.tables) or '(none)'})",
                    )
                pooled.append(pool(result.embeddings(dim)[inverse], samples, dense.slot_ids))
                absent |= ~result.found
            if isinstance(dense, PaddleDense):
                ctr = dense.predict_inputs(pooled)
            else:
                ctr = dense.predict(pooled[0])
        except SampleError as exc:
            raise PredictError(400, str(exc)) from None
        except CubeError as exc:  # a value of the wrong size: the table is not this model's
            raise PredictError(503, f"version {version}: {exc}") from None
        missing = int(np.count_nonzero(absent[inverse]))
        self.by_version[version] = self.by_version.get(version, 0) + 1
        self.samples.inc(len(samples))
        self.features.inc(int(samples.feasigns.shape[0]))
        self.missing.inc(missing)
        return {
            "version": version,
            "ctr": ctr.tolist(),
            "features": int(samples.feasigns.shape[0]),
            "missing_features": missing,
        }

    def status(self) -> dict[str, Any]:
        def total(name: str) -> int:
            return int(self.registry.get_sample_value(f"{name}_total") or 0)

        return {
            "ready": self.readiness.ready,
            "not_ready_reason": self.readiness.reason,
            "answers_by_version": self.by_version,
            "dense_loaded": self.dense.versions(),
            "samples": total("ctr_predict_samples"),
            "features": total("ctr_predict_features"),
            "missing_features": total("ctr_predict_missing_features"),
        }


def make_app(predictor: Predictor, token: str = "") -> web.Application:
    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in ("/health", "/ready") and not token_matches(
            bearer_token(request.headers.get("Authorization")), token
        ):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def predict(request: web.Request) -> web.Response:
        started = time.monotonic()
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise PredictError(400, "the body is not JSON") from None
            lines = body.get("samples") if isinstance(body, dict) else None
            if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
                raise PredictError(400, 'expected {"samples": [<sample line>, ...]}')
            answer = await predictor.predict(lines)
        except PredictError as exc:
            predictor.requests.labels(str(exc.status)).inc()
            return web.json_response({"error": str(exc)}, status=exc.status)
        predictor.requests.labels("200").inc()
        predictor.latency.observe(time.monotonic() - started)
        return web.json_response(answer, dumps=_dumps)

    async def status(request: web.Request) -> web.Response:
        return web.json_response(predictor.status())

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(predictor.registry), content_type="text/plain", charset="utf-8"
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def ready(request: web.Request) -> web.Response:
        readiness = predictor.readiness
        if readiness.ready:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": readiness.reason}, status=503)

    app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
    app.add_routes(
        [
            web.post("/predict", predict),
            web.get("/status", status),
            web.get("/metrics", metrics),
            web.get("/health", health),
            web.get("/ready", ready),
        ]
    )
    return app


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def flag_set() -> FlagSet[Flags]:
    return (
        FlagSet("python -m examples.ctr.predictor", "CTR predictions from Cube's embeddings.")
        .add("cube_conf", str, "", "the SDK's cube.conf (cube-local writes one)", required=True)
        .add("dict_name", str, "", "dictionary in cube.conf (default: its only one)")
        .add("model_dir", str, "", "the trainer's <out>/models (dense parts)", required=True)
        .add("host", str, "127.0.0.1", "address to bind")
        .add("port", int, 8400, "port (0: any free one, printed at start)")
        .add("token", str, "", f"bearer token clients must send (or env {TOKEN_ENV})")
        .add("insecure", bool, False, "allow binding off loopback without a token")
        .add("max_samples", int, 10_000, "samples per request at most")
        .add("timeout", float, 0.5, "seconds a Cube lookup may take")
        .add(
            "tables",
            str,
            "",
            "the tables of a version to look up, comma-separated, for a model of several "
            "(the Paddle trainer's DeepFM: 000,001); default: the version's one table",
        )
    )


async def serve(flags: Any, token: str) -> None:
    kwargs: dict[str, Any] = {"timeout": flags.timeout}
    client = AsyncCubeClient.from_conf(flags.cube_conf, flags.dict_name or None, **kwargs)
    tables = [t for t in flags.tables.split(",") if t]
    predictor = Predictor(client, Path(flags.model_dir), flags.max_samples, tables)
    runner = web.AppRunner(make_app(predictor, token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, flags.host, flags.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"ctr predictor listening on http://{flags.host}:{port}", flush=True)
    watch = asyncio.ensure_future(watch_readiness(predictor.readiness, flags.timeout))
    try:
        await asyncio.Event().wait()
    finally:
        watch.cancel()
        await runner.cleanup()
        await client.close()


async def watch_readiness(readiness: Readiness, timeout_s: float, every_s: float = 1.0) -> None:
    """Recheck readiness every `every_s` seconds, logging each change."""
    last: str | None = None
    while True:
        reason = await readiness.check(timeout_s)
        if reason != last:
            log.info("ready" if not reason else "not ready: %s", reason)
            last = reason
        await asyncio.sleep(every_s)


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    if flags.max_samples < 1 or flags.timeout <= 0:
        raise FlagError("--max_samples must be >= 1 and --timeout > 0")
    token = token_from(flags.token, TOKEN_ENV)
    try:
        require_token("the CTR predictor", flags.host, token, flags.insecure, "--token")
    except SecurityError as exc:
        raise FlagError(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(flags, token))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
