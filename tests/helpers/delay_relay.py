"""A TCP relay that adds latency or takes a link down, for tests: this machine's kernel has no
`sch_netem`, so `tc qdisc ... netem delay` is not available; tests point a replica's address
at this relay instead, which forwards every port to the replica and holds each chunk of bytes
`--delay_ms` milliseconds in each direction (about twice that per round trip), in order.

- As a process (tests/test_multihost.py): one delay for its life.

      python tests/helpers/delay_relay.py LISTEN_IP TARGET_IP PORT[,PORT...] DELAY_MS

- In a thread (`Link`, the loopback SDK tests): a delay that may change while connections
  are open, and `cut()` / `heal()`: a link taken down as a pulled cable or a dead host does
  it, without a reset: bytes on open connections are held (as a kernel keeps retransmitting
  them), and a new connection never completes (the listener stops accepting with its backlog
  full, so the kernel drops the SYNs) until `heal()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any


async def pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay: Callable[[], float],
    up: asyncio.Event | None = None,
) -> None:
    """Copy `reader` to `writer`, each chunk held `delay()` seconds (read when the chunk comes
    in: a caller may change it while connections are open), in order; while `up` is cleared
    nothing is delivered (the chunks wait, a bounded queue of them)."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=1024)

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            if not chunk:
                break
            pause = due - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            if up is not None:
                await up.wait()
            writer.write(chunk)
            await writer.drain()
        writer.close()

    delivery = asyncio.create_task(deliver())
    try:
        while chunk := await reader.read(65536):
            await queue.put((time.monotonic() + delay(), chunk))
    except (ConnectionError, OSError):
        pass
    finally:
        await queue.put((time.monotonic() + delay(), b""))
        try:
            await asyncio.wait_for(delivery, 30)
        except (ConnectionError, OSError, TimeoutError):
            writer.close()


async def relay_connection(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    target: str,
    port: int,
    delay: Callable[[], float],
    up: asyncio.Event | None = None,
) -> None:
    """Relay one accepted connection to target:port, `delay()` seconds each way (held while
    `up` is cleared)."""
    try:
        server_r, server_w = await asyncio.wait_for(asyncio.open_connection(target, port), 5)
    except (OSError, TimeoutError):
        client_w.close()
        return
    await asyncio.gather(pump(client_r, server_w, delay, up), pump(server_r, client_w, delay, up))


class Link:
    """A relay in a thread: listens on `listen` at each of `ports` and forwards to the same port
    on `target` (a server's lookup port and its TCP lane port, which the SDK finds on the host
    it was given), `delay`/2 seconds each way; `cut()` and `heal()` (module docstring), of
    every port or some (a firewall that drops one)."""

    BACKLOG = 128

    def __init__(
        self, ports: list[int], listen: str = "127.0.0.2", target: str = "127.0.0.1"
    ) -> None:
        self.delay = 0.0
        self.target = target
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._ports = {port: _Port(port, listen, self._run(_event())) for port in ports}
        self._relays: set[asyncio.Task[None]] = set()
        for port in self._ports.values():
            self._resume(port)

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def _resume(self, port: _Port) -> None:
        async def start() -> asyncio.Task[None]:
            return asyncio.create_task(self._accept(port))

        port.accepting = self._run(start())

    async def _accept(self, port: _Port) -> None:
        while True:
            sock, _ = await self.loop.sock_accept(port.listener)
            reader, writer = await asyncio.open_connection(sock=sock)
            task = asyncio.create_task(self._relay(reader, writer, port))
            self._relays.add(task)
            task.add_done_callback(self._relays.discard)

    async def _relay(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: _Port
    ) -> None:
        try:
            await relay_connection(
                reader, writer, self.target, port.number, lambda: self.delay / 2, port.up
            )
        except asyncio.CancelledError:  # the relay closes
            writer.close()

    def cut(self, ports: list[int] | None = None, settle: float = 0.05) -> None:
        """Take the link down (of `ports` only, when given): open connections stall, new ones
        never complete."""
        for port in [self._ports[p] for p in ports] if ports else self._ports.values():

            async def down(port: _Port = port) -> None:
                port.up.clear()
                if port.accepting is not None:
                    port.accepting.cancel()
                    await asyncio.gather(port.accepting, return_exceptions=True)

            self._run(down())
            port.listener.listen(0)  # an accept queue of one, filled below: SYNs are dropped
            for _ in range(8):  # until a connection attempt hangs (the queue is full)
                filler = socket.socket()
                filler.setblocking(False)
                port.fillers.append(filler)
                filler.connect_ex(port.listener.getsockname())
                time.sleep(settle)
                if not _connected(filler):
                    break

    def heal(self) -> None:
        """The link back up: held bytes flow, connections complete again."""
        for port in self._ports.values():
            for filler in port.fillers:
                filler.close()
            port.fillers.clear()
            port.listener.listen(self.BACKLOG)
            self.loop.call_soon_threadsafe(port.up.set)
            if port.accepting is None or port.accepting.done():
                self._resume(port)

    def close(self) -> None:
        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._run(stop())
        for port in self._ports.values():
            for sock in [port.listener, *port.fillers]:
                sock.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class _Port:
    """One port of a Link: its listener, whether it is up, what fills its backlog when not."""

    def __init__(self, number: int, listen: str, up: asyncio.Event) -> None:
        self.number = number
        self.listener = socket.create_server((listen, number), backlog=Link.BACKLOG)
        self.listener.setblocking(False)
        self.up = up
        self.accepting: asyncio.Task[None] | None = None
        self.fillers: list[socket.socket] = []


async def _event() -> asyncio.Event:
    """A set Event, made in the loop that will wait on it."""
    event = asyncio.Event()
    event.set()
    return event


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


async def _serve(listen: str, target: str, port: int, delay: float) -> asyncio.Server:
    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        await relay_connection(client_r, client_w, target, port, lambda: delay)

    return await asyncio.start_server(relay, listen, port)


async def main(listen: str, target: str, ports: str, delay_ms: str) -> None:
    delay = float(delay_ms) / 1000.0 / 2  # half each way
    servers = [await _serve(listen, target, int(p), delay) for p in ports.split(",")]
    print("relaying", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(*sys.argv[1:5]))
