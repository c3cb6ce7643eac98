"""The checked-in protobuf stubs are what proto/*.proto generates today."""

import subprocess
import sys

import pytest

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow


def test_stubs_are_not_stale() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cube.pb.generate", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
