"""hdfs:// and afs:// through the Hadoop client command (cube/hadoop.py), against the real
Hadoop FsShell: the client jars of the pyspark wheel (`java -cp '<jars>/*'
org.apache.hadoop.fs.FsShell`), on the local file system. The URLs keep their schemes: a
core-site.xml maps hdfs:// and afs:// to Hadoop's ViewFileSystemOverloadScheme, whose mount
table for the namenode `nn` falls back to a local directory, so that the client lists, reads
and writes local files under hdfs://nn:9000/... and prints them as such.

Failure injection (a client that hangs, one that fails once) uses a Hadoop home whose
bin/hadoop is a script; no test reads output written by hand in place of the client's.
A JVM starts for every command (1 to 4 s on a loaded machine): the tests run few of them.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cube import hadoop, remote
from cube.builder import sources
from cube.builder.build import BuildError, list_input_files
from cube.seqfile import SequenceFileWriter
from cube.transfer.donefile import SourceUnavailable, mirror_input, read_donefile
from cube.transfer.local import command
from cube.values import ValueColumn

pytestmark = pytest.mark.slow  # every test but the parsing ones starts the client

PASSWORD = "hunter2-ugi-secret"
CONFIGS = f"fs.default.name=hdfs://nn:9000,hadoop.job.ugi=alice,{PASSWORD}"
DIM = 4

CORE_SITE = """<?xml version="1.0"?>
<configuration>
<property><name>fs.hdfs.impl</name>
  <value>org.apache.hadoop.fs.viewfs.ViewFileSystemOverloadScheme</value></property>
<property><name>fs.afs.impl</name>
  <value>org.apache.hadoop.fs.viewfs.ViewFileSystemOverloadScheme</value></property>
<property><name>fs.viewfs.mounttable.nn.linkFallback</name><value>file://{root}</value></property>
</configuration>
"""


def _jars() -> Path | None:
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        return None
    jars = Path(spec.origin).parent / "jars"
    return jars if any(jars.glob("hadoop-client-api-*.jar")) else None


JARS = _jars()
JAVA = shutil.which("java")


@dataclass(frozen=True)
class Cluster:
    root: Path  # what hdfs://nn:9000/ and afs://nn/ are
    command: str  # CUBE_HADOOP_CMD


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if JAVA is None or JARS is None:
        pytest.skip("needs java and the Hadoop client jars of the pyspark wheel")
    base = tmp_path_factory.mktemp("hdfs")
    root = base / "root"
    root.mkdir()
    conf = base / "conf"
    conf.mkdir()
    (conf / "core-site.xml").write_text(CORE_SITE.format(root=root))
    # a short-lived JVM: the client compiler only and the serial collector start fastest
    line = (f"{JAVA} -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto "
            f"-cp '{conf}:{JARS}/*' org.apache.hadoop.fs.FsShell")  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(hadoop.ENV_COMMAND, line)
        patch.setenv(hadoop.ENV_CONFIGS, CONFIGS)
        patch.delenv(hadoop.ENV_HOME, raising=False)
        yield Cluster(root, line)


def clean(message: str) -> None:
    assert PASSWORD not in message and "alice" not in message, message


def seqfile(path: Path, keys: np.ndarray, values: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    column = ValueColumn.fixed(np.ascontiguousarray(values, np.float32).view(np.uint8), DIM * 4)
    with SequenceFileWriter(path) as writer:
        writer.write_batch(np.asarray(keys, dtype=np.uint64), column)


def input_tree(root: Path, keys: np.ndarray, values: np.ndarray) -> Path:
    """Three SequenceFiles (one in a sub-directory, one with a space and a '#' in its name),
    an empty _SUCCESS and a hidden file."""
    third = len(keys) // 3
    seqfile(root / "part-00000", keys[:third], values[:third])
    seqfile(root / "part 00001 #b", keys[third : 2 * third], values[third : 2 * third])
    seqfile(root / "sub dir" / "part-00002", keys[2 * third :], values[2 * third :])
    (root / "_SUCCESS").write_bytes(b"")
    (root / ".part-00000.crc").write_bytes(b"not a SequenceFile")
    return root


def table(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return np.arange(1, n + 1, dtype=np.uint64), rng.standard_normal((n, DIM), dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# settings (no client run)


@pytest.mark.parametrize(
    "text, configs",
    [
        ("", {}),
        ("fs.default.name=hdfs://nn:9000", {"fs.default.name": "hdfs://nn:9000"}),
        (CONFIGS, {"fs.default.name": "hdfs://nn:9000", "hadoop.job.ugi": f"alice,{PASSWORD}"}),
        ("hadoop.job.ugi=u,p=w,d, dfs.replication = 2",
         {"hadoop.job.ugi": "u,p=w,d", "dfs.replication": "2"}),
        ('{"hadoop.job.ugi": "u,x.y=z", "dfs.replication": 2}',
         {"hadoop.job.ugi": "u,x.y=z", "dfs.replication": "2"}),
    ],
)  # fmt: skip
def test_client_settings_are_read_as_paddle_gives_them(text: str, configs: dict[str, str]) -> None:
    assert hadoop.parse_configs(text) == configs


@pytest.mark.parametrize("text", [f"{PASSWORD},dfs.x=c", "{not json", '["dfs.x=c"]'])
def test_unreadable_settings_are_refused_without_quoting_them(text: str) -> None:
    with pytest.raises(ValueError) as refused:
        hadoop.parse_configs(text)
    assert PASSWORD not in str(refused.value) and "dfs.x" not in str(refused.value)


@pytest.mark.parametrize(
    "url, problem",
    [
        ("hdfs://alice:pw@nn:9000/in", "a user or password does not belong in an hdfs:// URL"),
        ("afs://alice@nn/in", "set hadoop.job.ugi"),
        ("hdfs://nn:9000/in?x=1", "query or fragment"),
    ],
)
def test_hadoop_urls_are_checked(url: str, problem: str) -> None:
    assert problem in (remote.check_url(url) or "")
    assert "pw" not in (remote.check_url(url) or "")


def test_hadoop_urls_with_and_without_a_cluster() -> None:
    for url in ("hdfs://nn:9000/in", "hdfs:/in", "hdfs:///in", "AFS://nn/in", "afs:/user/x"):
        assert remote.is_remote(url) and remote.check_url(url) is None, url
    assert remote.path_of("hdfs:/in/x") == "/in/x"
    assert not remote.is_remote("hdfs:in")  # a relative path with a colon, not a URL


def test_without_a_client_the_error_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (hadoop.ENV_HOME, hadoop.ENV_COMMAND):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(BuildError, match="hdfs://nn:9000/in: no Hadoop client configured: set "
                       "HADOOP_HOME"):  # fmt: skip
        sources.list_inputs("hdfs://nn:9000/in")
    monkeypatch.setenv(hadoop.ENV_HOME, "/nonexistent/hadoop")
    with pytest.raises(remote.RemoteError, match="/nonexistent/hadoop/bin/hadoop is not there"):
        remote.require("afs://nn/in")


# ---------------------------------------------------------------------------------------------
# the real client


def test_listing_an_input_keeps_the_builders_files_and_order(cluster: Cluster) -> None:
    local = input_tree(cluster.root / "in", *table(300, 1))
    want = [(str(p.relative_to(local)), p.stat().st_size) for p in list_input_files(local)]
    started = time.monotonic()
    found = sources.list_inputs("hdfs://nn:9000/in")
    assert [(f.url, f.size) for f in found] == [(f"hdfs://nn:9000/in/{n}", s) for n, s in want]
    assert "part 00001 #b" in [n for n, _ in want]  # spaces and '#' taken literally
    # one file: itself
    single = sources.list_inputs("afs://nn/in/part-00000")
    assert [(f.url, f.size) for f in single] == [("afs://nn/in/part-00000", want[0][1])]
    # no cluster in the URL: fs.default.name's; a scheme the client has no cluster for: said so
    with pytest.raises(BuildError, match=r"^afs:/in: the Hadoop client does not serve this URL's"):
        sources.list_inputs("afs:/in")
    assert time.monotonic() - started < 45


def test_fetching_an_input_copies_exactly_what_the_listing_said(cluster: Cluster) -> None:
    local = input_tree(cluster.root / "fetch", *table(300, 2))
    dest = cluster.root.parent / "mirror"
    names = mirror_input("hdfs://nn:9000/fetch", dest)  # the transfer's mirror of an input
    want = [str(p.relative_to(local)) for p in list_input_files(local)]
    assert names == want
    for name in names:
        assert (dest / name).read_bytes() == (local / name).read_bytes()
    assert not list(dest.rglob(".hadoop-get-*")) and not (dest.parent / "mirror.part").exists()
    # one file streamed from an offset (the Spark engine's fetch of its file): one run
    url, size = "afs://nn/fetch/part-00000", (local / "part-00000").stat().st_size
    with remote.Reader(url, 30.0, block=100, size=size, deadline=time.monotonic() + 60) as reader:
        blocks = list(reader.blocks(7))
    assert b"".join(blocks) == (local / "part-00000").read_bytes()[7:]
    assert max(len(b) for b in blocks) == 100


def test_donefiles_are_read_and_a_missing_one_is_empty(cluster: Cluster) -> None:
    (cluster.root / "donefile").mkdir()
    line = '{"id": "1700000000", "key": "1700000000", "input": "inputs/1700000000"}\n'
    (cluster.root / "donefile" / "base.txt").write_text(line)
    assert asyncio.run(read_donefile("hdfs://nn:9000/donefile", "base.txt")) == line
    assert asyncio.run(read_donefile("hdfs:/donefile", "patch.txt")) == ""  # fs.default.name
    with pytest.raises(remote.RemoteError, match="more than the 10 bytes allowed"):
        remote.read_bytes("hdfs://nn:9000/donefile/base.txt", 10, 30.0)


def test_a_missing_input_is_said_in_our_words(cluster: Cluster) -> None:
    with pytest.raises(BuildError) as missing:
        sources.list_inputs("hdfs://nn:9000/no/such/input")
    assert str(missing.value) == "hdfs://nn:9000/no/such/input: not found"
    clean(str(missing.value))


def test_an_upload_writes_the_file_whole(cluster: Cluster, tmp_path: Path) -> None:
    local = tmp_path / "emb_part0.tar"
    local.write_bytes(os.urandom(5000))
    remote.put_file(str(local), "hdfs://nn:9000/builds/1_1/emb_part0.tar", 60.0)
    assert (cluster.root / "builds" / "1_1" / "emb_part0.tar").read_bytes() == local.read_bytes()
    assert not list((cluster.root / "builds" / "1_1").glob("*COPYING*"))


def md5s(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in directory.rglob("*.tar")}


def test_cube_builder_builds_from_hdfs_what_it_builds_from_disk(
    cluster: Cluster, tmp_path: Path
) -> None:
    local = input_tree(cluster.root / "builder-input", *table(3000, 3))
    builder = command("cube-builder")
    common = ["-dict_name", "emb", "-shard_num", "2", "-only_build=false",
              "-cur_version", "1700000000", "-quiet", "-workers", "1"]  # fmt: skip
    # the settings as a flag, from a flagfile (the ugi's password off the command line)
    flagfile = tmp_path / "hadoop.flags"
    flagfile.write_text(f"--hadoop_configs={CONFIGS}\n")
    env = {k: v for k, v in os.environ.items() if k != hadoop.ENV_CONFIGS}
    for name, source in (("from-disk", str(local)), ("from-hdfs", "hdfs://nn:9000/builder-input")):
        out = tmp_path / name
        run = subprocess.run([builder, *common, "-input_path", source, "-output_path", str(out),
                              "--flagfile", str(flagfile)],
                             capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
        assert run.returncode == 0, run.stderr
    assert md5s(tmp_path / "from-hdfs") == md5s(tmp_path / "from-disk") != {}
    bad = subprocess.run([builder, *common, "-input_path", str(local), "-output_path",
                          str(tmp_path / "bad"), "-hadoop_configs", "nokey"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--hadoop_configs: piece 1 is not key=value" in bad.stderr
    assert not list((tmp_path / "from-hdfs").glob(".fetch-*"))  # the fetched input is removed


# ---------------------------------------------------------------------------------------------
# failure injection: a client that hangs, one that fails once


def fake_home(tmp_path: Path, script: str) -> Path:
    home = tmp_path / "hadoop"
    (home / "bin").mkdir(parents=True)
    hadoop_bin = home / "bin" / "hadoop"
    hadoop_bin.write_text("#!/bin/bash\n" + script)
    hadoop_bin.chmod(hadoop_bin.stat().st_mode | stat.S_IXUSR)
    return home


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")  # dead, not yet reaped by whoever adopted it


def test_a_hung_client_is_stopped_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """bin/hadoop records its arguments and its settings file, starts a child in its process
    group and never answers: the call fails as timed out soon after its bound, both processes
    are gone, the settings file is removed, and the password was never an argument."""
    seen = tmp_path / "seen"
    home = fake_home(tmp_path, f"""
printf '%s\\n' "$@" > {seen}/args
conf="$3"; stat -c %a "$conf" > {seen}/mode; cp "$conf" {seen}/conf.xml
sleep 300 & echo $! > {seen}/child
echo $$ > {seen}/leader
wait
""")  # fmt: skip
    seen.mkdir()
    monkeypatch.delenv(hadoop.ENV_COMMAND, raising=False)
    monkeypatch.setenv(hadoop.ENV_HOME, str(home))
    monkeypatch.setenv(hadoop.ENV_CONFIGS, CONFIGS)
    started = time.monotonic()
    with pytest.raises(SourceUnavailable) as hung:
        asyncio.run(read_donefile("hdfs://nn:9000/donefile", "base.txt", timeout=2.0))
    took = time.monotonic() - started
    assert str(hung.value).startswith("hdfs://nn:9000/donefile/base.txt: timed out"), hung.value
    clean(str(hung.value))
    assert took < 2.0 + hadoop.STOP_GRACE + 3.0
    args = (seen / "args").read_text().split("\n")
    assert args[:2] == ["fs", "-conf"] and args[3:5] == ["-cat", "hdfs://nn:9000/donefile/base.txt"]
    assert PASSWORD not in (seen / "args").read_text()
    assert (seen / "mode").read_text().strip() == "600"
    assert PASSWORD in (seen / "conf.xml").read_text()  # where the client reads it
    assert not Path(args[2]).exists()  # removed after the run
    for name in ("leader", "child"):
        assert gone(int((seen / name).read_text())), name


def test_a_failure_that_may_pass_is_tried_again(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first run fails as a namenode that refuses connections does (what the client
    prints on stderr then), the second is the real client; a missing file is not retried."""
    runs = tmp_path / "runs"
    (cluster.root / "retry").mkdir(exist_ok=True)
    (cluster.root / "retry" / "base.txt").write_text("x\n")
    home = fake_home(tmp_path, f"""
echo run >> {runs}
if [ "$(wc -l < {runs})" = 1 ]; then
  echo 'cat: Call From h to nn:9000 failed: java.net.ConnectException: Connection refused' >&2
  exit 1
fi
shift  # "fs": the real bin/hadoop's subcommand
exec {cluster.command} "$@"
""")  # fmt: skip
    monkeypatch.delenv(hadoop.ENV_COMMAND)
    monkeypatch.setenv(hadoop.ENV_HOME, str(home))
    assert remote.read_bytes("hdfs://nn:9000/retry/base.txt", 100, 60.0) == b"x\n"
    assert runs.read_text().count("run") == 2
    runs.unlink()
    runs.write_text("run\n")  # past the first failure: the real client from now on
    with pytest.raises(remote.RemoteError, match=r"^not found$") as missing:
        remote.read_bytes("hdfs://nn:9000/retry/none.txt", 100, 60.0)
    assert missing.value.missing and runs.read_text().count("run") == 2


def test_the_transfer_mirrors_a_parameter_server_save_from_afs(
    cluster: Cluster, tmp_path: Path
) -> None:
    """cube-transfer with source_format paddle_fleet and its donefile on afs://: a Fleet line's
    input (`.../000`, the table folder) is mirrored as its save directory, the empty part files
    included (an empty delta's table folder is how the builder finds it)."""
    from test_builder_paddle_ps import DATA

    from cube.transfer.build_runner import BuildRunner
    from cube.transfer.config import parse_config

    folder = DATA / "ctr_common_adagrad" / "delta_empty"
    shutil.copytree(folder, cluster.root / "models" / "20261128" / "delta-2")
    want = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    cfg = parse_config(
        "[default]\ndict_name: d\nwget_port: 0\ndonefile_address: afs://nn/donefile\n"
        f"output_address: o\ntmp_address: {tmp_path}\nshard_num: 1\n"
        "source_format: paddle_fleet\nbuilder_flags: -paddle_config /c\n"
        "[cube_agent]\nagent0_0: 127.0.0.1:1\ncube0_0: 127.0.0.1:2:/d\n",
        "t.conf",
        tmp_path,
    )
    runner = BuildRunner(cfg)
    source = runner.build_input("afs://nn/models/20261128/delta-2/000")
    assert source == "afs://nn/models/20261128/delta-2"
    mirror = tmp_path / "mirror"
    assert asyncio.run(runner._fetch(source, mirror, cfg.paddle_saves)) == str(mirror)
    assert sorted(str(p.relative_to(mirror)) for p in mirror.rglob("*") if p.is_file()) == want
