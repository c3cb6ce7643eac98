"""The transfer's two listeners: the query API (the original's `/dict/*`, `/instance/status`,
plus `/dict/rollback`) and the file server agents download built tars from.

The API answers with the original's envelope `{"success": "0"|"255"|"2", "message", "data"}`,
errors included (400 bad request, 401 no token, 404 unknown, 409 busy, 413 body too big, 500 a
bug: the traceback goes to the log, never to the client). Every query parameter and form field
is checked before use: numbers are integers in range (`shard` in [0, shard_num), `split` 0),
versions look like version ids or names (never paths), `name` must be this dict; unknown or
repeated parameters are refused. Bodies are at most 1 MiB, a registered meta 64 KiB. Answers are
encoded to JSON in a thread (a history with per-shard metas can be big), and file reads happen
in threads: a request never holds the event loop the file server and the rollout share. With
`api_token` every request needs it (`Authorization: Bearer <token>`, or a `token` field in a
POST body), reads included.

The file server serves `output_address` read-only (GET/HEAD, byte ranges for resumed downloads,
no directory listings, no symlinks out of the tree): aiohttp's static handler for `http`, an
anonymous read-only pyftpdlib server for `ftp`.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import re
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from multidict import MultiMapping

from cube.donefile import ID, VERSION_NAME
from cube.listen import listen_socket
from cube.remote import redact
from cube.security import TLSFiles, server_context, token_middleware
from cube.transfer import views
from cube.transfer.config import TransferConfig
from cube.transfer.service import Busy, TransferService

log = logging.getLogger("cube.transfer.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MAX_BODY = 1 << 20  # bytes of a request body (a meta registration or a rollback is tiny)
MAX_META = 64 << 10  # bytes of one registered meta (the builder's are under 1 KiB)
_INTEGER = re.compile(r"-?[0-9]{1,12}")
_ECHO = 100  # characters of a request path or value repeated in an error message

API_LIST = [
    "GET /dict/info",
    "GET /instance/status",
    "GET /dict/deploy/history",
    "GET /dict/scaler?shard=",
    "GET /dict/meta_info?name=&version=&depend=&shard=[&split=0]",
    "POST /dict/meta_info/register (form: name, version, depend, shard, split, meta)",
    'POST /dict/rollback (JSON {"version": "<version>"})',
    'POST /dict/retry (JSON {"version": "<version>"})',
]


class BadRequest(Exception):
    """A request that cannot be served as sent; the message names the parameter."""


async def _reply(
    data: Any = None, message: str = "query ok", success: str = "0", status: int = 200
) -> web.Response:
    """The envelope, encoded in a thread (`data` must be a copy the loop no longer changes:
    the views build fresh objects)."""
    text = await asyncio.to_thread(json.dumps, views.envelope(data, message, success))
    return web.Response(text=text, status=status, content_type="application/json")


def _error(message: str, status: int = 400, success: str = "255", data: Any = None) -> web.Response:
    """An error envelope (small: encoded here)."""
    body = json.dumps(views.envelope(data, message, success))
    return web.Response(text=body, status=status, content_type="application/json")


def _echo(text: str) -> str:
    """A client-sent string, shortened, for an error message."""
    return repr(text[:_ECHO] + ("..." if len(text) > _ECHO else ""))


def _params(given: MultiMapping[Any], allowed: tuple[str, ...], what: str) -> dict[str, str]:
    """The `allowed` parameters of a query or form as strings; unknown, repeated or non-text
    ones are a BadRequest."""
    unknown = sorted({k for k in given if k not in allowed})
    if unknown:
        names = ", ".join(_echo(k)[1:-1] for k in unknown[:5])
        raise BadRequest(f"unknown {what}(s): {names} (known: {', '.join(allowed)})")
    out: dict[str, str] = {}
    for key in allowed:
        values = given.getall(key, [])
        if len(values) > 1:
            raise BadRequest(f"{key}: given more than once")
        if values:
            if not isinstance(values[0], str):
                raise BadRequest(f"{key}: expected text, not a file")
            out[key] = values[0]
    return out


def _required(fields: dict[str, str], names: tuple[str, ...], what: str) -> None:
    missing = [k for k in names if not fields.get(k)]
    if missing:
        raise BadRequest(f"missing {what}(s): {', '.join(missing)}")


def _version_id(fields: dict[str, str], key: str) -> str:
    value = fields[key]
    if not ID.fullmatch(value):
        raise BadRequest(f"{key}: expected a version id (decimal digits), got {_echo(value)}")
    return str(int(value))


def _shard(fields: dict[str, str], shard_num: int) -> int:
    raw = fields["shard"]
    if not _INTEGER.fullmatch(raw):
        raise BadRequest(f"shard: expected an integer, got {_echo(raw)}")
    shard = int(raw)
    if not 0 <= shard < shard_num:
        raise BadRequest(f"shard: {shard} is outside [0, {shard_num - 1}]")
    split = fields.get("split", "0")
    if split != "0":
        raise BadRequest(f"split: only split 0 exists (no dict_split), got {_echo(split)}")
    return shard


PAGE_DIR = Path(__file__).parent / "page"
PAGE_FILES = {  # path -> (file under page/, content type)
    "/": ("status.html", "text/html"),
    "/status.js": ("status.js", "text/javascript"),
    "/status.css": ("status.css", "text/css"),
}


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as the envelope (the token is checked inside it, by `check_token`: not
    for the status page's own files, which hold no data, and the page asks for the token)."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(str(exc))
    except web.HTTPRequestEntityTooLarge:
        return _error(f"request body over {MAX_BODY} bytes", 413)
    except web.HTTPException as exc:
        return _error(f"{exc.status} {exc.reason}", exc.status)
    except Exception:
        log.exception("%s %s failed", request.method, request.path[:_ECHO])
        return _error("internal error (the transfer's log has the details)", 500)


HEALTH_PATH = "/healthz"  # no token: the kubelet's liveness probe (answered by the event loop)


async def _health(request: web.Request) -> web.Response:
    """Alive: the event loop answers (says nothing of rollouts or agents)."""
    body = json.dumps(views.envelope({"status": "RUNNING"}, "alive"))
    return web.Response(text=body, content_type="application/json")


async def _unknown(request: web.Request) -> web.Response:
    message = f"unknown api {request.method[:10]} {_echo(request.path)[1:-1]}"
    return _error(message, 404, "2", {"api_list": API_LIST})


def _meta_json(text: str) -> None:
    """Refuse a registered meta that is too big or not a non-empty JSON object."""
    if len(text.encode()) > MAX_META:
        raise BadRequest(f"meta: over {MAX_META} bytes")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"meta: not JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError):  # an integer of over 4300 digits, deep nesting
        raise BadRequest("meta: not JSON we read (too many digits or too deep)") from None
    if not isinstance(meta, dict) or not meta:
        raise BadRequest("meta: expected a non-empty JSON object")


async def _version_of(request: web.Request) -> str:
    """The version named by a rollback or retry body `{"version": "<version>"}`."""
    try:
        body = json.loads(await request.read())
    except (ValueError, RecursionError):  # not JSON, over 4300 digits, too deep
        raise BadRequest('the body must be JSON: {"version": "<version>"}') from None
    return _rollback_version(body)


def _rollback_version(body: object) -> str:
    """The version name of a rollback body `{"version": "<version>"}` (an int is taken too)."""
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object: {"version": "<version>"}')
    version = body.get("version")
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    if not isinstance(version, str) or not VERSION_NAME.fullmatch(version):
        shown = _echo(version) if isinstance(version, str) else type(version).__name__
        raise BadRequest(f"version: expected a version name (<id> or <base>_<id>), got {shown}")
    return version


class _Api:
    """The query API's handlers over one TransferService: reads of the rollout's state, the
    meta registry, rollback, and the status page."""

    def __init__(self, service: TransferService) -> None:
        self.service = service
        self.cfg = service.cfg

    def _name(self, fields: dict[str, str]) -> None:
        if fields["name"] != self.cfg.dict_name:
            raise BadRequest(
                f"name {_echo(fields['name'])} is not this transfer's dict {self.cfg.dict_name!r}"
            )

    # --- reads of the rollout's state

    async def dict_info(self, request: web.Request) -> web.Response:
        _params(request.query, (), "query parameter")
        return await _reply(views.dict_info(self.cfg, self.service.state))

    async def instance_status(self, request: web.Request) -> web.Response:
        _params(request.query, (), "query parameter")
        state = self.service.state
        return await _reply([views.instance_info(self.cfg, state, i) for i in self.cfg.instances])

    async def deploy_history(self, request: web.Request) -> web.Response:
        _params(request.query, (), "query parameter")
        return await _reply(views.history(self.cfg, self.service.state))

    async def scaler(self, request: web.Request) -> web.Response:
        """The original's shape: `data` is the list as a JSON string; shard defaults to 0."""
        query = _params(request.query, ("shard",), "query parameter")
        shard = _shard({"shard": "0", **query}, self.cfg.shard_num)
        return await _reply(json.dumps(views.scaler(self.cfg, self.service.state, shard)))

    # --- the meta registry

    async def meta_info(self, request: web.Request) -> web.Response:
        query = _params(
            request.query, ("name", "version", "depend", "shard", "split"), "query parameter"
        )
        _required(query, ("name", "version", "depend", "shard"), "query parameter")
        self._name(query)
        version, depend = _version_id(query, "version"), _version_id(query, "depend")
        shard = _shard(query, self.cfg.shard_num)
        meta = await self.service.meta_info(version, depend, shard)
        if meta is None:
            return _error(f"no meta for version {version} depend {depend} shard {shard}", 404)
        data = {
            "name": self.cfg.dict_name,
            "version": views.number(version),
            "depend": views.number(depend),
            "shard": shard,
            "split": 0,
            "meta": meta,
        }  # fmt: skip  (ints, as the original's)
        return await _reply(data)

    async def register_meta(self, request: web.Request) -> web.Response:
        if request.content_type not in (
            "application/x-www-form-urlencoded",
            "multipart/form-data",
        ):
            raise BadRequest("the body must be a form (name, version, depend, shard, split, meta)")
        names = ("name", "version", "depend", "shard", "split", "meta", "token")
        fields = _params(await request.post(), names, "form field")
        _required(fields, ("name", "version", "depend", "shard", "meta"), "form field")
        self._name(fields)
        version, depend = _version_id(fields, "version"), _version_id(fields, "depend")
        shard = _shard(fields, self.cfg.shard_num)
        _meta_json(fields["meta"])
        try:
            await self.service.register_meta(version, depend, shard, fields["meta"])
        except LookupError as exc:
            return _error(str(exc), 404)
        return await _reply("ok", "register ok")

    # --- rollback

    async def rollback(self, request: web.Request) -> web.Response:
        version = await _version_of(request)
        try:
            rec = await self.service.rollback(version)
        except Busy as exc:
            return _error(str(exc), 409)
        except ValueError as exc:
            return _error(str(exc), 400)
        info = views.version_info(self.cfg, rec)
        if rec.status != "finished":
            return await _reply(info, f"rollback to {version} failed: {rec.message}", "255", 500)
        return await _reply(info, f"rolled back to {version}")

    # --- retrying an abandoned version

    async def retry(self, request: web.Request) -> web.Response:
        """Re-queue an abandoned version (idempotent: one already on its way is left as it
        is); answers at once with its record, the rollout follows as for any version."""
        version = await _version_of(request)
        try:
            rec, requeued = await self.service.retry(version)
        except ValueError as exc:
            return _error(str(exc), 400)
        info = views.version_info(self.cfg, rec)
        if requeued:
            return await _reply(info, f"retry of {version} queued")
        state = "a retry scheduled" if rec.awaiting_retry else rec.status
        return await _reply(info, f"version {version} is already queued ({state})")

    # --- the status page

    async def page(self, request: web.Request) -> web.Response:
        """The rollout status page: HTML with the dict's shape filled in, its script and style
        (the script polls the JSON API below)."""
        name, content_type = PAGE_FILES[request.path]
        text = (PAGE_DIR / name).read_text()
        if name.endswith(".html"):
            text = text.format(
                dict_name=html.escape(self.cfg.dict_name),
                shard_num=self.cfg.shard_num,
                copy_num=self.cfg.copy_num,
                mode=html.escape(self.cfg.mode),
            )
        return web.Response(
            text=text,
            content_type=content_type,
            headers={
                "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff",
                "Cache-Control": "no-store",
            },
        )


def build_api(service: TransferService) -> web.Application:
    api = _Api(service)
    check_token = token_middleware(
        service.cfg.api_token_source(),
        lambda: _error("unauthorized: send 'Authorization: Bearer <token>' (api_token)", 401),
        public=lambda request: (
            request.method == "GET" and (request.path in PAGE_FILES or request.path == HEALTH_PATH)
        ),
    )
    app = web.Application(client_max_size=MAX_BODY, middlewares=[_guard, check_token])
    app.router.add_get(HEALTH_PATH, _health)
    for path in PAGE_FILES:
        app.router.add_get(path, api.page)
    app.router.add_get("/dict/info", api.dict_info)
    app.router.add_get("/instance/status", api.instance_status)
    app.router.add_get("/dict/deploy/history", api.deploy_history)
    app.router.add_get("/dict/scaler", api.scaler)
    app.router.add_get("/dict/meta_info", api.meta_info)
    app.router.add_post("/dict/meta_info/register", api.register_meta)
    app.router.add_post("/dict/rollback", api.rollback)
    app.router.add_post("/dict/retry", api.retry)
    app.router.add_route("*", "/{tail:.*}", _unknown)
    return app


def build_file_server(service: TransferService) -> web.Application:
    app = web.Application()
    app.router.add_static("/", service.cfg.output_address, show_index=False, follow_symlinks=False)
    return app


class FtpFileServer:
    """Anonymous, read-only FTP over output_address (download_mode: ftp), in a thread."""

    def __init__(self, root: str, sock: socket.socket) -> None:
        try:
            from pyftpdlib.authorizers import DummyAuthorizer
            from pyftpdlib.handlers import FTPHandler
            from pyftpdlib.servers import FTPServer
        except ImportError as exc:
            raise RuntimeError("download_mode ftp needs pyftpdlib (pip install pyftpdlib)") from exc
        authorizer = DummyAuthorizer()
        authorizer.add_anonymous(root, perm="elr")
        handler = type(
            "ReadOnlyHandler", (FTPHandler,), {"authorizer": authorizer, "banner": "cube-transfer"}
        )
        self.server = FTPServer(sock, handler)
        self.server.max_cons, self.server.max_cons_per_ip = 256, 32  # bounded, as any listener
        self.thread = threading.Thread(target=self._serve, name="ftp-file-server", daemon=True)
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        return int(self.server.socket.getsockname()[1])

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.server.serve_forever(timeout=0.5, blocking=False)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.server.close_all()


@dataclass
class ListenSockets:
    """The API's and the file server's sockets, bound before the service opens: a port in use
    fails at once, and port 0 (any free port) is resolved before the file server's port goes
    into the agents' source URLs."""

    api: socket.socket
    files: socket.socket | None  # None with download_mode s3: agents download from S3

    @property
    def api_port(self) -> int:
        return int(self.api.getsockname()[1])

    @property
    def files_port(self) -> int:
        return int(self.files.getsockname()[1]) if self.files is not None else 0

    def close(self) -> None:
        self.api.close()
        if self.files is not None:
            self.files.close()


def bind_listeners(cfg: TransferConfig, api_port: int) -> ListenSockets:
    """Bind the API port (`-p`; 0: any free port) and the file server's `wget_port` (0: any
    free port) on `listen`, each for this process alone (cube.listen: ListenError when
    one is in use); no file server with download_mode s3 or a download_address."""
    api = listen_socket(cfg.listen, api_port, "-p, the API", backlog=128)
    if not cfg.serves_files:
        return ListenSockets(api, None)
    try:
        what = f"wget_port, the {cfg.download_mode} file server"
        files = listen_socket(cfg.listen, cfg.wget_port, what, backlog=128)
    except OSError:
        api.close()
        raise
    return ListenSockets(api, files)


async def start_listeners(
    service: TransferService, sockets: ListenSockets
) -> Callable[[], Awaitable[None]]:
    """Serve the API and the built files on the bound `sockets`; returns an async stop
    function. `service.cfg.wget_port` must be the files socket's port (see bind_listeners)."""
    cfg = service.cfg
    runners: list[web.AppRunner] = []
    ftp: FtpFileServer | None = None
    tls = TLSFiles(cfg.tls_cert, cfg.tls_key)
    ssl_context = server_context(tls) if tls.serves else None
    try:
        api = web.AppRunner(build_api(service), access_log=None)
        await api.setup()
        runners.append(api)
        await web.SockSite(api, sockets.api, ssl_context=ssl_context).start()
        if sockets.files is None:
            pass  # uploaded to upload_address (s3), or served by download_address's server
        elif cfg.download_mode == "http":
            files = web.AppRunner(build_file_server(service), access_log=None)
            await files.setup()
            runners.append(files)
            await web.SockSite(files, sockets.files, ssl_context=ssl_context).start()
        else:
            ftp = FtpFileServer(str(cfg.output_address), sockets.files)
            ftp.start()
    except BaseException:
        for runner in runners:
            await runner.cleanup()
        sockets.close()
        raise
    if cfg.download_address:
        where = f"served by {redact(cfg.download_address)} (not by this transfer)"
    elif sockets.files is None:
        where = f"uploaded to {redact(cfg.upload_address)}"
    else:
        where = f"({cfg.download_mode}) on {cfg.listen}:{sockets.files_port}"
    log.info(
        "API on %s://%s:%d, files %s from %s",
        "https" if ssl_context else "http",
        cfg.listen,
        sockets.api_port,
        where,
        cfg.output_address,
    )

    async def stop() -> None:
        for runner in runners:
            await runner.cleanup()
        if ftp is not None:
            await asyncio.to_thread(ftp.stop)
        sockets.close()

    return stop
