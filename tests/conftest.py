"""Fixtures shared by the test modules."""

from __future__ import annotations

import cube  # noqa: F401  (first: it turns gRPC's fork handlers off before grpc is imported)

# isort: split

import contextlib
import logging
import multiprocessing.process
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import trustme
from helpers.agent_helpers import AgentProc, HttpFileServer
from helpers.procs import ServerProc, start_server
from helpers.s3_helpers import MotoServer

from cube.processes import free_port

# py4j (PySpark's bridge) logs at INFO from an atexit hook, after pytest has closed the streams
# it captured: a "--- Logging error ---" traceback after the summary. Its INFO lines say nothing
# the tests need.
logging.getLogger("py4j").setLevel(logging.WARNING)


class StartsAProcess(RuntimeError):
    """A test not marked slow started a process (make quick runs those tests)."""


@contextlib.contextmanager
def _no_process_unless_slow(item: pytest.Item) -> Iterator[None]:
    """`make quick` runs the tests not marked slow and must stay within a minute on 2 cores:
    a test that starts a process (a server, a CLI, a worker pool), itself or through a fixture
    of any scope, is marked `slow`. This turns the rule into a failure instead of a drift."""
    if item.get_closest_marker("slow"):
        yield
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise StartsAProcess(f"{item.nodeid} starts a process: mark it @pytest.mark.slow")

    with (
        mock.patch.object(subprocess.Popen, "__init__", refuse),
        mock.patch.object(multiprocessing.process.BaseProcess, "start", refuse),
    ):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _no_process_unless_slow(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_process_unless_slow(item):
        return (yield)


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """moto's S3 server, a process on a free loopback port, shared by the session's s3:// tests
    (each points the AWS environment at it for its own duration: s3_helpers.aws_environment)."""
    with MotoServer(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PEM files: a test CA (`ca`), a certificate for 127.0.0.1/localhost it signed (`cert`,
    `key`), and another CA that signed nothing of ours (`other`)."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = {k: root / f"{k}.pem" for k in ("ca", "cert", "key", "other")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    cert.private_key_pem.write_to_path(str(files["key"]))
    trustme.CA().cert_pem.write_to_path(str(files["other"]))
    return {k: str(v) for k, v in files.items()}


class Deployment:
    """One machine's cube-agent deployment in a test: a files dir that file servers serve, a
    deploy dir (`data/` inside), and what a test starts on demand: file servers, a cube-server
    on `data/`, agents. Everything started is stopped, by PID, at teardown (`close`)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.files = tmp / "files"
        self.files.mkdir()
        self.deploy = tmp / "deploy"
        self.data = self.deploy / "data"
        self.data.mkdir(parents=True)
        self.server: ServerProc | None = None
        self.http: HttpFileServer | None = None  # the file server, when a fixture starts one
        self.closers: list[Callable[[], object]] = []  # run last first

    def serve_files(self, routes: dict[str, Any] | None = None) -> HttpFileServer:
        """An HTTP file server on `files` (`routes` in front of the static files)."""
        http = HttpFileServer(self.files, routes)
        self.closers.append(http.close)
        return http

    def start_server(self, *flags: str) -> ServerProc:
        """The cube-server on `data`, the default `--server` of the agents started after it."""
        self.server = start_server(self.data, *flags)
        self.closers.append(self.server.stop)
        return self.server

    def agent(self, *extra: str, server: str = "", token: str | None = None) -> AgentProc:
        """A started cube-agent on `deploy`; its server: `server`, else the one started here,
        else a closed port (an agent with no server to talk to)."""
        if not server:
            server = self.server.control_address if self.server else f"127.0.0.1:{free_port()}"
        proc = AgentProc(self.deploy, server, *extra, token=token)
        self.closers.append(proc.stop)
        return proc.start()

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    box = Deployment(tmp_path)
    try:
        yield box
    finally:
        box.close()
