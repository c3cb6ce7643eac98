"""The agent's HTTP API (aiohttp): the original's JSON envelope, bearer-token auth.

Every response is `{"success": "0"|"255"|"2", "message": str, "data": ...}`. Handlers never do
long work: commands are submitted as tasks and the transfer polls them. See docs/ROLLOUT.md.
A command from the original cube-transfer (`asked_the_original_way`) is answered when its task
ends, as the original agent answered, within --sync_reply_timeout.

One agent may serve several instances (--instances), as the original's did: a command goes to
the instance its `deploy_path` names, `GET /agent/status?deploy_path=` reports one, and without
it the status of every instance is listed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from cube import protocol
from cube.agent import __version__
from cube.agent.deploy import Agent
from cube.agent.peers import MANIFEST_PATH, TAR_PATH
from cube.agent.tasks import Task, TaskBusy
from cube.layout import is_name
from cube.protocol import (
    ERROR,
    FAILED,
    OK,
    QUERY_COMMAND,
    SUCCEEDED,
    UNKNOWN_API,
    BadRequest,
    asked_the_original_way,
    parse_work,
    pick_deploy_path,
)
from cube.security import TokenLike, token_middleware

log = logging.getLogger("cube.agent")

API_LIST = ["GET /agent/status", "POST /agent/cmd"]  # the original's (peers' and /healthz aside)
HEALTH_PATH = "/healthz"  # no token: the kubelet's liveness probe (answered by the event loop)
MAX_BODY = 1 << 20  # a command is a few hundred bytes
AGENTS_KEY = web.AppKey("agents", dict[Path, Agent])


def envelope(success: str, message: str, data: Any = None, status: int = 200) -> web.Response:
    return web.json_response(protocol.envelope(data, message, success), status=status)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"number {text[:40]} is out of range")
    return number


def parse_json(raw: bytes) -> Any:
    """Strict JSON ({} when empty): UTF-8, no NaN/Infinity, no overflowing numbers, bounded
    nesting; anything else is BadRequest (400), never an internal error."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8 JSON") from None
    if not text.strip():
        return {}
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise BadRequest("the body is not usable JSON: nested too deeply") from None
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None


async def _json_body(request: web.Request) -> Any:
    """The parsed JSON body, read once (auth and handler both need it)."""
    if "json_body" not in request:
        raw = await request.read() if request.body_exists else b""
        request["json_body"] = parse_json(raw)
    return request["json_body"]


def _agent_for(request: web.Request, requested: str) -> Agent:
    """The instance's Agent a request names by deploy_path (BadRequest when it names none)."""
    agents = request.app[AGENTS_KEY]
    return agents[pick_deploy_path(requested, list(agents))]


def make_app(agents: Agent | Sequence[Agent], token: TokenLike = "") -> web.Application:
    """The API of one agent process: `agents`, one per instance (--deploy_path, --instances)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
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
        except web.HTTPRequestEntityTooLarge:
            return envelope(ERROR, f"the body is larger than {MAX_BODY} bytes", status=413)
        except web.HTTPException as exc:  # every answer carries the envelope
            return envelope(ERROR, exc.text or exc.reason, status=exc.status)
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path)
            message = f"internal error ({type(exc).__name__}); details in the agent's log"
            return envelope(ERROR, message, status=500)

    def unauthorized() -> web.Response:
        message = (
            "unauthorized: send 'Authorization: Bearer <token>' (the agent's --token or CUBE_TOKEN)"
        )
        return envelope(ERROR, message, status=401)

    check_token = token_middleware(
        token,
        unauthorized,
        public=lambda request: request.method == "GET" and request.path == HEALTH_PATH,
        json_body=_json_body,
    )
    app = web.Application(middlewares=[guard, check_token], client_max_size=MAX_BODY)
    listed = [agents] if isinstance(agents, Agent) else list(agents)
    app[AGENTS_KEY] = {agent.layout.deploy_path: agent for agent in listed}
    app.router.add_get("/agent/status", handle_status)
    app.router.add_post("/agent/cmd", handle_cmd)
    app.router.add_get(HEALTH_PATH, handle_health)
    app.router.add_get(MANIFEST_PATH, handle_peer_manifest)
    app.router.add_get(TAR_PATH + "/{version}/{name}", handle_peer_tar)
    return app


async def _reply_when_done(agent: Agent, task: Task) -> web.Response:
    """The original agent's synchronous answer: success "0" once the work is done, "255" with
    the reason when it failed, or when it still runs after --sync_reply_timeout (the same
    command sent again waits for the same task)."""
    await agent.tasks.wait_for(task, agent.config.sync_reply_timeout)
    summary = f"{task.command} of {task.version}"
    if task.state == SUCCEEDED:
        return envelope(OK, f"{summary}: done", task.to_json())
    if task.state == FAILED:
        return envelope(ERROR, f"{summary} failed: {task.message}", task.to_json())
    return envelope(
        ERROR,
        f"{summary} still running after {agent.config.sync_reply_timeout:g}s; send it again"
        " to wait for it",
        task.to_json(),
    )


async def handle_status(request: web.Request) -> web.Response:
    """One instance's status (the only one, or `?deploy_path=`); several: each listed."""
    agents = request.app[AGENTS_KEY]
    requested = request.query.get("deploy_path", "")
    if len(agents) == 1 or requested:
        return envelope(OK, "", await _agent_for(request, requested).status_json())
    statuses = [await agent.status_json() for agent in agents.values()]
    return envelope(OK, "", {"status": "RUNNING", "version": __version__, "instances": statuses})


async def handle_health(request: web.Request) -> web.Response:
    """Alive: the event loop answers (no token; says nothing about versions or the server)."""
    return envelope(OK, "alive", {"status": "RUNNING"})


async def handle_peer_manifest(request: web.Request) -> web.Response:
    """What a recovering replica of this shard may take from here (agent/peers.py)."""
    agent = _agent_for(request, request.query.get("deploy_path", ""))
    return envelope(OK, "", await agent.peer_manifest())


async def handle_peer_tar(request: web.Request) -> web.StreamResponse:
    """A verified tar of the chain this replica serves, to a peer (ranges: it resumes)."""
    agent = _agent_for(request, request.query.get("deploy_path", ""))
    version, name = request.match_info["version"], request.match_info["name"]
    if not (is_name(version) and is_name(name)):
        raise BadRequest("version and tar name must be names")
    tar = agent.peer_tar(version, name)
    if tar is None:
        message = f"no verified tar {name} of {version} in the chain served here"
        return envelope(ERROR, message, status=404)
    return web.FileResponse(tar, headers={"Content-Type": "application/x-tar"})


async def handle_cmd(request: web.Request) -> web.Response:
    body = await _json_body(request)
    requested = body.get("deploy_path") if isinstance(body, dict) else None
    agent = _agent_for(request, requested.strip() if isinstance(requested, str) else "")
    work = parse_work(body, agent.layout.deploy_path)
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
    if asked_the_original_way(await _json_body(request)):
        return await _reply_when_done(agent, task)
    summary = f"{task.command} of {task.version}: {task.state}"
    return envelope(OK, f"{summary}: {task.message}" if task.message else summary, task.to_json())
