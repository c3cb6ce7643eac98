"""One logging setup for every command (cube.logs): text by default, JSON lines on request."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

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
