"""The deploy directory of one instance, version names, and the retention rule.

`deploy_path/data/` is the cube-server's `--data_dir`: `data/<version>/` holds a placed shard
(index.cube, data.cube, CHAIN for a delta) and `data/VERSION` names the version to serve at start.
`cube_data/<shard_seq>/<version>/` holds downloads, `agent_state/` the agent's journal.

Everything that decides (name checks, version names, what retention deletes) is pure; the few
file helpers write through a temp name and rename so a reader never sees half a file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cube.fsutil import atomic_write_text
from cube.layout import (
    CHAIN_FILE,
    VERSION_FILE,
    LayoutError,
    is_name,
    parse_chain,
    parse_version,
    version_text,
)

TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Layout:
    """Paths under one deploy_path."""

    deploy_path: Path

    @property
    def data_dir(self) -> Path:
        return self.deploy_path / "data"

    @property
    def state_dir(self) -> Path:
        return self.deploy_path / "agent_state"

    @property
    def downloads_dir(self) -> Path:
        return self.deploy_path / "cube_data"

    @property
    def version_file(self) -> Path:
        return self.data_dir / VERSION_FILE

    def version_dir(self, version: str) -> Path:
        return self.data_dir / version

    def download_dir(self, shard_seq: int, version: str) -> Path:
        return self.downloads_dir / str(shard_seq) / version

    def extract_dir(self, version: str) -> Path:
        return self.data_dir / f"{TMP_PREFIX}{version}-{os.getpid()}"

    def create(self) -> None:
        for path in (self.data_dir, self.state_dir, self.downloads_dir):
            path.mkdir(parents=True, exist_ok=True)


def read_version_file(layout: Layout) -> str:
    """The version data/VERSION names (cube.layout.parse_version), or '' when there is none."""
    try:
        text = layout.version_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    return parse_version(text) or ""


def write_version_file(layout: Layout, version: str) -> None:
    atomic_write_text(layout.version_file, version_text(version))


def read_chain(layout: Layout, version: str) -> list[str]:
    """A placed version's chain: the CHAIN file of a delta, `[version]` for a base. A line that
    is not a version name is left out (a chain never leads outside data/); the placed-files
    check reports such a CHAIN as damaged."""
    try:
        text = (layout.version_dir(version) / CHAIN_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return [version]
    return [name for name in _chain_lines(text) if is_name(name)] or [version]


def chain_is_valid(layout: Layout, version: str) -> bool:
    """Whether data/<version>/CHAIN is a chain the server accepts (cube.layout.parse_chain)."""
    try:
        text = (layout.version_dir(version) / CHAIN_FILE).read_text(encoding="utf-8")
        parse_chain(text, version)
    except (OSError, UnicodeDecodeError, LayoutError):
        return False
    return True


def _chain_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def placed_versions(layout: Layout) -> list[str]:
    """Version directories in data/ (hidden temp dirs excluded), by name."""
    try:
        entries = list(os.scandir(layout.data_dir))
    except FileNotFoundError:
        return []
    return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def plan_retention(newest_first: Sequence[str], keep: int, protected: Iterable[str]) -> list[str]:
    """Versions to delete: all but the `keep` newest and the protected ones (serving, loading,
    the current chain). Pure, so the rule is tested without files."""
    protected_set = set(protected)
    kept = set(newest_first[: max(keep, 0)])
    return [v for v in newest_first if v not in kept and v not in protected_set]
