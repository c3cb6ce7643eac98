"""A TCP relay that adds latency, for tests/test_multihost.py: this machine's kernel has no
`sch_netem`, so `tc qdisc ... netem delay` is not available; the test points a replica's DNS
name at this relay instead, which forwards every port to the replica and holds each chunk of
bytes `--delay_ms` milliseconds in each direction (about twice that per round trip), in order.

    python tests/delay_relay.py LISTEN_IP TARGET_IP PORT[,PORT...] DELAY_MS
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable


async def pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Callable[[], float]
) -> None:
    """Copy `reader` to `writer`, each chunk held `delay()` seconds (read when the chunk comes
    in: a caller may change it while connections are open), in order."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=1024)

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            if not chunk:
                break
            pause = due - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
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
) -> None:
    """Relay one accepted connection to target:port, `delay()` seconds each way."""
    try:
        server_r, server_w = await asyncio.wait_for(asyncio.open_connection(target, port), 5)
    except (OSError, TimeoutError):
        client_w.close()
        return
    await asyncio.gather(pump(client_r, server_w, delay), pump(server_r, client_w, delay))


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
    asyncio.run(main(*sys.argv[1:5]))
