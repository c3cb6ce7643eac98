"""cube-import's command: flags, signals, and the run from inputs to published outputs
(`cube-import --help`, docs/MIGRATION.md section 5).
"""

from __future__ import annotations

import gc
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cube.builder.build import (
    BuildError,
)
from cube.builder.import_original.base import (
    _VERSION_RULE,
    EXIT_FAILED,
    EXIT_OK,
    ImportError_,
    warn,
)
from cube.builder.import_original.discover import Hints, find_sources, parse_version_name
from cube.builder.import_original.plan import keep_shard, make_plan
from cube.builder.import_original.write import (
    Totals,
    _state,
    _terminate,
    write_build_outputs,
    write_data_dir,
)
from cube.flags import FlagError, FlagSet, flag, one_line, run_cli
from cube.layout import (
    is_name,
)
from cube.original_format import (
    OriginalFormatError,
)

DESCRIPTION = """\
Converts tables built by the original Cube (PaddlePaddle Serving's C++ cube-builder: data.N,
index.N, data.n, index.n per shard) into this project's format, base and patches, written by
this project's builder code.

-input_path (comma-separated for several) may be:
  the original builder's -output_path (version directories <depend>_<cur>), one version
  directory (<dict>_part<i>/ and/or <dict>_part<i>.tar, .tar.md5 checked when present), one
  shard directory or tar; or a deployment of the original: its deploy path, its data/ (VERSION
  names the served version; its links lead to the versions in cube_data/), or its cube_data/
  (<shard>/<version>/ downloads; <shard>/<version>-<dict>/ in the agent's service mode). A
  local-mode data/ (one version's files, no VERSION) needs -version and -shard.

The versions and their order come from the original's files: a base holds index.0, each
patch's index.n and data.n lists start with those of the version before it (the check the
original server makes), and its files are the next ones. Every key must belong to its shard by
the original's rule, key % shard_num (the same as -partitioner mod here): a wrong -shard_num is
refused. Every address, length field and byte of the data files is checked; a problem names
the file and offset. The original has no deletions and no checksums (a tar's .md5 aside).
Files of another format (e.g. this project's index.cube and data.cube) are refused, never
read as an empty shard.

Output (exactly one):
  -output_path OUT  build output as cube-builder writes it: OUT/<depend>_<cur>/<dict>_part<i>/
                    {index.cube,data.cube}, .tar, .tar.md5 and OUT/meta_info/, for every
                    version (each needs all -shard_num shards); cube-transfer and cube-agent
                    take it as any build
  -data_dir DIR     a cube-server --data_dir for one shard (-shard, or the only one found):
                    DIR/<version>/ (a patch with CHAIN) and DIR/VERSION naming the version the
                    deployment's VERSION named (else the newest); an existing version directory
                    or a VERSION naming another version is refused
Every target is checked and every version written aside before any is renamed into place:
an import that fails, or is stopped by SIGINT or SIGTERM, publishes nothing and leaves no
staging folder; an input file cut short or rewritten while it is read (a live deployment's)
fails the import, naming the file and the offset where it now ends. Memory: one
shard of one version at a time, about 63 bytes a record at the peak (its keys, value
offsets and lengths, and the table built from them); values are read from the mapped files.
Warnings (skipped downloads, several bases, empty versions) go to stderr, -quiet or not.

Exit status: 0 imported, 1 failed (nothing published), 2 bad flags."""


@dataclass(frozen=True)
class ImportFlags:
    """cube-import's flags."""

    input_path: str = flag(
        "",
        "the original's files (see above); comma-separated for several",
        required=True,
        metavar="PATH,...",
    )
    dict_name: str = flag("", "the dict: its parts are <dict>_part<i>", required=True)
    shard_num: int = flag(0, "shard count of the original build (key % shard_num)", required=True)
    output_path: str = flag("", "write build output here (see above)", metavar="DIR")
    data_dir: str = flag("", "write a cube-server data directory here (see above)")
    shard: int = flag(-1, "the shard to import when the input does not say (or to pick one)")
    version: str = flag(
        "",
        "the version of an input that names none (local mode) or names 0, e.g. 1700000000",
        metavar="VERSION",
    )
    check_md5: bool = flag(True, "check each tar against its .md5 file when there is one")
    quiet: bool = flag(False, "no summary line (warnings still go to stderr)")


def flag_set() -> FlagSet[ImportFlags]:
    return FlagSet("cube-import", DESCRIPTION, spec=ImportFlags)


def _check_flags(flags: ImportFlags) -> None:
    """Flag errors spell flags as this tool's other messages do: -name."""
    if not flags.dict_name or not is_name(flags.dict_name):
        raise FlagError(f"-dict_name {flags.dict_name!r} must be a plain name")
    if flags.shard_num < 1:
        raise FlagError(f"-shard_num must be >= 1, got {flags.shard_num}")
    if bool(flags.output_path) == bool(flags.data_dir):
        raise FlagError("give exactly one of -output_path (build output) and -data_dir")
    if flags.shard < -1 or flags.shard >= flags.shard_num:
        raise FlagError(f"-shard must be in 0..{flags.shard_num - 1}, got {flags.shard}")
    version = flags.version
    if version and parse_version_name(version) is None:
        raise FlagError(f"-version {version!r} is not a version name ({_VERSION_RULE})")


def run(argv: Sequence[str]) -> int:
    flags = flag_set().parse(argv)
    _check_flags(flags)
    hints = Hints(
        flags.dict_name,
        flags.shard if flags.shard >= 0 else None,
        flags.version or None,
    )
    paths = [Path(p.strip()) for p in flags.input_path.split(",") if p.strip()]
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    _state.published, _state.deferred = False, 0
    started = time.monotonic()
    totals = Totals()
    collecting = gc.isenabled()
    gc.disable()
    try:
        inventory = find_sources(paths, hints)
        for note in inventory.notes:
            warn(note)
        inventory.notes.clear()
        # -data_dir: one shard, chosen before any tar is opened or hashed
        shard = keep_shard(inventory, hints.shard) if flags.data_dir else None
        plan = make_plan(inventory, flags.shard_num, flags.check_md5)
        for note in inventory.notes:
            warn(note)
        if shard is None:
            written = write_build_outputs(
                plan,
                inventory,
                flags.dict_name,
                Path(flags.output_path),
                flags.shard_num,
                totals,
            )
            serving = ""
        else:
            written, serve = write_data_dir(
                plan,
                inventory,
                flags.dict_name,
                Path(flags.data_dir),
                flags.shard_num,
                shard,
                totals,
            )
            serving = f"; VERSION names {serve}"
    except (ImportError_, OriginalFormatError, BuildError, ValueError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a bug: still one line, and still nothing published
        print(f"error: internal error {type(exc).__name__}: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        gc.freeze()
        if collecting:
            gc.enable()
    if not flags.quiet:
        seconds = time.monotonic() - started
        rate = totals.records / max(seconds, 1e-9)
        print(
            f"imported {len(written)} version(s) ({', '.join(totals.versions)}) of "
            f"{flags.dict_name}: {totals.shards} shard files, {totals.records} records in "
            f"{seconds:.2f} s ({rate:,.0f} records/s) into "
            f"{flags.output_path or flags.data_dir}{serving}"
        )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
