"""AioLane's writes (cube.client._aio_transport): a call with none other in flight is written
at once; the calls started while others are in flight leave together, in one write at the end
of the loop turn (one syscall for the client, one read and one lane pass for the server). A
fake transport records the writes; the answers are fed as the event loop would."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from cube.client._aio_transport import _MAX_UNSENT_BYTES, AioLane
from cube.client.errors import TransportError
from cube.pb import cube_fast_pb2
from cube.wire import LANE_MAGIC, REQUEST_HEADER, answer_header, encode_seek_request


class Recorder(asyncio.Transport):
    """A transport that keeps what was written, one entry per write or writelines call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.writes.append(b"".join(bytes(d) for d in list_of_data))

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def abort(self) -> None:
        self.aborted = True


def request(key: int) -> bytes:
    return encode_seek_request(np.array([key], np.uint64), request_id=key)


def frame(key: int) -> bytes:
    body = request(key)
    return REQUEST_HEADER.pack(len(body)) + body


def answer(key: int) -> bytes:
    body = cube_fast_pb2.SeekResponse(
        found=b"\x01", values=key.to_bytes(8, "little"), value_width=8, version="1"
    ).SerializeToString()
    return answer_header(len(body)) + body


def feed(lane: AioLane, data: bytes) -> None:
    view = lane.get_buffer(len(data))
    view[: len(data)] = data
    lane.buffer_updated(len(data))


async def a_lane() -> tuple[AioLane, Recorder]:
    lane, transport = AioLane(), Recorder()
    lane.connection_made(transport)
    assert transport.writes == [LANE_MAGIC]
    transport.writes.clear()
    return lane, transport


def test_calls_started_in_one_loop_turn_leave_in_one_write() -> None:
    async def run() -> None:
        lane, transport = await a_lane()
        first = lane.send(request(1), 5.0)  # nothing in flight: written at once
        assert transport.writes == [frame(1)]
        second, third = lane.send(request(2), 5.0), lane.send(request(3), 5.0)
        assert transport.writes == [frame(1)]  # held to the end of this loop turn
        await asyncio.sleep(0)
        assert transport.writes == [frame(1), frame(2) + frame(3)]
        feed(lane, answer(1) + answer(2) + answer(3))
        got = [await f for f in (first, second, third)]
        values = [cube_fast_pb2.SeekResponse.FromString(bytes(g)).values for g in got]
        assert values == [k.to_bytes(8, "little") for k in (1, 2, 3)]
        alone = lane.send(request(4), 5.0)  # in flight alone again: at once
        assert transport.writes[-1] == frame(4)
        alone.cancel()
        lane.close()

    asyncio.run(run())


def test_held_frames_count_against_the_unsent_bound_and_go_with_a_lost_connection() -> None:
    async def run() -> None:
        lane, transport = await a_lane()
        lane.send(request(1), 5.0)
        big = encode_seek_request(np.arange(_MAX_UNSENT_BYTES // 8 // 2, dtype=np.uint64))
        held = [lane.send(big, 5.0) for _ in range(3)]
        with pytest.raises(TransportError, match="not taking requests"):
            await held[-1]  # the first two were held: 16 MiB and more unsent
        lane.connection_lost(None)
        await asyncio.sleep(0)
        assert transport.writes == [frame(1)]  # nothing written after the loss
        for call in held[:2]:
            with pytest.raises(TransportError, match="connection lost"):
                await call

    asyncio.run(run())
