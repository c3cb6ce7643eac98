"""The agent's HTTP API (aiohttp): the original's JSON envelope, bearer-token auth.

Every response is `{"success": "0"|"255"|"2", "message": str, "data": ...}`. Handlers never do
long work: commands are submitted as tasks and the transfer polls them. See docs/ROLLOUT.md.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from aiohttp import web

from agent.deploy import Agent
from agent.layout import BadRequest
from agent.tasks import TaskBusy
from agent.work import QUERY_COMMAND, parse_work

log = logging.getLogger("cube.agent")

OK, ERROR, UNKNOWN_API = "0", "255", "2"
API_LIST = ["GET /agent/status", "POST /agent/cmd"]
AGENT_KEY = web.AppKey("agent", Agent)


def envelope(success: str, message: str, data: Any = None, status: int = 200) -> web.Response:
    return web.json_response({"success": success, "message": message, "data": data}, status=status)


async def _json_body(request: web.Request) -> Any:
    """The parsed JSON body ({} when empty), read once (auth and handler both need it)."""
    if "json_body" not in request:
        text = await request.text() if request.body_exists else ""
        try:
            request["json_body"] = json.loads(text) if text.strip() else {}
        except ValueError as exc:
            raise BadRequest(f"the body is not JSON: {exc}") from None
    return request["json_body"]


def _authorized(request: web.Request, body: Any, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return True
    body_token = body.get("token") if isinstance(body, dict) else None
    return isinstance(body_token, str) and hmac.compare_digest(body_token.encode(), token.encode())


def make_app(agent: Agent, token: str = "") -> web.Application:
    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        try:
            if token:
                body = await _json_body(request) if request.method == "POST" else {}
                if not _authorized(request, body, token):
                    return envelope(
                        ERROR,
                        "unauthorized: send 'Authorization: Bearer <token>' (the agent's --token "
                        "or CUBE_TOKEN)",
                        status=401,
                    )
            return await handler(request)
        except BadRequest as exc:
            return envelope(ERROR, str(exc), status=400)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
            return envelope(
                UNKNOWN_API,
                f"unknown api {request.method} {request.path}",
                {"api_list": API_LIST},
                status=404,
            )
        except web.HTTPException:
            raise
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path)
            return envelope(ERROR, f"internal error: {type(exc).__name__}: {exc}", status=500)

    app = web.Application(middlewares=[guard])
    app[AGENT_KEY] = agent
    app.router.add_get("/agent/status", handle_status)
    app.router.add_post("/agent/cmd", handle_cmd)
    return app


async def handle_status(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    return envelope(OK, "", await agent.status_json())


async def handle_cmd(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    work = parse_work(await _json_body(request), agent.layout.deploy_path)
    if work.command == QUERY_COMMAND:
        if work.task_command:
            task = agent.tasks.find(work.task_command, work.version)
        else:
            task = agent.tasks.latest_for(work.version)
        if task is None:
            what = f"{work.task_command} task" if work.task_command else "task"
            return envelope(ERROR, f"no {what} for version {work.version}", status=404)
        return envelope(OK, task.message, task.to_json())
    try:
        task = await agent.submit(work)
    except TaskBusy as exc:
        return envelope(ERROR, str(exc), status=409)
    summary = f"{task.command} of {task.version}: {task.state}"
    return envelope(OK, f"{summary}: {task.message}" if task.message else summary, task.to_json())
