"""Python SDK of Cube: `CubeClient` (blocking) and `AsyncCubeClient` (asyncio).

    from cube.client import CubeClient
    with CubeClient.from_conf("cube.conf", dict_name="test_dict") as client:
        result = client.seek([1, 2, 3])          # SeekResult: found, values, version, column
        emb = client.get_embeddings(keys, dim=8)  # (n, 8) float32, zero rows for misses

Routing, grouping and scattering are vectorized (cube.routing); replicas get load balancing,
retries with backoff and backup requests (cube.client.policy); a batch is answered from one
version (rule in cube.client.core).
"""

from cube.client.aio import AsyncCubeClient
from cube.client.conf import DictConf, load_conf, parse_conf
from cube.client.core import SeekResult, version_order
from cube.client.errors import (
    Attempt,
    ConfError,
    ConfigMismatchError,
    CubeError,
    KeyRangeError,
    RequestRejectedError,
    ShardUnavailableError,
    ValueSizeError,
    VersionMismatchError,
)
from cube.client.sync import CubeClient

__all__ = [
    "AsyncCubeClient",
    "Attempt",
    "ConfError",
    "ConfigMismatchError",
    "CubeClient",
    "CubeError",
    "DictConf",
    "KeyRangeError",
    "RequestRejectedError",
    "SeekResult",
    "ShardUnavailableError",
    "ValueSizeError",
    "VersionMismatchError",
    "load_conf",
    "parse_conf",
    "version_order",
]
