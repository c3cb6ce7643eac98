"""The JSON shapes of the query interface (the original's field names; ours are added after).

Pure: config + state in, JSON-ready objects out: fresh objects sharing nothing mutable with the
state (the API encodes them in a thread). Credentials in URLs (an ftp donefile's user and
password, say) are hidden in everything shown.
"""

from __future__ import annotations

from typing import Any, overload

from cube import protocol
from cube.layout import output_dir_name, tar_name
from cube.protocol import OK, Work
from cube.remote import redact
from cube.transfer.config import Instance, TransferConfig
from cube.transfer.state import (
    INSTANCE_STATUS,
    VERSION_STATUS,
    TransferState,
    VersionRecord,
    awaiting_retry,
)
from cube.transfer.upload import object_url

_INSTANCE_TIMES = (
    "builded_time",
    "download_start_time",
    "downloaded_time",
    "reload_start_time",
    "reloaded_time",
    "enable_start_time",
    "enabled_time",
    "create_time",
)


def number(text: str) -> int:
    """A field the original typed int from ours, a string: a version name gives its id (the
    last part of `<base>_<id>`, as the original's version was), 0 when there is no number, as
    the original left such fields unset."""
    last = text.rsplit("_", 1)[-1]
    return int(last) if last.isascii() and last.isdigit() else 0


def envelope(data: Any = None, message: str = "query ok", success: str = OK) -> dict[str, Any]:
    return protocol.envelope(data, message, success)


@overload
def version_info(cfg: TransferConfig, rec: VersionRecord) -> dict[str, Any]: ...
@overload
def version_info(cfg: TransferConfig, rec: VersionRecord | None) -> dict[str, Any] | None: ...
def version_info(cfg: TransferConfig, rec: VersionRecord | None) -> dict[str, Any] | None:
    if rec is None:
        return None
    return {
        "dict_name": cfg.dict_name,
        "version": rec.version,
        "depend": rec.depend,
        "id": rec.id,
        "key": rec.key,
        "mode": rec.mode,
        "input": redact(rec.input),
        "output": rec.output,
        "status": VERSION_STATUS.get(rec.status, 0),
        "status_str": rec.status,
        "finish_time": int(rec.finish_time),
        "create_time": int(rec.create_time),
        "meta_infos": dict(rec.meta_infos),
        # ours
        "message": redact(rec.message),
        "line": rec.line,
        "chain": list(rec.chain),
        "times": dict(rec.times),
        "took": took(rec),
        # retries of a failed version: attempts so far, when the next begins (0: none), why
        # the last failed, why there will be no other (abandoned)
        "attempts": rec.attempts,
        "max_attempts": cfg.version_retries + 1,
        "retry_at": rec.retry_at,
        "last_error": redact(rec.last_error),
        "abandoned": redact(rec.abandoned),
    }


def took(rec: VersionRecord) -> float | None:
    """Seconds from the record's creation to its end, to the millisecond (create_time and
    finish_time are whole seconds, as the original's: a sub-second phase would read 0 or 1);
    None while it is in progress."""
    if not rec.finish_time or not rec.create_time:
        return None
    return round(max(0.0, rec.finish_time - rec.create_time), 3)


def instance_info(cfg: TransferConfig, state: TransferState, inst: Instance) -> dict[str, Any]:
    known = state.instances.get(inst.name)
    dep = state.deployment
    target = state.record(dep.version) if dep and dep.kind == "deploy" else None
    live = state.record(state.live_version)
    rec = target or live
    times = known.times if known else {}
    status = known.status if known else "Init"
    out: dict[str, Any] = {
        "dict_name": cfg.dict_name,
        "mode": cfg.mode,
        "version": number(rec.version) if rec else 0,  # ints, as the original's
        "depend": number(rec.depend) if rec else 0,
        "id": number(rec.id) if rec else 0,
        "key": number(rec.key) if rec else 0,
        "shard": inst.shard,
        "source": redact(source_url(cfg, rec, inst.shard)) if rec else "",
        "deploy_path": inst.deploy_path,
        "ip": inst.server_host,
        "port": inst.server_port,
        "agent_ip": inst.agent_host,
        "agent_port": inst.agent_port,
        "status_id": INSTANCE_STATUS.get(status, 0),
        "status": status,
    }
    for name in _INSTANCE_TIMES:
        out[name] = int(times.get(name, 0))
    out.update(
        {
            "replica": inst.replica,
            "name": inst.name,
            "serving_version": known.version if known else "",
            "bg_version": known.bg_version if known else "",
            "reachable": bool(known and known.reachable),
            "live_version": state.live_version,
            "message": redact(known.message) if known else "",
            # a replica the reconciler fails to bring to the live version (kept until it does)
            "failures": known.catch_up_failures if known else 0,
            "next_retry_time": int(known.next_catch_up) if known else 0,
            "last_failure_command": known.failure_command if known else "",
            "last_failure_version": known.failure_version if known else "",
            "last_failure_reason": known.failure_reason if known else "",
            "last_failure_message": redact(known.failure_message) if known else "",
            "last_failure_time": int(known.failed_at) if known else 0,
        }
    )
    return out


def source_url(cfg: TransferConfig, rec: VersionRecord, shard: int) -> str:
    """Where agents download a shard of `rec` from: the transfer's own file server, or with
    download_mode s3 the copy uploaded under upload_address (transfer/upload.py)."""
    out_name = rec.output.rstrip("/").rsplit("/", 1)[-1] if rec.output else ""
    if not out_name:
        out_name = output_dir_name(rec.depend, rec.id)
    if cfg.download_mode == "s3":
        return object_url(cfg, out_name, tar_name(cfg.dict_name, shard))
    if cfg.download_address:  # an external file server of output_address
        return f"{cfg.download_address}/{out_name}/{tar_name(cfg.dict_name, shard)}"
    scheme = "https" if cfg.download_mode == "http" and cfg.tls_cert else cfg.download_mode
    return (
        f"{scheme}://{cfg.transfer_address}:{cfg.wget_port}/"
        f"{out_name}/{tar_name(cfg.dict_name, shard)}"
    )


def work_for(
    cfg: TransferConfig, inst: Instance, command: str, rec: VersionRecord
) -> dict[str, Any]:
    """The POST /agent/cmd body that runs `command` for `rec` on `inst` (the original's Work
    object, ours added)."""
    shard = rec.shards.get(str(inst.shard)) or {}
    work = Work(
        command=command,
        version=rec.version,
        mode=rec.mode,
        dict_name=cfg.dict_name,
        shard_seq=inst.shard,
        source=source_url(cfg, rec, inst.shard),
        md5=str(shard.get("md5") or ""),
        size=shard.get("size"),
        chain=list(rec.chain) if rec.mode == "delta" else [],
        depend=rec.depend,
        deploy_path=inst.deploy_path,
        port=inst.server_port,
        id=rec.id,
        key=rec.key,
    )
    return work.to_json()


def history(cfg: TransferConfig, state: TransferState) -> list[dict[str, Any]]:
    return [version_info(cfg, rec) for rec in state.history]


def scaler(cfg: TransferConfig, state: TransferState, shard: int) -> list[dict[str, Any]]:
    """The original's `/dict/scaler` list for one shard: every version of the live chain, then
    the one being rolled out once built, each with where its shard is downloaded from (the
    real URL: the original's had a stray `/<version>/` segment)."""
    records = [state.record(v) for v in state.live_chain]
    dep = state.deployment
    if dep is not None and dep.kind == "deploy":
        rec = state.record(dep.version)
        if rec is not None and rec.shards and rec.version not in state.live_chain:
            records.append(rec)
    return [
        {
            "name": cfg.dict_name,
            "version": rec.version,
            "depend": rec.depend,
            "id": rec.id,
            "key": rec.key,
            "shard": shard,
            "mode": rec.mode,
            "data_source": redact(source_url(cfg, rec, shard)),
        }
        for rec in records
        if rec is not None
    ]


def dict_info(cfg: TransferConfig, state: TransferState) -> dict[str, Any]:
    instances = [instance_info(cfg, state, inst) for inst in cfg.instances]
    dep = state.deployment
    wait = state.record(dep.version, include_rollbacks=dep.kind == "rollback") if dep else None

    def named(status_ids: tuple[int, ...]) -> int:
        return sum(1 for inst in instances if inst["status_id"] in status_ids)

    current = [
        version_info(cfg, state.record(v)) for v in state.live_chain if state.record(v) is not None
    ]
    return {
        "dict_name": cfg.dict_name,
        "dict_mode": cfg.mode,
        "shard_num": cfg.shard_num,
        "copy_num": cfg.copy_num,
        "inst_num": len(cfg.instances),
        "deploy_path": "",
        "donefile_addr": redact(cfg.donefile_address),
        "output_addr": str(cfg.output_address),
        "tmp_addr": str(cfg.tmp_address),
        "download_mode": cfg.download_mode,
        "wget_port": str(cfg.wget_port),  # a string in the original's JSON
        "upload_addr": redact(cfg.upload_address),
        "download_addr": redact(cfg.download_address),
        "download_inst": named((40,)),
        "reload_insts": named((70,)),
        "enable_insts": named((100,)),
        "instances": instances,
        "wait_version_info": version_info(cfg, wait),
        "current_version_info": current,
        # ours
        "live_version": state.live_version,
        "live_chain": list(state.live_chain),
        "live_since": int(state.live_since),
        "quorum": cfg.quorum,
        "deployment": dep.to_json() if dep else None,
        "awaiting_retry": [version_info(cfg, rec) for rec in awaiting_retry(state)],
    }
