"""Inputs that exercise every build rule at once, and a byte-level picture of a build's output:
for tests that compare two builds of the same input (local vs local, local vs Spark)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from cube.seqfile import SequenceFileWriter
from cube.values import ValueColumn


def write_mixed_input(root: Path, records: int = 3000, seed: int = 7) -> tuple[Path, Path]:
    """A directory of SequenceFiles and a delete list. Across the files: keys repeat (within
    a file and across files, so the last record wins by file order then position), a nested
    directory, a hidden file and an empty `_SUCCESS` that must be skipped, both dialects
    (Cube's raw keys, genuine BytesWritable), compressed (record and block zlib) and plain
    files, fixed-width values in some files and variable widths (including empty values) in
    others, and deleted keys that are also written. Returns (input dir, delete file)."""
    rng = np.random.default_rng(seed)
    inputs = root / "input"
    key_space = records * 2
    files = [
        ("part-00000", "cube", "none", 16, None),
        ("part-00001", "byteswritable", "none", 16, None),
        ("part-00002", "cube", "block", 0, "default"),
        ("sub/part-00003", "cube", "none", 0, None),
        ("sub/part-00004", "byteswritable", "record", 16, "default"),
    ]
    for number, (name, dialect, compression, width, codec) in enumerate(files):
        keys = rng.integers(0, key_space, records, dtype=np.uint64)
        keys[: records // 10] = keys[records // 10 : records // 5]  # repeats within the file
        if width:
            values = [(b"%d:%d:" % (number, i)).ljust(width, b"w")[:width] for i in range(records)]
        else:
            values = [b"v%d" % number * int(rng.integers(0, 5)) for _ in range(records)]
        path = inputs / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with SequenceFileWriter(path, dialect=dialect, compression=compression, codec=codec) as w:
            w.write_batch(keys, ValueColumn.from_list(values))
    (inputs / "_SUCCESS").write_bytes(b"")
    with SequenceFileWriter(inputs / ".hidden") as w:
        w.write_batch(np.arange(5, dtype=np.uint64), ValueColumn.from_list([b"x"] * 5))
    deleted = rng.integers(0, key_space, records // 20, dtype=np.uint64)
    delete_file = root / "deleted.txt"
    delete_file.write_text("# keys to delete\n" + "\n".join(map(str, deleted.tolist())) + "\n")
    return inputs, delete_file


def output_digests(output: Path) -> dict[str, str]:
    """sha256 of every file under a build's output root, by relative path."""
    return {
        str(path.relative_to(output)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(output.rglob("*"))
        if path.is_file()
    }
