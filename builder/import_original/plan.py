"""cube-import's plan: the sources' versions in families (a base and its patches), in order,
with the shards each needs; what cannot be imported is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cube.builder.import_original.base import ImportError_
from cube.builder.import_original.discover import Inventory, parse_version_name
from cube.builder.import_original.files import _Files, list_source, plan_source
from cube.layout import (
    served_version,
)
from cube.original_format import (
    Layer,
    order_layers,
)


@dataclass(frozen=True)
class Version:
    original: str  # the original's name of it
    depend: int
    cur: int
    is_base: bool

    @property
    def served(self) -> str:
        return served_version(str(self.depend), str(self.cur), self.is_base)


@dataclass
class Plan:
    families: list[list[Version]]  # each: a base then its patches, in order
    layers: dict[tuple[str, int], Layer]
    shards: list[int]
    served: str | None
    files: dict[tuple[str, int], _Files] = field(default_factory=dict)  # as checked


def keep_shard(inventory: Inventory, shard: int | None) -> int:
    """-data_dir: the one shard to import (-shard, or the only one found); the inventory keeps
    only its sources, so that nothing else is opened or hashed."""
    shards = sorted({source.shard for source in inventory.sources.values()})
    if shard is None:
        if len(shards) != 1:
            raise ImportError_(
                f"the input holds shards {', '.join(map(str, shards))}; a data directory "
                "serves one: give -shard"
            )
        shard = shards[0]
    if shard not in shards:
        raise ImportError_(
            f"no shard {shard} in the input (it holds {', '.join(map(str, shards))})"
        )
    inventory.sources = {k: s for k, s in inventory.sources.items() if s.shard == shard}
    return shard


def make_plan(inventory: Inventory, shard_num: int, check_md5: bool) -> Plan:
    """Every source's layer checked (tars against their .md5 files too), the versions grouped
    by base and ordered."""
    layers: dict[tuple[str, int], Layer] = {}
    checked: dict[tuple[str, int], _Files] = {}
    parsed: dict[str, tuple[int, int]] = {}
    for key, source in sorted(inventory.sources.items()):
        if source.shard >= shard_num:
            raise ImportError_(
                f"{source.path} is shard {source.shard}, but -shard_num is {shard_num}"
            )
        checked[key] = list_source(source, check_md5)
        layers[key] = plan_source(source, checked[key])
        pair = parse_version_name(source.version)
        assert pair is not None, source  # every name came through version_name
        parsed[source.version] = pair
        if layers[key].no_files and pair[0] != pair[1]:
            raise ImportError_(
                f"{source.path}: an empty shard, but version {source.version} is a patch, and "
                "the original writes data.n and index.n into every shard of a patch (an "
                "incomplete copy?)"
            )
    by_depend: dict[int, list[str]] = {}
    for name in sorted(parsed):
        by_depend.setdefault(parsed[name][0], []).append(name)
    shards = sorted({shard for _version, shard in layers})
    families = []
    for depend, members in sorted(by_depend.items()):
        order: list[str] | None = None
        for shard in shards:
            mine = {v: layers[(v, shard)] for v in members if (v, shard) in layers}
            if not mine:
                continue
            if set(mine) != set(members):
                lacking = sorted(set(members) - set(mine))
                raise ImportError_(
                    f"shard {shard} lacks version(s) {', '.join(lacking)} of base {depend} that "
                    "other shards have"
                )
            found = order_layers(mine, {v: parsed[v][1] for v in mine})
            if order is not None and found != order:
                raise ImportError_(
                    f"the shards disagree on the order of the versions of base {depend}: "
                    f"{', '.join(order)} vs {', '.join(found)}"
                )
            order = found
        assert order is not None
        versions = []
        for name in order:
            is_base = name == order[0]
            dep, cur = parsed[name]
            if is_base != (dep == cur):
                raise ImportError_(_misnamed(name, is_base))
            versions.append(Version(name, dep, cur, is_base))
            if all(layers[(name, shard)].no_files for shard in shards):
                inventory.notes.append(_empty_note(name, shards))
        families.append(versions)
    return Plan(families, layers, shards, inventory.served, checked)


def _empty_note(name: str, shards: Sequence[int]) -> str:
    """A version without records where it is imported (one empty shard among others is not
    worth a word). The original builder leaves an empty directory and a tar of ./ for a base
    shard that got no record; imported, it is an empty shard."""
    if len(shards) == 1:
        return (
            f"version {name} shard {shards[0]} holds no record (an empty directory or a tar "
            "of ./ only, what the original builder leaves for a shard that got none): "
            "imported as an empty shard"
        )
    return (
        f"version {name}: none of its {len(shards)} shards holds a record (each an empty "
        "directory or a tar of ./ only, what the original builder leaves for a base built "
        "from no input): imported as empty shards"
    )


def _misnamed(name: str, is_base: bool) -> str:
    if is_base:
        return (
            f"version {name}: its name says patch, but it holds a base's files (index.0): "
            "which version brought which file is lost, as when a deployment's data/<version>/ "
            "holds copies rather than the agent's links into cube_data/; give the deployment's "
            "cube_data/ (or the builder's output) instead"
        )
    return (
        f"version {name}: its name says base, but it holds a patch's files (no index.0): a "
        "patch's directory renamed? give it its <depend>_<cur> name"
    )
