"""s3:// and webhdfs:// sources below the processes: URL checks, the builder's lister and
fetcher (builder/sources.py), the transfer's donefile reads and input mirrors, the agent's
source policy and ranged S3 downloads, and the errors of each (a missing object, bad
credentials, an unreachable endpoint, s3fs not installed): short, naming the URL, never a
credential nor what a server sent. Against moto's S3 server (a process, tests/conftest.py
`moto`) and a fake WebHDFS namenode (tests/helpers/s3_helpers.py); the real-process end to end is
tests/test_s3_e2e.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from helpers.build_inputs import output_digests
from helpers.s3_helpers import (
    ACCESS_KEY,
    SECRET_KEY,
    FakeNamenode,
    MotoServer,
    ObjectStore,
    S3Bucket,
    SilentEndpoint,
    aws_environment,
    s3_filesystem,
)

from cube import remote
from cube.agent.fetch import (
    FetchError,
    FetchPolicy,
    SourcePolicy,
    SourceRefused,
    check_source,
    fetch_file,
    fetch_md5,
)
from cube.builder import sources
from cube.builder.build import BuildError, list_input_files
from cube.processes import free_port
from cube.transfer.config import ConfigError, parse_config
from cube.transfer.donefile import SourceUnavailable, mirror_input, read_donefile, resolve_input

BUCKET = "cube-test"
TREE = {  # names whose byte order differs from their string order once '/' is involved
    "a.txt": b"1",
    "a/x": b"22",
    "a/.hidden/y": b"hidden",
    "b/part-00001": b"333",
    "B": b"4444",
    "_SUCCESS": b"",
    ".staging": b"hidden",
    "d/e/f": b"55555",
    "\u00e9t\u00e9": b"666666",
}


@pytest.fixture(scope="module")
def s3(moto: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Bucket]:
    """The AWS environment pointed at the session's moto server for this module, a bucket,
    and an s3fs filesystem to put objects with."""
    root = tmp_path_factory.mktemp("s3-sources")
    with aws_environment(moto.url, root):
        fs = s3_filesystem()
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        yield S3Bucket(root=root, fs=fs, url=moto.url)


def put_tree(fs: ObjectStore, prefix: str, tree: dict[str, bytes]) -> str:
    for name, data in tree.items():
        fs.pipe_file(f"{BUCKET}/{prefix}/{name}", data)
    return f"s3://{BUCKET}/{prefix}"


def write_tree(root: Path, tree: dict[str, bytes]) -> Path:
    for name, data in tree.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def relative(files: Sequence[sources.InputFile | Path], root: str) -> list[str]:
    return [str(f.url if hasattr(f, "url") else f)[len(root.rstrip("/")) + 1 :] for f in files]


def clean(message: str) -> None:
    """A message shows no credential and nothing a server sent."""
    for secret in (SECRET_KEY, ACCESS_KEY, "namenode-internal-detail", "hunter2"):
        assert secret not in message, message


# ---------------------------------------------------------------------------------------------
# URLs and configuration (no network)


@pytest.mark.parametrize(
    "url, problem",
    [
        ("hdfs://alice:hunter2@nn:8020/data/in", "does not belong in an hdfs:// URL (set hadoop"),
        ("s3://AKIA:hunter2@bucket/in", "credentials do not belong in an s3:// URL"),
        ("s3://bucket:9000/in", "set AWS_ENDPOINT_URL"),
        ("s3:///in", "no bucket"),
        ("s3://bucket/in?versionId=3", "query or fragment"),
        ("webhdfs://nn/in", "no port: webhdfs://<namenode>:<http port>/<path>"),
        ("webhdfs://alice:hunter2@nn:9870/in", "a password does not belong in the URL"),
        ("gs://bucket/in", "unsupported scheme 'gs'"),
    ],
)
def test_remote_urls_are_refused_with_what_to_use(url: str, problem: str) -> None:
    assert problem in (remote.check_url(url) or "")
    with pytest.raises(BuildError) as refused:
        sources.list_inputs(url)
    assert problem in str(refused.value)
    clean(str(refused.value))


def test_which_paths_are_remote() -> None:
    for path in ("s3://b/in", "webhdfs://nn:9870/in", "http://h/in", "hdfs://nn:8020/in"):
        assert remote.is_remote(path), path
    for path in ("/data/in", "data/in", "file:///data/in", "odd:name/in"):
        assert not remote.is_remote(path), path
    assert remote.check_url("s3://bucket/in") is None
    assert remote.check_url("webhdfs://alice@nn:9870/in") is None


def test_s3fs_missing_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # `import s3fs` now raises ImportError
    with pytest.raises(BuildError, match=re.escape("s3://b/in: s3:// needs s3fs: pip install")):
        sources.list_inputs("s3://b/in")
    with pytest.raises(SourceUnavailable, match=re.escape("pip install 'cube-py[s3]'")):
        asyncio.run(read_donefile("s3://b/donefile", "base.txt"))
    policy = FetchPolicy(attempts=3, sources=SourcePolicy.from_flags("s3://b/", False))
    started = time.monotonic()
    with pytest.raises(FetchError, match=re.escape("pip install 'cube-py[s3]'")):
        asyncio.run(fetch_file("s3://b/x.tar", tmp_path / "x.part", size=None, policy=policy))
    assert time.monotonic() - started < 5  # not retried: installing is not a retry


def test_failures_are_told_in_our_words() -> None:
    import requests
    from botocore.exceptions import (  # type: ignore[import-untyped]  # botocore: no py.typed
        ClientError,
        EndpointConnectionError,
    )

    said = "server-said-hunter2"

    def client_error(code: str, status: int) -> OSError:
        answer = {"Error": {"Code": code, "Message": said}}
        cause = ClientError({**answer, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
        error = OSError(5, said)
        error.__cause__ = cause
        return error

    reply = requests.Response()
    reply.status_code = 503
    cases = [
        (FileNotFoundError(said), "not found", "missing"),
        (client_error("NoSuchBucket", 404), "the bucket does not exist", ""),
        (PermissionError(said), "access denied (check AWS_ACCESS_KEY_ID", "denied"),
        (client_error("SlowDown", 503), "HTTP 503 Service Unavailable", "retryable"),
        (client_error("InvalidRange", 416), "HTTP 416 Requested Range Not Satisfiable", ""),
        (requests.HTTPError(said, response=reply), "HTTP 503 Service Unavailable", "retryable"),
        (
            EndpointConnectionError(endpoint_url=f"http://s3.local:9000/b/{said}"),
            "cannot connect to the S3 endpoint http://s3.local:9000",
            "retryable",
        ),
        (requests.ConnectionError(said), "cannot connect", "retryable"),
        (ConnectionResetError(104, said), "the connection was lost", "retryable"),
        (requests.ReadTimeout(said), "timed out", "retryable"),
        (RuntimeError(said), "the server refused the request (RuntimeError)", ""),
        (KeyError(said), "failed (KeyError)", "retryable"),
    ]
    for exc, message, flag in cases:
        error = remote.failure(exc)
        assert str(error).startswith(message), (exc, str(error))
        assert said not in str(error) and "hunter2" not in str(error)
        assert {f for f in ("missing", "denied", "retryable") if getattr(error, f)} == (
            {flag} if flag else set()
        ), exc


CONF = """\
[default]
dict_name: emb
shard_num: 2
output_address: out
tmp_address: tmp
{extra}
[cube_agent]
agent0_0: 127.0.0.1:8001
cube0_0: 127.0.0.1:8000:/srv/0
agent1_0: 127.0.0.1:8011
cube1_0: 127.0.0.1:8010:/srv/1
"""


@pytest.mark.parametrize(
    "extra, error",
    [
        ("donefile_address: afs://u:hunter2@nn/donefile\nwget_port: 0", "hadoop.job.ugi"),
        ("donefile_address: gs://b/donefile\nwget_port: 0", "unsupported scheme 'gs'"),
        ("donefile_address: s3://b/d\ndownload_mode: s3", "download_mode s3 needs upload_address"),
        ("donefile_address: /d\ndownload_mode: s3\nupload_address: http://h/x", "upload_address"),
        ("donefile_address: /d\nwget_port: 0\nupload_address: s3://b/x", "only with download_mode"),
        ("donefile_address: /d\ndownload_mode: s3\nupload_address: s3://k:hunter2@b/x", "creden"),
    ],
)
def test_transfer_conf_refuses_remote_addresses_it_cannot_use(
    tmp_path: Path, extra: str, error: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)) as refused:
        parse_config(CONF.format(extra=extra), "t.conf", tmp_path)
    assert "t.conf:" in str(refused.value)
    clean(str(refused.value))


def test_download_mode_s3_sends_agents_to_the_uploaded_copy(tmp_path: Path) -> None:
    from cube.transfer.state import VersionRecord
    from cube.transfer.views import source_url

    extra = "donefile_address: s3://trainer/donefile\ndownload_mode: s3\n"
    cfg = parse_config(CONF.format(extra=extra + "upload_address: s3://builds/emb/"), "t", tmp_path)
    assert cfg.wget_port == 0 and cfg.donefile_address == "s3://trainer/donefile"
    rec = VersionRecord("100", "100", "100", "100", "base", "", "base.txt:1")
    rec.output = str(tmp_path / "out" / "100_100")
    assert source_url(cfg, rec, 1) == "s3://builds/emb/100_100/emb_part1.tar"
    donefile = cfg.donefile_address
    assert resolve_input(donefile, "inputs/100") == "s3://trainer/donefile/inputs/100"
    assert resolve_input(donefile, "/inputs/100") == "s3://trainer/inputs/100"
    assert resolve_input(donefile, "s3://other/in") == "s3://other/in"
    assert resolve_input("webhdfs://nn:9870/d", "in") == "webhdfs://nn:9870/d/in"


def test_an_upload_of_a_missing_build_file_blames_the_build_not_s3(tmp_path: Path) -> None:
    from cube.transfer.upload import upload_outputs

    extra = "donefile_address: /d\ndownload_mode: s3\nupload_address: s3://builds/emb\n"
    cfg = parse_config(CONF.format(extra=extra), "t", tmp_path)
    (tmp_path / "100_100").mkdir()
    with pytest.raises(remote.RemoteError, match=re.escape("emb_part0.tar is missing")) as caught:
        upload_outputs(cfg, tmp_path / "100_100", timeout=5)
    assert str(caught.value).startswith("upload to s3://builds/emb/100_100/emb_part0.tar: ")


@pytest.mark.slow
def test_daemons_configured_for_s3_without_s3fs_stop_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess

    from cube.agent.main import main as agent_main

    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "s3fs.py").write_text("raise ImportError('s3fs is not installed here')\n")
    conf = tmp_path / "t.conf"
    extra = "donefile_address: s3://trainer/donefile\nwget_port: 0\n"
    conf.write_text(CONF.format(extra=extra))
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    run = subprocess.run([sys.executable, "-m", "cube.transfer.main", "--config", str(conf)],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert run.returncode == 2
    assert f"{conf}: donefile_address: s3:// needs s3fs: pip install 'cube-py[s3]'" in run.stderr
    monkeypatch.setitem(sys.modules, "s3fs", None)
    flags = ["-P", "0", "--deploy_path", str(tmp_path), "--allowed_sources", "s3://b/shards"]
    assert agent_main(flags) == 2
    assert (
        "--allowed_sources: s3:// needs s3fs: pip install 'cube-py[s3]'" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "source, allowed, refused",
    [
        ("s3://bkt/shards/v1/t_part0.tar", "", "must be allowed; list its s3://bucket/prefix"),
        ("s3://bkt/shards/v1/t_part0.tar", "http://h/", "must be allowed"),
        ("s3://bkt/shards/v1/t_part0.tar", "s3://bkt/shards", ""),
        ("s3://bkt/shards/v1/t_part0.tar", "s3://bkt", ""),
        ("s3://bkt/shards/v1/t_part0.tar", "s3://other/shards", "must be allowed"),
        ("s3://bkt/shardsx/t_part0.tar", "s3://bkt/shards", "must be allowed"),  # whole segments
        ("s3://bkt/shards/../secret.tar", "s3://bkt/shards", "'..'"),
        ("s3://bkt/shards/%2e%2e/t.tar", "s3://bkt/shards", "no '%'"),  # keys are literal
        ("s3://k:hunter2@bkt/shards/t.tar", "s3://bkt/shards", "credentials do not belong"),
        ("s3://bkt:9000/shards/t.tar", "s3://bkt/shards", "not host:port"),
        ("s3://bkt", "s3://bkt", "no key"),
        ("s3://bkt/shards//t.tar", "s3://bkt/shards", "an empty segment"),  # not shards/t.tar
        ("s3://bkt/shards/t/", "s3://bkt/shards", "an empty segment"),
        ("s3://bkt/shards/t.tar?versionId=1", "s3://bkt/shards", "query"),
    ],
)
def test_agent_s3_sources_need_an_allowed_prefix(source: str, allowed: str, refused: str) -> None:
    policy = SourcePolicy.from_flags(allowed, False)
    if not refused:
        target = check_source(source, policy)
        assert (target.kind, target.host, target.url) == ("s3", "bkt", source)
        return
    with pytest.raises(SourceRefused, match=re.escape(refused)) as caught:
        check_source(source, policy)
    clean(str(caught.value))


@pytest.mark.parametrize(
    "entry", ["s3://", "s3://b:1/x", "s3://u@b/x", "s3://b/a/../x", "s3://b/a%2Fb"]
)
def test_bad_s3_allowed_sources_entries_are_flag_errors(entry: str) -> None:
    with pytest.raises(ValueError, match="--allowed_sources"):
        SourcePolicy.from_flags(entry, False)


# ---------------------------------------------------------------------------------------------
# moto


@pytest.mark.slow
def test_inputs_are_listed_and_fetched_in_the_builders_order(s3: S3Bucket, tmp_path: Path) -> None:
    url = put_tree(s3.fs, "inputs/order", TREE)
    local = write_tree(tmp_path / "local", TREE)
    expected = [str(p.relative_to(local)) for p in list_input_files(local)]
    assert expected == ["B", "a/x", "a.txt", "b/part-00001", "d/e/f", "\u00e9t\u00e9"]
    listed = sources.list_inputs(url + "/")
    assert relative(listed, url) == expected
    assert [f.size for f in listed] == [len(TREE[name]) for name in expected]
    # the local lister is list_input_files itself
    assert [f.url for f in sources.list_inputs(str(local))] == [
        str(p) for p in list_input_files(local)
    ]
    fetched = sources.fetch_inputs(url, tmp_path / "fetched")
    assert fetched == list_input_files(tmp_path / "fetched")  # same files, same order
    assert [p.read_bytes() for p in fetched] == [TREE[name] for name in expected]
    assert not [p for p in (tmp_path / "fetched").rglob("*") if p.name.startswith(".")]
    # a file as the input, and small files read whole
    assert sources.list_inputs(f"{url}/a.txt") == [sources.InputFile(f"{url}/a.txt", 1)]
    assert sources.list_inputs(f"{url}/_SUCCESS") == []
    assert sources.read_bytes(f"{url}/d/e/f", 5) == b"55555"
    with pytest.raises(BuildError, match=re.escape(f"{url}/d/e/f: 5 bytes, more than the 4")):
        sources.read_bytes(f"{url}/d/e/f", 4)


@pytest.mark.slow
def test_a_parameter_server_save_in_s3_builds_with_its_empty_shards(
    s3: S3Bucket, tmp_path: Path
) -> None:
    """cube-builder -input_format paddle_ps on s3://: the save is fetched with its empty part
    files (an empty delta's table folder holds nothing else), the table found as locally."""
    from test_builder import build_args, run_builder
    from test_builder_paddle_ps import CTR_FLAGS, DATA

    for save in ("delta", "delta_empty"):
        folder = DATA / "ctr_common_adagrad" / save
        tree = {
            str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()
        }
        url = put_tree(s3.fs, f"saves/{save}", tree)
        for where, source in (("local", folder), ("s3", url)):
            # build_args str()s its input: an s3:// URL (not a Path: it would lose a '/') too
            out = tmp_path / where / save
            args = build_args(source, out, 2, allow_empty="true", **CTR_FLAGS)  # type: ignore[arg-type]
            done = run_builder(*args)
            assert done.returncode == 0, done.stderr
    local, fetched = (output_digests(tmp_path / where) for where in ("local", "s3"))
    assert local == fetched and len(local) == 2 * (2 * 4 + 2)


@pytest.mark.slow
def test_the_transfer_mirrors_a_parameter_server_save_with_its_empty_shards(
    s3: S3Bucket, tmp_path: Path
) -> None:
    """cube-transfer with source_format paddle_fleet: a Fleet line's input (`.../000`, the
    table folder) is mirrored as its save directory, empty part files included, so an empty
    delta keeps its table folder and the builder finds it; a save over http is refused."""
    from test_builder_paddle_ps import DATA

    from cube.transfer.build_runner import BuildRunner

    folder = DATA / "ctr_common_adagrad" / "delta_empty"
    tree = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert not any(tree[name] for name in tree if name.startswith("000/"))  # all empty
    url = put_tree(s3.fs, "models/20261128/delta-2", tree)
    cfg = parse_config(
        "[default]\ndict_name: d\nwget_port: 0\ndonefile_address: /x\noutput_address: o\n"
        f"tmp_address: {tmp_path}\nshard_num: 1\nsource_format: paddle_fleet\n"
        "builder_flags: -paddle_config /c\n"
        "[cube_agent]\nagent0_0: 127.0.0.1:1\ncube0_0: 127.0.0.1:2:/d\n",
        "t.conf",
        tmp_path,
    )
    runner = BuildRunner(cfg)
    source = runner.build_input(f"{url}/000")
    assert source == url
    mirror = tmp_path / "mirror"
    where = asyncio.run(runner._fetch(source, mirror, cfg.paddle_saves))
    assert where == str(mirror)
    mirrored = sorted(str(p.relative_to(mirror)) for p in mirror.rglob("*") if p.is_file())
    assert mirrored == sorted(tree)
    with pytest.raises(SourceUnavailable, match="a parameter-server save is read from a local "
                       "path, s3:// or webhdfs://, not over http"):  # fmt: skip
        asyncio.run(runner._fetch("http://127.0.0.1:1/models/20261128/base", mirror, True))


@pytest.mark.slow
def test_missing_objects_and_buckets(s3: S3Bucket, tmp_path: Path) -> None:
    missing = f"s3://{BUCKET}/inputs/never-written"
    with pytest.raises(BuildError, match=f"^{re.escape(missing)}: not found$"):
        sources.list_inputs(missing)
    with pytest.raises(BuildError, match=f"^{re.escape(missing)}/x: not found$"):
        sources.fetch_input(f"{missing}/x", tmp_path / "x")
    assert not list(tmp_path.iterdir())  # nothing half-written left behind
    with pytest.raises(BuildError, match="s3://no-such-bucket/in: the bucket does not exist"):
        sources.list_inputs("s3://no-such-bucket/in")
    # the transfer: a donefile not written yet is empty, a missing input names its URL
    assert asyncio.run(read_donefile(f"s3://{BUCKET}/donefile-none", "base.txt")) == ""
    with pytest.raises(SourceUnavailable, match="the bucket does not exist"):
        asyncio.run(read_donefile("s3://no-such-bucket/donefile", "base.txt"))
    with pytest.raises(SourceUnavailable, match=f"^input {re.escape(missing)}: not found$"):
        mirror_input(missing, tmp_path / "mirror")
    put_tree(s3.fs, "inputs/only-empty", {"_SUCCESS": b"", ".x": b"x"})
    with pytest.raises(SourceUnavailable, match="no input files"):
        mirror_input(f"s3://{BUCKET}/inputs/only-empty", tmp_path / "mirror")


@pytest.mark.slow
def test_donefile_lines_and_inputs_from_s3(s3: S3Bucket, tmp_path: Path) -> None:
    address = f"s3://{BUCKET}/donefile-poll"
    assert asyncio.run(read_donefile(address, "base.txt")) == ""  # not written yet
    first = '{"id": "100", "key": "100", "input": "inputs/100"}\n'
    s3.fs.pipe_file(f"{BUCKET}/donefile-poll/base.txt", first.encode())
    assert asyncio.run(read_donefile(address + "/", "base.txt")) == first
    second = first + '{"id": "200", "key": "200", "input": "inputs/200"}\n'
    s3.fs.pipe_file(f"{BUCKET}/donefile-poll/base.txt", second.encode())  # "appended"
    assert (
        asyncio.run(read_donefile(address, "base.txt")).splitlines()[1].startswith('{"id": "200"')
    )
    # the line's relative input resolves under the donefile's prefix and is mirrored
    source = resolve_input(address, "inputs/100")
    put_tree(s3.fs, "donefile-poll/inputs/100", TREE)
    names = mirror_input(source, tmp_path / "mirror")
    assert names == ["B", "a/x", "a.txt", "b/part-00001", "d/e/f", "\u00e9t\u00e9"]
    assert (tmp_path / "mirror" / "d" / "e" / "f").read_bytes() == b"55555"
    assert not (tmp_path / "mirror.part").exists()


def _policy(
    attempts: int = 3, backoff: float = 0.05, timeout: float = 30.0, io_timeout: float = 5.0
) -> FetchPolicy:
    allowed = SourcePolicy.from_flags(f"s3://{BUCKET}/shards", False)
    return FetchPolicy(attempts, backoff, timeout=timeout, io_timeout=io_timeout, sources=allowed)


@pytest.mark.slow
def test_agent_fetches_s3_objects_resuming_from_the_part(s3: S3Bucket, tmp_path: Path) -> None:
    data = os.urandom(remote.BLOCK + 300_000)  # two ranged reads
    s3.fs.pipe_file(f"{BUCKET}/shards/v1/t_part0.tar", data)
    s3.fs.pipe_file(f"{BUCKET}/shards/v1/t_part0.tar.md5",
                    f"{hashlib.md5(data).hexdigest()}  t_part0.tar\n".encode())  # fmt: skip
    source = f"s3://{BUCKET}/shards/v1/t_part0.tar"
    part = tmp_path / "t_part0.tar.part"
    part.write_bytes(data[:1_000_000])  # an earlier attempt's bytes
    seen: list[int] = []

    def progress(done: int, total: int | None) -> None:
        seen.append(done)

    policy = _policy()
    got = asyncio.run(fetch_file(source, part, size=len(data), policy=policy, progress=progress))
    assert got == len(data) and part.read_bytes() == data
    assert seen[0] == 1_000_000 + policy.chunk  # its first write went on from the offset
    md5 = asyncio.run(fetch_md5(source, tmp_path / "t_part0.tar.md5", _policy()))
    assert md5 == hashlib.md5(data).hexdigest()
    # a size the object does not have: refused before the first byte, nothing kept
    part.unlink()
    with pytest.raises(FetchError, match="has 8688608 bytes, the request says size 5"):
        asyncio.run(fetch_file(source, part, size=5, policy=_policy()))
    assert not part.exists()


@pytest.mark.slow
def test_agent_s3_errors_are_short_and_final(s3: S3Bucket, tmp_path: Path) -> None:
    part = tmp_path / "x.part"
    missing = f"s3://{BUCKET}/shards/v1/gone.tar"
    started = time.monotonic()
    with pytest.raises(FetchError, match=f"^source {re.escape(missing)}: not found$") as caught:
        asyncio.run(fetch_file(missing, part, size=None, policy=_policy(backoff=5.0)))
    assert not caught.value.retryable and time.monotonic() - started < 5  # no attempt again
    assert not part.exists()
    with pytest.raises(SourceRefused, match="must be allowed"):
        asyncio.run(fetch_file(f"s3://{BUCKET}/elsewhere/x.tar", part, size=None,
                               policy=_policy()))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# credentials and endpoints that do not work


@pytest.mark.slow
def test_bad_credentials_are_a_clear_error_without_the_secret(tmp_path: Path) -> None:
    """Against a moto server that authenticates every request: keys it does not know are
    refused (403) as AWS refuses them."""
    with (
        MotoServer(tmp_path / "moto-auth.log", auth=True) as strict,
        aws_environment(strict.url, tmp_path),
    ):
        with pytest.raises(SourceUnavailable) as unread:
            asyncio.run(read_donefile(f"s3://{BUCKET}/donefile", "base.txt"))
        with pytest.raises(BuildError) as unlisted:
            sources.list_inputs(f"s3://{BUCKET}/inputs")
        with pytest.raises(FetchError) as unfetched:
            policy = _policy(backoff=5.0)
            asyncio.run(fetch_file(f"s3://{BUCKET}/shards/t.tar", tmp_path / "t.part",
                                   size=None, policy=policy))  # fmt: skip
    assert str(unread.value) == (
        f"s3://{BUCKET}/donefile/base.txt: access denied (check AWS_ACCESS_KEY_ID/"
        "AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN or AWS_PROFILE, and the permissions)"
    )
    assert str(unlisted.value).startswith(f"s3://{BUCKET}/inputs: access denied (check AWS_")
    assert "access denied" in str(unfetched.value) and not unfetched.value.retryable
    for error in (unread, unlisted, unfetched):
        clean(str(error.value))


def test_unreachable_endpoints_fail_fast_and_say_where(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    with aws_environment(f"http://127.0.0.1:{port}", tmp_path, AWS_MAX_ATTEMPTS="1"):
        started = time.monotonic()
        with pytest.raises(SourceUnavailable) as unread:
            asyncio.run(read_donefile(f"s3://{BUCKET}/donefile", "base.txt", timeout=20))
        assert time.monotonic() - started < 20
    assert str(unread.value) == (
        f"s3://{BUCKET}/donefile/base.txt: cannot connect to the S3 endpoint "
        f"http://127.0.0.1:{port}"
    )
    webhdfs = f"webhdfs://127.0.0.1:{port}/data"
    started = time.monotonic()
    with pytest.raises(BuildError, match=f"^{re.escape(webhdfs)}/in: cannot connect$"):
        sources.list_inputs(f"{webhdfs}/in")
    with pytest.raises(SourceUnavailable, match=f"^{re.escape(webhdfs)}/base.txt: cannot conn"):
        asyncio.run(read_donefile(webhdfs, "base.txt"))
    assert time.monotonic() - started < 10


TIMEOUT = 1.0  # the configured timeout of each call below
SLACK = 10.0  # what a loaded 2-core machine may add (a first S3 client, fsspec's 1 s polls; 4.1 s
# seen at load 17); unbounded, these calls ran for minutes (313 s reported)


def every_remote_call(base: str, tmp: Path) -> dict[str, Callable[[], object]]:
    """Each kind of remote call our code makes on `base` (s3://bucket or webhdfs://nn:port),
    every one configured to end within TIMEOUT seconds and its I/O timeout left long (60 s),
    so that only a bound on the whole call can end it in time."""
    (tmp / "local.tar").write_bytes(b"x" * 100)

    def on(url: str, method: str, **kwargs: object) -> object:
        fs, path = remote.open_fs(url, 60.0)
        return remote.call(fs, method, path, timeout=TIMEOUT, **kwargs)

    calls: dict[str, Callable[[], object]] = {
        "builder listing": lambda: sources.list_inputs(f"{base}/in", TIMEOUT),
        "builder fetch (listing first)": lambda: sources.fetch_inputs(
            f"{base}/in", tmp / "fetched", TIMEOUT
        ),
        "builder fetch of one file": lambda: sources.fetch_input(
            f"{base}/in/x", tmp / "x", TIMEOUT
        ),
        "delete list": lambda: sources.read_delete_list(f"{base}/delete", 1000, TIMEOUT),
        "size": lambda: remote.Reader(f"{base}/in/x", 60.0, deadline=time.monotonic() + TIMEOUT),
        "exists/info": lambda: on(f"{base}/in", "info"),
        "listing": lambda: remote.find_files(*remote.open_fs(f"{base}/in", 60.0), TIMEOUT),
        "ranged read": lambda: on(f"{base}/in/x", "cat_file", start=0, end=10),
        "small file": lambda: remote.read_bytes(f"{base}/k", 100, TIMEOUT, 60.0),
        "donefile": lambda: asyncio.run(read_donefile(f"{base}/d", "base.txt", TIMEOUT)),
        "upload": lambda: remote.put_file(str(tmp / "local.tar"), f"{base}/up/t.tar", TIMEOUT),
    }
    if base.startswith("s3://"):
        policy = _policy(timeout=TIMEOUT, io_timeout=60.0, attempts=1)
        calls["agent download"] = lambda: asyncio.run(fetch_file(
            f"{base}/shards/t.tar", tmp / "t.part", size=None, policy=policy))  # fmt: skip
    return calls


def assert_each_ends_in_time(calls: dict[str, Callable[[], object]], shown: str) -> None:
    """Every call fails as timed out, in our words naming the source where the caller does,
    within TIMEOUT + SLACK seconds."""
    for kind, attempt in calls.items():
        started = time.monotonic()
        with pytest.raises(Exception) as failed:
            attempt()
        took = time.monotonic() - started
        message = str(failed.value)
        assert isinstance(failed.value, (BuildError, remote.RemoteError, SourceUnavailable,
                                         FetchError)), (kind, repr(failed.value))  # fmt: skip
        assert re.search("timed out|not fetched within", message), (kind, message)
        if not isinstance(failed.value, remote.RemoteError):
            assert shown in message, (kind, message)
        clean(message)
        assert took < TIMEOUT + SLACK, (kind, took)


@pytest.mark.slow  # real time: each call waits out its timeout
def test_every_s3_call_ends_within_its_timeout_on_a_stalled_endpoint(tmp_path: Path) -> None:
    """Timeouts are wall time, whatever botocore's and s3fs's own retries would add: listings,
    sizes, reads, donefiles, delete lists, uploads and the agent's downloads against an
    endpoint that accepts and never answers all fail as timed out within their timeout (the
    builder's listing took 313 s with -fetch_timeout 5: it had a timeout of its own)."""
    with (
        SilentEndpoint() as silent,
        aws_environment(f"http://127.0.0.1:{silent.port}", tmp_path, AWS_MAX_ATTEMPTS="5"),
    ):
        assert_each_ends_in_time(every_remote_call(f"s3://{BUCKET}", tmp_path), f"s3://{BUCKET}/")


@pytest.mark.slow  # real time: each call waits out its timeout
@pytest.mark.parametrize("drip", [b"", b"HTTP/1.1 200 OK\r\n" + b"X-Slow: 1\r\n" * 100])
def test_every_webhdfs_call_ends_within_its_timeout_on_a_stalled_namenode(
    tmp_path: Path, drip: bytes
) -> None:
    """The same for WebHDFS (requests, which has no total timeout): a namenode that accepts
    and never answers, and one that answers a byte every 0.2 s (no read ever times out), are
    cut at the call's deadline (a call waited for its I/O timeout, or for ever)."""
    with SilentEndpoint(drip) as silent:
        base = f"webhdfs://alice@127.0.0.1:{silent.port}"
        shown = f"webhdfs://***@127.0.0.1:{silent.port}/"  # the user is redacted too
        assert_each_ends_in_time(every_remote_call(base, tmp_path), shown)


# ---------------------------------------------------------------------------------------------
# WebHDFS (a fake namenode: no HDFS runs here)


def test_webhdfs_inputs_and_donefiles(tmp_path: Path) -> None:
    write_tree(tmp_path / "hdfs" / "in", TREE)
    (tmp_path / "hdfs" / "donefile").mkdir()
    (tmp_path / "hdfs" / "donefile" / "base.txt").write_text('{"id": "1"}\n')
    (tmp_path / "hdfs" / "denied").mkdir()
    namenode = FakeNamenode(tmp_path / "hdfs")
    try:
        base = f"webhdfs://alice@127.0.0.1:{namenode.port}"
        listed = sources.list_inputs(f"{base}/in")
        expected = [str(p.relative_to(tmp_path / "hdfs" / "in"))
                    for p in list_input_files(tmp_path / "hdfs" / "in")]  # fmt: skip
        assert relative(listed, f"{base}/in") == expected
        fetched = sources.fetch_inputs(f"{base}/in", tmp_path / "fetched")
        assert [p.read_bytes() for p in fetched] == [TREE[name] for name in expected]
        assert set(namenode.users) == {"alice"}  # the URL's user is the HDFS user
        assert asyncio.run(read_donefile(f"{base}/donefile", "base.txt")) == '{"id": "1"}\n'
        assert asyncio.run(read_donefile(f"{base}/donefile", "patch.txt")) == ""
        shown = f"webhdfs://***@127.0.0.1:{namenode.port}"  # no user either, as redact shows
        with pytest.raises(BuildError, match=f"^{re.escape(shown)}/nothing: not found$"):
            sources.list_inputs(f"{base}/nothing")
        with pytest.raises(BuildError, match="denied/x: access denied \\(check the user") as no:
            sources.list_inputs(f"{base}/denied/x")
        clean(str(no.value))
    finally:
        namenode.close()
