"""The on-disk contract every Cube process shares: names, the data layout, chains, tar members.

Pure (text in, decisions out; the shells read and write the files). One home for rules the
builder, transfer, agent and server each used to spell out on their own:

- Names: a dict or version name is one safe path component (`NAME_RE`).
- Build output: `<output>/<depend>_<cur>/<dict>_part<shard>/` and `<dict>_part<shard>.tar`
  (`output_dir_name`, `part_name`, `tar_name`, `PART_NAME_RE`); a base's output `<d>_<d>` is
  served as `<d>` (`served_version`, `served_name`).
- Versions: a base is `<depend>`, a delta `<depend>_<cur>` (`base_of`, `is_delta`,
  `delta_order`); the original's pair (version=<cur>, depend=<depend>) maps to the same name.
- Data layout (the server's --data_dir, the agent's deploy_path/data): `VERSION` names the
  version to serve at start (its first line; missing or blank: none), `<version>/` holds
  `index.cube` + `data.cube`, and a delta's `CHAIN` lists its chain, base first, ending with it.
- Value widths: a delta keeps its chain's value width (`value_widths`, `width_change`).
- Tables: a version of a model with several sparse tables holds, in each shard directory (build
  output part, tar, and the server's `<version>/`), a `TABLES` file listing the table names
  (`parse_tables`, `tables_text`) and one `<table>/` with `index.cube` + `data.cube` per
  table; a version without `TABLES` is one unnamed table, as before. Every layer of a chain
  has the same tables.
- Tar members a shard tar may hold: plain files and directories with relative names that stay
  inside the target (`member_problem`).
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import PurePosixPath
from typing import TypeGuard

VERSION_FILE = "VERSION"
CHAIN_FILE = "CHAIN"
TABLES_FILE = "TABLES"
MAX_TABLES = 256  # tables of one version (a DLRM has 26)
# names a table may not have: a version directory's own files (a delta's CHAIN beside a table
# called CHAIN; the shard files of a version of one table)
RESERVED_TABLE_NAMES = frozenset({VERSION_FILE, CHAIN_FILE, TABLES_FILE, "index.cube", "data.cube"})
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = "letters, digits, '.', '_', '-'; at most 128 characters; no '..'"


class LayoutError(ValueError):
    """A name, VERSION or CHAIN that breaks the contract; the message says which and why."""


# ---------------------------------------------------------------------------------------------
# names


def is_name(value: object) -> TypeGuard[str]:
    """A dict or version name: one path component, no '..'."""
    return isinstance(value, str) and bool(NAME_RE.fullmatch(value)) and ".." not in value


def part_name(dict_name: str, shard: int) -> str:
    """A shard's build directory (and, with .tar, its archive): `<dict>_part<shard>`."""
    return f"{dict_name}_part{shard}"


def tar_name(dict_name: str, shard: int) -> str:
    return f"{part_name(dict_name, shard)}.tar"


# A shard's build directory `<dict>_part<shard>` as part_name writes it (a shard number without
# leading zeros), and what build output looks like: those directories, their tars and md5s.
PART_NAME_RE = re.compile(r"(?P<dict>.+)_part(?P<shard>0|[1-9][0-9]{0,5})")
PART_RE = re.compile(rf"{PART_NAME_RE.pattern}(\.tar(\.md5)?)?")


def output_dir_name(depend: str, cur: str) -> str:
    """The builder's output directory of a version: `<depend>_<cur>` (a base: `<d>_<d>`)."""
    return f"{depend}_{cur}"


def served_version(depend: str, cur: str, is_base: bool) -> str:
    """The version name servers and agents use: `<depend>` for a base, else `<depend>_<cur>`."""
    return str(depend) if is_base else output_dir_name(depend, cur)


def served_name(dir_name: str) -> str:
    """The version an output directory `<depend>_<cur>` is served as: `<d>` for a base's
    `<d>_<d>`, else the name itself."""
    base, sep, cur = dir_name.rpartition("_")
    return base if sep and base == cur else dir_name


def base_of(name: str) -> str:
    """`<base>_<cur>` -> `<base>`; a base is its own base (`X_X` too, the builder's base dir)."""
    if "_" not in name:
        return name
    base, _, cur = name.rpartition("_")
    return name if base == cur else base


def is_delta(name: str) -> bool:
    return base_of(name) != name


def delta_order(name: str) -> tuple[int, int, str]:
    """Sort deltas of one base by their `<cur>` part: numerically when it is a number."""
    cur = name.rpartition("_")[2]
    return (0, int(cur), "") if cur.isdigit() else (1, 0, cur)


# ---------------------------------------------------------------------------------------------
# VERSION and CHAIN


def parse_version(text: str) -> str | None:
    """The version VERSION names: its first line, stripped; None when blank."""
    lines = text.strip().splitlines()
    return lines[0].strip() if lines and lines[0].strip() else None


def version_text(name: str) -> str:
    return f"{name}\n"


def chain_text(chain: Sequence[str]) -> str:
    return "".join(f"{name}\n" for name in chain)


def parse_chain(text: str, name: str) -> list[str]:
    """The chain a CHAIN file of version `name` lists, checked: version names, base first,
    ending with `name`, no repeats, one base. LayoutError says what is wrong."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or lines[-1] != name or lines[0] != base_of(name):
        raise LayoutError(
            f"a chain must start with the base {base_of(name)!r} and end with {name!r},"
            f" got {lines[:8]!r}"
        )
    if not all(map(is_name, lines)):
        raise LayoutError(f"a chain lists only version names, got {lines[:8]!r}")
    if len(set(lines)) != len(lines) or any(base_of(n) != lines[0] for n in lines):
        raise LayoutError(f"bad chain {lines[:8]!r} (a repeat, or a delta of another base)")
    return lines


# ---------------------------------------------------------------------------------------------
# TABLES


def tables_text(names: Sequence[str]) -> str:
    """A TABLES file's text; the names are checked as `parse_tables` checks them."""
    text = "".join(f"{name}\n" for name in names)
    parse_tables(text)
    return text


def parse_tables(text: str) -> list[str]:
    """The table names a TABLES file lists, in order, checked: one name a line (blank lines
    ignored), each a name (`is_name`) and none of RESERVED_TABLE_NAMES, no repeats, 1 to
    MAX_TABLES of them."""
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise LayoutError("a TABLES file lists no table")
    if len(names) > MAX_TABLES:
        raise LayoutError(f"a TABLES file lists {len(names)} tables, more than {MAX_TABLES}")
    bad = [name for name in names if not is_name(name)]
    if bad:
        raise LayoutError(f"table names must be {NAME_RULE}: got {clip(bad[0])}")
    reserved = [name for name in names if name in RESERVED_TABLE_NAMES]
    if reserved:
        raise LayoutError(
            f"a table may not be called {clip(reserved[0])} (a version directory's own file)"
        )
    if len(set(names)) != len(names):
        repeated = sorted({name for name in names if names.count(name) > 1})
        raise LayoutError(f"a TABLES file lists {clip(repeated[0])} more than once")
    return names


# ---------------------------------------------------------------------------------------------
# tar members


def member_problem(member: tarfile.TarInfo) -> str | None:
    """Why a shard tar member may not be extracted, or None when it is a plain file or
    directory whose relative name stays inside the target."""
    name = member.name
    if name.startswith("/") or PurePosixPath(name).is_absolute():
        return "absolute path"
    if ".." in PurePosixPath(name).parts:
        return "path leaves the target directory ('..')"
    if "\\" in name or "\x00" in name:
        return "backslash or NUL in the name"
    if member.issym():
        return f"symlink (to {clip(member.linkname)})"
    if member.islnk():
        return f"hard link (to {clip(member.linkname)})"
    if member.ischr() or member.isblk():
        return "device file"
    if member.isfifo():
        return "fifo"
    if not (member.isreg() or member.isdir()):
        return f"unsupported member type {member.type!r}"
    return None


def clip(value: object, limit: int = 100) -> str:
    """A value for a message, quoted and cut (a name or a request field can be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------
# value widths


def value_widths(shards: Iterable[tuple[int, int]]) -> frozenset[int]:
    """The value widths of the shards that hold values, from (record_count, value_width) per
    shard as their headers say (width 0: values of varying width). Empty: no values at all."""
    return frozenset(width for records, width in shards if records)


def describe_widths(widths: AbstractSet[int]) -> str:
    """`8-byte values`, or `values of varying width`."""
    if len(widths) == 1 and 0 not in widths:
        return f"{next(iter(widths))}-byte values"
    return "values of varying width"


def width_change(chain: AbstractSet[int], delta: AbstractSet[int]) -> tuple[str, str] | None:
    """Whether a delta would change the value width of a fixed-width dictionary: (the chain's
    widths, the delta's) described when it would, else None. `chain`: `value_widths` of the
    versions the delta goes over; `delta`: its own. Why it matters: a server serves such a
    chain as variable-width, and a client reading fixed-width values (get_embeddings) fails
    on every lookup. Nothing to compare when the delta holds no value (empty, or deletions
    only) or the chain none; a chain whose values vary already is not fixed-width."""
    if len(chain) != 1 or 0 in chain or not delta or delta == chain:
        return None
    return describe_widths(chain), describe_widths(delta)
