"""The transfer's two listeners: the query API (the original's `/dict/*`, `/instance/status`,
plus `/dict/rollback`) and the file server agents download built tars from.

The API answers with the original's envelope `{"success": "0"|"255"|"2", "message", "data"}`.
The file server serves `output_address` read-only (GET/HEAD, byte ranges for resumed downloads,
no directory listings, no symlinks out of the tree): aiohttp's static handler for `http`, an
anonymous read-only pyftpdlib server for `ftp`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from transfer import views
from transfer.service import Busy, TransferService

log = logging.getLogger("cube.transfer.http")
Handler = Callable[[web.Request], Awaitable[web.Response]]

API_LIST = [
    "GET /dict/info",
    "GET /instance/status",
    "GET /dict/deploy/history",
    "GET /dict/meta_info?name=&version=&depend=&shard=[&split=0]",
    "POST /dict/meta_info/register (form: name, version, depend, shard, split, meta)",
    'POST /dict/rollback (JSON {"version": "<version>"})',
]


def _reply(data: Any = None, message: str = "query ok", success: str = "0", status: int = 200):
    return web.json_response(views.envelope(data, message, success), status=status)


def _error(message: str, status: int = 400) -> web.Response:
    return _reply(None, message, "255", status)


def build_api(service: TransferService) -> web.Application:
    cfg = service.cfg

    def authorized(request: web.Request, body: dict[str, Any] | None = None) -> bool:
        if not cfg.api_token:
            return True
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else str((body or {}).get("token", ""))
        return hmac.compare_digest(given.encode(), cfg.api_token.encode())

    async def dict_info(request: web.Request) -> web.Response:
        return _reply(views.dict_info(cfg, service.state))

    async def instance_status(request: web.Request) -> web.Response:
        return _reply([views.instance_info(cfg, service.state, i) for i in cfg.instances])

    async def deploy_history(request: web.Request) -> web.Response:
        return _reply(views.history(cfg, service.state))

    async def meta_info(request: web.Request) -> web.Response:
        query = request.query
        missing = [k for k in ("name", "version", "depend", "shard") if not query.get(k)]
        if missing:
            return _error(f"missing query parameter(s): {', '.join(missing)}")
        if query["name"] != cfg.dict_name:
            return _error(f"name {query['name']!r} is not this transfer's dict {cfg.dict_name!r}")
        meta = service.meta_info(query["version"], query["depend"], query["shard"])
        if meta is None:
            return _error(
                f"no meta for version {query['version']} depend {query['depend']} "
                f"shard {query['shard']}",
                404,
            )
        data = {
            "name": query["name"],
            "version": query["version"],
            "depend": query["depend"],
            "shard": query["shard"],
            "split": query.get("split", "0"),
            "meta": meta,
        }
        return _reply(data)

    async def register_meta(request: web.Request) -> web.Response:
        form = await request.post()
        fields = {
            k: str(form.get(k, "")) for k in ("name", "version", "depend", "shard", "split", "meta")
        }
        if not authorized(request, fields):
            return _error("unauthorized", 401)
        missing = [k for k in ("name", "version", "depend", "shard", "meta") if not fields[k]]
        if missing:
            return _error(f"missing form field(s): {', '.join(missing)}")
        try:
            meta = json.loads(fields["meta"])
        except ValueError as exc:
            return _error(f"meta: not JSON ({exc})")
        if not isinstance(meta, dict) or not meta:
            return _error("meta: expected a non-empty JSON object")
        try:
            service.register_meta(
                fields["name"], fields["version"], fields["depend"], fields["shard"], fields["meta"]
            )
        except ValueError as exc:
            return _error(str(exc), 404)
        return _reply("ok", "register ok")

    async def rollback(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error('the body must be JSON: {"version": "<version>"}')
        if not isinstance(body, dict):
            return _error('the body must be a JSON object: {"version": "<version>"}')
        if not authorized(request, body):
            return _error("unauthorized", 401)
        version = body.get("version")
        if isinstance(version, int) and not isinstance(version, bool):
            version = str(version)
        if not isinstance(version, str) or not version:
            return _error("version: expected a version name")
        try:
            rec = await service.rollback(version)
        except Busy as exc:
            return _error(str(exc), 409)
        except ValueError as exc:
            return _error(str(exc), 400)
        info = views.version_info(cfg, rec)
        if rec.status != "finished":
            return _reply(info, f"rollback to {version} failed: {rec.message}", "255", 500)
        return _reply(info, f"rolled back to {version}")

    async def unknown(request: web.Request) -> web.Response:
        return _reply(
            {"api_list": API_LIST}, f"unknown api {request.method} {request.path}", "2", 404
        )

    app = web.Application(client_max_size=16 << 20)
    app.router.add_get("/dict/info", dict_info)
    app.router.add_get("/instance/status", instance_status)
    app.router.add_get("/dict/deploy/history", deploy_history)
    app.router.add_get("/dict/meta_info", meta_info)
    app.router.add_post("/dict/meta_info/register", register_meta)
    app.router.add_post("/dict/rollback", rollback)
    app.router.add_route("*", "/{tail:.*}", unknown)
    return app


def build_file_server(service: TransferService) -> web.Application:
    app = web.Application()
    app.router.add_static("/", service.cfg.output_address, show_index=False, follow_symlinks=False)
    return app


class FtpFileServer:
    """Anonymous, read-only FTP over output_address (download_mode: ftp), in a thread."""

    def __init__(self, root: str, host: str, port: int) -> None:
        try:
            from pyftpdlib.authorizers import DummyAuthorizer
            from pyftpdlib.handlers import FTPHandler
            from pyftpdlib.servers import FTPServer
        except ImportError as exc:
            raise RuntimeError("download_mode ftp needs pyftpdlib (pip install pyftpdlib)") from exc
        authorizer = DummyAuthorizer()
        authorizer.add_anonymous(root, perm="elr")
        handler = type("ReadOnlyHandler", (FTPHandler,), {"authorizer": authorizer})
        handler.banner = "cube-transfer"
        self.server = FTPServer((host, port), handler)
        self.thread = threading.Thread(target=self._serve, name="ftp-file-server", daemon=True)
        self._stop = threading.Event()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.server.serve_forever(timeout=0.5, blocking=False)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.server.close_all()


async def start_listeners(service: TransferService, api_port: int) -> Callable[[], Awaitable[None]]:
    """Start the API and the file server on `listen`; returns an async stop function."""
    cfg = service.cfg
    runners: list[web.AppRunner] = []
    ftp: FtpFileServer | None = None
    try:
        api = web.AppRunner(build_api(service), access_log=None)
        await api.setup()
        runners.append(api)
        await web.TCPSite(api, cfg.listen, api_port).start()
        if cfg.download_mode == "http":
            files = web.AppRunner(build_file_server(service), access_log=None)
            await files.setup()
            runners.append(files)
            await web.TCPSite(files, cfg.listen, cfg.wget_port).start()
        else:
            ftp = FtpFileServer(str(cfg.output_address), cfg.listen, cfg.wget_port)
            ftp.start()
    except BaseException:
        for runner in runners:
            await runner.cleanup()
        raise
    log.info(
        "API on http://%s:%d, files (%s) on %s:%d from %s",
        cfg.listen,
        api_port,
        cfg.download_mode,
        cfg.listen,
        cfg.wget_port,
        cfg.output_address,
    )

    async def stop() -> None:
        for runner in runners:
            await runner.cleanup()
        if ftp is not None:
            await asyncio.to_thread(ftp.stop)

    return stop
