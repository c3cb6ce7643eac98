"""Per-shard build meta: the `meta_info/*.json` files and the transfer's register call.

The original's three keys are kept with meaningful values (numbers as strings, as it wrote
them) so old tooling that reads them still works; everything else is ours:
- `index_total_count`: keys in this shard's index (records + tombstones);
- `data_len_list` / `index_len_list`: one entry each, the sizes of `data.cube` / `index.cube`;
  for a shard of a version of several tables, one entry per table in TABLES order (the
  original listed one per data file), `record_count`, `tombstone_count` and
  `index_total_count` the sums over its tables, `value_width` the width they share (0 when
  they differ), `build_id` theirs joined by commas, and `tables` each table's own.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cube.fsutil import atomic_write_json

META_DIR = "meta_info"
REGISTER_PATH = "/dict/meta_info/register"


@dataclass(frozen=True)
class ShardOutput:
    """What finishing one shard produced (returned by a worker process)."""

    shard: int
    record_count: int
    tombstone_count: int
    value_width: int
    build_id: str
    index_size: int
    data_size: int
    tar_size: int
    md5: str
    # a version of several tables: each table's part of the shard (its tar_size and md5 are
    # the shard's, left 0 and ""), in TABLES order; the fields above sum them
    tables: tuple[tuple[str, ShardOutput], ...] = ()


def meta_info_name(cur_version: int, depend_version: int, shard: int, split: int = 0) -> str:
    """`<cur>_<depend>_<shard>_<split>.json`: cur first here, depend first in the version dir
    name, as the original."""
    return f"{cur_version}_{depend_version}_{shard}_{split}.json"


def shard_meta_info(output: ShardOutput, common: dict[str, Any]) -> dict[str, Any]:
    """The JSON object for one shard; `common` carries the build-wide fields. A shard of a
    version of several tables adds `tables` (each table's counts, width and file sizes, in
    TABLES order); `data_len_list` / `index_len_list` then have one entry per table."""
    parts = [output for _, output in output.tables] or [output]
    meta = {
        "index_total_count": str(output.record_count + output.tombstone_count),
        "data_len_list": [str(part.data_size) for part in parts],
        "index_len_list": [str(part.index_size) for part in parts],
        **common,
        "shard": output.shard,
        "record_count": output.record_count,
        "tombstone_count": output.tombstone_count,
        "value_width": output.value_width,
        "build_id": output.build_id,
        "md5": output.md5,
        "tar_size": output.tar_size,
    }
    if output.tables:
        meta["tables"] = [
            {
                "table": name,
                "record_count": table.record_count,
                "tombstone_count": table.tombstone_count,
                "value_width": table.value_width,
                "build_id": table.build_id,
                "index_size": table.index_size,
                "data_size": table.data_size,
            }
            for name, table in output.tables
        ]
    return meta


def write_meta_file(directory: Path, name: str, meta: dict[str, Any]) -> Path:
    """Write one meta file atomically and durably (never half-written)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    atomic_write_json(path, meta, indent=None)
    return path


class RegisterError(RuntimeError):
    """The transfer did not accept a shard's meta."""


def register_meta(
    master_address: str,
    fields: dict[str, str],
    timeout: float = 10.0,
) -> None:
    """POST one shard's meta to `http://<master>/dict/meta_info/register` as form fields
    (name, shard, split, version, depend, meta), as the original builder did.

    Success is any 2xx answer, unless the body is the JSON envelope with a non-zero
    `success` field."""
    base = master_address if "://" in master_address else f"http://{master_address}"
    url = base.rstrip("/") + REGISTER_PATH
    body = urllib.parse.urlencode(fields).encode()
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = response.read(1 << 20)
    except urllib.error.HTTPError as exc:
        raise RegisterError(f"POST {url}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RegisterError(f"POST {url}: {reason}") from exc
    try:
        envelope = json.loads(answer)
    except ValueError:
        return
    if isinstance(envelope, dict) and str(envelope.get("success", "0")) != "0":
        message = envelope.get("message", "")
        raise RegisterError(f"POST {url}: refused (success={envelope['success']}): {message}")
