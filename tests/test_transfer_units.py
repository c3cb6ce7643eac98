"""cube-transfer pure parts: transfer.conf, donefile lines, the version state machine, quorum,
catch-up plans, the journal, builder output checks."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

import pytest

from cube.donefile import BadLine, DonefileEntry, parse_line, parse_lines, split_complete_lines
from cube.format import HEADER_SIZE, encode_header
from cube.transfer import build as builds
from cube.transfer.config import ConfigError, Instance, parse_config, render_config
from cube.transfer.donefile import SourceUnavailable, read_donefile, resolve_input
from cube.transfer.journal import Journal, JournalError
from cube.transfer.state import (
    Deployment,
    RetryPolicy,
    Step,
    TransferState,
    VersionRecord,
    catch_up_plan,
    ingest,
    live_records,
    next_version,
    quorum_shortfall,
    shrink_refusal,
    width_refusal,
)

CONF = """\
# the original's sample, plus ours
[default]
dict_name: test_dict
mode: base_delta
download_mode: http
wget_port: 8009   # inline comment
buildtool_local: /bin/true
donefile_address: /data/donefile
output_address: out
tmp_address: /tmp/cube-transfer
shard_num: 2
copy_num: 2
transfer_address: 127.0.0.1
quorum: 1
phase_timeout: 30

[cube_agent]
agent0_0: 127.0.0.1:8001
cube0_0: 127.0.0.1:8000:/home/work/cube0_0
agent0_1: 127.0.0.1:8011
cube0_1: 127.0.0.1:8010:/home/work/cube0_1
agent1_0: 127.0.0.1:8021
cube1_0: 127.0.0.1:8020:/home/work/cube1_0
agent1_1: 127.0.0.1:8031
cube1_1: 127.0.0.1:8030:/home/work/c:odd
"""


# ---------------------------------------------------------------------------------------------
# config


def test_config_parses_the_original_format(tmp_path: Path) -> None:
    cfg = parse_config(CONF, "t.conf", tmp_path)
    assert cfg.dict_name == "test_dict" and cfg.mode == "base_delta"
    assert cfg.wget_port == 8009
    assert cfg.output_address == tmp_path / "out"  # relative to the config's directory
    assert cfg.shard_num == 2 and cfg.copy_num == 2 and cfg.quorum == 1
    assert cfg.download_timeout == 30 and cfg.reload_timeout == 30 and cfg.enable_timeout == 30
    assert [i.name for i in cfg.instances] == ["0_0", "0_1", "1_0", "1_1"]
    last = cfg.instance("1_1")
    assert (last.agent_address, last.server_address) == ("127.0.0.1:8031", "127.0.0.1:8030")
    assert last.deploy_path == "/home/work/c:odd"
    assert [i.name for i in cfg.shard_instances(1)] == ["1_0", "1_1"]


def test_config_defaults_quorum_to_all_replicas(tmp_path: Path) -> None:
    cfg = parse_config(CONF.replace("quorum: 1\n", ""), "t.conf", tmp_path)
    assert cfg.quorum == 2
    assert cfg.retries == 3 and cfg.partitioner == "mod" and cfg.listen == "127.0.0.1"
    other = parse_config(CONF.replace("transfer_address: 127.0.0.1", "transfer_address: 10.0.0.7"))
    assert other.listen == "10.0.0.7"  # agents reach the file server there


def test_render_config_round_trips(tmp_path: Path) -> None:
    cfg = parse_config(CONF, "t.conf", tmp_path)
    again = parse_config(render_config(cfg), "r.conf", tmp_path)
    assert again.instances == cfg.instances
    assert (again.quorum, again.output_address, again.mode) == (1, cfg.output_address, "base_delta")


def test_render_config_keeps_every_field(tmp_path: Path) -> None:
    """cube-local writes transfer.conf with render_config: a field it drops silently falls back
    to its default (an api_token dropped = an open API)."""
    import dataclasses

    cfg = parse_config(CONF, "t.conf", tmp_path)
    changed = dataclasses.replace(
        cfg, listen="127.0.0.2", download_timeout=1.5, reload_timeout=2.25, enable_timeout=3.0,
        build_timeout=4.0, fetch_timeout=5.5, retries=7, partitioner="murmur3",
        agent_token="agent-s3cret", api_token="api-s3cret", verify_output=False,
        history_limit=77, max_shrink=0.25, allow_empty_base=True, extra={"mine": "x"},
        insecure=True, tls_cert="/pki/cert.pem", tls_key="/pki/key.pem",
        agent_tls_ca="/pki/ca.pem", download_mode="s3", upload_address="s3://builds/cube",
        builder_flags=("-engine", "spark", "-spark_conf", "a=b c,d=#e", "-paddle_config", "/f"),
        mirror_input=False, variable_width=True, version_retries=2, version_retry_backoff=0.5,
        source_format="paddlerec", paddlerec_workdir="/trainer",
    )  # fmt: skip
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name in defaults:
        # download_address goes with download_mode http or ftp, not s3, and the token files
        # replace the tokens: checked below
        skipped = ("instances", "extra", "download_address", "agent_token_file", "api_token_file")
        if name not in skipped and defaults[name] is not dataclasses.MISSING:
            assert getattr(changed, name) != defaults[name], f"test {name} with a non-default"
    assert parse_config(render_config(changed), "r.conf", tmp_path) == changed
    external = dataclasses.replace(cfg, download_address="https://files:8443/cube/output")
    assert parse_config(render_config(external), "r.conf", tmp_path) == external
    with pytest.raises(ConfigError, match="api_token: a token with whitespace"):
        render_config(dataclasses.replace(cfg, api_token="two words"))
    files = dataclasses.replace(cfg, agent_token_file="/s/agent", api_token_file="/s/api")
    assert parse_config(render_config(files), "r.conf", tmp_path) == files
    both = render_config(dataclasses.replace(files, api_token="api-s3cret"))
    with pytest.raises(ConfigError, match="api_token and api_token_file: give one"):
        parse_config(both, "r.conf", tmp_path)


def test_config_shrink_guard_keys(tmp_path: Path) -> None:
    cfg = parse_config(CONF, "t.conf", tmp_path)
    assert (cfg.max_shrink, cfg.allow_empty_base) == (0.5, False)
    text = CONF.replace("quorum: 1", "quorum: 1\nmax_shrink: 1\nallow_empty_base: yes")
    cfg = parse_config(text, "t.conf", tmp_path)
    assert (cfg.max_shrink, cfg.allow_empty_base) == (1.0, True)
    for value in ("1.5", "-0.1", "nan", "half"):
        with pytest.raises(ConfigError, match=r"t\.conf:15: max_shrink"):
            parse_config(CONF.replace("quorum: 1", f"quorum: 1\nmax_shrink: {value}"), "t.conf")
    with pytest.raises(ConfigError, match=r"t\.conf:15: allow_empty_base: expected"):
        parse_config(CONF.replace("quorum: 1", "quorum: 1\nallow_empty_base: maybe"), "t.conf")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("shard_num: 2", "shard_num: x"), "t.conf:11: shard_num: expected an integer"),
        (("mode: base_delta", "mode: weird"), "mode: 'weird' is not one of"),
        (("quorum: 1", "quorum: 3"), "quorum: 3 is outside [1, 2]"),
        (("agent1_1: 127.0.0.1:8031\n", ""), "needs agent1_1: ip:port"),
        (("cube0_0: 127.0.0.1:8000:/home/work/cube0_0", "cube0_0: 127.0.0.1:8000"), "ip:port:"),
        (("agent0_0: 127.0.0.1:8001", "agent0_0: localhost"), "expected ip:port"),
        (("agent0_0: 127.0.0.1:8001", "agent5_0: 127.0.0.1:8001"), "outside shard_num=2"),
        (("dict_name: test_dict", "dict_name: ../x"), "not a plain name"),
        (
            ("wget_port: 8009", "wget_port: 8009\nwget_prot: 1"),
            "unknown key 'wget_prot'; did you mean wget_port?",
        ),
        (("wget_port: 8009", "wget_port: 8009\nwget_port: 1"), "repeats line"),
        (("[default]", "[default"), "bad section header"),
        (("wget_port: 8009   # inline comment", "just words"), "expected 'key: value'"),
    ],
)
def test_config_errors_name_the_place(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(CONF.replace(*change), "t.conf", tmp_path)


def test_config_keeps_keys_it_does_not_use_but_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys of the original's configs that cube-transfer does not use are kept (written back
    by render_config) and logged, so a config carries over; a near miss of a key it uses is
    an error (above), since it would silently leave the default in place."""
    cfg = parse_config(
        CONF.replace("wget_port: 8009", "wget_port: 8009\nstorage_place: LOCAL"), "t.conf", tmp_path
    )
    assert cfg.extra == {"storage_place": "LOCAL"}
    assert (
        "t.conf:" in caplog.text and "'storage_place' is not one cube-transfer uses" in caplog.text
    )


def test_config_requires_the_essentials(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no \\[default\\] section"):
        parse_config("[cube_agent]\n", "t.conf", tmp_path)
    with pytest.raises(ConfigError, match="needs donefile_address"):
        parse_config(CONF.replace("donefile_address: /data/donefile\n", ""), "t.conf", tmp_path)


# ---------------------------------------------------------------------------------------------
# donefile


def test_a_local_donefile_directory_that_is_gone_is_a_read_error(tmp_path: Path) -> None:
    """A donefile not written yet reads as empty; its directory gone (a volume unmounted, the
    directory moved) is an error the transfer counts (cube_transfer_donefile_poll_errors,
    the CubeDonefileUnreadable alert), not an empty donefile forever."""
    import asyncio

    donefile = tmp_path / "donefile"
    donefile.mkdir()
    assert asyncio.run(read_donefile(str(donefile), "base.txt")) == ""
    (donefile / "base.txt").write_text('{"id": "1"}\n')
    assert asyncio.run(read_donefile(f"file://{donefile}", "base.txt")) == '{"id": "1"}\n'
    donefile.rename(tmp_path / "moved")
    for address in (str(donefile), f"file://{donefile}"):
        with pytest.raises(SourceUnavailable, match=r"donefile directory .*: no such directory"):
            asyncio.run(read_donefile(address, "base.txt"))


def test_donefile_lines_parse_ids_as_integers() -> None:
    base = parse_line("base.txt", 1, '{"id": "1700000000", "key": 1700000000, "input": "/in/b"}')
    assert base == DonefileEntry("base.txt", 1, "1700000000", "1700000000", "/in/b")
    patch = parse_line(
        "patch.txt", 4, '{"id":"1700000100","key":"1700000000","input":"p","delete":"/d"}'
    )
    assert isinstance(patch, DonefileEntry)
    assert (patch.key, patch.delete, patch.where) == ("1700000000", "/d", "patch.txt:4")
    assert parse_line("base.txt", 2, "   ") is None
    assert not base.allow_shrink
    forced = parse_line("base.txt", 3, '{"id": 5, "key": 5, "input": "b", "allow_shrink": true}')
    assert isinstance(forced, DonefileEntry) and forced.allow_shrink


@pytest.mark.parametrize(
    ("file", "text", "reason"),
    [
        ("base.txt", '{"id": "1", "key": "1", "input": "/x"', "not JSON"),
        ("base.txt", "[1, 2]", "expected a JSON object"),
        ("base.txt", '{"key": "1", "input": "/x"}', "'id' is missing"),
        ("base.txt", '{"id": "1a", "key": "1a", "input": "/x"}', "decimal integer"),
        ("base.txt", '{"id": "1", "key": "2", "input": "/x"}', "id == key"),
        ("base.txt", '{"id": "1", "key": "1", "input": ""}', "'input' is missing or empty"),
        ("patch.txt", '{"id": "1", "key": "1", "input": "/x", "delete": 5}', "'delete'"),
        ("base.txt", '{"id": true, "key": "1", "input": "/x"}', "'id' is missing or not"),
        (
            "base.txt",
            '{"id": "1", "key": "1", "input": "/x", "allow_shrink": "yes"}',
            "'allow_shrink' must be true or false",
        ),
        (
            "patch.txt",
            '{"id": "2", "key": "1", "input": "/x", "allow_shrink": true}',
            "'allow_shrink' applies to base lines only",
        ),
    ],
)
def test_bad_donefile_lines_say_why(file: str, text: str, reason: str) -> None:
    parsed = parse_line(file, 7, text)
    assert isinstance(parsed, BadLine)
    assert reason in parsed.reason and parsed.reason.startswith(f"{file}:7:")


def test_an_unterminated_last_line_waits_unless_complete() -> None:
    assert split_complete_lines('{"a": 1}\n{"id": "2"') == ['{"a": 1}']
    assert split_complete_lines('{"a": 1}\n{"b": 2}') == ['{"a": 1}', '{"b": 2}']
    assert split_complete_lines("") == []
    entries = parse_lines("base.txt", '{"id":"1","key":"1","input":"a"}\n\n{"id":"2",', 0)
    assert [e.line_no for e in entries] == [1]


def test_inputs_resolve_like_the_original() -> None:
    assert resolve_input("/srv/donefile", "/abs/in") == "/abs/in"
    assert resolve_input("/srv/donefile", "rel/in") == "/srv/donefile/rel/in"
    assert (
        resolve_input("http://h:8080/cube/donefile", "/output/2019/base")
        == "http://h:8080/output/2019/base"
    )
    assert resolve_input("ftp://h/donefile", "in") == "ftp://h/donefile/in"
    assert resolve_input("/x", "http://other/in") == "http://other/in"


# ---------------------------------------------------------------------------------------------
# state machine


def _lines(
    state: TransferState, file: str, *objs: dict[str, str], start: int = 1
) -> list[tuple[str, str]]:
    parsed = [parse_line(file, start + i, json.dumps(o)) for i, o in enumerate(objs)]
    return ingest(state, [p for p in parsed if p is not None], 1.0)


def _base(i: int, inp: str = "/in") -> dict[str, str]:
    return {"id": str(i), "key": str(i), "input": inp}


def _patch(i: int, key: int, inp: str = "/in") -> dict[str, str]:
    return {"id": str(i), "key": str(key), "input": inp}


def _next(
    state: TransferState, at: float, paddle_saves: bool = False
) -> tuple[VersionRecord, list[str]]:
    """next_version where the test expects a version to go next."""
    rec, logs = next_version(state, at, paddle_saves)
    assert rec is not None, logs
    return rec, logs


def _record(state: TransferState, version: str) -> VersionRecord:
    """state.record where the test expects the version in the history."""
    rec = state.record(version)
    assert rec is not None, version
    return rec


def _go_live(state: TransferState, rec: VersionRecord) -> None:
    rec.status = "finished"
    state.live_version = rec.version
    state.live_chain = list(rec.chain)


def test_newest_base_wins_and_older_pending_are_skipped() -> None:
    state = TransferState()
    _lines(state, "base.txt", _base(100), _base(300), _base(200))
    rec, logs = _next(state, 2.0)
    assert rec.version == "300" and rec.chain == ["300"]
    statuses = {r.version: r.status for r in state.history}
    assert statuses == {"100": "skipped", "300": "pending", "200": "skipped"}
    assert any("superseded by the newer base 300" in line for line in logs)


def test_patches_apply_in_order_on_the_live_base_only() -> None:
    state = TransferState()
    _lines(state, "base.txt", _base(100))
    base, _ = _next(state, 2.0)
    _go_live(state, base)
    _lines(state, "patch.txt", _patch(110, 100), _patch(105, 99), _patch(120, 100))
    first, _ = _next(state, 3.0)
    assert first.version == "100_110" and first.chain == ["100", "100_110"]
    _go_live(state, first)
    second, _ = _next(state, 3.0)
    assert second.version == "100_120" and second.chain == ["100", "100_110", "100_120"]
    refused = _record(state, "99_105")
    assert refused.status == "refused"
    assert "is for base 99, but the live base is 100" in refused.message
    _go_live(state, second)
    _lines(state, "patch.txt", _patch(115, 100), start=4)
    none, _ = next_version(state, 4.0)
    assert none is None
    assert "not newer than the live delta 100_120" in _record(state, "100_115").message


def test_a_new_base_refuses_the_old_bases_pending_patches_and_resets_the_chain() -> None:
    state = TransferState()
    _lines(state, "base.txt", _base(100))
    _go_live(state, _next(state, 1.0)[0])
    _lines(state, "patch.txt", _patch(110, 100), _patch(210, 200))
    _lines(state, "base.txt", _base(200), start=2)
    rec, _ = _next(state, 2.0)
    assert rec.version == "200" and rec.chain == ["200"]
    assert _record(state, "100_110").status == "refused"
    assert _record(state, "200_210").status == "pending"  # applies once 200 is live
    _go_live(state, rec)
    rec, _ = _next(state, 3.0)
    assert rec.version == "200_210" and rec.chain == ["200", "200_210"]


def test_old_bases_and_orphan_patches_are_refused() -> None:
    state = TransferState()
    _lines(state, "patch.txt", _patch(5, 1))
    assert next_version(state, 1.0)[0] is None
    assert "no base is live" in _record(state, "1_5").message
    _lines(state, "base.txt", _base(100))
    _go_live(state, _next(state, 1.0)[0])
    _lines(state, "base.txt", _base(50), start=2)
    assert next_version(state, 1.0)[0] is None
    assert "not newer than the live base 100" in _record(state, "50").message


def test_repeated_lines_are_ignored_but_a_failed_version_may_be_retried() -> None:
    state = TransferState()
    _lines(state, "base.txt", _base(100))
    logs = _lines(state, "base.txt", _base(100), start=2)
    assert len(state.history) == 1 and "repeats base.txt:1" in logs[0][1]
    state.history[0].status = "failed"
    _lines(state, "base.txt", _base(100), start=3)
    assert [r.status for r in state.history] == ["failed", "pending"]


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self, at: float = 1000.0) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def _fail_attempt(
    rec: VersionRecord,
    clock: FakeClock,
    policy: RetryPolicy,
    message: str = "download did not reach quorum 2",
    final: str = "",
) -> str:
    """What the service does with a version whose rollout attempt failed."""
    from cube.transfer.state import after_failure, begin_attempt, finish

    begin_attempt(rec)
    finish(rec, "failed", message, clock())
    return after_failure(rec, not final, final, policy, clock())


def test_a_failed_version_is_retried_with_bounded_backoff_then_abandoned() -> None:
    from cube.backoff import Backoff

    clock, policy = FakeClock(), RetryPolicy(3, Backoff(30.0, 100.0))
    state = TransferState()
    _lines(state, "base.txt", _base(100))
    _lines(state, "patch.txt", _patch(110, 100))
    rec, _ = _next(state, clock())
    waits = []
    for attempt in range(1, 5):
        assert rec is not None and rec.version == "100", attempt
        note = _fail_attempt(rec, clock, policy)
        if attempt == 4:
            break
        assert rec.status == "failed" and rec.awaiting_retry and not rec.terminal
        assert f"attempt {attempt} of 4 failed" in note
        waits.append(rec.retry_at - clock())
        clock.at = rec.retry_at - 0.001
        assert next_version(state, clock())[0] is None  # not yet
        assert _record(state, "100_110").status == "pending"  # its patch waits with it
        clock.at += 0.001
        rec, _ = _next(state, clock())
    assert waits == [30.0, 60.0, 100.0]  # doubling, capped
    assert rec.attempts == 4 and rec.retry_at == 0.0 and rec.terminal
    assert rec.abandoned == "gave up after 4 attempts" and "abandoned" in note
    assert rec.last_error == "download did not reach quorum 2"
    assert next_version(state, clock.at + 1e6)[0] is None  # never again
    assert "no base is live" in _record(state, "100_110").message  # now its patch can't apply


def test_a_failure_retrying_cannot_help_is_abandoned_at_once() -> None:
    clock, state = FakeClock(), TransferState()
    _lines(state, "base.txt", _base(100))
    rec, _ = _next(state, clock())
    _fail_attempt(rec, clock, RetryPolicy(), "builder exited with status 1", "bad input")
    assert rec.abandoned == "not retried: bad input" and not rec.awaiting_retry
    assert next_version(state, clock() + 1e6)[0] is None


def test_a_retry_is_abandoned_when_a_newer_base_or_its_line_again_supersedes_it() -> None:
    clock, state = FakeClock(), TransferState()
    _lines(state, "base.txt", _base(100))
    first, _ = _next(state, clock())
    _fail_attempt(first, clock, RetryPolicy())
    logs = _lines(state, "base.txt", _base(100), start=2)  # published again: a new attempt
    assert "published again" in logs[0][1]
    assert first.abandoned == "its line was published again (base.txt:2)" and first.terminal
    again, _ = _next(state, clock())
    assert again is not first and again.version == "100" and again.attempts == 0
    _fail_attempt(again, clock, RetryPolicy())
    _lines(state, "patch.txt", _patch(110, 100))
    _lines(state, "base.txt", _base(200), start=3)
    rec, notes = _next(state, clock())  # before the retry is due: the newer base wins
    assert rec.version == "200"
    assert again.status == "failed" and again.abandoned == "superseded by the newer base 200"
    assert again.last_error == again.message == "download did not reach quorum 2"
    assert _record(state, "100_110").status == "refused"
    assert any("abandoned: superseded by the newer base 200" in line for line in notes)


def test_patches_after_a_patch_awaiting_its_retry_wait_for_it() -> None:
    clock, state = FakeClock(), TransferState()
    _lines(state, "base.txt", _base(100))
    _go_live(state, _next(state, clock())[0])
    _lines(state, "patch.txt", _patch(110, 100), _patch(120, 100))
    first, _ = _next(state, clock())
    assert first.version == "100_110"
    _fail_attempt(first, clock, RetryPolicy())
    assert next_version(state, clock())[0] is None  # 100_120 waits: deltas apply in order
    assert _record(state, "100_120").status == "pending"
    clock.at = first.retry_at
    retried, _ = _next(state, clock())
    assert retried is first and first.chain == ["100", "100_110"]
    _go_live(state, first)
    assert _next(state, clock())[0].version == "100_120"


def test_retry_state_survives_the_journal(tmp_path: Path) -> None:
    clock, journal = FakeClock(), Journal(tmp_path / "tmp")
    state = journal.load("d")
    _lines(state, "base.txt", _base(100), *[_base(i) for i in range(1, 30)])
    rec, _ = _next(state, clock())
    _fail_attempt(rec, clock, RetryPolicy())
    state.trim_history(10)  # a record awaiting its retry is never trimmed
    assert state.record("100") is rec
    journal.save(state)
    again = Journal(tmp_path / "tmp").load("d").record("100")
    assert again is not None
    assert (again.attempts, again.retry_at, again.last_error) == (1, 1030.0, rec.last_error)
    assert again.awaiting_retry


def test_malformed_lines_become_failed_records() -> None:
    state = TransferState()
    parsed = parse_line("base.txt", 1, "{oops")
    assert parsed is not None
    logs = ingest(state, [parsed], 1.0)
    assert state.history[0].status == "failed" and "malformed donefile line" in logs[0][1]
    assert next_version(state, 1.0)[0] is None


def _built(version: str, mode: str, records: list[int], deleted: list[int] | None = None,
           allow: bool = False) -> VersionRecord:  # fmt: skip
    rec = VersionRecord(version=version, depend=version.split("_")[0], id=version.split("_")[-1],
                        key=version.split("_")[0], mode=mode, input="/in", line="x:1",
                        allow_shrink=allow)  # fmt: skip
    deleted = deleted or [0] * len(records)
    rec.shards = {str(i): {"md5": "0" * 32, "size": 1, "records": r, "deleted": d}
                  for i, (r, d) in enumerate(zip(records, deleted, strict=True))}  # fmt: skip
    return rec


def test_live_records_is_a_lower_bound_of_what_is_served() -> None:
    state = TransferState()
    assert live_records(state) is None
    state.history = [
        _built("100", "base", [600, 400]),
        _built("100_110", "delta", [50, 50], [10, 5]),
        _built("100_120", "delta", [0, 0], [0, 85]),
    ]
    state.live_chain = ["100"]
    assert live_records(state) == 1000
    state.live_chain = ["100", "100_110", "100_120"]
    assert live_records(state) == 900  # delta records update or add: never counted
    state.history[1].shards["0"].pop("deleted")  # a record from before counts were kept
    assert live_records(state) is None


def test_a_base_may_not_empty_or_shrink_the_table_unless_allowed() -> None:
    empty = _built("200", "base", [0, 0])
    assert "base 200 has no records" in shrink_refusal(empty, None, 0.5, False)
    assert "has no records" in shrink_refusal(empty, 1000, 1.0, False)
    assert shrink_refusal(empty, None, 0.5, True) == ""  # nothing live, empty allowed
    assert "100% fewer than the live version's 1000" in shrink_refusal(empty, 1000, 0.5, True)
    assert shrink_refusal(empty, 1000, 1.0, True) == ""
    assert shrink_refusal(_built("200", "base", [0, 0], allow=True), 1000, 0.5, False) == ""
    small = _built("200", "base", [200, 299])
    message = shrink_refusal(small, 1000, 0.5, False)
    assert "base 200 has 499 records, 50% fewer than the live version's 1000" in message
    assert "max_shrink 0.5" in message and '"allow_shrink": true' in message
    assert shrink_refusal(_built("200", "base", [200, 300]), 1000, 0.5, False) == ""  # exactly
    assert shrink_refusal(small, 1000, 0.6, False) == ""
    assert shrink_refusal(small, None, 0.0, False) == ""  # unknown live count: no comparison
    assert "fewer" in shrink_refusal(_built("200", "base", [999, 0]), 1000, 0.0, False)
    assert shrink_refusal(_built("100_130", "delta", [0, 0]), 1000, 0.5, False) == ""


def _widths(rec: VersionRecord, *widths: int | None) -> VersionRecord:
    for shard, width in zip(rec.shards.values(), widths, strict=True):
        if width is not None:
            shard["value_width"] = width
    return rec


def test_a_delta_must_keep_the_live_chains_value_width() -> None:
    from cube.layout import width_change

    state = TransferState()
    state.history = [_widths(_built("100", "base", [600, 0]), 16, 0),  # shard 1 holds nothing
                     _widths(_built("100_110", "delta", [5, 5]), 16, 16)]  # fmt: skip
    state.live_version, state.live_chain = "100_110", ["100", "100_110"]
    narrow = _widths(_built("100_120", "delta", [3, 0]), 8, 0)
    message = width_refusal(state, narrow, variable_width=False)
    assert message.startswith("delta 100_120 has 8-byte values, the live version 100_110 (base "
                              "100) 16-byte values")  # fmt: skip
    assert width_refusal(state, narrow, variable_width=True) == ""
    varying = _widths(_built("100_120", "delta", [3, 3]), 8, 16)
    assert "values of varying width, the live version" in width_refusal(state, varying, False)
    assert width_refusal(state, _widths(_built("100_120", "delta", [0, 0], [4, 0]), 0, 0),
                         False) == ""  # fmt: skip  # deletions only: no width
    assert width_refusal(state, _widths(_built("100_120", "delta", [1, 1]), 16, 16), False) == ""
    assert width_refusal(state, _built("100_120", "delta", [1, 1]), False) == ""  # unknown
    assert width_refusal(state, _widths(_built("200", "base", [1, 1]), 8, 8), False) == ""
    state.history[0].shards["0"]["value_width"] = 0  # a base whose values vary already
    assert width_refusal(state, narrow, False) == ""
    del state.history[1].shards["0"]["value_width"]  # a live record from an older journal
    state.history[0].shards["0"]["value_width"] = 16
    assert width_refusal(state, narrow, False) == ""
    assert width_change(set(), {8}) is None  # nothing live holds values yet
    assert width_change({16}, {16, 8}) == ("16-byte values", "values of varying width")


def test_quorum_shortfall() -> None:
    shards = {0: ["0_0", "0_1"], 1: ["1_0", "1_1"]}
    assert quorum_shortfall({"0_0", "0_1", "1_0", "1_1"}, shards, 2) == []
    assert quorum_shortfall({"0_0", "1_1"}, shards, 1) == []
    assert quorum_shortfall({"0_0", "0_1", "1_1"}, shards, 2) == [
        "shard 1: 1 of 2 replicas ready, need 2"
    ]
    assert quorum_shortfall({"0_0"}, {0: ["0_0"]}, 3) == []  # quorum capped by replicas


def test_catch_up_plans() -> None:
    chain = ["100", "100_110", "100_120"]
    assert catch_up_plan("100_120", chain, set()) == []
    forward = catch_up_plan("100_110", chain, {"100", "100_110"})
    assert [(s.command, s.version) for s in forward] == [
        ("download", "100_120"),
        ("reload", "100_120"),
        ("enable", "100_120"),
    ]
    assert forward[-1].chain == tuple(chain) and forward[-1].mode == "delta"
    fresh = catch_up_plan("", chain, set())
    assert [(s.command, s.version) for s in fresh] == [
        ("download", "100"),
        ("download", "100_110"),
        ("download", "100_120"),
        ("reload", "100_120"),
        ("enable", "100_120"),
    ]
    assert fresh[0] == Step("download", "100", "base", ("100",))
    back = catch_up_plan("100_130", chain, {"100", "100_110", "100_120", "100_130"})
    assert back == [Step("rollback", "100_120", "delta", tuple(chain))]
    # the target is on disk but its base was quarantined (corrupt): a rollback would load the
    # CHAIN from disk and fail again, forever; the base is downloaded again instead
    repair = catch_up_plan("100_130", chain, {"100_110", "100_120", "100_130"})
    assert [(s.command, s.version) for s in repair] == [
        ("download", "100"),
        ("download", "100_110"),  # placed already: the agent answers at once
        ("download", "100_120"),
        ("reload", "100_120"),
        ("enable", "100_120"),
    ]


def test_backoff_is_bounded_however_many_failures() -> None:
    from cube.transfer.state import backoff_delay

    assert [backoff_delay(n, 5.0) for n in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert backoff_delay(10_000, 5.0) == 300.0  # days of failures: no float overflow


# ---------------------------------------------------------------------------------------------
# journal


def test_journal_round_trips_and_refuses_another_dict(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "tmp")
    state = journal.load("d")
    _lines(state, "base.txt", _base(100))
    state.cursors["base.txt"] = 1
    state.deployment = Deployment(kind="deploy", version="100", phase="reload", targets=["0_0"])
    journal.save(state)
    journal.event("x", a=1)
    again = Journal(tmp_path / "tmp").load("d")
    assert again.to_json() == state.to_json()
    assert json.loads((tmp_path / "tmp" / "transfer_events.jsonl").read_text())["a"] == 1
    assert not list((tmp_path / "tmp").glob(".*tmp*"))
    with pytest.raises(JournalError, match="belongs to dict 'd'"):
        Journal(tmp_path / "tmp").load("other")
    (tmp_path / "tmp" / "transfer_state.json").write_text("{not json")
    with pytest.raises(JournalError, match="unusable state"):
        Journal(tmp_path / "tmp").load("d")


def test_history_trim_keeps_pending_and_live() -> None:
    state = TransferState()
    _lines(state, "base.txt", *[_base(i) for i in range(1, 21)])
    for rec in state.history[:-1]:
        rec.status = "skipped"
    state.live_chain = ["1"]
    state.trim_history(5)
    names = [r.version for r in state.history]
    assert len(names) == 5 and "1" in names and "20" in names


# ---------------------------------------------------------------------------------------------
# build outputs


def _tar_bytes(members: dict[str, bytes], extra: tarfile.TarInfo | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if extra is not None:
            tar.addfile(extra)
    return buf.getvalue()


def _write_output(out: Path, shard: int, data: bytes, md5: str | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tar = out / f"d_part{shard}.tar"
    tar.write_bytes(data)
    digest = md5 or hashlib.md5(data).hexdigest()
    (out / f"d_part{shard}.tar.md5").write_text(f"{digest}  {tar.name}\n")
    return tar


def _index(records: int, deleted: int = 0, **fields: object) -> bytes:
    """An index.cube that is only its header (all the transfer reads of it)."""
    header = {"record_count": records, "tombstone_count": deleted, "file_size": HEADER_SIZE,
              "sections": {}, **fields}  # fmt: skip
    return encode_header("index", header)


def test_check_outputs_accepts_good_tars_and_counts_their_records(tmp_path: Path) -> None:
    for shard in range(2):
        members = {"./data.cube": b"d", "./index.cube": _index(10 + shard, shard)}
        _write_output(tmp_path, shard, _tar_bytes(members))
    shards = builds.check_outputs(tmp_path, "d", 2)
    assert [s.shard for s in shards] == [0, 1] and shards[0].size > 0
    assert [(s.records, s.deleted) for s in shards] == [(10, 0), (11, 1)]
    # without verify_output the counts are still read (one member header and 4 KiB)
    assert builds.check_outputs(tmp_path, "d", 2, verify=False)[1].records == 11


def test_check_outputs_needs_a_readable_index_header(tmp_path: Path) -> None:
    cases = {
        "short": ({"index.cube": b"i"}, "too short for a header"),
        "magic": ({"index.cube": b"x" * HEADER_SIZE}, "bad magic"),
        "nested": ({"sub/index.cube": _index(1)}, "no top-level index.cube"),
        "uncounted": ({"index.cube": _index("many")}, "header without a record count"),  # type: ignore[arg-type]  # bad on purpose
        "grown": ({"index.cube": _index(1) + b"x"}, "header says 4096"),
    }
    for name, (members, message) in cases.items():
        _write_output(tmp_path / name, 0, _tar_bytes(members))
        with pytest.raises(builds.BuildError, match=message):
            builds.check_outputs(tmp_path / name, "d", 1)


def test_check_outputs_rejects_bad_builds(tmp_path: Path) -> None:
    good = _tar_bytes({"index.cube": _index(1)})
    _write_output(tmp_path / "a", 0, good, md5="0" * 32)
    with pytest.raises(builds.BuildError, match=r"does not match its \.md5"):
        builds.check_outputs(tmp_path / "a", "d", 1)
    _write_output(tmp_path / "b", 0, _tar_bytes({"../evil": b"x"}))
    with pytest.raises(builds.BuildError, match=r"leaves the target directory"):
        builds.check_outputs(tmp_path / "b", "d", 1)
    link = tarfile.TarInfo("link")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    _write_output(tmp_path / "c", 0, _tar_bytes({}, link))
    with pytest.raises(builds.BuildError, match="symlink"):
        builds.check_outputs(tmp_path / "c", "d", 1)
    _write_output(tmp_path / "d", 0, b"garbage" * 100)
    with pytest.raises(builds.BuildError, match="not a readable tar"):
        builds.check_outputs(tmp_path / "d", "d", 1)
    _write_output(tmp_path / "e", 0, good)
    with pytest.raises(builds.BuildError, match="no tar for shard 1"):
        builds.check_outputs(tmp_path / "e", "d", 2)
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "d_part0.tar").write_bytes(good)
    with pytest.raises(builds.BuildError, match="the builder wrote no md5"):
        builds.check_outputs(tmp_path / "f", "d", 1)


def test_resolve_command(tmp_path: Path) -> None:
    assert builds.resolve_command("sh").endswith("/sh")
    with pytest.raises(builds.BuildError, match="not found on PATH"):
        builds.resolve_command("no-such-builder-here")
    script = tmp_path / "b.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(builds.BuildError, match="not an executable file"):
        builds.resolve_command(str(script))
    os.chmod(script, 0o755)
    assert builds.resolve_command(str(script)) == str(script)


def test_builder_argv_is_a_list_without_a_shell() -> None:
    argv = builds.builder_argv(
        "/x/cube-builder",
        dict_name="d",
        input_path="/in; rm -rf /",
        output_path="/out",
        shard_num=2,
        mode="delta",
        cur_version="110",
        depend_version="100",
        partitioner="mod",
        delete_path="/del",
    )
    assert argv[argv.index("-input_path") + 1] == "/in; rm -rf /"
    assert argv[-2:] == ["-delete_path", "/del"] and "-quiet" in argv


def test_builder_flags_follow_the_flags_the_transfer_sets(tmp_path: Path) -> None:
    """builder_flags is split like a shell would split it (quotes kept together, nothing run)
    and appended to the builder's argv; a flag the transfer sets itself is refused."""
    text = CONF.replace(
        "quorum: 1", "quorum: 1\nbuilder_flags: -engine spark -spark_conf 'a=b c'\nmirror_input: no"
    )
    cfg = parse_config(text, "t.conf", tmp_path)
    assert cfg.builder_flags == ("-engine", "spark", "-spark_conf", "a=b c")
    assert cfg.mirror_input is False
    argv = builds.builder_argv(
        "/x/cube-builder", dict_name="d", input_path="s3://b/in", output_path="/out",
        shard_num=2, mode="base", cur_version="100", depend_version="100", partitioner="mod",
        fetch_timeout=cfg.fetch_timeout, extra_flags=cfg.builder_flags,
    )  # fmt: skip
    assert argv[-6:] == ["-fetch_timeout", "3600", "-engine", "spark", "-spark_conf", "a=b c"]
    assert parse_config(CONF, "t.conf", tmp_path).mirror_input is True
    for flags, message in [
        (
            "-output_path /elsewhere",
            "t.conf:15: builder_flags: -output_path is set by cube-transfer",
        ),
        ("--shard_num=4", "builder_flags: --shard_num is set by cube-transfer"),
        ("-fetch_timeout 5", "builder_flags: -fetch_timeout is set by cube-transfer"),
        ("-engine 'spark", "t.conf:15: builder_flags: No closing quotation"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(CONF.replace("quorum: 1", f"quorum: 1\nbuilder_flags: {flags}"), "t.conf")


BUILDER_CONF = CONF.replace("buildtool_local: /bin/true", "buildtool_local: cube-builder")


def test_builder_settings_are_checked_by_the_builders_own_parser(tmp_path: Path) -> None:
    """A typo in builder_flags, a bad value, flags that do not go together: refused when
    transfer.conf is read, naming the key and the flag (not found by a version abandoned at
    its build); another buildtool_local's flags are its own."""
    for flags, message in [
        ("-engin spark", "t.conf:15: builder_flags: cube-builder would refuse them: unknown "
                         "flag '-engin'; did you mean --engine?"),
        ("-workers many", "t.conf:15: builder_flags: .*--workers: bad value 'many'"),
        ("-engine mapreduce", "--engine: 'mapreduce' is not one of local, spark"),
        ("-paddle_dim 8", "-paddle_dim needs -input_format paddle_ps"),
        ("-spark_conf nokey", "--spark_conf: 'nokey' is not key=value"),
        ("-input_format paddle_ps -paddle_accessor ctr -paddle_config /c", "unknown accessor"),
        ("--help", "--help prints and exits"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            parse_config(BUILDER_CONF.replace("quorum: 1", f"quorum: 1\nbuilder_flags: {flags}"),
                         "t.conf")  # fmt: skip
    fine = "-input_format paddle_ps -paddle_config /not/read/when/parsing -workers 3"
    parse_config(BUILDER_CONF.replace("quorum: 1", f"quorum: 1\nbuilder_flags: {fine}"), "t.conf")
    other = CONF.replace("quorum: 1", "quorum: 1\nbuilder_flags: -x 1")  # buildtool_local /bin/true
    assert parse_config(other, "t.conf").builder_flags == ("-x", "1")


@pytest.mark.slow
def test_cube_transfer_exits_2_on_bad_builder_settings(tmp_path: Path) -> None:
    """The real command: exit 2, one line naming transfer.conf's key and the flag, no
    traceback; a -paddle_config that is there but cannot be read is said at start too (one
    not there yet is not: a Fleet trainer writes it with its first save, and each build reads
    it)."""
    import subprocess
    import sys

    from cube.transfer.build import builder_settings_problem

    missing = ("-paddle_config", str(tmp_path / "missing.prototxt"))
    assert builder_settings_problem("cube-builder", missing, True, read_config=True) == ""
    (tmp_path / "bad.prototxt").write_text("not a fleet desc {{{\n")
    for flags, message in [
        ("-engine spark -workerz 3", "transfer.conf:15: builder_flags: cube-builder would "
         "refuse them: unknown flag '-workerz'; did you mean --workers?"),
        (f"-input_format paddle_ps -paddle_config {tmp_path}/bad.prototxt",
         f"builder_flags: cube-builder would refuse them: -paddle_config {tmp_path}/bad"),
    ]:  # fmt: skip
        conf = tmp_path / "transfer.conf"
        text = BUILDER_CONF.replace("quorum: 1", f"quorum: 1\nbuilder_flags: {flags}")
        conf.write_text(text.replace("/tmp/cube-transfer", str(tmp_path)))
        done = subprocess.run(
            [sys.executable, "-m", "cube.transfer.main", "--config", str(conf), "-p", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow
def test_cube_transfer_cli_rejects_bad_configs(tmp_path: Path) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cube.transfer.main", *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    missing = cli("--config", str(tmp_path / "nope.conf"))
    assert missing.returncode == 2 and "nope.conf: cannot read" in missing.stderr
    bad = tmp_path / "bad.conf"
    bad.write_text(CONF.replace("shard_num: 2", "shard_num: two"))
    result = cli("-p", "0", "--config", str(bad))
    assert result.returncode == 2 and "bad.conf:11: shard_num" in result.stderr
    assert cli("--no_such_flag", "1").returncode == 2
    assert "--poll_interval" in cli("--help").stdout


class _ScriptedAgent:
    """An AgentClient stand-in: task answers come from a script; status says the server is
    reachable (as it is once a killed server has restarted)."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers = list(answers)
        self.submits = 0

    async def submit(self, inst: Instance, fields: dict[str, Any]) -> dict[str, Any]:
        self.submits += 1
        return self.answers.pop(0)

    async def task(self, inst: Instance, command: str, version: str) -> dict[str, Any]:
        return self.answers.pop(0)

    async def status(self, inst: Instance) -> dict[str, Any]:
        return {"server": {"reachable": True}}


def test_drive_waits_out_an_unreachable_server_without_spending_retries() -> None:
    """A task that failed because the server was unreachable is re-sent without counting as
    a failure even when the server is back by the time the agent is asked (the race that made
    a kill -9 of a loading server fail the phase)."""
    import asyncio

    from cube.transfer.agents import drive

    inst = Instance(0, 0, "127.0.0.1", 1, "127.0.0.1", 2, "/tmp/x")
    fields = {"command": "reload", "version": "7"}
    unreachable = {
        "command": "reload",
        "version": "7",
        "state": "failed",
        "message": "cube-server unreachable",
        "reason": "server_unreachable",
    }
    done = {"command": "reload", "version": "7", "state": "succeeded", "message": "ok"}
    agent = _ScriptedAgent([unreachable, unreachable, done])
    outcome = asyncio.run(drive(agent, inst, fields, 30.0, 0, poll=0.01))  # type: ignore[arg-type]  # scripted agent
    assert outcome.ok and agent.submits == 3

    refused = {**unreachable, "reason": "", "message": "bad tar"}
    agent = _ScriptedAgent([refused, done])
    outcome = asyncio.run(drive(agent, inst, fields, 30.0, 0, poll=0.01))  # type: ignore[arg-type]  # scripted agent
    assert not outcome.ok and "bad tar" in outcome.message


def test_drive_gives_up_at_once_on_a_corrupt_copy() -> None:
    """The agent quarantined the copy its server refused: re-sending the load cannot work, so
    the caller learns it at once (reason corrupt_version) and downloads again."""
    import asyncio

    from cube.protocol import CORRUPT_VERSION
    from cube.transfer.agents import drive

    inst = Instance(0, 0, "127.0.0.1", 1, "127.0.0.1", 2, "/tmp/x")
    corrupt = {"command": "reload", "version": "7", "state": "failed",
               "message": "DATA_LOSS: checksum mismatch", "reason": CORRUPT_VERSION}  # fmt: skip
    agent = _ScriptedAgent([corrupt, corrupt, corrupt])
    outcome = asyncio.run(
        drive(agent, inst, {"command": "reload", "version": "7"}, 30.0, 5, poll=0.01)  # type: ignore[arg-type]  # scripted agent
    )
    assert not outcome.ok and outcome.reason == CORRUPT_VERSION and agent.submits == 1
    assert "DATA_LOSS" in outcome.message


# ---------------------------------------------------------------------------------------------
# what the API shows and what peers send (issue 9 audit)


def test_credentials_in_urls_are_never_shown(tmp_path: Path) -> None:
    from cube.remote import redact
    from cube.transfer import views

    assert redact("ftp://u:p@ss@h:21/d and http://x@y/z, /plain@path") == (
        "ftp://***@h:21/d and http://***@y/z, /plain@path"
    )
    assert redact("http://host/a@b") == "http://host/a@b"  # an '@' in the path is no userinfo
    text = CONF.replace("/data/donefile", "ftp://trainer:hunter2@10.0.0.1/donefile")
    cfg = parse_config(text, "t.conf", tmp_path)
    state = TransferState(dict_name="test_dict")
    _lines(state, "base.txt", _base(100, "ftp://trainer:hunter2@10.0.0.1/in"))
    state.history[0].message = "input ftp://trainer:hunter2@10.0.0.1/in: not found"
    shown = json.dumps([views.dict_info(cfg, state), views.history(cfg, state)])
    assert "hunter2" not in shown and "ftp://***@10.0.0.1/donefile" in shown


def test_history_says_how_long_a_version_took_to_the_millisecond(tmp_path: Path) -> None:
    """create_time and finish_time stay whole seconds (the original's ints), which made a
    0.42 s rollout read 1 s (or 0) on the status page: `took` is the float difference."""
    from cube.transfer import views

    cfg = parse_config(CONF, "t.conf", tmp_path)
    rec = VersionRecord(version="100", depend="100", id="100", key="100", mode="base",
                        input="/in", line="base.txt:1", create_time=1795435070.58,
                        finish_time=1795435071.0)  # fmt: skip
    shown = views.version_info(cfg, rec)
    assert (shown["create_time"], shown["finish_time"]) == (1795435070, 1795435071)
    assert shown["took"] == 0.42 and json.loads(json.dumps(shown))["took"] == 0.42
    rec.finish_time = 1795435070.58 + 83.2504
    assert views.version_info(cfg, rec)["took"] == 83.25
    rec.finish_time = 0.0  # in progress (or a retry begun)
    assert views.version_info(cfg, rec)["took"] is None


def test_bad_donefile_lines_do_not_echo_what_was_read() -> None:
    secret = "x" * 50 + "<script>"
    for text in (
        json.dumps({"id": secret, "key": "1", "input": "/x"}),
        json.dumps({"id": "1", "key": "1", "input": {"a": secret}}),
        json.dumps({"id": "1", "key": "1", "input": "/x", "delete": [secret]}),
        '{"id": "1", "key": "1", "input": "' + secret + '"',  # not JSON
    ):
        parsed = parse_line("base.txt", 3, text)
        assert isinstance(parsed, BadLine) and secret not in parsed.reason
        state = TransferState()
        ingest(state, [parsed], 1.0)
        assert secret not in state.history[0].message


def test_an_agent_answer_is_bounded(tmp_path: Path) -> None:
    import asyncio

    import aiohttp
    from aiohttp import web

    from cube.transfer.agents import MAX_ANSWER, AgentClient, AgentRefused, AgentUnreachable

    async def huge(request: web.Request) -> web.Response:
        return web.Response(body=b" " * (MAX_ANSWER + 10), content_type="application/json")

    async def chatty(request: web.Request) -> web.Response:
        return web.json_response({"success": "255", "message": "y" * 100_000, "data": None})

    async def body() -> None:
        app = web.Application()
        app.router.add_get("/agent/status", huge)
        app.router.add_post("/agent/cmd", chatty)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        inst = Instance(0, 0, "127.0.0.1", port, "127.0.0.1", 1, "/d")
        try:
            async with aiohttp.ClientSession() as session:
                client = AgentClient(session)
                with pytest.raises(AgentUnreachable, match=f"answer over {MAX_ANSWER} bytes"):
                    await client.status(inst)
                with pytest.raises(AgentRefused) as refused:
                    await client.submit(inst, {"command": "download", "version": "1"})
                assert len(str(refused.value)) < 1200
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_the_rollout_table() -> None:
    """One table says how a deploy walks its phases and what every status becomes; the
    statuses keep the original's names and numbers in JSON."""
    from cube.transfer.state import INSTANCE_STATUS, ROLLOUT, VERSION_STATUS, Phase

    walk: list[str] = []
    phase: Phase | None = Phase.BUILD
    while phase is not None:
        walk.append(phase.value)
        phase = ROLLOUT[phase].next
    assert walk == ["build", "download", "reload", "enable"]
    assert [ROLLOUT[Phase(p)].version_status for p in walk] == [
        "deploying", "downloaded", "reloaded", "finished"
    ]  # fmt: skip
    for phase in (Phase.DOWNLOAD, Phase.RELOAD, Phase.ENABLE, Phase.ROLLBACK):
        rule = ROLLOUT[phase]
        assert rule.failed is not None and rule.failed.endswith("_Failed")
        assert rule.succeeded is not None and rule.succeeded.endswith("_Succ")
    assert (INSTANCE_STATUS["Enable_Succ"], INSTANCE_STATUS["Dead"]) == (100, 250)
    assert (VERSION_STATUS["finished"], VERSION_STATUS["refused"]) == (90, 120)
    assert json.dumps({"phase": Phase.RELOAD}) == '{"phase": "reload"}'


def test_instances_may_share_an_agent_but_not_its_deploy_path(tmp_path: Path) -> None:
    """The original's shipped transfer.conf puts several instances under one agent: allowed
    (cube-agent --instances), told apart by deploy_path; the same deploy_path twice is not."""
    shared = CONF.replace("agent0_1: 127.0.0.1:8011", "agent0_1: 127.0.0.1:8001")
    cfg = parse_config(shared, "t.conf", tmp_path)
    assert cfg.instances[0].agent_address == cfg.instances[1].agent_address
    clash = shared.replace("/home/work/cube0_1", "/home/work/cube0_0")
    with pytest.raises(ConfigError, match=r"instances 0_0 and 0_1 share agent 127\.0\.0\.1:8001"):
        parse_config(clash, "t.conf", tmp_path)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("/d2", "is not DEPLOY_PATH=HOST:PORT"),
        ("/d2=host", "is not DEPLOY_PATH=HOST:PORT"),
        ("/d2=h:x", "is not DEPLOY_PATH=HOST:PORT"),
        ("/d1=h:2", "deploy_path '/d1' is given twice"),
        ("/d2=h:1", "server 'h:1' is given twice"),
    ],
)
def test_agent_instances_flag(text: str, error: str) -> None:
    from pathlib import Path

    from cube.agent.deploy import AgentConfig
    from cube.agent.main import instance_configs
    from cube.flags import FlagError

    first = AgentConfig(deploy_path=Path("/d1"), server="h:1")
    with pytest.raises(FlagError, match=re.escape(error)):
        instance_configs(first, text)
    configs = instance_configs(first, "/d2=h:2, /d3=other:9")
    assert [(str(c.deploy_path), c.server) for c in configs] == [
        ("/d1", "h:1"), ("/d2", "h:2"), ("/d3", "other:9")
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# a PaddlePaddle trainer's donefiles (source_format paddle_fleet / paddlerec)


def test_fleet_and_paddlerec_lines_announce_parameter_server_saves() -> None:
    """The lines Paddle's FleetUtil.write_xbox_donefile and PaddleRec's trainer write parse as
    they are (their extra fields ignored), from their own file names; the base/patch kind comes
    from the file, and a save of the other kind is refused with the reason."""
    from cube.donefile import DONEFILE_FORMATS, format_fleet_line, paddle_save_of

    fleet = DONEFILE_FORMATS["paddle_fleet"]
    assert (fleet.base_file, fleet.patch_file) == ("xbox_base_done.txt", "xbox_patch_done.txt")
    rec = DONEFILE_FORMATS["paddlerec"]
    assert (rec.base_file, rec.patch_file) == ("base_donefile.txt", "patch_donefile.txt")
    line = format_fleet_line("1795478400", "1795478400", "/m/20261124/base/000", "/m", "20261124")
    assert list(json.loads(line))[:3] == ["id", "key", "input"]
    base = parse_line(fleet.base_file, 1, line, fleet)
    assert isinstance(base, DonefileEntry)
    assert base.is_base and base.input == "/m/20261124/base/000"
    # PaddleRec's: id, key, input, monitor_data
    text = '{"id": "1795482000", "key": "1795478400", "input": "/m/20261124/delta-2/000", '
    patch = parse_line(rec.patch_file, 2, text + '"monitor_data": ""}', rec)
    assert isinstance(patch, DonefileEntry)
    assert not patch.is_base and (patch.key, patch.id) == ("1795478400", "1795482000")
    # the other kind of save, in either file
    as_patch = parse_line(fleet.patch_file, 3, line, fleet)
    assert isinstance(as_patch, BadLine)
    assert (
        "input is a base save (20261124/base), but the line is in xbox_patch_done.txt: a "
        "base replaces the whole table" in as_patch.reason
    )
    delta = format_fleet_line("7", "7", "/m/20261124/delta-3/000", "/m", "20261124")
    as_base = parse_line(fleet.base_file, 4, delta, fleet)
    assert isinstance(as_base, BadLine)
    assert (
        "input is a delta save (20261124/delta-3), but the line is in "
        "xbox_base_done.txt" in as_base.reason
    )
    # other paths are not judged; seqfile donefiles never are
    assert parse_line(fleet.base_file, 5, format_fleet_line("7", "7", "/x/y", "/m", "1"), fleet)
    assert not isinstance(parse_line("base.txt", 6, delta), BadLine)
    # what a path says of its save
    save = paddle_save_of("s3://b/m/20261124/delta-12/000")
    assert save is not None
    assert (save.day, save.is_base, save.folder) == ("20261124", False, "delta-12")
    assert save.save_dir == "s3://b/m/20261124/delta-12"
    for path, save_dir in (
        ("/m/20261124/delta_2/", "/m/20261124/delta_2"),
        ("/m/20261124/base", "/m/20261124/base"),
    ):
        save = paddle_save_of(path)
        assert save is not None and save.save_dir == save_dir, path
    for other in ("/data/1700000000/base", "/m/20261124/base/sparse", "/m/base/000", "base"):
        assert paddle_save_of(other) is None, other


def test_source_format_configures_the_donefiles_and_the_builder(tmp_path: Path) -> None:
    from cube.transfer.build_runner import BuildRunner

    fleet = CONF.replace(
        "phase_timeout: 30", "phase_timeout: 30\nsource_format: paddle_fleet\n"
        "builder_flags: -paddle_config /conf/fleet_desc.prototxt -paddle_value show,click,embed_w"
    )  # fmt: skip
    cfg = parse_config(fleet, "t.conf", tmp_path)
    assert cfg.donefile_format.base_file == "xbox_base_done.txt" and cfg.paddle_saves
    runner = BuildRunner(cfg)
    assert runner.extra_flags[:2] == ("-input_format", "paddle_ps")
    assert runner.extra_flags[2:] == cfg.builder_flags
    # the save, not the table folder the writer appended: the builder finds the sparse table
    assert runner.build_input("/m/20261124/delta-2/000") == "/m/20261124/delta-2"
    assert runner.build_input("/m/other/000") == "/m/other/000"
    seqfile = parse_config(CONF, "t.conf", tmp_path)
    assert not seqfile.paddle_saves and BuildRunner(seqfile).extra_flags == ()
    assert BuildRunner(seqfile).build_input("/m/20261124/delta-2/000").endswith("/000")
    # SequenceFile donefiles naming saves: the builder flag says so (mirrors keep empty files)
    flagged = CONF.replace("phase_timeout: 30", "phase_timeout: 30\nbuilder_flags: "
                           "-input_format=paddle_ps -paddle_config /c")  # fmt: skip
    assert parse_config(flagged, "t.conf", tmp_path).paddle_saves
    with pytest.raises(ConfigError, match=r"t.conf:\d+: source_format: 'paddle' is not one of "
                       "seqfile, paddle_fleet, paddlerec"):  # fmt: skip
        parse_config(fleet.replace("paddle_fleet", "paddle"), "t.conf", tmp_path)
    with pytest.raises(ConfigError, match="-input_format is set by cube-transfer"):
        parse_config(fleet.replace("-paddle_config", "-input_format paddle_ps -paddle_config"),
                     "t.conf", tmp_path)  # fmt: skip
    no_layout = fleet.replace("-paddle_config /conf/fleet_desc.prototxt", "-paddle_dim 8")
    with pytest.raises(ConfigError, match=r"add -paddle_config FILE .* or -paddle_accessor, "
                       r"-paddle_optimizer$"):  # fmt: skip
        parse_config(no_layout, "t.conf", tmp_path)
    layout = "-paddle_accessor ctr_common -paddle_dim 8 -paddle_optimizer adagrad"
    assert parse_config(no_layout.replace("-paddle_dim 8", layout), "t.conf", tmp_path)


def paddlerec_trainer(workdir: Path, model_save_path: str) -> Path:
    """Files as PaddleRec's online trainer (tools/static_ps_online_trainer.py, local mode)
    lays them out when it runs in `workdir` with runner.model_save_path `model_save_path`:
    the saves under <model_save_path>/<day>/, and base_donefile.txt / patch_donefile.txt in
    <model_save_path>, each line's input that path as the config gives it, plus
    /<day>/base/000 or /<day>/delta-<pass>/000. Returns the donefiles' directory."""
    models = (workdir / model_save_path).resolve()
    for folder in ("20261124/base/000", "20261124/delta-1/000"):
        (models / folder).mkdir(parents=True)
        (models / folder / "part-000-00000").write_text("1 0 0 0 1 1 0.5 0.1\n")
    prefix = model_save_path.rstrip("/")
    for name, id_, folder in (("base_donefile.txt", "1795478400", "base"),
                              ("patch_donefile.txt", "1795482000", "delta-1")):  # fmt: skip
        line = {"id": id_, "key": "1795478400", "input": f"{prefix}/20261124/{folder}/000",
                "monitor_data": ""}  # fmt: skip
        (models / name).write_text(json.dumps(line) + "\n")
    return models


def paddlerec_runner(tmp_path: Path, donefiles: Path, workdir: str = "") -> Any:
    from cube.transfer.build_runner import BuildRunner

    conf = CONF.replace("donefile_address: /data/donefile", f"donefile_address: {donefiles}")
    settings = "source_format: paddlerec\nbuilder_flags: -paddle_config /c\n"
    if workdir:
        settings += f"paddlerec_workdir: {workdir}\n"
    conf = conf.replace("phase_timeout: 30\n", "phase_timeout: 30\n" + settings)
    return BuildRunner(parse_config(conf, "t.conf", tmp_path))


def paddlerec_inputs(runner: Any, donefiles: Path) -> list[str]:
    """Where the transfer finds each line's save: what the builder is handed."""
    import asyncio

    from cube.donefile import DONEFILE_FORMATS

    found = []
    for name in ("base_donefile.txt", "patch_donefile.txt"):
        text = (donefiles / name).read_text().splitlines()[0]
        entry = parse_line(name, 1, text, DONEFILE_FORMATS["paddlerec"])
        assert isinstance(entry, DonefileEntry), entry
        source = runner.build_input(entry.input)
        found.append(asyncio.run(runner._fetch(source, donefiles / "mirror", True)))
    return found


@pytest.mark.parametrize("model_save_path", ["output_model", "./output_model/", "a/b/models"])
def test_paddlerec_relative_inputs_are_its_trainers_working_directorys(
    tmp_path: Path, model_save_path: str
) -> None:
    """Issue 36: PaddleRec writes a relative runner.model_save_path into its donefiles as it is
    (relative to the trainer's working directory, not the config's nor the donefile's), and
    the donefiles into that directory: the saves are found there, not at
    <donefile dir>/<model_save_path>/..., wherever the trainer ran."""
    donefiles = paddlerec_trainer(tmp_path / "trainer", model_save_path)
    runner = paddlerec_runner(tmp_path, donefiles)
    assert paddlerec_inputs(runner, donefiles) == [
        str(donefiles / "20261124" / "base"),
        str(donefiles / "20261124" / "delta-1"),
    ]
    # read through a symbolic link of another name: the directory's real name tells
    linked = tmp_path / "donefiles"
    linked.symlink_to(donefiles)
    runner = paddlerec_runner(tmp_path, linked)
    assert paddlerec_inputs(runner, linked) == [
        str(linked / "20261124" / "base"),
        str(linked / "20261124" / "delta-1"),
    ]


def test_a_paddlerec_input_that_cannot_be_placed_needs_the_trainers_directory(
    tmp_path: Path,
) -> None:
    """The donefiles read from a directory of another name than the input's (copied there, say,
    the saves left where the trainer wrote them): no guess, a reason naming
    paddlerec_workdir; with it (relative to transfer.conf, or absolute), the inputs are the
    trainer's."""
    from cube.transfer.build_runner import BuildFailed

    donefiles = paddlerec_trainer(tmp_path / "trainer", "output_model")
    mounted = tmp_path / "copy" / "models"
    mounted.mkdir(parents=True)
    for name in ("base_donefile.txt", "patch_donefile.txt"):
        (mounted / name).write_bytes((donefiles / name).read_bytes())
    runner = paddlerec_runner(tmp_path, mounted)
    with pytest.raises(BuildFailed) as caught:
        runner.build_input("output_model/20261124/base/000")
    assert str(caught.value) == (
        "input output_model/20261124/base/000 is relative to the PaddleRec trainer's working "
        "directory, whose output_model (runner.model_save_path) holds its donefiles; but they "
        f"are read from {mounted}, not a folder of that name: set paddlerec_workdir in "
        "transfer.conf to the trainer's working directory, as this transfer sees it"
    )
    with pytest.raises(BuildFailed, match="not PaddleRec's <model_save_path>/<day>/base"):
        runner.build_input("output_model/latest")
    for workdir in ("trainer", str(tmp_path / "trainer")):
        runner = paddlerec_runner(tmp_path, mounted, workdir)
        assert runner.cfg.paddlerec_workdir == str(tmp_path / "trainer")
        assert paddlerec_inputs(runner, mounted) == [
            str(donefiles / "20261124" / "base"),
            str(donefiles / "20261124" / "delta-1"),
        ]
    # absolute inputs and URLs are as they were written; other formats' relative inputs
    # are relative to the donefile's directory, as before
    assert runner.build_input("/m/20261124/base/000") == "/m/20261124/base"
    assert runner.build_input("s3://b/m/20261124/base/000") == "s3://b/m/20261124/base"
    fleet = CONF.replace("phase_timeout: 30", "phase_timeout: 30\nsource_format: paddle_fleet\n"
                         "builder_flags: -paddle_config /c")  # fmt: skip
    from cube.transfer.build_runner import BuildRunner

    other = BuildRunner(parse_config(fleet, "t.conf", tmp_path))
    assert other.build_input("m/20261124/base/000") == "m/20261124/base"
    with pytest.raises(ConfigError, match=r"t.conf:\d+: paddlerec_workdir: only with "
                       "source_format: paddlerec"):  # fmt: skip
        parse_config(fleet.replace("-paddle_config /c", "-paddle_config /c\npaddlerec_workdir: /t"),
                     "t.conf", tmp_path)  # fmt: skip


def test_paddlerec_relative_input_rules() -> None:
    from cube.donefile import paddlerec_relative_input as relative

    assert relative("output_model/20261124/base/000", "/w/output_model") == "20261124/base/000"
    assert relative("./out/./20261124/delta-3/000", "/w/out/") == "20261124/delta-3/000"
    assert relative("../../m/out/20261124/base/000", "/x/m/out") == "20261124/base/000"
    assert relative("20261124/base/000", "/anything") == "20261124/base/000"
    assert relative("a/b/20261124/base", "/w/x/../a/b") == "20261124/base"
    for source, folder in (("out/20261124/base/000", "/w/output"),
                           ("a/b/20261124/base/000", "/w/b"),
                           ("../m/20261124/base/000", "/w/n")):  # fmt: skip
        with pytest.raises(ValueError, match="set paddlerec_workdir"):
            relative(source, folder)


def test_cube_local_up_source_format_reaches_transfer_conf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """cube-local up --source_format (and the saves' layout: --paddle_config, made absolute,
    or layout flags in --builder_flags) becomes transfer.conf's source_format and
    builder_flags; combinations the builder would refuse at every build are refused by up
    before anything starts."""
    from cube.transfer import local

    monkeypatch.chdir(tmp_path)
    specs: list[local.ClusterSpec] = []

    def recorded(spec: local.ClusterSpec, health_timeout: float = 60.0) -> local.Cluster:
        specs.append(spec)
        raise local.LocalError("not started")

    monkeypatch.setattr(local, "up", recorded)
    donefile = ["up", "--donefile", str(tmp_path), "--dir", str(tmp_path / "c")]
    fleet = ["--source_format", "paddle_fleet", "--paddle_config", "conf/fleet_desc.prototxt"]
    assert local.run([*donefile, *fleet, "--builder_flags", "-paddle_table '0 0'"]) == 1
    config = str(tmp_path / "conf" / "fleet_desc.prototxt")
    assert specs[-1].source_format == "paddle_fleet"
    assert specs[-1].builder_flags == ("-paddle_config", config, "-paddle_table", "0 0")
    cfg = local.cluster_config(specs[-1], local.plan_ports(2, 2, 0))
    conf = parse_config(render_config(cfg), "t.conf", tmp_path)
    assert (conf.source_format, conf.builder_flags) == ("paddle_fleet", specs[-1].builder_flags)
    assert conf.donefile_format.base_file == "xbox_base_done.txt" and conf.paddle_saves
    layout = "-paddle_accessor ctr_common -paddle_dim 8 -paddle_optimizer adagrad"
    assert local.run([*donefile, "--source_format=paddlerec", "--builder_flags", layout]) == 1
    assert specs[-1].source_format == "paddlerec" and specs[-1].builder_flags == tuple(
        layout.split()
    )
    capsys.readouterr()
    assert local.main([*donefile, "--source_format", "paddle"]) == 2  # not one of the choices
    assert "is not one of seqfile, paddle_fleet, paddlerec" in capsys.readouterr().err
    assert local.run([*donefile, "--builder_flags", "-paddle_table '0"]) == 1
    assert "--builder_flags: No closing quotation" in capsys.readouterr().err
    monkeypatch.undo()  # the real up: refusals come before any process starts

    def refused(*flags: str) -> str:
        assert local.run([*donefile, *flags]) == 1
        return capsys.readouterr().err

    err = refused("--source_format", "paddle_fleet")
    assert "--source_format paddle_fleet reads parameter-server saves" in err
    assert "--paddle_config FILE" in err and "-paddle_accessor, -paddle_dim" in err
    err = refused("--source_format", "paddlerec", "--builder_flags", "-paddle_dim 8")
    assert "--builder_flags with -paddle_accessor, -paddle_optimizer" in err
    err = refused("--paddle_config", "/conf/fleet_desc.prototxt")  # SequenceFile donefiles
    assert "add --source_format paddle_fleet or paddlerec" in err
    err = refused(*fleet, "--builder_flags", "-input_format paddle_ps")
    assert "-input_format is set by cube-transfer" in err
    assert not (tmp_path / "c" / "cluster.json").exists()


def test_a_parameter_server_delta_applies_on_its_own_days_base() -> None:
    """A day's base follows the shrink, whose deletions no delta carries: a delta save of
    another day than its base's is refused, whatever its key says."""
    state = TransferState()
    fleet = ("xbox_base_done.txt", "xbox_patch_done.txt")
    _lines(state, fleet[0], _base(100, "/m/20261124/base/000"))
    _go_live(state, _next(state, 1.0, paddle_saves=True)[0])
    _lines(state, fleet[1], _patch(110, 100, "/m/20261125/delta-1/000"), start=1)
    _lines(state, fleet[1], _patch(120, 100, "/m/20261124/delta-2/000"), start=2)
    rec, logs = _next(state, 2.0, paddle_saves=True)
    assert rec.version == "100_120"
    assert _record(state, "100_110").status == "refused"
    assert (
        logs
        and "patch 100_110 is a save of day 20261125, but its base 100 is of day "
        "20261124: a delta applies on its own day's base"
        in logs[0]
    )
    # without parameter-server saves, paths are not read
    state = TransferState()
    _lines(state, "base.txt", _base(100, "/m/20261124/base/000"))
    _go_live(state, _next(state, 1.0)[0])
    _lines(state, "patch.txt", _patch(110, 100, "/m/20261125/delta-1/000"))
    assert _next(state, 2.0)[0].version == "100_110"


def test_agents_still_starting_are_info_until_the_grace_passes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that has not answered since the transfer started (cube-local up: agents and
    the transfer start together) is INFO until --dead_timeout from the start, then one
    WARNING; one that had answered and goes silent is a WARNING at once (fake clock)."""
    import asyncio
    import logging

    from cube.transfer.agents import AgentUnreachable
    from cube.transfer.reconcile import Reconciler
    from cube.transfer.state import InstanceState

    cfg = parse_config(CONF, "t.conf", tmp_path)
    answering: set[str] = set()

    class Agents:
        async def status(self, inst: Instance) -> dict[str, Any]:
            if inst.name not in answering:
                raise AgentUnreachable(f"agent {inst.name}: connection refused")
            return {"server": {"reachable": True, "cur_version": ""}}

    clock = [100.0]
    reconciler = Reconciler(cfg, Agents(), None, 60.0, 1.0, clock=lambda: clock[0])  # type: ignore[arg-type]  # fake agents
    state = TransferState(instances={i.name: InstanceState() for i in cfg.instances})

    def refresh() -> list[tuple[int, str]]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cube.transfer"):
            asyncio.run(reconciler.refresh(state))
        return [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records]

    assert refresh() == [(logging.INFO, f"instance {i.name}") for i in cfg.instances]
    answering.add("0_0")
    clock[0] += 30
    assert refresh() == []  # said once
    answering.discard("0_0")  # it had answered: its silence is news at once
    assert refresh() == [(logging.WARNING, "instance 0_0")]
    clock[0] += 31  # the grace has passed: the others' silence is a warning now, once
    assert sorted(refresh()) == [(logging.WARNING, f"instance {n}") for n in ("0_1", "1_0", "1_1")]
    assert refresh() == []


def test_cube_cli_retry_reads_its_token_as_every_command_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--token_file through cube.security's one reader: its first token is sent; a file that
    cannot be read is a flag error naming it; without one, $CUBE_API_TOKEN."""
    from cube.client.transfer_cmd import RetryFlags, read_token
    from cube.flags import FlagError

    tokens = tmp_path / "api-token"
    tokens.write_text("new\nold\n")
    assert read_token(RetryFlags(token_file=str(tokens))) == "new"
    with pytest.raises(FlagError, match=r"--token_file: token file .*missing"):
        read_token(RetryFlags(token_file=str(tmp_path / "missing")))
    monkeypatch.setenv("CUBE_API_TOKEN", "from-env")
    assert read_token(RetryFlags()) == "from-env"


def test_a_small_local_input_is_built_in_one_process(tmp_path: Path) -> None:
    from cube.transfer import build as builds

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "part-00000").write_bytes(b"x" * 1000)
    assert builds.small_input(str(folder)) and builds.small_input(str(folder / "part-00000"))
    with (folder / "part-00001").open("wb") as big:  # sparse: past the bound without the bytes
        big.truncate(builds.SMALL_INPUT_BYTES + 1)
    assert not builds.small_input(str(folder))
    assert not builds.small_input("hdfs://nn/user/x/in")  # remote: the builder's default
    assert builds.small_input(str(tmp_path / "missing"))  # nothing there: nothing to fork for
