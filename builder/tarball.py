"""The shard tars cube-builder and cube-import publish: a plain tar of a shard's files with its
md5 computed in the same pass (`write_tar`), its `.md5` file, and fsyncs that overlap. Written
with O_DIRECT where the system allows (`_TarSink`: why, in its docstring). What a tar holds:
docs/reference/data-layout.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import tarfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from cube.fsutil import atomic_write_text, md5_line
from cube.shard_writer import Writeback

_COPY_CHUNK = 8 << 20
_DIRECT_CHUNK = 8 << 20  # bytes per direct write of a tar (a multiple of any block size)


def sync_files(paths: Sequence[Path]) -> None:
    """fsync the files at once, one thread each: their journal commits and the waits for the
    disk overlap instead of adding up (each is tens of ms even when little is left to write)."""

    def sync(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max(1, len(paths))) as threads:
        list(threads.map(sync, paths))


def write_tar(
    tar_path: Path, directory: Path, members: Sequence[str], mtime: int, sync: bool = True
) -> tuple[int, str]:
    """Plain tar (tarfile's headers) of `directory`'s `members` as `./<name>`, with its md5
    computed in the same pass: each file is mapped and every byte goes to md5 and the tar
    once (no read copies). Written under a temp name (fsynced unless `sync` is False: then
    the caller does), renamed when complete. Returns (size, md5 hex).

    Every member gets `mtime` (the builder passes the version's cur_version, a Unix time) and
    no owner names: the same shard files make the same tar, whoever builds them and when."""
    tmp = tar_path.with_name(f".{tar_path.name}.tmp-{os.getpid()}")
    md5 = hashlib.md5()
    size = 0
    try:
        with _TarSink(tmp) as out:

            def emit(data: bytes | memoryview, in_place: bool = False) -> None:
                nonlocal size
                md5.update(data)
                if in_place:
                    out.write_in_place(memoryview(data))
                else:
                    out.write(data)
                size += len(data)

            for name in members:
                path = directory / name
                with open(path, "rb") as source:
                    info = tarfile.TarInfo(f"./{name}")
                    info.size = os.fstat(source.fileno()).st_size
                    info.mtime = mtime
                    info.mode = 0o644
                    emit(info.tobuf(tarfile.DEFAULT_FORMAT, "utf-8", "surrogateescape"))
                    if info.size:
                        _emit_mapped(source, info.size, emit, out.wait)
                if info.size % tarfile.BLOCKSIZE:
                    emit(bytes(tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE))
            end = 2 * tarfile.BLOCKSIZE  # two zero blocks, then zeros to a whole record
            end += -(size + end) % tarfile.RECORDSIZE
            emit(bytes(end))
            out.flush()
            if sync:
                os.fsync(out.fd)
        os.replace(tmp, tar_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return size, md5.hexdigest()


class _TarSink:
    """Where write_tar's bytes go: the file opened with O_DIRECT where the system allows, the
    writes done by a thread while the caller hashes the next piece. Why: the tar is the second
    copy of a shard's bytes and nothing reads it back here, so it need not pass through the
    page cache; each buffered byte costs a copy into a freshly allocated page (after md5 the
    build's largest cost), while the disk has to write it either way. Whole blocks of a
    member's body go to disk straight from its mapping (`write_in_place`); headers, padding and
    a body's last partial block through a reused, page-aligned buffer. Elsewhere: a plain
    buffered file, with writeback started as it grows."""

    def __init__(self, path: Path) -> None:
        self.fd = -1
        direct = getattr(os, "O_DIRECT", 0)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        if direct:
            try:
                self.fd = os.open(path, flags | direct, 0o644)
                self.direct = True
            except OSError:  # e.g. tmpfs: no direct I/O
                self.fd = -1
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)
        self.offset = 0  # file offset of the next byte handed to the writer (or written)
        self.writeback = Writeback(self.fd)
        self._buffers = [mmap.mmap(-1, _DIRECT_CHUNK) for _ in range(2)] if self.direct else []
        self._filled = 0  # bytes waiting in the current buffer
        self._current = 0
        self._pending: Future[Any] | None = None
        self._thread = ThreadPoolExecutor(1) if self.direct else None

    def __enter__(self) -> _TarSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, data: bytes | memoryview) -> None:
        """Copy `data` out (it may be reused at once)."""
        view = memoryview(data).cast("B")
        if not self.direct:
            self._write_all(view, -1)
            self.writeback.wrote(self.offset)
            return
        while view:
            buffer = self._buffers[self._current]
            step = min(_DIRECT_CHUNK - self._filled, len(view))
            buffer[self._filled : self._filled + step] = view[:step]
            self._filled += step
            view = view[step:]
            if self._filled == _DIRECT_CHUNK:
                self._submit_buffer()

    def write_in_place(self, view: memoryview) -> None:
        """Like `write`, for a view that stays valid until `wait()`: its whole blocks are
        written from where they are (no copy) when the file is at a block boundary."""
        aligned = len(view) and np.frombuffer(view, np.uint8).ctypes.data % mmap.PAGESIZE == 0
        if not self.direct or self._filled % tarfile.BLOCKSIZE or not aligned:
            self.write(view)
            return
        if self._filled:
            self._submit_buffer()
        whole = len(view) - len(view) % tarfile.BLOCKSIZE
        for start in range(0, whole, _DIRECT_CHUNK):
            piece = view[start : min(start + _DIRECT_CHUNK, whole)]
            self._submit(piece, len(piece))
        self.write(view[whole:])

    def _submit_buffer(self) -> None:
        """Hand the current buffer to the writer thread and switch to the other one."""
        self._submit(self._buffers[self._current], self._filled)
        self._current ^= 1
        self._filled = 0

    def _submit(self, source: Any, length: int) -> None:
        assert self._thread is not None
        self.wait()  # one write in flight: the other buffer is free again
        self._pending = self._thread.submit(self._write_at, source, length, self.offset)
        self.offset += length

    def wait(self) -> None:
        """Wait for the write in flight (then views given to write_in_place may go)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write_at(self, source: Any, length: int, offset: int) -> None:
        with memoryview(source) as view:
            try:
                self._write_all(view[:length], offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                # this file system or device wants other alignments: through the cache
                buffered = fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT
                fcntl.fcntl(self.fd, fcntl.F_SETFL, buffered)
                self._write_all(view[:length], offset)

    def _write_all(self, view: memoryview, offset: int) -> None:
        """Every byte of `view` at `offset` (-1: at the file position, buffered)."""
        while view:
            done = os.write(self.fd, view) if offset < 0 else os.pwrite(self.fd, view, offset)
            view = view[done:]
            if offset < 0:
                self.offset += done
            else:
                offset += done

    def flush(self) -> None:
        """Write what is buffered. A direct write must be whole blocks: a tail that is not
        (a tar is whole 512-byte blocks, a device may want 4096) goes through the cache."""
        if not self.direct:
            return
        self.wait()
        if self._filled:
            self._write_at(self._buffers[self._current], self._filled, self.offset)
            self.offset += self._filled
            self._filled = 0

    def close(self) -> None:
        if self._thread is not None:
            with contextlib.suppress(Exception):  # an error was raised already
                self.wait()
            self._thread.shutdown(wait=True)
            self._thread = None
        for buffer in self._buffers:
            buffer.close()
        self._buffers = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _emit_mapped(
    source: Any,
    length: int,
    emit: Callable[[memoryview, bool], None],
    release: Callable[[], None],
) -> None:
    """The file's bytes to `emit`, in place from a mapping; `release()` before unmapping."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapped = mmap.mmap(source.fileno(), length, flags=flags, prot=mmap.PROT_READ)
    try:
        with memoryview(mapped) as view:
            try:
                for start in range(0, length, _COPY_CHUNK):
                    emit(view[start : start + _COPY_CHUNK], True)
            finally:
                release()
    finally:
        mapped.close()


def write_md5_file(tar_path: Path, md5: str) -> Path:
    """`<tar>.md5` in md5sum's format (`md5sum -c` works from the version directory)."""
    path = tar_path.with_name(tar_path.name + ".md5")
    atomic_write_text(path, md5_line(md5, tar_path.name))
    return path
