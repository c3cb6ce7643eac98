"""On-disk layout of a shard: a 4 KiB header in front of page-aligned array sections.

Pure: encodes and checks headers and section tables; reading and writing files is shard.py's.

Every shard version directory holds two files (one shard or one split of a shard):
- `index.cube` (format 3): sections `bucket_starts` (uint32 LE, 2**bucket_bits + 1),
  `remainders` (uint8, record_count x remainder_bytes) and `deleted_keys` (uint64 LE, sorted;
  empty but in deltas that delete), see index.py. Format 2 (sections `slot_keys`, `bucket_rows`,
  `deleted_keys`) is still read: cube.shard converts it in memory;
- `data.cube` (format 2, unchanged by index format 3): section `values` and, for
  variable-width values, `offsets` (n+1 uint64 LE).
Documented for users in docs/reference/data-layout.md.

Header (both files), little-endian:
    magic        8 bytes   b"CUBEIDX1" or b"CUBEDAT1"
    format       uint32    WRITTEN[kind]; one outside READABLE[kind] is refused
    json_length  uint32
    json_crc32   uint32    crc32 of the JSON bytes
    json         UTF-8 JSON object, zero padding to HEADER_SIZE
The JSON carries the record count, value layout, table parameters, the build id (which pairs
the two files), the file size (so truncation is caught at open in constant time) and, per
section, `[offset, length, crc32]` (checked by a full verify, e.g. at load).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mmap

MAGICS = {"index": b"CUBEIDX1", "data": b"CUBEDAT1"}
# 2: per-bucket rows and a deleted-key list replace per-slot rows; 3: the index is a quotiented
# hash directory (bucket starts + remainders), data.cube unchanged (so it stays 2).
FORMAT_VERSION = 3  # a shard's format: its index.cube's
WRITTEN = {"index": FORMAT_VERSION, "data": 2}
READABLE = {"index": (2, 3), "data": (2,)}  # index 2: converted in memory (cube.shard)
HEADER_SIZE = 4096
SECTION_ALIGN = 4096
_PREFIX = struct.Struct("<8sIII")

INDEX_SECTIONS = ("bucket_starts", "remainders", "deleted_keys")
INDEX_SECTIONS_V2 = ("slot_keys", "bucket_rows", "deleted_keys")
DATA_SECTIONS = ("values",)  # plus "offsets" when value_width == 0


class ShardFormatError(ValueError):
    """A shard file that must not be served; the message names the file and what is wrong."""

    def __init__(self, path: str, problem: str, offset: int | None = None) -> None:
        where = f"{path} at offset {offset}" if offset is not None else path
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.offset = offset


def align(n: int, to: int = SECTION_ALIGN) -> int:
    return (n + to - 1) // to * to


def layout_sections(sizes: dict[str, int]) -> tuple[dict[str, tuple[int, int]], int]:
    """Place sections after the header, each page-aligned. Returns ({name: (offset, length)},
    file size)."""
    placed = {}
    offset = HEADER_SIZE
    for name, length in sizes.items():
        placed[name] = (offset, length)
        offset = align(offset + length)
    return placed, offset


def encode_header(kind: str, fields: dict[str, Any]) -> bytes:
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    if _PREFIX.size + len(body) > HEADER_SIZE:
        raise ValueError(f"{kind} header JSON of {len(body)} bytes does not fit in {HEADER_SIZE}")
    prefix = _PREFIX.pack(MAGICS[kind], WRITTEN[kind], len(body), zlib.crc32(body))
    return (prefix + body).ljust(HEADER_SIZE, b"\0")


def decode_header(kind: str, header: bytes, path: str, file_size: int) -> dict[str, Any]:
    """Check magic, format, header checksum, file size and section bounds; return the fields
    (see `header_format` for the format number)."""
    if len(header) < _PREFIX.size:
        raise ShardFormatError(path, f"file of {file_size} bytes is too short for a header", 0)
    magic, version, length, crc = _PREFIX.unpack_from(header)
    if magic != MAGICS[kind]:
        raise ShardFormatError(path, f"bad magic {magic!r}, expected {MAGICS[kind]!r}", 0)
    readable = READABLE[kind]
    if version not in readable:
        age = "newer" if version > max(readable) else "older"
        formats = " or ".join(str(v) for v in readable)
        raise ShardFormatError(
            path,
            f"format {version} is {age} than this reader's ({formats}): rebuild the"
            " shard with this release's cube-builder",
            8,
        )
    if _PREFIX.size + length > min(len(header), HEADER_SIZE):
        raise ShardFormatError(path, f"header JSON length {length} overruns the header", 12)
    body = bytes(header[_PREFIX.size : _PREFIX.size + length])
    if zlib.crc32(body) != crc:
        raise ShardFormatError(path, "header checksum mismatch (corrupted header)", _PREFIX.size)
    try:
        fields = json.loads(body)
    except ValueError as exc:
        raise ShardFormatError(path, f"header JSON unreadable: {exc}", _PREFIX.size) from exc
    expected = fields.get("file_size")
    if expected != file_size:
        raise ShardFormatError(
            path, f"file is {file_size} bytes, header says {expected} (truncated or extended)"
        )
    if not isinstance(fields, dict):
        raise ShardFormatError(path, "header JSON is not an object", _PREFIX.size)
    for name, (offset, length, _crc) in fields.get("sections", {}).items():
        if offset < HEADER_SIZE or offset + length > file_size:
            raise ShardFormatError(path, f"section {name} [{offset}, +{length}) out of bounds")
    return fields


def header_format(header: bytes) -> int:
    """The format number of a header `decode_header` accepted."""
    return int(_PREFIX.unpack_from(header)[1])


class VerifyCancelled(Exception):
    """A checksum pass stopped because its caller asked (see `section_crc`)."""


def section_crc(
    buffer: memoryview | bytes | mmap.mmap,
    offset: int,
    length: int,
    cancelled: Callable[[], bool] | None = None,
    checked: Callable[[int, int], None] | None = None,
) -> int:
    """crc32 of a section, in 64 MiB steps so a huge section never needs one huge call;
    `cancelled()` is asked before each step (VerifyCancelled when it says so), `checked(start,
    length)` told after it."""
    crc = 0
    step = 64 << 20
    # A view, not a slice: slicing an mmap copies the step into a new bytes object, faulting
    # the pages in with the GIL held (seconds with the disk busy: every other thread of a
    # server stalls) and taking 64 MiB of anonymous memory; zlib reads a view without the GIL.
    with memoryview(buffer) as view:
        for start in range(offset, offset + length, step):
            if cancelled is not None and cancelled():
                raise VerifyCancelled(f"checksum pass stopped at offset {start}")
            end = min(start + step, offset + length)
            crc = zlib.crc32(view[start:end], crc)
            if checked is not None:
                checked(start, end - start)
    return crc
