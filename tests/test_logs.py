"""One logging setup for every command (cube.logs): text by default, JSON lines on request."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cube.logs import setup_logging

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow


def test_json_lines_carry_fields_extras_and_exceptions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_file = tmp_path / "logs" / "tool.log"
    setup_logging("cube-tool", "INFO", "json", log_file, tag="worker 1")
    log = logging.getLogger("cube.test")
    log.info("loaded %s", "1700000000", extra={"request_id": 42})
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")
    log.debug("not shown")
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert [line["message"] for line in lines] == ["loaded 1700000000", "failed"]
    first = lines[0]
    assert first["level"] == "INFO" and first["logger"] == "cube.test"
    assert first["program"] == "cube-tool" and first["role"] == "worker 1"
    assert first["request_id"] == 42 and first["time"].endswith("Z")
    assert "ValueError: bad" in lines[1]["exception"]
    assert capsys.readouterr().err.count("\n") == 2  # stderr as well


def test_text_is_the_default_and_a_bad_format_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging("cube-tool", logging.INFO)
    logging.getLogger("cube.test").warning("plain")
    assert "WARNING cube.test: plain" in capsys.readouterr().err
    setup_logging("cube-tool", logging.INFO, tag="worker 1")
    logging.getLogger("cube.test").info("tagged")
    assert LINE.fullmatch(capsys.readouterr().err.strip())
    with pytest.raises(ValueError, match="xml"):
        setup_logging("cube-tool", logging.INFO, "xml")


@pytest.mark.parametrize(
    "argv",
    [
        ["cube.server.main", "--port", "0", "--allow_empty", "--data_dir", "{tmp}/d"],
        ["cube.transfer.main", "-p", "0", "--config", "{tmp}/transfer.conf"],
    ],
)
def test_commands_take_log_format_json(tmp_path: Path, argv: list[str]) -> None:
    """What a command logs with --log_format json is JSON objects, one a line."""
    (tmp_path / "donefile").mkdir()  # the transfer refuses a donefile directory that is not
    (tmp_path / "transfer.conf").write_text(
        "[default]\ndict_name: d\nwget_port: 0\nshard_num: 1\n"
        f"donefile_address: {tmp_path}/donefile\noutput_address: {tmp_path}/out\n"
        f"tmp_address: {tmp_path}/tmp\n[cube_agent]\nagent0_0: 127.0.0.1:1\n"
        "cube0_0: 127.0.0.1:2:/d\n"
    )
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    process = subprocess.Popen(
        [sys.executable, "-m", *args, "--log_format", "json"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert process.stderr is not None  # a pipe
        first = process.stderr.readline()  # the first log line
    finally:
        process.terminate()
        process.wait(15)
    entry = json.loads(first)
    assert entry["program"] in ("cube-server", "cube-transfer") and entry["message"]


# The one shape of a text log line (cube.logs.TEXT_FORMAT): time, LEVEL, logger name (with the
# process's role and pid where one command runs several processes), message.
LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL)"
    r" [A-Za-z_][\w.]*( \[[\w ]+ pid \d+\])?: \S.*"
)


def _publish(donefile: Path, root: Path, version: str, base: str) -> None:
    """A SequenceFile of 500 keys and its donefile line: a base when `version` is `base`."""
    from cube.donefile import BASE_FILE, PATCH_FILE, append_line, format_line
    from cube.seqfile import SequenceFileWriter
    from cube.values import ValueColumn

    keys = np.arange(1, 501, dtype=np.uint64)
    values = np.full((500, 4), int(version) % 97, np.float32)
    source = root / "input" / version
    source.mkdir(parents=True)
    with SequenceFileWriter(source / "part-00000") as writer:
        writer.write_batch(keys, ValueColumn.fixed(values.view(np.uint8).reshape(-1), 16))
    name = BASE_FILE if version == base else PATCH_FILE
    append_line(donefile / name, format_line(version, base, str(source)))


@pytest.mark.slow
def test_a_normal_cube_local_run_logs_one_format_and_no_warning(tmp_path: Path) -> None:
    """`cube-local up`, a base and a delta rolled out, `cube-local down`: every line of every
    server's, agent's and the transfer's log has the one format, and none is a WARNING (an
    empty data dir waiting for its agent, agents still starting: INFO)."""
    from helpers.procs import kill_processes_under

    local = [str(Path(sys.executable).parent / "cube-local")]
    cluster, donefile = tmp_path / "cluster", tmp_path / "donefile"
    donefile.mkdir()

    def run(*args: str, timeout: float = 180) -> str:
        done = subprocess.run(
            [*local, *args, "--dir", str(cluster)], capture_output=True, text=True,
            timeout=timeout, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    try:
        run("up", "--donefile", str(donefile), "--poll_interval", "0.2")
        _publish(donefile, tmp_path, "1700000000", "1700000000")
        run("wait", "--version", "1700000000")
        _publish(donefile, tmp_path, "1700000100", "1700000000")
        run("wait", "--version", "1700000000_1700000100")
        run("down")
    finally:
        kill_processes_under(tmp_path)
    logs = sorted((cluster / "logs").glob("*.log"))
    assert {p.stem.rstrip("0123456789_") for p in logs} == {"server", "agent", "transfer"}
    lines = [(p.name, line) for p in logs for line in p.read_text().splitlines()]
    assert len(lines) > 20
    bare = [(name, line) for name, line in lines if not LINE.fullmatch(line)]
    assert not bare, bare[:5]
    warned = [(name, line) for name, line in lines if LINE.fullmatch(line).group(1) != "INFO"]  # type: ignore[union-attr]
    assert not warned, warned[:5]
