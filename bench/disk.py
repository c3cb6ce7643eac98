"""Random 4 KiB reads from a file not in the page cache, at several depths (issue 37): what
the disk under a version served paged can do.

    python -m cube.bench.disk --dir /tmp --gib 2 --seconds 4

Writes a file of --gib GiB (removed at the end), drops it from the page cache before each
depth, and reads random 4 KiB blocks with `os.pread` from 1, 4, 16, 32 and 64 threads (the
read releases the GIL: N threads keep N reads outstanding). Prints reads/s per depth.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path

DEPTHS = (1, 4, 16, 32, 64)


def reads_per_second(fd: int, size: int, threads: int, seconds: float) -> float:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    counts = [0] * threads
    stop = time.monotonic() + seconds

    def work(index: int) -> None:
        draw = random.Random(index)
        blocks = size >> 12
        done = 0
        while time.monotonic() < stop:
            os.pread(fd, 4096, draw.randrange(blocks) << 12)
            done += 1
        counts[index] = done

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(seconds + 60)
    return sum(counts) / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    size = int(args.gib * (1 << 30)) >> 20 << 20
    with tempfile.NamedTemporaryFile(dir=args.dir, prefix="cube-disk-") as handle:
        chunk = os.urandom(1 << 20)
        for _ in range(size >> 20):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
        fd = os.open(Path(handle.name), os.O_RDONLY)
        try:
            result = {str(d): round(reads_per_second(fd, size, d, args.seconds)) for d in DEPTHS}
        finally:
            os.close(fd)
    print(json.dumps({"reads_per_s_by_depth": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
