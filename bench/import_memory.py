"""Peak traced memory of cube-import per record: one shard in the original's format (written
by tests/helpers/original_cube.py, which follows the original builder byte by byte), converted
in-process under tracemalloc (numpy's arrays are traced; the mapped input files are not).

    python -m bench.import_memory --records 2000000 --width 8
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np

from cube.builder.import_original import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.original_cube import OriginalBuilder


def main() -> None:
    # the original's builder is a test helper: imported as the tests import it (tests/ on the
    # path), so that mypy knows the file by one name
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--width", type=int, default=40, help="value bytes")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cube-import-memory-"))
    try:
        keys = np.random.default_rng(1).choice(1 << 40, args.records, replace=False)
        value = bytes(args.width)
        OriginalBuilder(root / "orig", "emb", 1).build(((int(k), value) for k in keys), 1, True)
        tracemalloc.start()
        source, output = str(root / "orig"), str(root / "out")
        flags = ["-dict_name", "emb", "-shard_num", "1", "-quiet"]
        code = run([*flags, "-input_path", source, "-output_path", output])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        if code != 0:
            raise SystemExit(f"cube-import failed (exit {code})")
        print(
            f"{args.records} records x {args.width} B: peak traced {peak / 1e6:.1f} MB, "
            f"{peak / args.records:.1f} B a record"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
