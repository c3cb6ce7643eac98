"""The TCP lane's compiled pass (cube.kernel.LanePass, cube/_lane_jit.py) against the Python
path it stands beside (the reference): the same frames through a lane with the compiled pass
and through one without it give byte-identical answer streams and the same counters, over fixed
and variable widths, hits and misses, base + delta stacks with deletes, pinned versions and
every kind of refused frame, whole or cut into pieces. In process: a lane protocol with a
transport that keeps what is written and a loop that runs its callbacks when asked."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol, TypeAlias

import numpy as np
import pytest
from helpers.procs import fixed_values, write_version

from cube import kernel
from cube.pb import cube_fast_pb2
from cube.server.lane import MAGIC, Lane, LaneProtocol
from cube.server.service import DEFAULT_MAX_ANSWER_BYTES, SeekService
from cube.server.versions import LoadOptions, VersionSlots, load_base
from cube.wire import Buffer

pytestmark = pytest.mark.skipif(not kernel.COMPILED, reason="needs the compiled kernel")

DICT = "test_dict"

# a lane's counters after a run: requests, keys, misses, errors by status, batch histogram
Counts: TypeAlias = tuple[int, int, int, dict[str, int], list[int]]
# what `serve` returns: bytes written, counters, callbacks queued for the Python path
Served: TypeAlias = tuple[bytes, Counts, int]


class Transport:
    """What the lane writes, in order; never holds bytes back."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def get_extra_info(self, name: str) -> None:
        return None

    def set_write_buffer_limits(self, high: int | None = None) -> None:
        pass

    def write(self, data: Buffer | bytearray) -> None:
        self.data += bytes(data)

    def writelines(self, buffers: Iterable[Buffer | bytearray]) -> None:
        for buffer in buffers:
            self.data += bytes(buffer)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Loop:
    """call_soon's callbacks, run by `drain`."""

    def __init__(self) -> None:
        self.ready: list[tuple[Callable[..., object], tuple[object, ...]]] = []

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        self.ready.append((callback, args))

    def drain(self) -> int:
        ran = 0
        while self.ready:
            callback, args = self.ready.pop(0)
            callback(*args)
            ran += 1
        return ran


def frame(
    keys: np.ndarray | None = None,
    *,
    dict_name: str = "",
    version: str = "",
    request_id: int = 0,
    raw: bytes | None = None,
) -> bytes:
    if raw is None:
        message = cube_fast_pb2.SeekRequest(
            keys=np.asarray(keys, dtype="<u8").tobytes(),
            dict_name=dict_name,
            version=version,
            request_id=request_id,
        )
        raw = message.SerializeToString()
    return struct.pack("<I", len(raw)) + raw


def serve(service: SeekService, frames: list[bytes], compiled: bool, pieces: int = 1) -> Served:
    """(bytes written, counters, whether the Python path answered anything) for `frames`
    sent as one stream cut into `pieces` reads."""
    lane = Lane(service)
    if not compiled:
        lane.compiled = None
    loop = Loop()
    lane._loop = loop  # type: ignore[assignment]
    connection = LaneProtocol(lane)
    transport = Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    stream = MAGIC + b"".join(frames)
    cuts = np.linspace(0, len(stream), pieces + 1).astype(int)
    queued = 0
    for start, stop in itertools.pairwise(cuts):
        connection.data_received(stream[start:stop])
        queued += sum(1 for callback, _ in loop.ready if callback == lane._answer_queued)
        loop.drain()
    lane.fold_counts()
    api = service.counters.api["lane"]
    counts: Counts = (api.requests, api.keys, api.misses, dict(api.errors), list(api.batch.counts))
    service.counters.api["lane"] = type(api)()  # fresh counters for the next run
    return bytes(transport.data), counts, queued


def same_answers(
    service: SeekService,
    frames: list[bytes],
    pieces: int = 1,
    python_expected: bool | None = None,
) -> Served:
    compiled = serve(service, frames, True, pieces)
    reference = serve(service, frames, False, pieces)
    assert compiled[0] == reference[0]
    assert compiled[1] == reference[1]
    if python_expected is not None:  # the compiled pass answered alone, or handed over
        assert bool(compiled[2]) == python_expected
    return reference


class LoadService(Protocol):
    """The `versions` fixture: a service over `data_dir` serving version `name`."""

    def __call__(
        self,
        data_dir: Path,
        name: str,
        background: str | None = None,
        *,
        max_batch: int = 5000,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ) -> SeekService: ...


@pytest.fixture
def versions(tmp_path: Path) -> Iterator[LoadService]:
    """A service over `data_dir` with `load(name, *background)` installing versions."""
    made: list[VersionSlots] = []

    def load(
        data_dir: Path,
        name: str,
        background: str | None = None,
        *,
        max_batch: int = 5000,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ) -> SeekService:
        slots = VersionSlots()
        made.append(slots)
        if background is not None:
            slots.install(load_base([data_dir], background, LoadOptions()))
            slots.stage(load_base([data_dir], name, LoadOptions()))
            slots.commit()
            slots.switch()
        else:
            slots.install(load_base([data_dir], name, LoadOptions()))
        return SeekService(
            slots, max_batch=max_batch, max_answer_bytes=max_answer_bytes, dict_name=DICT
        )

    yield load
    for slots in made:
        slots.close()


def random_keys(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**64 - 1, count, dtype=np.uint64)


@pytest.mark.parametrize("width", [1, 3, 8, 24, 40, 64, 100])
def test_fixed_width_hits_misses_and_request_ids(
    tmp_path: Path, versions: LoadService, width: int
) -> None:
    keys = random_keys(width, 3000)
    write_version(tmp_path, "1", keys, fixed_values(keys, width), current=True)
    service = versions(tmp_path, "1")
    absent = random_keys(99, 500)
    frames = [
        frame(keys[:1000], request_id=1),
        frame(np.concatenate([keys[1000:1400], absent[:300]]), request_id=2**63 + 5),
        frame(absent[300:], dict_name=DICT, version="1"),
        frame(keys[5:6], request_id=300, dict_name=DICT),
        frame(keys[: 4000 // 2]),
    ]
    _, counts, _ = same_answers(service, frames, python_expected=False)
    assert counts[0] == 5 and counts[2] == 300 + 200
    for pieces in (3, 17):
        same_answers(service, frames, pieces, python_expected=False)


def test_base_and_deltas_with_deletes(tmp_path: Path, versions: LoadService) -> None:
    width = 16
    keys = random_keys(1, 4000)
    write_version(tmp_path, "1", keys, fixed_values(keys, width, tag=1))
    changed, new = keys[:300], random_keys(2, 200)
    delta_keys = np.concatenate([changed, new])
    write_version(
        tmp_path, "1_2", delta_keys, fixed_values(delta_keys, width, tag=2), deleted=keys[300:400]
    )
    again = np.concatenate([keys[350:360], new[:50]])  # deleted then put back, and updated
    write_version(
        tmp_path, "1_3", again, fixed_values(again, width, tag=3), deleted=np.concatenate(
            [keys[:20], new[100:120], random_keys(3, 5)]
        ),
    )  # fmt: skip
    write_version(tmp_path, "1_4", [], [], deleted=keys[3000:3010])  # deletes only
    service = versions(tmp_path, "1_4")
    current = service.slots.current
    assert current is not None and len(current.stacks[0].layers) == 4
    probe = np.concatenate([keys[:500], new, keys[2990:3020], random_keys(4, 100)])
    frames = [frame(probe, request_id=7), frame(probe[::-1].copy(), version="1_4")]
    _, counts, _ = same_answers(service, frames, python_expected=False)
    assert counts[2] > 0


def test_variable_width_and_mixed_layers(tmp_path: Path, versions: LoadService) -> None:
    rng = np.random.default_rng(5)
    keys = random_keys(6, 2000)
    values = [
        bytes(rng.integers(0, 256, int(n), dtype=np.uint8)) for n in rng.integers(0, 90, 2000)
    ]
    write_version(tmp_path, "1", keys, values)
    delta = np.concatenate([keys[:100], random_keys(7, 100)])
    write_version(tmp_path, "1_2", delta, fixed_values(delta, 12), deleted=keys[100:150])
    service = versions(tmp_path, "1_2")
    current = service.slots.current
    assert current is not None and current.value_width == 0
    probe = np.concatenate([keys[:300], delta[100:], random_keys(8, 50)])
    frames = [frame(probe, request_id=3), frame(keys[1000:2000]), frame(random_keys(9, 20))]
    same_answers(service, frames, python_expected=False)
    same_answers(service, frames, pieces=11, python_expected=False)


def test_empty_base_and_empty_values(tmp_path: Path, versions: LoadService) -> None:
    keys = random_keys(10, 100)
    write_version(tmp_path, "1", keys, [b""] * 50 + [b"x"] * 50)
    service = versions(tmp_path, "1")
    same_answers(service, [frame(keys), frame(random_keys(11, 3))], python_expected=False)


def test_refused_frames_get_the_python_paths_errors_in_order(
    tmp_path: Path, versions: LoadService
) -> None:
    width = 8
    keys = random_keys(12, 1000)
    write_version(tmp_path, "1", keys, fixed_values(keys, width, 1))
    write_version(tmp_path, "2", keys[:500], fixed_values(keys[:500], width, 2))
    service = versions(tmp_path, "2", background="1", max_batch=600, max_answer_bytes=4000)
    good = frame(keys[:400], request_id=9)
    message = frame(keys[:3], request_id=1)[4:]
    bad = [
        frame(keys[:10], dict_name="other"),  # NOT_FOUND
        frame(keys[:10], version="1"),  # the background version, pinned: answered
        frame(keys[:10], version="3"),  # FAILED_PRECONDITION
        frame(keys[:601]),  # RESOURCE_EXHAUSTED: --max_batch
        frame(keys[:501]),  # RESOURCE_EXHAUSTED: --max_answer_bytes
        frame(raw=b"\x0a\x05" + b"12345"),  # keys not a multiple of 8
        frame(raw=b""),  # no keys
        frame(raw=b"\x0a\xff"),  # truncated
        frame(raw=message + b"\x28\x01"),  # an unknown field: answered by the Python path
        frame(raw=message + message),  # every field twice: the last wins
        frame(raw=b"\x12\x02\xff\xfe" + message),  # a dict name that is not UTF-8
    ]
    stream = []
    for item in bad:
        stream += [good, item]
    stream.append(good)
    _written, counts, _queued = same_answers(service, stream, python_expected=True)
    assert counts[3]  # errors were counted
    same_answers(service, stream, pieces=7)
    # the last frame: too large, so the connection is refused after the answers before it
    same_answers(service, [good, frame(keys[:1000]), good], python_expected=True)
    huge = Lane(service).limits.max_frame + 1
    same_answers(service, [good, struct.pack("<I", huge)], python_expected=True)


@pytest.mark.parametrize("partitioner", ["mod", "murmur3"])
def test_misses_of_keys_routed_elsewhere_are_refused(
    tmp_path: Path, versions: LoadService, partitioner: str
) -> None:
    from cube.routing import shard_of

    keys = random_keys(13, 4000)
    mine = keys[shard_of(keys, 2, partitioner) == 1]
    theirs = keys[shard_of(keys, 2, partitioner) == 0]
    routing = {"shard": 1, "shard_num": 2, "partitioner": partitioner}
    write_version(tmp_path, "1", mine[:1000], fixed_values(mine[:1000], 8), routing=routing)
    service = versions(tmp_path, "1")
    frames = [
        frame(mine[:1200]),  # misses, all of this shard: answered
        frame(np.concatenate([mine[:10], theirs[:1]])),  # refused
        frame(mine[:5]),
    ]
    _written, counts, _ = same_answers(service, frames, python_expected=True)
    assert counts[3] == {"INVALID_ARGUMENT": 1}
    same_answers(service, frames[:1] + frames[2:], python_expected=False)


def test_murmur3_matches_the_routing_function() -> None:
    from cube.hashing import murmur3_32

    keys = np.concatenate([random_keys(14, 2000), np.array([0, 1, 2**64 - 1], np.uint64)])
    compiled = np.array([kernel.lane_loops()._murmur3_32(k) for k in keys], dtype=np.uint64)
    assert (compiled == murmur3_32(keys).astype(np.uint64)).all()


def test_a_version_that_cannot_serve_goes_to_the_python_path(
    tmp_path: Path, versions: LoadService
) -> None:
    keys = random_keys(15, 100)
    write_version(tmp_path, "1", keys, fixed_values(keys, 8))
    service = versions(tmp_path, "1")
    service.slots.set_not_ready("warming")
    same_answers(service, [frame(keys)], python_expected=True)
    service.slots.set_not_ready("")
    same_answers(service, [frame(keys)], python_expected=False)


def test_a_sealed_kernel_answers_on_the_compiled_pass_alone(
    tmp_path: Path, versions: LoadService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server seals its kernel (cube.kernel.seal): the pass must still count as run, not
    hand every frame it answered to the Python path as well."""
    keys = random_keys(16, 100)
    write_version(tmp_path, "1", keys, fixed_values(keys, 8))
    service = versions(tmp_path, "1")
    monkeypatch.setattr(kernel, "_sealed", True)
    same_answers(service, [frame(keys), frame(keys[:10])], python_expected=False)
