"""Writes the format-2 shards of this directory with the release before index format 3 (git
33a888f, whose cube.index built format 2): run it from a checkout of that commit,
    PYTHONPATH=<that checkout> python tests/data/format2/generate.py tests/data/format2
The shards' contents are functions of the keys (`expected` below, also in tests/test_shard.py),
so the test needs no list of them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from cube.format import FORMAT_VERSION
from cube.index import build_table
from cube.shard import write_shard
from cube.values import ValueColumn

STEP = np.uint64(0x9E3779B97F4A7C15)


def base_keys() -> np.ndarray:
    """600 spread keys, and 0 and 2**64 - 1."""
    with np.errstate(over="ignore"):
        keys = np.arange(1, 601, dtype=np.uint64) * STEP
    return np.concatenate([keys, np.array([0, 2**64 - 1], np.uint64)])


def delta_parts() -> tuple[np.ndarray, np.ndarray]:
    """(keys written: 100 updated, 50 new; keys deleted: 40 of the base, 5 never written)."""
    base = base_keys()
    with np.errstate(over="ignore"):
        new = np.arange(1001, 1051, dtype=np.uint64) * STEP
        never = np.arange(2001, 2006, dtype=np.uint64) * STEP
    return np.concatenate([base[:100], new]), np.concatenate([base[100:140], never])


def value(keys: np.ndarray, layer: int) -> ValueColumn:
    """8 bytes a key: the key plus the layer number (little-endian)."""
    with np.errstate(over="ignore"):
        words = (keys + np.uint64(layer)).astype("<u8")
    return ValueColumn.fixed(words.view(np.uint8).copy(), 8)


def main(out: Path) -> None:
    assert FORMAT_VERSION == 2, "run with the release that writes format 2"
    keys = base_keys()
    write_shard(out / "base", build_table(keys), value(keys, 0), {"version": "1"})
    written, deleted = delta_parts()
    write_shard(out / "delta", build_table(written, deleted), value(written, 1), {"version": "2"})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
