"""Python SDK of Cube: `CubeClient` (blocking) and `AsyncCubeClient` (asyncio).

    from cube.client import CubeClient, Retry, Timeouts
    with CubeClient.from_conf("cube.conf", dict_name="test_dict") as client:
        result = client.seek([1, 2, 3])          # SeekResult: found, values, version, column
        emb = client.get_embeddings(keys, dim=8)  # (n, 8) float32, zero rows for misses
                                                  # (dim: by default cube.conf's `dim`)

    CubeClient([["10.0.0.5:8000", "10.0.0.6:8000"], ["10.0.0.7:8000"]],
               timeout=Timeouts(attempt=0.2, backup_after=0.02, total=0.5), retry=Retry(3))

    with CubeClients.from_conf("cube.conf") as cube:  # every dict of the file, by name
        cube.get_table_names()
        cube.seek("test_dict", [1, 2, 3])

Routing, grouping and scattering are vectorized (cube.routing); replicas get load balancing,
retries with backoff and backup requests; a batch is answered from one version. What this
package exports is its public surface (tests/test_client_api.py); the modules whose names
start with `_` are internals.
"""

from cube.backoff import Backoff
from cube.client._base import ClientOptions
from cube.client._core import SeekResult, version_order
from cube.client._transport import AsyncTransport, SyncTransport, Transport
from cube.client.aio import AsyncCubeClient
from cube.client.conf import DictConf, load_conf, parse_conf
from cube.client.errors import (
    Attempt,
    ClientClosedError,
    ConfError,
    ConfigMismatchError,
    CubeError,
    DeadlineExceededError,
    DictNotChosenError,
    KeyRangeError,
    KeyShapeError,
    RequestRejectedError,
    ShardUnavailableError,
    TransportError,
    ValueSizeError,
    VersionMismatchError,
)
from cube.client.mock import MockTransport
from cube.client.multi import AsyncCubeClients, CubeClients
from cube.client.options import (
    LoadBalancer,
    Partitioner,
    Retry,
    Timeouts,
    TransportName,
    WireProtocol,
)
from cube.client.stats import ClientStats
from cube.client.sync import CubeClient

__all__ = [
    "AsyncCubeClient",
    "AsyncCubeClients",
    "AsyncTransport",
    "Attempt",
    "Backoff",
    "ClientClosedError",
    "ClientOptions",
    "ClientStats",
    "ConfError",
    "ConfigMismatchError",
    "CubeClient",
    "CubeClients",
    "CubeError",
    "DeadlineExceededError",
    "DictConf",
    "DictNotChosenError",
    "KeyRangeError",
    "KeyShapeError",
    "LoadBalancer",
    "MockTransport",
    "Partitioner",
    "RequestRejectedError",
    "Retry",
    "SeekResult",
    "ShardUnavailableError",
    "SyncTransport",
    "Timeouts",
    "Transport",
    "TransportError",
    "TransportName",
    "ValueSizeError",
    "VersionMismatchError",
    "WireProtocol",
    "load_conf",
    "parse_conf",
    "version_order",
]
