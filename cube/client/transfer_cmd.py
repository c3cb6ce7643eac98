"""`cube-cli retry VERSION --transfer HOST:PORT`: ask a cube-transfer to roll out an abandoned
version again (POST /dict/retry, docs/reference/transfer-api.md).

The API token comes from env CUBE_API_TOKEN or --token_file (never a flag's value: tokens
stay out of `ps`); an https:// transfer is trusted through --tls_ca (else the system's CAs).
Exit status: 0 queued (or already queued), 1 refused or unreachable, 2 bad flags.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cube.flags import FlagError, FlagSet, flag
from cube.security import SecurityError, client_context, token_of


@dataclass(frozen=True)
class RetryFlags:
    """cube-cli retry's flags."""

    transfer: str = flag(
        "127.0.0.1:8099", "the cube-transfer's API: host:port, or an http(s):// URL"
    )
    token_file: str = flag(
        "", "a file whose first line is the API token (default: env CUBE_API_TOKEN)"
    )
    tls_ca: str = flag("", "PEM CA bundle to trust for an https:// transfer")
    timeout: float = flag(10.0, "seconds to wait for the answer")
    version_name: str = flag("", "the version (instead of VERSION)", metavar="VERSION")


def flag_set() -> FlagSet[RetryFlags]:
    return FlagSet(
        "cube-cli retry",
        "Roll out an abandoned version again (the transfer's POST /dict/retry).",
        spec=RetryFlags,
    ).positional(
        "VERSION", "the version's name: <id>, or <base>_<id> for a delta", flag="version_name"
    )


def api_url(transfer: str, path: str) -> str:
    """`path` on the transfer at `transfer` (host:port, or a URL: its path is kept)."""
    base = transfer if "://" in transfer else f"http://{transfer}"
    if not base.startswith(("http://", "https://")):
        raise FlagError(f"--transfer: expected host:port or an http(s):// URL, got {transfer!r}")
    return base.rstrip("/") + path


def read_token(flags: RetryFlags) -> str:
    """The API token to send: the first line of --token_file, else $CUBE_API_TOKEN (the one
    reader of token files, cube.security.token_of)."""
    try:
        return token_of("", flags.token_file, "CUBE_API_TOKEN").value
    except SecurityError as exc:
        raise FlagError(f"--token_file: {exc}") from None


def post_json(url: str, body: Any, token: str, tls_ca: str, timeout: float) -> tuple[int, Any]:
    """POST `body` as JSON; (HTTP status, the answer's JSON or None)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = client_context(tls_ca) if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
            return resp.status, _json(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _json(exc.read())


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    version = flags.version_name
    if flags.timeout <= 0:
        raise FlagError(f"--timeout must be > 0, got {flags.timeout:g}")
    url = api_url(flags.transfer, "/dict/retry")
    try:
        status, answer = post_json(
            url, {"version": version}, read_token(flags), flags.tls_ca, flags.timeout
        )
    except SecurityError as exc:
        raise FlagError(str(exc)) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"error: cannot reach the transfer at {url}: {reason}", file=sys.stderr)
        return 1
    if not isinstance(answer, dict):
        print(f"error: {url} answered HTTP {status} without the API's JSON", file=sys.stderr)
        return 1
    message = str(answer.get("message", ""))
    if answer.get("success") != "0":
        print(f"error: {message} (HTTP {status})", file=sys.stderr)
        return 1
    print(message)
    return 0
