"""The contracts each process shares, each in one module: cube.layout (names, build output
and version names, VERSION and CHAIN, tar members), cube.backoff, cube.donefile (lines) and
cube.wire's TCP lane frames."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from cube import layout


def test_names() -> None:
    assert layout.is_name("1700000000_1700000100") and layout.is_name("my.dict-2")
    for bad in ("", "..", "a/b", ".hidden", "a..b", "x" * 129, None, 7):
        assert not layout.is_name(bad)
    assert layout.part_name("d", 3) == "d_part3" and layout.tar_name("d", 3) == "d_part3.tar"
    assert layout.PART_RE.fullmatch("d_part3.tar.md5") and not layout.PART_RE.fullmatch("d_x3")
    match = layout.PART_NAME_RE.fullmatch(layout.part_name("my_dict", 12))
    assert match and (match["dict"], match["shard"]) == ("my_dict", "12")
    assert not layout.PART_NAME_RE.fullmatch("d_part07")  # part_name writes no leading zeros


def test_version_names() -> None:
    assert layout.output_dir_name("100", "100") == "100_100"
    assert layout.served_version("100", "100", is_base=True) == "100"
    assert layout.served_version("100", "150", is_base=False) == "100_150"
    assert layout.base_of("100_150") == "100" and layout.base_of("100_100") == "100_100"
    assert [layout.served_name(n) for n in ("100_100", "100_150", "100")] == [
        "100",
        "100_150",
        "100",
    ]
    assert layout.is_delta("100_150") and not layout.is_delta("100")
    deltas = ["100_90", "100_1000", "100_b", "100_200"]
    assert sorted(deltas, key=layout.delta_order) == ["100_90", "100_200", "100_1000", "100_b"]


def test_version_and_chain_files() -> None:
    assert layout.parse_version("100\nignored\n") == "100"
    assert layout.parse_version("  \n") is None and layout.parse_version("") is None
    chain = ["100", "100_150", "100_200"]
    assert layout.parse_chain(layout.chain_text(chain), "100_200") == chain
    for text, words in [
        ("100\n100_150\n", "end with"),
        ("100_150\n100_200\n", "start with the base"),
        ("100\n../x\n100_200\n", "only version names"),
        ("100\n100_150\n100_150\n100_200\n", "repeat"),
    ]:
        with pytest.raises(layout.LayoutError, match=words):
            layout.parse_chain(text, "100_200")


@pytest.mark.parametrize(
    ("name", "kind", "words"),
    [
        ("/abs", tarfile.REGTYPE, "absolute"),
        ("a/../../x", tarfile.REGTYPE, "leaves the target"),
        ("a\\b", tarfile.REGTYPE, "backslash"),
        ("link", tarfile.SYMTYPE, "symlink"),
        ("hard", tarfile.LNKTYPE, "hard link"),
        ("dev", tarfile.CHRTYPE, "device"),
        ("fifo", tarfile.FIFOTYPE, "fifo"),
    ],
)
def test_tar_members_refused(name: str, kind: bytes, words: str) -> None:
    member = tarfile.TarInfo(name)
    member.type = kind
    assert words in (layout.member_problem(member) or "")


def test_tar_members_allowed() -> None:
    for name, kind in (("./index.cube", tarfile.REGTYPE), ("sub", tarfile.DIRTYPE)):
        member = tarfile.TarInfo(name)
        member.type = kind
        assert layout.member_problem(member) is None


def test_one_backoff_rule() -> None:
    import random

    from cube.backoff import Backoff

    plain = Backoff(5.0, 300.0)
    assert [plain.delay(i) for i in range(8)] == [5, 10, 20, 40, 80, 160, 300, 300]
    assert plain.delay(10**6) == 300.0  # days of failures: bounded, no overflow
    jittered = Backoff(0.002, 0.1, jitter=0.5)
    rng = random.Random(1)
    for retry in range(10):
        ceiling = min(0.1, 0.002 * 2**retry)
        assert ceiling / 2 <= jittered.delay(retry, rng) <= ceiling
    with pytest.raises(ValueError, match="jitter"):
        Backoff(1, 2, jitter=2)


def test_one_retry_loop_on_a_fake_clock() -> None:
    """cube.backoff.retrying (and its async twin): tries until a value, waits the backoff
    between tries, gives up on an error that is not retryable, after the last attempt, or
    once the deadline has passed (the wait clipped to it)."""
    import asyncio

    from cube.backoff import Backoff, retrying, retrying_async

    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    def flaky(fails: int, error: Exception) -> Callable[[int], int]:
        def attempt(number: int) -> int:
            if number <= fails:
                raise error
            return number

        return attempt

    backoff = Backoff(1.0, 3.0)

    def transient(exc: Exception) -> bool:
        return isinstance(exc, OSError)

    def run(attempt: Callable[[int], int], attempts: int, deadline: float | None = None) -> int:
        return retrying(
            attempt, backoff, attempts, transient, clock=lambda: now[0], sleep=sleep,
            deadline=deadline,
        )  # fmt: skip

    assert run(flaky(3, OSError("x")), 5) == 4 and slept == [1.0, 2.0, 3.0]
    slept.clear()
    with pytest.raises(OSError):  # the last attempt's error, as it is
        run(flaky(9, OSError("x")), 3)
    assert slept == [1.0, 2.0]
    slept.clear()
    with pytest.raises(ValueError):  # not retryable: at once
        run(flaky(9, ValueError("x")), 3)
    assert slept == []
    now[0] = 0.0
    with pytest.raises(OSError):  # the deadline clips the wait, then ends the tries
        run(flaky(9, OSError("x")), 9, deadline=2.5)
    assert slept == [1.0, 1.5] and now[0] == 2.5
    assert run(flaky(0, OSError("x")), 0) == 1  # at least one attempt

    async def asleep(seconds: float) -> None:
        slept.append(seconds)

    async def attempt(number: int) -> int:
        if number < 3:
            raise OSError("x")
        return number

    slept.clear()
    got = asyncio.run(retrying_async(attempt, backoff, 5, transient, sleep=asleep))
    assert got == 3 and slept == [1.0, 2.0]


def test_donefile_lines_written_and_read_by_one_module() -> None:
    from cube.donefile import BASE_FILE, PATCH_FILE, BadLine, DonefileEntry, format_line, parse_line

    line = format_line("200", "100", "/in/200", delete="/in/200.del")
    entry = parse_line(PATCH_FILE, 3, line)
    assert isinstance(entry, DonefileEntry), entry
    assert (entry.id, entry.key, entry.input) == ("200", "100", "/in/200")
    assert entry.delete == "/in/200.del"
    base = parse_line(BASE_FILE, 1, format_line("100", "100", "/in/100", allow_shrink=True))
    assert isinstance(base, DonefileEntry), base
    assert base.is_base and base.allow_shrink
    # a number too long for int(): used to crash the poll with AttributeError
    huge = parse_line(BASE_FILE, 4, '{"id": ' + "1" * 5000 + ', "key": 1, "input": "/x"}')
    assert isinstance(huge, BadLine) and "not JSON" in huge.reason


def test_lane_frames_scanned_by_one_function() -> None:
    from cube.wire import FrameTooLarge, answer_header, error_frame, next_frame, request_header

    data = request_header(3) + b"abc" + request_header(5) + b"de"  # the second is partial
    first = next_frame(data, 0, len(data), answers=False)
    assert first is not None and data[first.start : first.stop] == b"abc"
    assert next_frame(data, first.stop, len(data), answers=False) is None
    with pytest.raises(FrameTooLarge) as caught:
        next_frame(request_header(10) + b"x" * 10, 0, 14, answers=False, max_frame=9)
    assert caught.value.length == 10
    answer = answer_header(2) + b"ok" + error_frame(9, "no such version")
    ok = next_frame(answer, 0, len(answer), answers=True)
    assert ok is not None
    refused = next_frame(answer, ok.stop, len(answer), answers=True)
    assert refused is not None
    assert (ok.status, answer[ok.start : ok.stop]) == (0, b"ok")
    assert refused.status == 9 and answer[refused.start : refused.stop] == b"no such version"


def test_agent_commands_and_task_reports_round_trip(tmp_path: Path) -> None:
    """What the transfer sends is what the agent parses; what the agent reports is what the
    transfer reads (one module, cube.protocol, on both sides)."""
    from cube.agent.tasks import Task
    from cube.protocol import CORRUPT_VERSION, FAILED, TaskReport, Work, parse_work

    sent = Work(
        command="download", version="100_150", mode="delta", dict_name="d", shard_seq=3,
        source="http://transfer:8080/100_150/d_part3.tar", md5="a" * 32, size=4096,
        chain=["100", "100_150"], depend="100", deploy_path=str(tmp_path), port=8000,
        id="150", key="100",
    )  # fmt: skip
    parsed = parse_work(sent.to_json(), tmp_path)
    kept = ("command", "version", "mode", "dict_name", "shard_seq", "source", "md5", "size")
    assert all(getattr(parsed, name) == getattr(sent, name) for name in kept)
    assert parsed.chain == sent.chain
    query = parse_work(Work("task", "100_150", task_command="reload").to_json(), tmp_path)
    assert (query.command, query.task_command) == ("task", "reload")
    task = Task("reload", "100_150", state=FAILED, message="refused", reason=CORRUPT_VERSION)
    report = TaskReport.from_json(task.to_json())
    assert report is not None and (report.state, report.reason) == (FAILED, CORRUPT_VERSION)
    assert TaskReport.from_json({"state": "bogus"}) is None
