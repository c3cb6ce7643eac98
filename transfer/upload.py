"""download_mode s3: a built version's tars and md5 files copied to `upload_address`, where the
agents fetch them instead of from the transfer's file server:

    <upload_address>/<depend>_<cur>/<dict>_part<i>.tar
    <upload_address>/<depend>_<cur>/<dict>_part<i>.tar.md5

Every tar first, then the md5 files: each object appears whole or not at all (an S3 PUT, or a
multipart upload completed), so an `.md5` object always has its complete tar beside it (what an
agent with --md5_from_source relies on). Uploading the same build again writes the same bytes.
Objects are never deleted by the transfer: expire old ones with a bucket lifecycle rule.
"""

from __future__ import annotations

import time
from pathlib import Path

from cube import remote
from cube.layout import tar_name
from cube.transfer.config import TransferConfig


def object_url(cfg: TransferConfig, out_name: str, file_name: str) -> str:
    """The URL of one file of the build output directory `out_name` under upload_address."""
    return f"{cfg.upload_address.rstrip('/')}/{out_name}/{file_name}"


def upload_outputs(cfg: TransferConfig, out_dir: Path, timeout: float) -> list[str]:
    """Upload the tars, then the md5 files, of the build in `out_dir`, all within `timeout`
    seconds; returns the URLs written. RemoteError naming the object. Blocking."""
    deadline = time.monotonic() + timeout
    tars = [tar_name(cfg.dict_name, shard) for shard in range(cfg.shard_num)]
    written = []
    for name in [*tars, *(f"{tar}.md5" for tar in tars)]:
        url = object_url(cfg, out_dir.name, name)
        left = deadline - time.monotonic()
        if left <= 0:
            raise remote.RemoteError(f"upload to {url}: not done within {timeout:g} s")
        local = out_dir / name
        if not local.is_file():  # ours to say: put_file would blame the remote side
            raise remote.RemoteError(f"upload to {url}: {local} is missing (the build wrote none)")
        try:
            remote.put_file(str(local), url, left, min(left, 60.0))
        except remote.RemoteError as exc:
            raise remote.RemoteError(f"upload to {url}: {exc}") from None
        written.append(url)
    return written
