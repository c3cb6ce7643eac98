"""What a cube-server worker derives from its flags besides its ports (cube/server/ports.py):
the control token, the TLS files, the gRPC message bound and the byte, connection and time
bounds of its socket ports. The flags themselves: cube/server/main.py and
docs/reference/cube-server.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cube.listen import raise_open_files
from cube.security import TLSFiles, Token, token_of
from cube.server.bounds import LaneLimits

if TYPE_CHECKING:
    from cube.server.flags import ServerFlags

log = logging.getLogger("cube.server")

# Open files a worker needs besides its socket ports' connections (gRPC connections, shard
# files, the metrics endpoint's connections, ...).
FILES_BESIDES_CONNECTIONS = 512


def control_token(flags: ServerFlags) -> Token:
    """--control_token, else --control_token_file (read again when it changes), else
    $CUBE_CONTROL_TOKEN (false: none). SecurityError for a file that cannot be read."""
    return token_of(flags.control_token, flags.control_token_file, "CUBE_CONTROL_TOKEN")


def tls_files(flags: ServerFlags) -> TLSFiles:
    return TLSFiles(cert=flags.tls_cert, key=flags.tls_key)


def max_message(flags: ServerFlags) -> int:
    """The most bytes of one request message (gRPC's bound, the lane's frame, the faces' body):
    room for --max_batch keys. A DictRequest's key takes up to 11 bytes (proto2 repeated
    uint64 is not packed: a tag and a varint of up to 10 bytes), a cube.v1 one 8 or 9."""
    return max(4 << 20, int(flags.max_batch) * 11 + (1 << 16))


def lane_limits(flags: ServerFlags) -> LaneLimits:
    """The bounds of the worker's socket ports (TCP lane, HTTP+JSON, baidu_std): one budget and
    one connection count for them all. The process must be able to hold that many connections,
    twice (a burst of newcomers is accepted while as many connections they made room for are
    still closing), besides its other files: else the limit is never reached, the idle never
    make room, and accept fails instead. So the open-files limit is raised, and where it
    cannot be raised enough, --lane_max_connections is lowered (logged)."""
    max_connections = int(flags.lane_max_connections)
    files = raise_open_files(2 * max_connections + FILES_BESIDES_CONNECTIONS)
    if files < 2 * max_connections + FILES_BESIDES_CONNECTIONS:
        max_connections = max((files - FILES_BESIDES_CONNECTIONS) // 2, 64)
        log.warning(
            "--lane_max_connections %d lowered to %d: this process may open %d files"
            " (raise the hard RLIMIT_NOFILE, ulimit -Hn)",
            flags.lane_max_connections,
            max_connections,
            files,
        )
    return LaneLimits(
        max_frame=max_message(flags),
        connection_bytes=flags.lane_connection_bytes,
        budget_bytes=flags.lane_budget_bytes,
        stall_timeout=flags.lane_stall_timeout,
        max_connections=max_connections,
        idle_timeout=flags.lane_idle_timeout,
        request_timeout=flags.lane_request_timeout,
    )
