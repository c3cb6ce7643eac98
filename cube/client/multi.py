"""Several dicts behind one object, as the original's API had them: its cube.conf is a list of
dicts, and `CubeAPI::seek(dict_name, keys, ...)` and `get_table_names()` take or list them.

    with CubeClients.from_conf("cube.conf") as cube:
        cube.get_table_names()                     # ["test_dict", "small_dict"], file order
        result = cube.seek("test_dict", keys)      # as CubeClient.seek
        emb = cube.table("small_dict").get_embeddings(keys, dim=8)

Each dict has its own `CubeClient` (its shards, timeouts, retries and balancer from its
cube.conf entry); `table(name)` returns it. `AsyncCubeClients` is the same over
`AsyncCubeClient`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, Self, TypeVar, Unpack

import numpy.typing as npt
from numpy.typing import DTypeLike, NDArray

from cube.client._base import ClientBase, ClientOptions
from cube.client._core import SeekResult
from cube.client._transport import AsyncTransport, SyncTransport
from cube.client.aio import AsyncCubeClient
from cube.client.conf import load_all
from cube.client.errors import ConfError
from cube.client.sync import CubeClient

C = TypeVar("C", bound=ClientBase[Any])


class _Dicts(Generic[C]):
    """The clients of several dicts, by dict name (each client's `dict_name`)."""

    def __init__(self, clients: Iterable[C]) -> None:
        self._clients: dict[str, C] = {}
        for client in clients:
            name = client.dict_name
            if not name:
                raise ConfError("every client needs its dict_name to be found by it")
            if name in self._clients:
                raise ConfError(f"dict {name!r} is given twice")
            self._clients[name] = client
        if not self._clients:
            raise ConfError("no dict given")

    @staticmethod
    def _open(
        factory: type[C],
        path: str | os.PathLike[str],
        dict_names: Sequence[str] | None,
        overrides: ClientOptions[Any],
    ) -> list[C]:
        if "stats" in overrides:
            raise ConfError(
                "stats would mix the dicts' shards in one ClientStats: build each dict's client"
                " with its own (CubeClient.from_conf(path, name, stats=...)) and pass them to"
                " CubeClients([...])"
            )
        if "dict_name" in overrides:
            raise ConfError("the dict names come from cube.conf: choose them with dict_names=")
        confs = load_all(path, dict_names)
        return [factory._from_dict_conf(conf, **overrides) for conf in confs]

    def table(self, dict_name: str) -> C:
        """The client of `dict_name`; ConfError (naming the dicts there are) if none."""
        try:
            return self._clients[dict_name]
        except KeyError:
            raise ConfError(f"no dict {dict_name!r} (has {', '.join(self._clients)})") from None

    def get_table_names(self) -> list[str]:
        """The dict names, in cube.conf order (the original listed them in no set order)."""
        return list(self._clients)

    def __contains__(self, dict_name: object) -> bool:
        return dict_name in self._clients

    def __iter__(self) -> Iterator[str]:
        return iter(self._clients)

    def __len__(self) -> int:
        return len(self._clients)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self._clients)})"


class CubeClients(_Dicts[CubeClient]):
    """Blocking clients of several dicts, by name. `CubeClients.from_conf(path)` opens every
    dict of a cube.conf (or those in `dict_names`); `CubeClients([client, ...])` groups
    clients built by hand (each with its `dict_name`). Closing it closes them all."""

    @classmethod
    def from_conf(
        cls,
        path: str | os.PathLike[str],
        dict_names: Sequence[str] | None = None,
        **overrides: Unpack[ClientOptions[SyncTransport]],
    ) -> Self:
        """A client for every dict of the cube.conf at `path` (or those in `dict_names`);
        keyword arguments override every dict's settings as in `CubeClient.from_conf`."""
        return cls(cls._open(CubeClient, path, dict_names, overrides))

    def seek(self, dict_name: str, keys: npt.ArrayLike, version: str | None = None) -> SeekResult:
        """`CubeClient.seek` on dict `dict_name` (the original's `seek(dict_name, keys)`)."""
        return self.table(dict_name).seek(keys, version)

    def get_embeddings(
        self,
        dict_name: str,
        keys: npt.ArrayLike,
        dim: int | None = None,
        dtype: DTypeLike = "float32",
    ) -> NDArray[Any]:
        """`CubeClient.get_embeddings` on dict `dict_name` (`dim`: by default its cube.conf's)."""
        return self.table(dict_name).get_embeddings(keys, dim, dtype)

    def wait_ready(self, timeout_s: float = 5.0) -> list[str]:
        """Connect to every dict's endpoints; return the ones not ready within `timeout_s`
        (each dict waits its turn, up to `timeout_s`)."""
        late: list[str] = []
        for client in self._clients.values():
            late += [a for a in client.wait_ready(timeout_s) if a not in late]
        return late

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncCubeClients(_Dicts[AsyncCubeClient]):
    """As CubeClients, over AsyncCubeClient (`await cube.seek(dict_name, keys)`)."""

    @classmethod
    def from_conf(
        cls,
        path: str | os.PathLike[str],
        dict_names: Sequence[str] | None = None,
        **overrides: Unpack[ClientOptions[AsyncTransport]],
    ) -> Self:
        """As CubeClients.from_conf."""
        return cls(cls._open(AsyncCubeClient, path, dict_names, overrides))

    async def seek(
        self, dict_name: str, keys: npt.ArrayLike, version: str | None = None
    ) -> SeekResult:
        """`AsyncCubeClient.seek` on dict `dict_name`."""
        return await self.table(dict_name).seek(keys, version)

    async def get_embeddings(
        self,
        dict_name: str,
        keys: npt.ArrayLike,
        dim: int | None = None,
        dtype: DTypeLike = "float32",
    ) -> NDArray[Any]:
        """`AsyncCubeClient.get_embeddings` on dict `dict_name`."""
        return await self.table(dict_name).get_embeddings(keys, dim, dtype)

    async def wait_ready(self, timeout_s: float = 5.0) -> list[str]:
        """As CubeClients.wait_ready."""
        late: list[str] = []
        for client in self._clients.values():
            late += [a for a in await client.wait_ready(timeout_s) if a not in late]
        return late

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()

    async def close(self) -> None:
        """The same as `aclose()` (the name it had first)."""
        await self.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
