"""What the original cube-server's two brpc faces share (cube.server.http_json and
cube.server.baidu_std): the HTTP+JSON bodies of DictService/seek and ControlService/cmd, and
how a refusal becomes a brpc error code or an HTTP status. Pure: no I/O.

JSON, as brpc's json2pb converts the original's messages (proto/cube.proto) on an
open-source build (`pb_bytes_to_base64` on, empty arrays left out):
- seek request: `{"keys": [1, 2, ...], "version_required": false}`. A key is a JSON number or
  a decimal string (json2pb takes both for uint64); other members are ignored.
- seek response: `{"values": [{"status": 0, "value": "<base64>"}, ...], "version": "..."}`,
  one value per key in request order; a miss is `{"status": 4294967295, "value": ""}`;
  `version` only when `version_required` is true; no key: no `values` (`{}`).
- control request: `{"cmd": "status", "version_path": "/<dir>", "version": "<dir>"}`;
  response: `{"cur_version", "bg_version", "status"}` (+ `message` for a command that did
  something).

The JSON answer is written by numpy passes over the answer's arrays (values base64-encoded in
one `b64encode` call, the fixed text between them scattered in), never one object per key.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import grpc
import numpy as np

from cube.pb import cube_pb2
from cube.server.encoders import Answer
from cube.server.service import RequestError

# brpc's error codes (its errno.proto), as a baidu_std response's error_code
ENOSERVICE, ENOMETHOD, EREQUEST, ERPCAUTH = 1001, 1002, 1003, 1004
EINTERNAL, ELOGOFF, ELIMIT = 2001, 2003, 2004

# A refusal's gRPC status -> (HTTP status, brpc error code, HTTP status of a request body
# refused before it is read or cut off while read). UNAVAILABLE is brpc's ELOGOFF (HTTP 503),
# which brpc's default retry policy retries on another replica, as the SDK does; client errors
# (a bad request, too many keys, an answer over the byte bound) are EREQUEST (HTTP 400), which
# no client retries, but a body over the byte bound is 413 and one sent too slowly 408.
_CODES: dict[grpc.StatusCode, tuple[int, int, int]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, EREQUEST, 400),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (400, EREQUEST, 413),
    grpc.StatusCode.FAILED_PRECONDITION: (400, EREQUEST, 400),
    grpc.StatusCode.OUT_OF_RANGE: (400, EREQUEST, 400),
    grpc.StatusCode.NOT_FOUND: (404, EREQUEST, 404),
    grpc.StatusCode.UNAUTHENTICATED: (401, ERPCAUTH, 401),
    grpc.StatusCode.PERMISSION_DENIED: (403, ERPCAUTH, 403),
    grpc.StatusCode.ABORTED: (409, EINTERNAL, 409),
    grpc.StatusCode.UNAVAILABLE: (503, ELOGOFF, 503),
    grpc.StatusCode.DEADLINE_EXCEEDED: (500, EINTERNAL, 408),
}
_OTHER = (500, EINTERNAL, 500)


def http_status(code: grpc.StatusCode, body: bool = False) -> int:
    """The HTTP status of a refusal; `body`: of a request body refused before it was read or
    cut off while read (413 over the bound, 408 too slow)."""
    return _CODES.get(code, _OTHER)[2 if body else 0]


def brpc_error(code: grpc.StatusCode) -> int:
    return _CODES.get(code, _OTHER)[1]


def _bad(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


# ---------------------------------------------------------------------------------------------
# requests


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_object(body: bytes, what: str) -> dict[str, Any]:
    """A JSON object body (UTF-8, no NaN or Infinity); RequestError says where it is wrong,
    never what it holds."""
    try:
        value = json.loads(body.decode(), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise _bad(f"{what}: the body is not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise _bad(
            f"{what}: the body is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except (ValueError, RecursionError):
        raise _bad(f"{what}: the body is not JSON") from None
    if not isinstance(value, dict):
        raise _bad(f"{what}: the body is not a JSON object")
    return value


def seek_request(body: bytes) -> tuple[list[Any], bool, str]:
    """The keys (JSON values, unchecked: see `keys_array`), version_required and table (ours:
    the table of a version of several, "" by default) of a seek body."""
    request = parse_object(body, "seek")
    keys = request.get("keys")
    if keys is None:
        keys = []
    elif not isinstance(keys, list):
        raise _bad("seek: keys is not an array")
    required = request.get("version_required")
    if required is not None and not isinstance(required, bool):
        raise _bad("seek: version_required is not true or false")
    table = request.get("table")
    if table is not None and not isinstance(table, str):
        raise _bad("seek: table is not a string")
    return keys, bool(required), table or ""


_DECIMAL = re.compile(r"[0-9]{1,20}")
_UINT64_MAX = (1 << 64) - 1


def keys_array(items: list[Any]) -> np.ndarray:
    """JSON keys -> uint64. Numbers are converted in one numpy call once their types are
    checked (one C-level pass); decimal strings, which json2pb also takes, one by one."""
    types = set(map(type, items))
    if types <= {int}:
        try:
            return np.array(items, dtype=np.uint64)
        except OverflowError:
            pass  # a negative or too large number: find it below
    keys = np.empty(len(items), dtype=np.uint64)
    for index, item in enumerate(items):
        if type(item) is str and _DECIMAL.fullmatch(item):
            item = int(item)
        if type(item) is not int or not 0 <= item <= _UINT64_MAX:
            raise _bad(
                f"seek: keys[{index}] is not an unsigned 64-bit integer (a JSON number or"
                " decimal string in 0..18446744073709551615)"
            )
        keys[index] = item
    return keys


_CONTROL_FIELDS = ("cmd", "version_path", "version")


def control_request(body: bytes) -> cube_pb2.ControlRequest:
    """The original's control JSON as our ControlRequest (same command names and fields)."""
    command = parse_object(body, "ControlService/cmd")
    if not isinstance(command.get("cmd"), str):
        raise _bad("ControlService/cmd: cmd is missing or not a string")
    fields = {}
    for name in _CONTROL_FIELDS:
        value = command.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise _bad(f"ControlService/cmd: {name} is not a string")
        fields[name] = value
    return cube_pb2.ControlRequest(**fields)


def control_json(response: cube_pb2.ControlResponse) -> bytes:
    """The original's control answer: cur_version, bg_version, status (+ message)."""
    answer: dict[str, Any] = {
        "cur_version": response.cur_version,
        "bg_version": response.bg_version,
        "status": response.status,
    }
    if response.message:
        answer["message"] = response.message
    return json.dumps(answer).encode()


# ---------------------------------------------------------------------------------------------
# the seek answer

_END = b'"}'
_HIT = _END + b',{"status":0,"value":"'  # the text before a value, after the previous one
_MISS = _END + b',{"status":4294967295,"value":"'
_PIECES = np.zeros((2, len(_MISS)), dtype=np.uint8)
_PIECES[0, : len(_MISS)] = np.frombuffer(_MISS, np.uint8)
_PIECES[1, : len(_HIT)] = np.frombuffer(_HIT, np.uint8)
_PIECE_SIZES = np.array([len(_MISS), len(_HIT)], dtype=np.int64)
_PAD = ord("=")


def _base64(blob: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The base64 text of consecutive values (`lengths` bytes each, in `blob`) back to back,
    and each one's length in characters, in one b64encode call: every value is zero-padded to
    a multiple of 3 bytes (so its text starts on a 4-character group), then its padding
    characters are set to '='."""
    padded = (lengths + 2) // 3 * 3
    if np.array_equal(padded, lengths):
        source = blob
    else:
        source = np.zeros(int(padded.sum()), dtype=np.uint8)
        starts = np.cumsum(padded) - padded
        dest = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        dest += np.arange(dest.shape[0], dtype=np.int64)
        source[dest] = blob
    text = np.frombuffer(base64.b64encode(source.tobytes()), dtype=np.uint8).copy()
    sizes = padded // 3 * 4
    ends = np.cumsum(sizes)
    short = padded - lengths  # 0, 1 or 2 padding bytes: as many '=' at the value's end
    text[ends[short >= 1] - 1] = _PAD
    text[ends[short == 2] - 2] = _PAD
    return text, sizes


def _fixed_base64(rows: np.ndarray) -> np.ndarray:
    """(n, width) values -> (n, characters) base64 text, one row each."""
    n, width = rows.shape
    padded = (width + 2) // 3 * 3
    if padded != width:
        source = np.zeros((n, padded), dtype=np.uint8)
        source[:, :width] = rows
    else:
        source = np.ascontiguousarray(rows)
    text = np.frombuffer(base64.b64encode(source.tobytes()), dtype=np.uint8)
    text = text.reshape(n, padded // 3 * 4)
    if padded - width:
        text = text.copy()
        text[:, text.shape[1] - (padded - width) :] = _PAD
    return text


def seek_json(answer: Answer, version: str | None) -> bytes:
    """The JSON answer of a seek (module docstring): `version` None leaves it out."""
    found = answer.found
    n = found.shape[0]
    tail = b"" if version is None else b'"version":' + json.dumps(version).encode()
    if n == 0:
        return b"{" + tail + b"}"
    tail = b"]" + (b"," + tail if tail else b"") + b"}"
    width = answer.width
    hit_size = len(_HIT) + (width + 2) // 3 * 4  # a found entry's piece and text
    if width and hit_size >= len(_MISS):
        # Fixed width: one (n, entry) matrix of found entries; a miss is a shorter entry
        # written over its row's start, the rest of its row masked out.
        if found.all():
            values = answer.values.reshape(n, width)
        else:
            values = answer.values.reshape(n, width)[found]
        rows = np.empty((n, hit_size), dtype=np.uint8)
        rows[:, : len(_HIT)] = _PIECES[1, : len(_HIT)]
        if values.shape[0] == n:
            rows[:, len(_HIT) :] = _fixed_base64(values)
            body = rows.reshape(-1)
        else:
            if values.shape[0]:
                rows[found, len(_HIT) :] = _fixed_base64(values)
            missing = ~found
            rows[missing, : len(_MISS)] = _PIECES[0]
            keep = np.ones(rows.shape, dtype=bool)
            keep[missing, len(_MISS) :] = False
            body = rows[keep]
    else:
        if width:
            lengths = np.where(found, width, 0).astype(np.int64)
            blob = answer.values[found].reshape(-1)
        else:
            assert answer.offsets is not None
            lengths = np.diff(answer.offsets).astype(np.int64)
            blob = answer.values[answer.offsets[0] : answer.offsets[-1]]
        text, sizes = _base64(blob, lengths)
        # Entry i is its piece (the end of entry i-1, then its own head: hit or miss) then its
        # text. Piece byte j of entry i goes to (piece bytes before it) + (text before entry
        # i); the text fills the other positions, in order, in one masked copy.
        kinds = found.astype(np.intp)
        piece_sizes = _PIECE_SIZES[kinds]
        used = np.arange(_PIECES.shape[1]) < piece_sizes[:, None]
        piece_bytes = _PIECES[kinds][used]
        dest = np.repeat(np.cumsum(sizes) - sizes, piece_sizes)
        dest += np.arange(piece_bytes.shape[0], dtype=np.int64)
        body = np.empty(piece_bytes.shape[0] + text.shape[0], dtype=np.uint8)
        body[dest] = piece_bytes
        is_text = np.ones(body.shape[0], dtype=bool)
        is_text[dest] = False
        body[is_text] = text
    # The first piece begins with the end of an entry before it: replace that by the opening.
    return b'{"values":[' + body[len(_END) + 1 :].tobytes() + _END + tail
