"""cube-agent pieces in process: names, requests, tar member checks, retention rule, the task
manager's idempotency rules, the fetcher against real local servers, the gRPC control client
against a fake grpc.aio ControlService."""

from __future__ import annotations

import asyncio
import os
import re
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.agent_helpers import FakeServer, FtpFileServer, HttpFileServer, make_shard_tar

from cube.agent.control import ServerControl, ServerError, ServerUnreachable
from cube.agent.fetch import (
    FetchError,
    FetchPolicy,
    SourcePolicy,
    SourceRefused,
    check_source,
    fetch_file,
    fetch_md5,
    parse_md5_text,
)
from cube.agent.journal import Journal
from cube.agent.layout import plan_retention
from cube.agent.main import config_from_flags, flag_set
from cube.agent.main import main as agent_main
from cube.agent.tasks import (
    INTERRUPTED,
    Task,
    TaskBusy,
    TaskFailed,
    TaskManager,
)
from cube.agent.unpack import UnsafeTar, extract_shard_tar
from cube.layout import member_problem
from cube.protocol import (
    FAILED,
    RUNNING,
    SUCCEEDED,
    BadRequest,
    check_name,
    normalize_chain,
    parse_work,
    version_dir_name,
)
from cube.remote import redact

FAST = FetchPolicy(
    attempts=3, backoff=0.01, timeout=20, io_timeout=5, sources=SourcePolicy(allow_files=True)
)


# ------------------------------------------------------------------ names and requests


@pytest.mark.parametrize("bad", ["", "..", "a/b", "../x", "/abs", "a..b", ".hidden", "x" * 129, 5])
def test_check_name_refuses_path_tricks(bad: object) -> None:
    with pytest.raises(BadRequest, match="not a valid name"):
        check_name("version", bad)


def test_version_dir_names() -> None:
    assert version_dir_name("1700") == "1700"
    assert version_dir_name("1700_1700") == "1700"  # the builder's dir name of a base
    assert version_dir_name("1700_1800") == "1700_1800"
    assert version_dir_name("1800", depend="1700", mode="delta") == "1700_1800"  # original pair
    assert version_dir_name("1700", depend="1700", mode="base") == "1700"


def test_chain_rules() -> None:
    assert normalize_chain(["b", "b_1"], "b_1") == ["b", "b_1"]
    assert normalize_chain(["b"], "b_1") == ["b", "b_1"]  # the delta itself is appended
    with pytest.raises(BadRequest, match="non-empty list"):
        normalize_chain(None, "b_1")
    with pytest.raises(BadRequest, match="twice"):
        normalize_chain(["b", "b_1", "b", "b_1"], "b_1")
    with pytest.raises(BadRequest, match="not a valid name"):
        normalize_chain(["../b"], "b_1")


def test_parse_work_fields(tmp_path: Path) -> None:
    work = parse_work(
        {"command": "download", "version": "1_2", "source": "http://h/x.tar", "chain": ["1"],
         "shard_seq": "3", "md5": "A" * 32, "size": 10, "deploy_path": str(tmp_path)},
        tmp_path,
    )  # fmt: skip
    assert (work.mode, work.chain, work.shard_seq, work.md5) == ("delta", ["1", "1_2"], 3, "a" * 32)
    base = parse_work({"command": "download", "version": "7", "source": "/x.tar"}, tmp_path)
    assert base.mode == "base" and base.chain == []
    rollback = parse_work({"command": "rollback", "version": "7", "mode": "rollback"}, tmp_path)
    assert rollback.mode == ""  # the server-side commands take the mode from disk


@pytest.mark.parametrize(
    "body, field",
    [
        ([], "JSON object"),
        ({"command": "explode", "version": "1"}, "command"),
        ({"command": "reload"}, "version: required"),
        ({"command": "download", "version": "1"}, "source: required"),
        ({"command": "download", "version": "1", "source": "a;b"}, "one tar"),
        ({"command": "download", "version": "1", "source": "x", "md5": "zz"}, "md5"),
        ({"command": "download", "version": "1", "source": "x", "size": -1}, "size"),
        ({"command": "download", "version": "1", "source": "x", "mode": "delta"}, "chain"),
        ({"command": "reload", "version": "1", "deploy_path": "/elsewhere"}, "deploy_path"),
        ({"command": "download", "version": "1", "source": "x", "mode": "weird"}, "mode"),
        ({"command": "task", "version": "1", "task_command": "dance"}, "task_command"),
        ({"command": "reload", "version": "1", "deploy_path": "/x\0y"}, "deploy_path"),
        ({"command": "download", "version": "1", "source": "/" + "x" * 5000}, "source: longer"),
        ({"command": "download", "version": "1", "source": "x", "size": True}, "size"),
        ({"command": "download", "version": "1", "source": "x", "size": 1.5}, "size"),
    ],
)
def test_parse_work_refusals_name_the_field(tmp_path: Path, body: object, field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        parse_work(body, tmp_path)


def test_refusal_messages_are_clipped(tmp_path: Path) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_work({"command": "reload", "version": "v" * 100_000}, tmp_path)
    assert len(str(refused.value)) < 300


@pytest.mark.parametrize(
    "source, allowed, files, refused",
    [
        ("http://h/x.tar", "", False, ""),
        ("ftp://u:p@h:2121/x.tar", "", False, ""),
        ("http://[::1/x.tar", "", False, "not a valid URL"),
        ("http://h:99999/x.tar", "", False, "bad port"),
        ("http:///x.tar", "", False, "no host"),
        ("gopher://h/x", "", False, "unsupported scheme"),
        ("http://h/a/../x.tar", "", False, "'..'"),
        ("http://h/a/%2e%2E/x.tar", "", False, "'..'"),
        ("http://h/a x.tar", "", False, "spaces"),
        ("http://h/x.tar", "http://h/a/", False, "--allowed_sources"),
        ("http://h/a/x.tar", "http://h/a/", False, ""),
        ("http://h:80/a/x.tar", "http://h/a", False, ""),  # the default port is the same port
        ("http://h:8080/a/x.tar", "http://h/a", False, "--allowed_sources"),
        ("http://h/ab/x.tar", "http://h/a", False, "--allowed_sources"),
        ("http://h/a/x.tar", "https://h/a", False, "--allowed_sources"),
        ("http://H/a/x.tar", "http://h/a", False, ""),  # host names are case-insensitive
        ("http://h/a@evil/a/x.tar", "http://h/a", False, "--allowed_sources"),
        ("http://h@evil/a/x.tar", "http://h/a", False, "--allowed_sources"),
        ("/abs/x.tar", "", False, "--allow_file_sources"),
        ("/abs/x.tar", "", True, ""),
        ("file://remote/x.tar", "", True, "remote host"),
        ("file:///abs/x.tar?y", "", True, "query"),
        ("rel/x.tar", "", True, "absolute"),
        ("/abs/x.tar", "file:///abs", False, ""),
        ("/abs/../x.tar", "file:///abs", False, "'..'"),
        ("/absx/x.tar", "file:///abs", False, "file:// prefix"),
    ],
)
def test_source_checks(source: str, allowed: str, files: bool, refused: str) -> None:
    policy = SourcePolicy.from_flags(allowed, files)
    if not refused:
        check_source(source, policy)
        return
    with pytest.raises(SourceRefused, match=re.escape(refused)):
        check_source(source, policy)


def test_file_sources_are_judged_by_where_symlinks_lead(tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "secret").write_text("x")
    (tmp_path / "ok" / "link.tar").symlink_to(tmp_path / "secret")
    policy = SourcePolicy.from_flags(f"file://{tmp_path}/ok", False)
    with pytest.raises(SourceRefused, match="file:// prefix"):
        check_source(str(tmp_path / "ok" / "link.tar"), policy)
    target = check_source(str(tmp_path / "ok" / "x.tar"), policy)
    assert target.url == str((tmp_path / "ok" / "x.tar").resolve())


@pytest.mark.parametrize(
    "entry",
    ["gopher://h/", "http://u@h/", "http://h/?q", "http://h/a/../b", "file://h/x", "http://"],
)
def test_bad_allowed_sources_entries_are_flag_errors(entry: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--allowed_sources"):
        SourcePolicy.from_flags(entry, False)
    assert agent_main(["-P", "1", "--deploy_path", str(tmp_path), "--allowed_sources", entry]) == 2


def test_passwords_are_not_shown() -> None:
    assert redact("ftp://user:s3cret@h/x.tar") == "ftp://***@h/x.tar"
    assert redact("http://h/x.tar") == "http://h/x.tar"


def test_md5_text() -> None:
    assert parse_md5_text("ABCDEF0123456789abcdef0123456789  x.tar\n", "f") == "abcdef" + (
        "0123456789abcdef0123456789"
    )
    with pytest.raises(FetchError, match="no md5") as refused:
        parse_md5_text("<html>not found</html>", "x.tar.md5")
    assert "html" not in str(refused.value)  # the text came from the source


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = config_from_flags(flag_set().parse(["-P", "8001", "--deploy_path", str(tmp_path)]))
    assert config.deploy_path == tmp_path and config.keep == 2
    assert config.server == "127.0.0.1:9000"  # the control port: --port + 1000
    assert agent_main(["--deploy_path", str(tmp_path)]) == 2
    assert "-P/--port is required" in capsys.readouterr().err
    assert agent_main(["-P", "1", "--deploy_path", str(tmp_path), "--keep", "0"]) == 2
    assert agent_main(["-P", "1", "--deploy_path", str(tmp_path), "--log_level", "LOUD"]) == 2


def test_disk_limit_takes_bytes_and_kubernetes_quantities(tmp_path: Path) -> None:
    """--disk_limit takes what the chart passes (agent.storage.size, an emptyDir's sizeLimit)."""
    from cube.agent.main import byte_quantity

    for text, expected in (
        ("0", 0), ("4096", 4096), ("20Gi", 20 << 30), ("500M", 500 * 10**6), ("64Ki", 65536),
        ("1.5Gi", 3 << 29), ("0.5k", 500), ("1.0001k", 1001), ("2E", 2 * 10**18),
    ):  # fmt: skip
        assert byte_quantity(text) == expected, text
    for bad in ("", "-1", "20GB", "1e9", "Gi", "100m", "1.Gi"):
        with pytest.raises(ValueError):
            byte_quantity(bad)
    args = ["-P", "8001", "--deploy_path", str(tmp_path)]
    assert config_from_flags(flag_set().parse([*args, "--disk_limit=8Mi"])).disk_limit == 8 << 20
    assert config_from_flags(flag_set().parse(args)).disk_limit == 0
    assert agent_main([*args, "--disk_limit", "lots"]) == 2


def test_disk_space_counts_against_the_limit_and_refuses_what_would_not_fit(
    tmp_path: Path,
) -> None:
    """With --disk_limit (the emptyDir's sizeLimit, which statvfs does not show) the room left
    is the limit less the files under the deploy path (the metrics' available bytes), and a
    download whose tar and extracted copy would not fit there is refused (`no_space`) before
    a byte is fetched, instead of the kubelet evicting the pod past the limit."""
    import shutil

    from cube.agent.deploy import Agent, AgentConfig
    from cube.agent.metrics import disk_space
    from cube.protocol import NO_SPACE

    deploy = tmp_path / "deploy"
    agent = Agent(AgentConfig(deploy_path=deploy, disk_limit=1 << 20))
    agent.open()
    try:
        (deploy / "data" / "junk").write_bytes(b"x" * 600_000)
        capacity, available = agent.disk_space()
        used = sum(p.stat().st_size for p in deploy.rglob("*") if p.is_file())
        assert capacity == 1 << 20 and available == (1 << 20) - used
        part = deploy / "cube_data" / "v.tar.part"
        agent._check_space(part.parent, 200_000, part)  # 400 kB fits
        with pytest.raises(TaskFailed, match="of --disk_limit 1048576") as refused:
            agent._check_space(part.parent, 300_000, part)
        assert refused.value.reason == NO_SPACE
        part.write_bytes(b"y" * 100_000)  # a resumed download needs only what it lacks
        agent._check_space(part.parent, 220_000, part)  # 340 kB of 348 kB
        assert disk_space(deploy, 1000) == (1000, 0)  # over the limit: none left
        usage = shutil.disk_usage(deploy)
        whole = disk_space(deploy)
        assert whole[0] == usage.total and abs(whole[1] - usage.free) < 64 << 20
    finally:
        asyncio.run(agent.close())


# ------------------------------------------------------------------ retention rule


def test_retention_keeps_newest_and_protected() -> None:
    newest_first = ["v5", "v4", "v3", "v2", "v1"]
    assert plan_retention(newest_first, 2, protected=set()) == ["v3", "v2", "v1"]
    assert plan_retention(newest_first, 2, protected={"v1", "v2"}) == ["v3"]
    assert plan_retention(newest_first, 0, protected={"v5"}) == ["v4", "v3", "v2", "v1"]


# ------------------------------------------------------------------ tar members


def _info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize(
    "member, reason",
    [
        (_info("/etc/passwd"), "absolute"),
        (_info("../evil"), "'..'"),
        (_info("./a/../../evil"), "'..'"),
        (_info("x", tarfile.SYMTYPE, "/etc/passwd"), "symlink"),
        (_info("x", tarfile.LNKTYPE, "index.cube"), "hard link"),
        (_info("x", tarfile.CHRTYPE), "device"),
        (_info("x", tarfile.BLKTYPE), "device"),
        (_info("x", tarfile.FIFOTYPE), "fifo"),
    ],
)
def test_member_problems(member: tarfile.TarInfo, reason: str) -> None:
    assert reason in (member_problem(member) or "")


def test_plain_members_pass() -> None:
    assert member_problem(_info("./index.cube")) is None
    assert member_problem(_info("./sub", tarfile.DIRTYPE)) is None


def test_extract_refuses_tar_without_shard_files(tmp_path: Path) -> None:
    tar_path = tmp_path / "x.tar"
    with tarfile.open(tar_path, "w") as tar:
        (tmp_path / "readme").write_text("hi")
        tar.add(tmp_path / "readme", arcname="./readme")
    with pytest.raises(UnsafeTar, match=r"no index\.cube, data\.cube"):
        extract_shard_tar(tar_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_extract_good_tar(tmp_path: Path) -> None:
    make_shard_tar(tmp_path / "s.tar")
    assert extract_shard_tar(tmp_path / "s.tar", tmp_path / "out") == ["data.cube", "index.cube"]


def test_extract_without_extraction_filters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a Python before 3.11.4 (Debian bookworm's 3.11.2, the image's) tarfile has no
    `filter`: the checked members are extracted as the `data` filter would (no set-id, sticky
    or group/other write bits; the extracting user owns them). The agent failed every download
    there with a TypeError (tests/test_containers.py found it)."""
    make_shard_tar(tmp_path / "s.tar")
    with tarfile.open(tmp_path / "s.tar", "a") as tar:
        (tmp_path / "x").write_bytes(b"x")
        info = tar.gettarinfo(tmp_path / "x", arcname="./extra")
        info.mode, info.uid, info.gid = 0o6777, 4321, 4321
        with open(tmp_path / "x", "rb") as f:
            tar.addfile(info, f)
    monkeypatch.delattr(tarfile, "data_filter")
    calls: list[dict[str, object]] = []
    extract = tarfile.TarFile.extractall

    def old_extractall(
        self: tarfile.TarFile, path: str, members: object = None, **kw: object
    ) -> None:
        calls.append(kw)
        assert not kw, "a Python before 3.11.4 takes no filter="
        extract(self, path, members=members, filter="fully_trusted")  # type: ignore[arg-type]

    monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
    names = extract_shard_tar(tmp_path / "s.tar", tmp_path / "out")
    assert names == ["data.cube", "extra", "index.cube"] and calls == [{}]
    extra = (tmp_path / "out" / "extra").stat()
    assert extra.st_mode & 0o7777 == 0o755
    assert (extra.st_uid, extra.st_gid) == (os.getuid(), os.getgid())


def test_extract_keeps_a_margin_of_free_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files must fit in the free space less a margin (64 MiB or 1 % of the disk) kept for
    the server and the other versions: refused before anything is written (it extracted
    whenever the files alone fitted, and could fill the disk)."""
    from types import SimpleNamespace

    from cube.agent import unpack

    make_shard_tar(tmp_path / "s.tar", n_keys=2000)
    with tarfile.open(tmp_path / "s.tar") as tar:
        files = sum(m.size for m in tar if m.isreg())
    free = files + (32 << 20)  # room for the files, not for the margin too
    disk = SimpleNamespace(f_bavail=free // 4096, f_bfree=free // 4096, f_frsize=4096,
                           f_blocks=(1 << 30) // 4096)  # fmt: skip
    monkeypatch.setattr(os, "statvfs", lambda path: disk)  # the os unpack calls
    with pytest.raises(UnsafeTar, match=r"tar s\.tar: its files unpack to \d+ bytes or more, and "):
        extract_shard_tar(tmp_path / "s.tar", tmp_path / "data" / "v1")
    assert not (tmp_path / "data" / "v1").exists()
    assert unpack.free_for_extraction(tmp_path) == disk.f_bavail * 4096 - (64 << 20)
    disk.f_bavail += (64 << 20) // 4096
    assert extract_shard_tar(tmp_path / "s.tar", tmp_path / "data" / "v1") == [
        "data.cube",
        "index.cube",
    ]


# ------------------------------------------------------------------ fetcher on real servers


@pytest.fixture
def files(tmp_path: Path) -> Path:
    root = tmp_path / "files"
    root.mkdir()
    make_shard_tar(root / "s.tar", n_keys=20000)
    return root


def test_http_resume_uses_range(tmp_path: Path, files: Path) -> None:
    http = HttpFileServer(files)
    try:
        whole = (files / "s.tar").read_bytes()
        part = tmp_path / "s.tar.part"
        part.write_bytes(whole[:12345])
        got = asyncio.run(fetch_file(f"{http.url}/s.tar", part, size=len(whole), policy=FAST))
        assert got == len(whole) and part.read_bytes() == whole
        assert http.ranges_for("s.tar") == ["bytes=12345-"]
    finally:
        http.close()


def test_complete_part_is_not_fetched_again(tmp_path: Path, files: Path) -> None:
    """A crash between the last byte and the md5 check leaves a complete .part."""
    http = HttpFileServer(files)
    ftp = FtpFileServer(files)
    try:
        whole = (files / "s.tar").read_bytes()
        for source in (f"{http.url}/s.tar", f"{ftp.url}/s.tar", str(files / "s.tar")):
            part = tmp_path / "s.tar.part"
            part.write_bytes(whole)
            assert asyncio.run(fetch_file(source, part, size=None, policy=FAST)) == len(whole)
            assert part.read_bytes() == whole
        assert http.ranges_for("s.tar") == [f"bytes={len(whole)}-"]
        assert ftp.rest_offsets == []
    finally:
        http.close()
        ftp.close()


def test_http_retries_transient_errors_then_succeeds(tmp_path: Path, files: Path) -> None:
    http = HttpFileServer(files)
    try:
        http.fail_next["/s.tar"] = 2
        part = tmp_path / "s.tar.part"
        asyncio.run(fetch_file(f"{http.url}/s.tar", part, size=None, policy=FAST))
        assert part.read_bytes() == (files / "s.tar").read_bytes()
        assert len(http.ranges_for("s.tar")) == 3
    finally:
        http.close()


def test_http_attempts_are_bounded(tmp_path: Path, files: Path) -> None:
    http = HttpFileServer(files)
    try:
        http.fail_next["/s.tar"] = 100
        with pytest.raises(FetchError, match="failed after 3 attempts: HTTP 503"):
            asyncio.run(fetch_file(f"{http.url}/s.tar", tmp_path / "p", size=None, policy=FAST))
        assert len(http.ranges_for("s.tar")) == 3
        with pytest.raises(FetchError, match="HTTP 404"):  # permanent: no retry
            asyncio.run(fetch_file(f"{http.url}/nope.tar", tmp_path / "q", size=None, policy=FAST))
        assert len(http.ranges_for("nope.tar")) == 1
    finally:
        http.close()


def test_size_disagreement_is_an_error(tmp_path: Path, files: Path) -> None:
    source = str(files / "s.tar")
    with pytest.raises(FetchError, match="request says size 10"):
        asyncio.run(fetch_file(source, tmp_path / "p", size=10, policy=FAST))


def test_ftp_resume_uses_rest_and_md5_file(tmp_path: Path, files: Path) -> None:
    ftp = FtpFileServer(files)
    try:
        whole = (files / "s.tar").read_bytes()
        part = tmp_path / "s.tar.part"
        part.write_bytes(whole[:5000])
        asyncio.run(fetch_file(f"{ftp.url}/s.tar", part, size=None, policy=FAST))
        assert part.read_bytes() == whole
        assert ftp.rest_offsets == ["5000"]
        digest = asyncio.run(fetch_md5(f"{ftp.url}/s.tar", tmp_path / "s.tar.md5", FAST))
        assert digest == (files / "s.tar.md5").read_text().split()[0]
        with pytest.raises(FetchError, match="550"):
            asyncio.run(fetch_file(f"{ftp.url}/nope.tar", tmp_path / "q", size=None, policy=FAST))
    finally:
        ftp.close()


def test_overall_deadline_stops_a_slow_download_and_keeps_the_part(
    tmp_path: Path, files: Path
) -> None:
    slow = FetchPolicy(
        attempts=3, backoff=0.01, timeout=0.5, limit_rate=64 * 1024, chunk=4096,
        sources=FAST.sources,
    )  # fmt: skip
    part = tmp_path / "s.tar.part"
    with pytest.raises(FetchError, match=r"timed out after 0\.5 s .*kept s\.tar\.part"):
        asyncio.run(fetch_file(str(files / "s.tar"), part, size=None, policy=slow))
    assert 0 < part.stat().st_size < (files / "s.tar").stat().st_size


def test_unsupported_scheme(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="unsupported scheme 'gopher'"):
        asyncio.run(fetch_file("gopher://x/y", tmp_path / "p", size=None, policy=FAST))


# ------------------------------------------------------------------ control client


def test_internal_errors_answer_500_with_the_envelope_and_no_details(tmp_path: Path) -> None:
    """A bug's exception text may quote anything (a source's bytes): the log has it, the
    answer names only the type."""
    from aiohttp.test_utils import TestClient, TestServer

    from cube.agent.api import make_app
    from cube.agent.deploy import Agent, AgentConfig

    async def scenario() -> tuple[int, dict[str, Any]]:
        agent = Agent(AgentConfig(deploy_path=tmp_path, server="127.0.0.1:1"))
        agent.open()

        async def broken() -> dict[str, Any]:
            raise RuntimeError("TOPSECRET from somewhere")

        agent.status_json = broken  # type: ignore[method-assign]  # a failing stand-in
        try:
            async with TestClient(TestServer(make_app(agent))) as client:
                resp = await client.get("/agent/status")
                return resp.status, await resp.json()
        finally:
            await agent.close()

    status, reply = asyncio.run(scenario())
    assert status == 500 and reply["success"] == "255" and reply["data"] is None
    assert "RuntimeError" in reply["message"] and "TOPSECRET" not in reply["message"]


def test_server_error_carries_the_grpc_code(tmp_path: Path) -> None:
    import grpc

    fake = FakeServer(tmp_path)

    async def scenario() -> None:
        control = ServerControl(fake.address, timeout=5)
        try:
            await control.cmd("bg_load_base", version_path="/missing")
        finally:
            await control.close()

    try:
        with pytest.raises(ServerError) as failed:
            asyncio.run(scenario())
    finally:
        fake.close()
    assert failed.value.code == grpc.StatusCode.NOT_FOUND
    assert failed.value.details.startswith("no shard in")


def test_damaged_layers_under_a_running_task_are_not_removed(tmp_path: Path) -> None:
    """A reload of a delta needs its base: a download that finds the base damaged must not
    remove it while that reload runs (the task's whole chain is in use, not only its name)."""
    from cube.agent.deploy import Agent, AgentConfig
    from cube.agent.tasks import Task

    data = tmp_path / "deploy" / "data"
    make_shard_tar(tmp_path / "t.tar")
    for name in ("b", "b_1"):
        extract_shard_tar(tmp_path / "t.tar", data / name)
    (data / "b_1" / "CHAIN").write_text("b\nb_1\n")
    fake = FakeServer(data)

    async def scenario() -> None:
        agent = Agent(AgentConfig(deploy_path=tmp_path / "deploy", server=fake.address))
        agent.open()
        try:
            agent.tasks._tasks[("reload", "b_1")] = Task("reload", "b_1")  # running
            with pytest.raises(TaskFailed, match=r"a task uses it \(b\)"):
                await agent._remove_damaged("b", {"b": "data/b/index.cube: damaged"})
            assert (data / "b").is_dir() and (data / "b_1").is_dir()
            del agent.tasks._tasks[("reload", "b_1")]
            removed = await agent._remove_damaged("b", {"b": "data/b/index.cube: damaged"})
            assert removed == ["b", "b_1"]  # the delta cannot load without its base
            assert not (data / "b").exists() and not (data / "b_1").exists()
        finally:
            await agent.close()

    try:
        asyncio.run(scenario())
    finally:
        fake.close()


def test_control_client_against_fake_server(tmp_path: Path) -> None:
    make_shard_tar(tmp_path / "t.tar")
    extract_shard_tar(tmp_path / "t.tar", tmp_path / "data" / "v1")
    fake = FakeServer(tmp_path / "data")

    async def scenario() -> None:
        control = ServerControl(fake.address, timeout=5)
        try:
            assert (await control.status()).cur_version == ""
            await control.cmd("bg_load_base", version_path="/v1")
            st = await control.wait_for("v1", slot="bg", timeout=5)
            assert st.bg_version == "v1"
            st = await control.cmd("enable", version="v1")
            assert (st.cur_version, st.bg_version) == ("v1", "")
            with pytest.raises(ServerError, match="NOT_FOUND: no shard"):
                await control.cmd("bg_load_base", version_path="/missing")
        finally:
            await control.close()

    try:
        asyncio.run(scenario())
    finally:
        fake.close()


def test_control_client_unreachable() -> None:
    async def scenario() -> None:
        control = ServerControl("127.0.0.1:1", timeout=2)
        try:
            await control.status()
        finally:
            await control.close()

    with pytest.raises(ServerUnreachable, match=r"127\.0\.0\.1:1 unreachable"):
        asyncio.run(scenario())


# ------------------------------------------------------------------ task manager


def test_task_rules(tmp_path: Path) -> None:
    """Idempotent repeats, restart of failed tasks, busy refusals, journal recovery."""
    journal = Journal(tmp_path / "state")
    journal.open()
    runs: list[str] = []

    async def scenario() -> None:
        release = asyncio.Event()

        async def slow(task: Task, checkpoint: Callable[[], None]) -> str:
            runs.append(task.command)
            await asyncio.wait_for(release.wait(), 10)
            return "done"

        async def fails(task: Task, checkpoint: Callable[[], None]) -> str:
            runs.append(task.command)
            raise TaskFailed("no luck")

        async def still_done(task: Task, request: dict[str, Any]) -> bool:
            return True

        manager = TaskManager(
            journal,
            {"download": slow, "reload": fails, "enable": slow, "rollback": slow},
            exclusive={"reload", "enable", "rollback"},
            still_done=still_done,
        )
        first = await manager.submit("download", "v1", {})
        assert (await manager.submit("download", "v1", {})) is first  # repeat while running
        with pytest.raises(TaskBusy, match="download of version v1 is running"):
            await manager.submit("reload", "v1", {})
        enable = await manager.submit("enable", "v0", {})
        with pytest.raises(TaskBusy, match="one control command at a time"):
            await manager.submit("rollback", "v9", {})
        release.set()
        await manager.wait_idle(10)
        assert first.state == SUCCEEDED and enable.state == SUCCEEDED
        assert (await manager.submit("download", "v1", {})) is first  # succeeded: not redone
        failed = await manager.submit("reload", "v1", {})
        await manager.wait_idle(10)
        assert failed.state == FAILED and failed.message == "no luck"
        again = await manager.submit("reload", "v1", {})  # failed: restarted
        await manager.wait_idle(10)
        assert again is not failed and again.runs == 2
        # a task the journal says is running was cut off: it comes back failed, interrupted
        journal.save_task({**first.to_record(), "version": "v7", "state": RUNNING})

    asyncio.run(scenario())
    assert runs == ["download", "enable", "reload", "reload"]
    manager = TaskManager(journal, {}, set(), still_done=None)  # type: ignore[arg-type]  # recover() never asks
    manager.recover()
    recovered = manager.find("download", "v7")
    assert recovered is not None and recovered.state == FAILED
    assert recovered.message == INTERRUPTED
    done = manager.find("download", "v1")
    assert done is not None and done.state == SUCCEEDED
