"""Durable transfer state in `tmp_address`: a snapshot plus an append-only event log.

- `transfer_state.json` is the whole `TransferState`, replaced atomically on every change (temp
  file, fsync, rename, fsync of the directory): after a kill -9 it is the old or the new state,
  never half of one. It is the only thing read back at start.
- `transfer_events.jsonl` records every transition (one JSON object per line, fsync'd) for
  people and post-mortems; rotated at 16 MiB to `.1`.

The transfer saves the state *before* acting on a decision (e.g. "committed" before the first
enable), and every phase is idempotent (agents dedupe a repeated command), so a restarted
transfer resumes the deployment at its recorded phase without redeploying what is live.

`persist` keeps the event loop free while a big state (history with per-shard metas) is
encoded and fsync'd: the snapshot is copied on the loop, then written by one writer thread, so
snapshots reach the disk in the order they were taken.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cube.fsutil import atomic_write_bytes
from cube.transfer.state import TransferState, now

STATE_FILE = "transfer_state.json"
EVENTS_FILE = "transfer_events.jsonl"
_ROTATE_BYTES = 16 << 20
log = logging.getLogger("cube.transfer.journal")


class JournalError(RuntimeError):
    """A state file that exists but cannot be used (the message names it)."""


class Journal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.state_path = directory / STATE_FILE
        self.events_path = directory / EVENTS_FILE
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")

    def load(self, dict_name: str) -> TransferState:
        """The saved state, or a fresh one. A state of another dictionary is refused (two
        transfers must not share a tmp_address)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(f".{STATE_FILE}.tmp-*"):
            stale.unlink(missing_ok=True)
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return TransferState(dict_name=dict_name)
        try:
            state = TransferState.from_json(json.loads(raw))
        except (ValueError, TypeError, KeyError) as exc:
            raise JournalError(
                f"{self.state_path}: unusable state ({exc}); move it away to start fresh "
                "(the live version stays on the instances)"
            ) from exc
        if state.dict_name and state.dict_name != dict_name:
            raise JournalError(
                f"{self.state_path}: belongs to dict {state.dict_name!r}, not {dict_name!r}"
            )
        state.dict_name = dict_name
        return state

    def save(self, state: TransferState) -> None:
        """Write the state now (blocking); an event loop uses `persist`."""
        self._write(state.to_json())

    async def persist(self, state: TransferState) -> None:
        """Write the state without blocking the loop: copied now, encoded and written by the
        writer thread after every earlier snapshot."""
        snapshot = state.to_json()
        await asyncio.get_running_loop().run_in_executor(self._writer, self._write, snapshot)

    def _write(self, snapshot: dict[str, Any]) -> None:
        data = json.dumps(snapshot, indent=1, sort_keys=True).encode() + b"\n"
        atomic_write_bytes(self.state_path, data)

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event line (best effort: a full disk must not stop a rollout midway)."""
        line = json.dumps({"time": now(), "event": kind, **fields}, sort_keys=True) + "\n"
        try:
            if self.events_path.exists() and self.events_path.stat().st_size > _ROTATE_BYTES:
                os.replace(self.events_path, self.events_path.with_suffix(".jsonl.1"))
            with open(self.events_path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            log.warning("cannot append to %s: %s", self.events_path, exc)
