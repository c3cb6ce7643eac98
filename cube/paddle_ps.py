"""PaddlePaddle parameter-server sparse tables as text, what `fleet.save_persistables` writes:
the accessors' row layouts, which columns become a served value, and the parser from bytes to
(uint64 keys, value rows).

Pure: bytes in, arrays out, no I/O. cube-builder's shell (`cube.builder.paddle_ps`) finds the
table in a save directory and reads its part files; docs/INPUT_FORMATS.md is the user's page.

A row is `key` then the accessor's float columns, space-separated, written by C++ `ostream`
with 6 significant digits (Paddle's `ParseToString`):

    slot unseen_days delta_score show click embed_w [embed optimizer state]
        embedx_w x embedx_dim [embedx optimizer state]

The embedx part (from embedx_w on) is written only for rows whose show/click score reached the
table's `embedx_threshold`: a "short" row. Its embedx_w is served as zeros, which is what the
trainer's own lookup returns for such a key (tests/test_paddle_ps.py compares with it).

A table of one weight per key (a DeepFM's first-order table: `sparse_embedding(size=[_, 3])`
with CtrCommonAccessor, `size=[_, 1]` with SparseAccessor) has embedx_dim 0: no embedx_w, and
its embedx part is the embedx rule's state alone. Adagrad (and adagrad_v2, and shared_adam's
gsum and g2sum) divide that state's update by embedx_dim, 0 / 0: Paddle writes it `-nan`
(`nan` elsewhere than glibc on x86), the one non-number a row may hold, and only there
(`TableLayout.nan_columns`). Such a table serves embed_w alone by default.

The parser's contract: a served value is `dtype(float64(text))`, numpy's conversion of the
correctly rounded double, byte for byte what a SequenceFile of the same rows holds when its
writer converts the same way. The compiled parser (`cube._paddle_ps_jit`, numba) gets the
double exactly for the decimals Paddle prints (Clinger's fast path: <= 19 digits and a power of
ten <= 22, one correctly rounded operation) and hands every other token to Python's `float`;
the numpy parser below is the fallback without numba and the oracle the tests compare with.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cube.kernel_constants import COMPILED

# ---------------------------------------------------------------------------------------------
# Layouts


@dataclass(frozen=True)
class Accessor:
    """One of Paddle's sparse-table accessors (paddle/fluid/distributed/ps/table/*_accessor.cc)."""

    name: str  # our flag value
    paddle_class: str  # accessor_class in Paddle's config
    non_embedx: int  # D - embedx_dim: the lookup's columns before embedx_w
    lookup: tuple[str, ...]  # the value fields the trainer's own lookup returns, in order
    # "rules": slot unseen_days delta_score show click embed_w [embed state] embedx_w...
    # [embedx state] (ctr_common_accessor.cc, sparse_accessor.cc); "double": unseen_days
    # delta_score show click embed_w embed_g2sum slot [embedx_g2sum embedx_w...]
    # (ctr_double_accessor.cc ParseToString: one g2sum per part whatever the rule)
    order: str = "rules"


ACCESSORS = {
    a.name: a
    for a in (
        Accessor("ctr_common", "CtrCommonAccessor", 3, ("show", "click", "embed_w", "embedx_w")),
        Accessor("sparse", "SparseAccessor", 1, ("embed_w", "embedx_w")),
        Accessor(
            "ctr_double",
            "CtrDoubleAccessor",
            3,
            ("show", "click", "embed_w", "embedx_w"),
            order="double",
        ),
    )
}
# CtrDoubleAccessor keeps one g2sum float per part: only rules whose state is that one number
# (or none: naive leaves it at its initial value) fit its value.
DOUBLE_RULES = ("adagrad", "adagrad_v2", "naive")
# The rules whose update divides their state by the part's dim (sparse_sgd_rule.cc): at
# embedx_dim 0 that state is 0 / 0, NaN, and Paddle saves it as `-nan`.
_DIVIDING_RULES = ("adagrad", "adagrad_v2", "shared_adam")
# The texts of such a NaN: glibc's ostream writes the default NaN of x86 (sign bit set) as -nan
NAN_TOKENS = (b"-nan", b"nan")
# The other accessors Paddle has, and why their saves are not read (docs/INPUT_FORMATS.md).
UNSUPPORTED_ACCESSORS = {
    "CtrDymfAccessor": "GPU parameter server only (its CPU update is a no-op); each row has "
    "its own embedx width (mf_dim, per slot) and another column order",
    "DownpourCtrAccessor": "the legacy (pslib) layout, with its own column order",
    "DownpourCtrDoubleAccessor": "the legacy (pslib) layout, with its own column order",
    "CommMergeAccessor": "dense and barrier tables: not an embedding table",
    "TensorAccessor": "dense tensors: not an embedding table",
}


@dataclass(frozen=True)
class SgdRule:
    """An optimizer rule of a sparse table (sparse_sgd_rule.h) and the state it saves."""

    name: str
    paddle_class: str

    def state(self, prefix: str, dim: int) -> tuple[str, ...]:
        """Names of the state columns it keeps for a part of `dim` weights."""
        if self.name == "naive":
            return ()
        if self.name in ("adagrad", "adagrad_v2"):
            return (f"{prefix}_g2sum",)
        if self.name == "std_adagrad":
            return tuple(f"{prefix}_g2sum[{i}]" for i in range(dim))
        if self.name == "adam":
            return (
                *(f"{prefix}_gsum[{i}]" for i in range(dim)),
                *(f"{prefix}_g2sum[{i}]" for i in range(dim)),
                f"{prefix}_beta1_pow",
                f"{prefix}_beta2_pow",
            )
        if self.name == "shared_adam":
            return tuple(f"{prefix}_{s}" for s in ("gsum", "g2sum", "beta1_pow", "beta2_pow"))
        raise ValueError(f"unknown optimizer rule {self.name}")


SGD_RULES = {
    r.name: r
    for r in (
        SgdRule("naive", "SparseNaiveSGDRule"),
        SgdRule("adagrad", "SparseAdaGradSGDRule"),
        SgdRule("adagrad_v2", "SparseAdaGradV2SGDRule"),
        SgdRule("std_adagrad", "StdAdaGradSGDRule"),
        SgdRule("adam", "SparseAdamSGDRule"),
        SgdRule("shared_adam", "SparseSharedAdamSGDRule"),
    )
}
# What shard headers and meta_info record as the key format of a save: "cube", the keys are
# the uint64s themselves (as in a Cube-dialect SequenceFile), so a save builds the same bytes
# as a SequenceFile of its rows.
KEY_FORMAT = "cube"
VALUE_FIELDS = ("show", "click", "embed_w", "embedx_w")
DTYPES = ("float32", "float16", "float64")
DEFAULT_VALUE = ("embed_w", "embedx_w")
_LEADING = ("slot", "unseen_days", "delta_score", "show", "click", "embed_w")
_DOUBLE_LEADING = (
    "unseen_days",
    "delta_score",
    "show",
    "click",
    "embed_w",
    "embed_g2sum",
    "slot",
)


@dataclass(frozen=True)
class TableLayout:
    """The float columns of one sparse table's rows: accessor, the model's embedding size D
    (`sparse_embedding(size=[_, D])`) and the optimizer rule of each part."""

    accessor: Accessor
    dim: int
    embed_rule: SgdRule
    embedx_rule: SgdRule

    def __post_init__(self) -> None:
        if self.dim < self.accessor.non_embedx:
            before = ", ".join(f for f in self.accessor.lookup if f != "embedx_w")
            raise ValueError(
                f"an embedding size of {self.dim} is less than the {self.accessor.non_embedx} "
                f"columns of a {self.accessor.name} lookup before its embedx part ({before}): "
                f"-paddle_dim >= {self.accessor.non_embedx}"
            )
        if self.accessor.order == "double":
            for rule in (self.embed_rule, self.embedx_rule):
                if rule.name not in DOUBLE_RULES:
                    raise ValueError(
                        f"{self.accessor.paddle_class} with {rule.paddle_class}: its value keeps "
                        f"one g2sum per part, which only {', '.join(DOUBLE_RULES)} fit"
                    )

    @property
    def embedx_dim(self) -> int:
        return self.dim - self.accessor.non_embedx

    @property
    def columns(self) -> tuple[str, ...]:
        """Every float column of a full row, in order (the key not counted)."""
        if self.accessor.order == "double":
            embedx = (f"embedx_w[{i}]" for i in range(self.embedx_dim))
            return (*_DOUBLE_LEADING, "embedx_g2sum", *embedx)
        return (
            *_LEADING,
            *self.embed_rule.state("embed", 1),
            *(f"embedx_w[{i}]" for i in range(self.embedx_dim)),
            *self.embedx_rule.state("embedx", self.embedx_dim),
        )

    @property
    def full(self) -> int:
        """Floats after the key in a full row."""
        return len(self.columns)

    @property
    def short(self) -> int:
        """Floats after the key in a row saved without its embedx part."""
        if self.accessor.order == "double":
            return len(_DOUBLE_LEADING)
        return len(_LEADING) + len(self.embed_rule.state("embed", 1))

    @property
    def embedx_start(self) -> int:
        return self.short + (1 if self.accessor.order == "double" else 0)

    @property
    def nan_columns(self) -> tuple[int, ...]:
        """The columns Paddle writes as NaN (`-nan`) in a table without embedx_w (embedx_dim
        0): the embedx rule's state its update divides by embedx_dim (sparse_sgd_rule.cc:
        adagrad's and adagrad_v2's g2sum, shared_adam's gsum and g2sum; CtrDoubleAccessor's
        one embedx_g2sum with those rules). Empty for every other layout: no NaN anywhere."""
        if self.embedx_dim or self.embedx_rule.name not in _DIVIDING_RULES:
            return ()
        names: tuple[str, ...] = ("embedx_gsum", "embedx_g2sum")
        if self.accessor.order == "double":
            names = ("embedx_g2sum",)  # its one g2sum: naive leaves it at its initial value
        return tuple(c for c, name in enumerate(self.columns) if name in names)

    def field_columns(self, field: str) -> list[int]:
        """The columns of one value field."""
        if field == "embedx_w":
            return list(range(self.embedx_start, self.embedx_start + self.embedx_dim))
        return [self.columns.index(field)]

    def checks(self) -> list[tuple[int, str]]:
        """The invariants of a row, (column, kind): "integer" (slot), "count" (an integer >= 0:
        unseen_days), "nonneg" (delta_score, show, click, every g2sum), "pow" (adam's beta
        powers, in (0, 1]), "nonneg_or_nan" and "any_or_nan" (the `nan_columns`: NaN, or >= 0
        for a g2sum); and show >= click, checked with the "click" entry. What a table
        written by this layout always satisfies, and another layout's rows read with these
        flags almost never do (column counts alone cannot tell layouts apart)."""
        found = []
        nan = self.nan_columns
        for column, name in enumerate(self.columns):
            base = name.split("[")[0]
            if column in nan:  # -nan, or a number of the column's own kind
                found.append((column, "nonneg_or_nan" if base.endswith("g2sum") else "any_or_nan"))
            elif name == "slot":
                found.append((column, "integer"))
            elif name == "unseen_days":
                found.append((column, "count"))
            elif name in ("delta_score", "show", "click") or base.endswith("g2sum"):
                found.append((column, "nonneg"))
            elif base.endswith(("beta1_pow", "beta2_pow")):
                found.append((column, "pow"))
        return found

    def describe(self) -> str:
        rules = (
            self.embed_rule.name
            if self.embed_rule == self.embedx_rule
            else f"{self.embed_rule.name},{self.embedx_rule.name}"
        )
        return f"{self.accessor.name} (dim {self.dim}, optimizer {rules})"


@dataclass(frozen=True)
class ValueSpec:
    """Which columns make the served value, in order, and their type. `fields` empty: the
    default (`DEFAULT_VALUE`: embed_w and the embedx_w, embed_w alone for a table without
    embedx_w); named (-paddle_value), each must be a column of the table (`check`)."""

    fields: tuple[str, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        unknown = [f for f in self.fields if f not in VALUE_FIELDS]
        if unknown:
            raise ValueError(
                f"-paddle_value {','.join(self.fields)!r}: each field one of "
                f"{', '.join(VALUE_FIELDS)} (not {', '.join(unknown)})"
            )
        if len(set(self.fields)) != len(self.fields):
            raise ValueError(f"-paddle_value {','.join(self.fields)}: a field is named twice")
        if self.dtype not in DTYPES:
            raise ValueError(f"-paddle_dtype {self.dtype!r}: one of {', '.join(DTYPES)}")

    @property
    def names(self) -> tuple[str, ...]:
        """The fields served, in order."""
        return self.fields or DEFAULT_VALUE

    def check(self, layout: TableLayout) -> None:
        """ValueError when -paddle_value names embedx_w for a table without it (embedx_dim 0):
        a value naming it would hold none of it, unlike what the flag says."""
        if "embedx_w" in self.fields and not layout.embedx_dim:
            rest = ",".join(f for f in self.fields if f != "embedx_w")
            raise ValueError(
                f"-paddle_value {','.join(self.fields)}: {layout.describe()} has no embedx_w "
                f"(embedx_dim 0: one weight per key, its lookup "
                f"{', '.join(f for f in layout.accessor.lookup if f != 'embedx_w')}); name "
                + (f"{rest} without embedx_w, or " if rest else "")
                + "leave -paddle_value out (embed_w alone is served)"
            )

    def targets(self, layout: TableLayout) -> np.ndarray:
        """For each float column of a full row, its place in the value (or -1: not served)."""
        target = np.full(layout.full, -1, dtype=np.int64)
        place = 0
        for field in self.names:
            for column in layout.field_columns(field):
                target[column] = place
                place += 1
        return target

    def count(self, layout: TableLayout) -> int:
        return sum(len(layout.field_columns(f)) for f in self.names)

    def width(self, layout: TableLayout) -> int:
        """Bytes per served value."""
        return self.count(layout) * np.dtype(self.dtype).itemsize


def parse_value_fields(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def accessor_named(name: str) -> Accessor:
    """Our name (ctr_common, sparse) or Paddle's class name; ValueError naming the others."""
    for accessor in ACCESSORS.values():
        if name in (accessor.name, accessor.paddle_class):
            return accessor
    if name in UNSUPPORTED_ACCESSORS:
        raise ValueError(f"accessor {name} is not supported: {UNSUPPORTED_ACCESSORS[name]}")
    known = ", ".join(f"{a.name} ({a.paddle_class})" for a in ACCESSORS.values())
    raise ValueError(f"unknown accessor {name!r}: one of {known}")


def rule_named(name: str) -> SgdRule:
    for rule in SGD_RULES.values():
        if name in (rule.name, rule.paddle_class):
            return rule
    known = ", ".join(f"{r.name} ({r.paddle_class})" for r in SGD_RULES.values())
    raise ValueError(f"unknown optimizer rule {name!r}: one of {known}")


def rules_named(text: str) -> tuple[SgdRule, SgdRule]:
    """-paddle_optimizer: one rule for both parts, or `embed_rule,embedx_rule`."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        rule = rule_named(parts[0])
        return rule, rule
    if len(parts) == 2:
        return rule_named(parts[0]), rule_named(parts[1])
    raise ValueError(f"-paddle_optimizer {text!r}: one rule, or two (embed,embedx)")


def candidate_layouts(floats: int) -> list[tuple[TableLayout, bool]]:
    """Every layout (accessor, one rule for both parts, embedx_dim 0 up to dim 4096) whose
    rows can have `floats` numbers after the key, each with whether such a row is a short one
    (its dim then unknown: the layout is given at its least dim)."""
    found = []
    for accessor in ACCESSORS.values():
        for rule in SGD_RULES.values():
            if accessor.order == "double" and rule.name not in DOUBLE_RULES:
                continue
            least = TableLayout(accessor, accessor.non_embedx + 1, rule, rule)
            if least.short == floats:
                found.append((least, True))
            for dim in range(accessor.non_embedx, 4097):
                layout = TableLayout(accessor, dim, rule, rule)
                if layout.full == floats:
                    found.append((layout, False))
                if layout.full >= floats:
                    break
    return found


# ---------------------------------------------------------------------------------------------
# Paddle's own configuration: the PSParameter text (fleet_desc.prototxt, the_one_ps's desc)


@dataclass(frozen=True)
class TableConfig:
    """What a PSParameter says about one table (downpour_table_param)."""

    table_id: int
    table_class: str
    table_type: str  # PS_SPARSE_TABLE, PS_DENSE_TABLE, ...
    table_name: str  # common.table_name: the embedding's parameter name
    accessor_class: str
    embedx_dim: int
    embedx_threshold: float
    embed_rule: str
    embedx_rule: str
    converter: bool = False  # a table_accessor_save_param sets a converter (sparse_converter)

    @property
    def sparse(self) -> bool:
        return self.table_type == "PS_SPARSE_TABLE" or (
            not self.table_type and "Sparse" in self.table_class
        )

    @property
    def folder(self) -> str:
        """The save's folder of this table (table_id, 3 digits)."""
        return f"{self.table_id:03d}"

    def layout(self) -> TableLayout:
        if self.converter:
            raise ValueError(
                f"table {self.table_id} ({self.table_name}) sets a save converter "
                "(sparse_converter: table_accessor_save_param.converter): its base and delta "
                "saves are that program's output, not Paddle's rows, and cannot be read as "
                "them; build from saves written without a converter"
            )
        accessor = accessor_named(self.accessor_class)
        return TableLayout(
            accessor,
            self.embedx_dim + accessor.non_embedx,
            rule_named(self.embed_rule or "SparseAdamSGDRule"),
            rule_named(self.embedx_rule or "SparseAdamSGDRule"),
        )


_TOKEN = re.compile(
    rb"""\s*(?:(\#[^\n]*)|("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')|([{}<>:;,\[\]])|([^\s{}<>:;,\[\]"'#]+))""",
    re.S,
)
_Message = list[tuple[str, Any]]


def _protobuf_text(text: bytes, source: str) -> _Message:
    """A protobuf text-format message as nested (field, value) lists: scalars as their token
    text (quotes removed), sub-messages as lists. Enough of the format for Paddle's configs."""
    tokens = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match or match.end() == pos:
            if text[pos:].strip():
                raise ValueError(f"{source}: not protobuf text at byte {pos}")
            break
        pos = match.end()
        comment, quoted, mark, word = match.groups()
        if comment is not None:
            continue
        if quoted is not None:
            tokens.append(("s", quoted[1:-1].decode("utf-8", "replace")))
        elif mark is not None:
            tokens.append((mark.decode(), ""))
        elif word is not None:
            tokens.append(("w", word.decode("utf-8", "replace")))
    stack: list[_Message] = [[]]
    index = 0
    while index < len(tokens):
        kind, value = tokens[index]
        if kind in ("}", ">"):
            if len(stack) == 1:
                raise ValueError(f"{source}: unbalanced {kind}")
            stack.pop()
            index += 1
            continue
        if kind in (";", ","):
            index += 1
            continue
        if kind != "w":
            raise ValueError(f"{source}: a field name expected, found {value or kind!r}")
        name = value
        index += 1
        if index < len(tokens) and tokens[index][0] == ":":
            index += 1
        if index < len(tokens) and tokens[index][0] in ("{", "<"):
            child: _Message = []
            stack[-1].append((name, child))
            stack.append(child)
            index += 1
            continue
        if index >= len(tokens) or tokens[index][0] not in ("w", "s"):
            raise ValueError(f"{source}: field {name} has no value")
        stack[-1].append((name, tokens[index][1]))
        index += 1
    if len(stack) != 1:
        raise ValueError(f"{source}: a message is not closed")
    return stack[0]


def _fields(message: _Message, name: str) -> Iterator[Any]:
    return (value for key, value in message if key == name)


def _first(message: _Message, name: str, default: Any = None) -> Any:
    return next(_fields(message, name), default)


def _walk(message: _Message, name: str) -> Iterator[_Message]:
    """Every sub-message called `name`, at any depth."""
    for key, value in message:
        if isinstance(value, list):
            if key == name:
                yield value
            else:
                yield from _walk(value, name)


def parse_fleet_desc(text: bytes, source: str) -> list[TableConfig]:
    """The tables of a PSParameter in text format (its worker and server parts list the same
    tables: each table_id once). ValueError naming `source` when it is not one."""
    tables: dict[int, TableConfig] = {}
    for param in _walk(_protobuf_text(text, source), "downpour_table_param"):
        try:
            table_id = int(_first(param, "table_id", "-1"))
            accessor = _first(param, "accessor", [])
            common = _first(param, "common", [])
            embed = _first(accessor, "embed_sgd_param", [])
            embedx = _first(accessor, "embedx_sgd_param", [])
            config = TableConfig(
                table_id=table_id,
                table_class=str(_first(param, "table_class", "")),
                table_type=str(_first(param, "type", "")),
                table_name=str(_first(common, "table_name", "")),
                accessor_class=str(_first(accessor, "accessor_class", "")),
                embedx_dim=int(_first(accessor, "embedx_dim", "0")),
                embedx_threshold=float(_first(accessor, "embedx_threshold", "0")),
                embed_rule=str(_first(embed, "name", "")),
                embedx_rule=str(_first(embedx, "name", "")),
                converter=any(
                    str(_first(save, "converter", "")).strip()
                    for save in _fields(accessor, "table_accessor_save_param")
                    if isinstance(save, list)
                ),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: a downpour_table_param is malformed ({exc})") from None
        if table_id >= 0:
            tables.setdefault(table_id, config)
    if not tables:
        raise ValueError(f"{source}: no downpour_table_param (not a Paddle PSParameter)")
    return [tables[t] for t in sorted(tables)]


# ---------------------------------------------------------------------------------------------
# What the user said (cube-builder's -paddle_* flags)


def check_layout_flags(accessor: str, optimizer: str, dim: int) -> None:
    """Each layout flag given, on its own (ValueError naming the bad one); "" and 0 are not
    given (the configuration says them)."""
    if accessor:
        accessor_named(accessor)
    if optimizer:
        rules_named(optimizer)
    if dim < 0:
        raise ValueError(f"-paddle_dim must be > 0, got {dim}")


@dataclass(frozen=True)
class PaddleSource:
    """How to read a save: the -paddle_* flags, and the tables of -paddle_config. The layout
    comes from the flags, from the configuration's entry for the chosen table, or from both
    when they agree (`layout_for`)."""

    accessor: str = ""  # "" = from the configuration
    dim: int = 0  # the model's embedding size D; 0 = from the configuration
    optimizer: str = ""  # one rule, or embed,embedx; "" = from the configuration
    table: str = ""  # a folder name, table id or (with a configuration) table name
    value: ValueSpec = ValueSpec()
    config: tuple[TableConfig, ...] = ()
    config_name: str = ""  # where the configuration came from, for messages

    def __post_init__(self) -> None:
        check_layout_flags(self.accessor, self.optimizer, self.dim)
        if not self.config and not (self.accessor and self.dim and self.optimizer):
            missing = [
                f"-{flag}"
                for flag, given in (
                    ("paddle_accessor", self.accessor),
                    ("paddle_dim", self.dim),
                    ("paddle_optimizer", self.optimizer),
                )
                if not given
            ]
            raise ValueError(
                f"-input_format paddle_ps needs {', '.join(missing)} (the row layout), or "
                "-paddle_config (the trainer's PSParameter text, which names them)"
            )

    @property
    def sparse_tables(self) -> list[TableConfig]:
        return [t for t in self.config if t.sparse]

    def config_for(self, folder: str) -> TableConfig | None:
        return next((t for t in self.config if t.folder == folder), None)

    def layout_for(self, table: TableConfig | None) -> TableLayout:
        """The layout of the table in `folder` (its configuration entry, if any): each of
        accessor, dim and optimizer from the flag or the configuration, which must agree."""
        accessor = accessor_named(self.accessor) if self.accessor else None
        dim = self.dim or None
        rules = rules_named(self.optimizer) if self.optimizer else None
        if table is not None:
            configured = table.layout()
            where = f"{self.config_name} (table {table.table_id}, {table.table_name})"
            if accessor and accessor != configured.accessor:
                raise ValueError(
                    f"-paddle_accessor {accessor.name}, but {where} says "
                    f"{configured.accessor.paddle_class}"
                )
            if dim and dim != configured.dim:
                raise ValueError(
                    f"-paddle_dim {dim}, but {where} says embedx_dim "
                    f"{configured.embedx_dim}: dim {configured.dim}"
                )
            both = (configured.embed_rule, configured.embedx_rule)
            if rules and rules != both:
                raise ValueError(
                    f"-paddle_optimizer {self.optimizer}, but {where} says "
                    f"{both[0].paddle_class},{both[1].paddle_class}"
                )
            return configured
        if accessor is None or dim is None or rules is None:
            raise ValueError(
                f"{self.config_name} has no entry for this table: give -paddle_accessor, "
                "-paddle_dim and -paddle_optimizer"
            )
        return TableLayout(accessor, dim, *rules)

    def names(self, folder: str) -> bool:
        """Whether -paddle_table names this folder (by its name, its number, or the table
        name the configuration gives it)."""
        wanted = self.table
        if not wanted:
            return False
        if folder == wanted or (
            wanted.isdigit() and folder.isdigit() and int(folder) == int(wanted)
        ):
            return True
        table = self.config_for(folder)
        return table is not None and table.table_name == wanted


# ---------------------------------------------------------------------------------------------
# Finding the table in a save

SPARSE_PART = re.compile(r"part-\d+-\d+(\.gz)?")  # part-<server>-<shard>: one per table shard
DENSE_PART = re.compile(r"part-\d+(\.gz)?")  # part-<server>: a dense table's parameters


def sparse_folder_problem(names: list[str], first_row: bytes | None) -> str:
    """Why a numbered folder of a save is not a sparse table ("" when it is one): its files
    must be part-<server>-<shard>[.gz] (Paddle's sparse tables; a dense table writes
    part-<server>), and its first row a key then at least 6 numbers (a dense row is 1 to 3
    numbers, no key). `first_row`: the first line of the first non-empty file (None: all empty)."""
    if not names:
        return "no files"
    if all(DENSE_PART.fullmatch(n) for n in names):
        return f"dense parameters ({names[0]})"
    others = [n for n in names if not SPARSE_PART.fullmatch(n)]
    if others:
        return f"not part-<server>-<shard> files ({others[0]})"
    if first_row is None:
        return ""
    fields = _SEPARATORS.split(first_row.strip(b" \t\r"))
    if not fields or not fields[0].isdigit() or len(fields) < 1 + len(_LEADING):
        return "its first row is not a key and 6 or more numbers"  # (not shown: no content)
    return ""


# ---------------------------------------------------------------------------------------------
# Rows


class PaddleRowError(ValueError):
    """A row that does not fit the layout; the message names the source, line and field.
    `line`: the row's bytes when its numbers, not its form, are what does not fit (so that
    `parse_rows` can say which layouts the row would fit)."""

    def __init__(self, message: str, line: bytes | None = None) -> None:
        super().__init__(message)
        self.line = line


@dataclass(frozen=True)
class ParsedRows:
    keys: np.ndarray  # uint64
    values: np.ndarray  # (rows, value count) of the value dtype, little-endian
    lines: int  # lines consumed, blank ones included
    short_rows: int  # rows saved without their embedx part

    def value_bytes(self) -> np.ndarray:
        """The values as one uint8 buffer, row after row."""
        return np.ascontiguousarray(self.values).reshape(-1).view(np.uint8)


_NUMBER = re.compile(rb"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_NUMBER_PREFIX = re.compile(rb"[+-]?\d*\.?\d*(?:[eE][+-]?\d*)?")  # how far a number reads
_NON_FINITE = re.compile(rb"[+-]?(?:nan|inf|infinity)", re.I)
# The parsers' field separators: space, tab and CR only (a vertical tab or form feed is not one,
# though Python's bytes.split() would take it).
_SEPARATORS = re.compile(rb"[ \t\r]+")
_FIELD = re.compile(rb"[^ \t\r]+")
_NUMBER_BYTES = b"0123456789+-.eE"
_BYTE_NAMES = {
    0: "a NUL byte",
    9: "a tab",
    11: "a vertical tab",
    12: "a form feed",
    13: "a carriage return",
    32: "a space",
    127: "a DEL byte",
}
# Doubles per parsing chunk of the compiled parser (32 MiB): its arrays are sized by this and by
# the rows actually read, never by a buffer's line count.
CHUNK_FLOATS = 4 << 20
# The numpy parser holds its tokens as a fixed-width array; a token longer than this (no number
# Paddle writes is) makes it take the compiled parser, or Python's conversion, instead.
LONG_TOKEN = 64
COMPILED_MIN_BYTES = 4 << 20  # from here a chunk repays loading the compiled parser (~0.5 s)


def _field_name(layout: TableLayout, column: int) -> str:
    return layout.columns[column] if column < layout.full else f"#{column + 1}"


def byte_kind(byte: int) -> str:
    """A byte in words, for messages that must not repeat what they read: its class, and the
    name of a control character (the likely culprit of a line the parsers refuse)."""
    if byte in _BYTE_NAMES:
        return _BYTE_NAMES[byte]
    if byte < 32:
        return f"a control character (0x{byte:02x})"
    if byte >= 128:
        return "a non-ASCII byte"
    if chr(byte).isalpha():
        return "a letter"
    if chr(byte).isdigit():
        return "a digit"
    return "a punctuation mark"


def describe_line(line: bytes, layout: TableLayout) -> str:
    """What is wrong with one line (without its newline), in words; "" when nothing is. Fields
    are split as the parsers split them (spaces, tabs, CR), and named by number, layout name
    and 1-based byte column; the message never repeats the line's text (a file read by mistake
    may hold anything: its content must not reach logs or the transfer's history)."""
    fields = [(m.start() + 1, m.group()) for m in _FIELD.finditer(line)]
    if not fields:
        return ""
    column, key = fields[0]
    where = f"field 1 (key), column {column}"
    if not key.isdigit() or not key.isascii():
        if key[:1] in (b"-", b"+"):
            return f"{where}: not an unsigned decimal integer (keys are uint64: no sign)"
        bad = next(i for i, b in enumerate(key) if not 48 <= b <= 57)
        return (
            f"{where}: not an unsigned decimal integer ({byte_kind(key[bad])} at column "
            f"{column + bad})"
        )
    digits = key.lstrip(b"0")
    if len(digits) > 20 or int(digits or b"0") >= 1 << 64:  # (int() refuses 4300+ digits)
        return (
            f"{where}: does not fit in 64 bits ({len(digits)} digits; at most 18446744073709551615)"
        )

    def problem(index: int, column: int, token: bytes) -> str:
        what = f"field {index + 2} ({_field_name(layout, index)}), column {column}"
        if _NON_FINITE.fullmatch(token):
            return f"{what}: not a finite number (nan or inf)"
        read = _NUMBER_PREFIX.match(token)
        reach = read.end() if read else 0
        if reach < len(token):
            kind = byte_kind(token[reach])
            return f"{what}: not a decimal number ({kind} at column {column + reach})"
        return f"{what}: not a decimal number (it ends before its digits do)"

    # a byte no number has first (a control character splits no field for the parsers: it
    # would be miscounted as a width problem), then the count, then each number's form; the
    # NaN Paddle writes in the `nan_columns` of a table without embedx_w is read there only
    nan = layout.nan_columns
    for index, (column, token) in enumerate(fields[1:]):
        if token.translate(None, _NUMBER_BYTES) and not (index in nan and token in NAN_TOKENS):
            return problem(index, column, token)
    floats = len(fields) - 1
    if floats not in (layout.full, layout.short):
        return count_problem(floats, layout)
    for index, (column, token) in enumerate(fields[1:]):
        if not _NUMBER.fullmatch(token) and not (index in nan and token in NAN_TOKENS):
            return problem(index, column, token)
    return ""


def count_problem(floats: int, layout: TableLayout) -> str:
    """A row of `floats` numbers after the key, for a layout whose rows have others."""
    return (
        f"{floats} numbers after the key; {layout.describe()} rows have {layout.full} "
        f"(or {layout.short} without the embedx part)"
    )


def _line_error(
    data: Any, start: int, layout: TableLayout, source: str, line: int, problem: str = ""
) -> PaddleRowError:
    end = bytes(data[start : start + (1 << 20)]).find(b"\n")
    text = bytes(data[start : start + end if end >= 0 else start + (1 << 20)])
    problem = problem or describe_line(text, layout) or "cannot be read (a parser bug)"
    counted = problem.endswith("without the embedx part)")  # count_problem's: a wrong layout
    return PaddleRowError(f"{source} line {line}: {problem}", text if counted else None)


def parse_rows(
    data: Any,
    layout: TableLayout,
    value: ValueSpec,
    source: str,
    first_line: int = 1,
    compiled: bool | None = None,
    hint: bool = True,
    checked: bool = True,
) -> ParsedRows:
    """Every row of `data` (bytes of whole lines; the last may lack its newline): keys and
    served values. Blank lines are skipped. PaddleRowError naming `source` and the line
    (`first_line` is the number of data's first line) at the first row that does not fit.
    `compiled`: the numba parser (True), numpy's (False), or by size (None). Every row is
    checked against the layout's invariants (`TableLayout.checks`): flags can name a layout
    whose column count the rows share (CtrDoubleAccessor and CtrCommonAccessor at one dim),
    not one whose invariants they keep. A row refused for its count or its numbers gets the
    layouts it would fit in its message (`hint`; `fit_report`)."""
    if compiled is None:
        compiled = COMPILED and (
            len(data) >= COMPILED_MIN_BYTES or "cube._paddle_ps_jit" in sys.modules
        )
    if compiled and not COMPILED:
        raise ValueError("the compiled parser needs numba (and CUBE_KERNEL other than numpy)")
    value.check(layout)
    buf = np.frombuffer(data, dtype=np.uint8)
    parse = _parse_compiled if compiled else _parse_numpy
    try:
        return parse(data, buf, layout, value, source, first_line, checked=checked)
    except PaddleRowError as exc:
        if exc.line is None or not hint:
            raise
        raise PaddleRowError(str(exc) + fit_report(exc.line, layout)) from None


def fitting_layouts(rows: Sequence[bytes]) -> list[tuple[TableLayout, bool]]:
    """The layouts a sample of a table's rows fits: every one of `candidate_layouts` (for the
    first row's count) whose form and invariants each row meets, with whether it is given at
    its least dim (short rows: the dim is then unknown). A sample proves no layout; it can
    only leave fewer."""
    if not rows:
        return []
    floats = len(_FIELD.findall(rows[0])) - 1
    return [
        (candidate, short)
        for candidate, short in candidate_layouts(floats)
        if not any(_refuses(row, candidate) for row in rows)
    ]


def fit_report(line: bytes, layout: TableLayout) -> str:
    """What a row refused by `layout` would fit, for its message: every other layout whose
    form and invariants it meets, and that one row proves none of them."""
    fits = []
    for candidate, short in fitting_layouts([line]):
        if candidate == layout:
            continue
        rules = candidate.describe().split("optimizer ")[1].rstrip(")")
        dim = "a short row: any dim" if short else f"dim {candidate.dim}"
        fits.append(f"{candidate.accessor.name} ({dim}, optimizer {rules})")
    if not fits:
        return "; it fits no layout this reader knows"
    shown = ", ".join(fits[:6]) + (f" and {len(fits) - 6} more" if len(fits) > 6 else "")
    return (
        f"; the row would fit {shown} (one row proves no layout: the trainer's "
        "configuration, -paddle_config, says which)"
    )


def _refuses(line: bytes, layout: TableLayout) -> bool:
    try:
        parse_rows(line + b"\n", layout, ValueSpec(), "", compiled=False, hint=False)
    except PaddleRowError:
        return True
    return False


@dataclass(frozen=True)
class _Plan:
    """The columns a parse extracts: the value's (places 0 .. served - 1), then those only
    checked (places from served on), and the checks by place."""

    targets: np.ndarray  # column -> place, or -1
    width: int
    served: int
    checks: tuple[tuple[int, int, str], ...]  # (column, place, kind)
    show: int  # the place of show and of click (-1: none)
    click: int


def _plan(layout: TableLayout, value: ValueSpec, checked: bool = True) -> _Plan:
    """`checked`: False for tests of number parsing on rows of arbitrary numbers only."""
    targets = value.targets(layout)
    served = value.count(layout)
    width = served
    checks = []
    for column, kind in layout.checks() if checked else []:
        if targets[column] < 0:
            targets[column] = width
            width += 1
        checks.append((column, int(targets[column]), kind))
    columns = layout.columns
    if not checked:
        return _Plan(targets, width, served, (), -1, -1)
    show = int(targets[columns.index("show")])
    click = int(targets[columns.index("click")])
    return _Plan(targets, width, served, tuple(checks), show, click)


# The invariants' numbers in the compiled parser's `kinds` (cube._paddle_ps_jit's NONE ... POW)
CHECK_KINDS = {
    "integer": 1,
    "count": 2,
    "nonneg": 3,
    "pow": 4,
    "nonneg_or_nan": 5,
    "any_or_nan": 6,
}
_WHY = {
    "integer": "not a whole number (a slot id is one)",
    "count": "not a whole number >= 0 (unseen_days counts days)",
    "nonneg": "below 0 (never so in this layout)",
    "nonneg_or_nan": "below 0 (never so in this layout)",
    "pow": "not in [0, 1] (a beta power)",
    "click": "above show (clicks are counted among shows)",
}


def _check_rows(
    floats: np.ndarray,
    row_lines: np.ndarray,
    layout: TableLayout,
    plan: _Plan,
    data: Any,
    source: str,
    first: int,
) -> None:
    """Every row against the layout's invariants (vectorized, one pass per checked column):
    PaddleRowError naming the line, field and column of the first row that breaks one."""
    if not floats.shape[0] or plan.show < 0:
        return
    worst: tuple[int, int, str] | None = None  # (row, column, kind)
    for column, place, kind in plan.checks:
        values = floats[:, place]
        if kind == "integer":
            bad = values != np.floor(values)
        elif kind == "count":
            bad = (values != np.floor(values)) | (values < 0)
        elif kind in ("nonneg", "nonneg_or_nan"):  # (NaN < 0 is False)
            bad = values < 0
        elif kind == "any_or_nan":
            continue
        else:  # 0 passes: a short row's embedx state is absent, read as zeros
            bad = (values < 0) | (values > 1)
        row = int(np.argmax(bad)) if bad.any() else -1
        if row >= 0 and (worst is None or row < worst[0]):
            worst = (row, column, kind)
    above = floats[:, plan.click] > floats[:, plan.show]
    if above.any():
        row = int(np.argmax(above))
        if worst is None or row < worst[0]:
            worst = (row, layout.columns.index("click"), "click")
    if worst is None:
        return
    row, column, kind = worst
    index = int(row_lines[row])
    text = bytes(data).split(b"\n", index + 1)[index]
    starts = [m.start() + 1 for m in _FIELD.finditer(text)]
    where = f"column {starts[column + 1]}" if column + 1 < len(starts) else "missing"
    raise PaddleRowError(
        f"{source} line {first + index}: field {column + 2} ({layout.columns[column]}), "
        f"{where}: {_WHY[kind]}: not a row of {layout.describe()}",
        text,
    )


def _to_dtype(
    floats: np.ndarray,
    value: ValueSpec,
    layout: TableLayout,
    source: str,
    row_lines: np.ndarray,
    first_line: int,
) -> np.ndarray:
    """The doubles as the value type (little-endian); an error naming the line and field of
    the first one that is not finite there (1e999 as a double, 70000 as a float16)."""
    with np.errstate(over="ignore"):  # found below, with the line
        values = floats.astype(np.dtype(value.dtype).newbyteorder("<"))
    finite = np.isfinite(values)
    if finite.all():
        return values
    row, place = (int(i) for i in np.argwhere(~finite)[0])
    column = int(np.flatnonzero(value.targets(layout) == place)[0])
    number = float(floats[row, place])
    largest = float(np.finfo(np.dtype(value.dtype)).max)
    why = (
        f"does not fit {value.dtype} (its magnitude is past {largest:g})"
        if np.isfinite(number)
        else "not a finite number (past the largest double)"
    )
    raise PaddleRowError(
        f"{source} line {first_line + int(row_lines[row])}: field {column + 2} "
        f"({_field_name(layout, column)}): {why}"
    )


# -- the compiled parser


def _recheck_rows(
    rows: list[int],
    data: Any,
    buf: np.ndarray,
    row_lines: np.ndarray,
    row_starts: np.ndarray,
    layout: TableLayout,
    plan: _Plan,
    source: str,
    first: int,
) -> None:
    """`_check_rows` on the rows the compiled parser could not clear: the first one it found
    breaking an invariant, and those with a checked number it left to Python's float. Their
    numbers are read again from their lines (a few rows, or an error on its way)."""
    floats = np.zeros((len(rows), plan.width), dtype=np.float64)
    for index, row in enumerate(rows):
        start = int(row_starts[row])
        width = 4096
        while True:  # the line's end: the first newline from its start
            hits = np.flatnonzero(buf[start : start + width] == 10)
            if hits.size or start + width >= buf.shape[0]:
                end = start + int(hits[0]) if hits.size else buf.shape[0]
                break
            width *= 4
        numbers = _FIELD.findall(bytes(data[start:end]))[1:]
        for column, number in enumerate(numbers[: layout.full]):
            if plan.targets[column] >= 0:
                floats[index, plan.targets[column]] = float(number)
    _check_rows(floats, row_lines[rows], layout, plan, data, source, first)


def _parse_compiled(
    data: Any,
    buf: np.ndarray,
    layout: TableLayout,
    value: ValueSpec,
    source: str,
    first: int,
    checked: bool = True,
) -> ParsedRows:
    """The compiled parser, in chunks of at most CHUNK_FLOATS doubles: its arrays grow with
    the rows read, not with the buffer's line count (a gzip of blank lines asked for 32 GiB)."""
    from cube import _paddle_ps_jit as jit

    plan = _plan(layout, value, checked)
    width = plan.served  # the invariants are checked as the numbers are read: not kept
    capacity = min(int(np.count_nonzero(buf == 10)) + 1, max(64, CHUNK_FLOATS // max(width, 1)))
    targets = value.targets(layout)
    kinds = np.zeros(layout.full, dtype=np.int64)
    for column, _, kind in plan.checks:
        kinds[column] = CHECK_KINDS[kind]
    show, click = (
        (layout.columns.index("show"), layout.columns.index("click")) if plan.checks else (-1, -1)
    )
    pos, line, short_rows = 0, 0, 0
    keys_parts: list[np.ndarray] = []
    value_parts: list[np.ndarray] = []
    while True:
        keys = np.empty(capacity, dtype=np.uint64)
        floats = np.zeros((capacity, width), dtype=np.float64)
        row_lines = np.empty(capacity, dtype=np.int64)
        row_starts = np.empty(capacity, dtype=np.int64)
        slow = np.empty((min(capacity, 1 << 16), 4), dtype=np.int64)
        rows, pos, line, short, error_line, error_start, slow_count, broken = jit.parse(
            buf, pos, line, layout.full, layout.short, targets, kinds, show, click, keys, floats,
            row_lines, row_starts, slow,
        )  # fmt: skip
        if error_line >= 0:
            raise _line_error(data, int(error_start), layout, source, first + int(error_line))
        if slow_count > slow.shape[0]:  # more long or huge-exponent numbers than noted
            return _parse_numpy(data, buf, layout, value, source, first, True, checked)
        recheck = {int(broken)} if broken >= 0 else set()
        for row, column, start, end in slow[:slow_count].tolist():
            if targets[column] >= 0:
                floats[row, targets[column]] = float(bytes(data[start:end]))
            if (kinds[column] or column in (show, click)) and (broken < 0 or row < broken):
                recheck.add(row)
        if recheck:
            _recheck_rows(
                sorted(recheck), data, buf, row_lines, row_starts, layout, plan, source, first
            )
        keys_parts.append(keys[:rows])
        value_parts.append(_to_dtype(floats[:rows], value, layout, source, row_lines, first))
        short_rows += int(short)
        if pos >= buf.shape[0]:
            break
    if len(keys_parts) == 1:
        return ParsedRows(keys_parts[0], value_parts[0], int(line), short_rows)
    return ParsedRows(
        np.concatenate(keys_parts), np.concatenate(value_parts), int(line), short_rows
    )


# -- the numpy parser (no numba; the tests' oracle)

_ALLOWED = np.zeros(256, dtype=bool)
_ALLOWED[list(b"0123456789.+-eE \t\r\n")] = True
_ALLOWED_NAN = _ALLOWED.copy()  # a layout with `nan_columns`: their -nan read too, then checked
_ALLOWED_NAN[list(b"na")] = True


def _parse_numpy(
    data: Any,
    buf: np.ndarray,
    layout: TableLayout,
    value: ValueSpec,
    source: str,
    first: int,
    long_ok: bool = False,
    checked: bool = True,
) -> ParsedRows:
    """Whole-buffer numpy passes: tokens by byte class, rows by newline, numbers by numpy's
    own conversion; anything unexpected sends the first bad line to `describe_line`. A token
    longer than LONG_TOKEN goes to the compiled parser when there is one (a fixed-width token
    array would be tokens x that length), else (or with `long_ok`) through Python's int and
    float, token by token: no number Paddle writes is that long."""
    newline = buf == 10
    lines = int(np.count_nonzero(newline)) + (1 if buf.size and buf[-1] != 10 else 0)
    dtype = np.dtype(value.dtype).newbyteorder("<")
    nothing = ParsedRows(
        np.empty(0, np.uint64), np.empty((0, value.count(layout)), dtype), lines, 0
    )
    nan = layout.nan_columns
    if not (_ALLOWED_NAN if nan else _ALLOWED)[buf].all():
        return _first_bad_line(data, layout, source, first)
    separator = newline | (buf == 32) | (buf == 9) | (buf == 13)
    token = ~separator
    starts = np.flatnonzero(token & ~np.concatenate(([False], token[:-1])))
    line_index = np.searchsorted(np.flatnonzero(newline), starts)  # newlines before each
    counts = np.bincount(line_index, minlength=lines)
    used = np.flatnonzero(counts)
    if not used.size:
        return nothing
    floats_per_row = counts[used] - 1
    is_short = floats_per_row == layout.short
    if not ((floats_per_row == layout.full) | is_short).all():
        return _first_bad_line(data, layout, source, first)
    ends = np.flatnonzero(token & ~np.concatenate((token[1:], [False])))
    longest = int((ends - starts).max()) + 1
    if longest > LONG_TOKEN and COMPILED and not long_ok:
        return _parse_compiled(data, buf, layout, value, source, first, checked)
    row_start = np.concatenate(([0], np.cumsum(counts[used])[:-1]))
    plan = _plan(layout, value, checked)
    width = plan.width
    targets = plan.targets
    try:
        if longest > LONG_TOKEN:
            keys, numbers = _convert_long(bytes(data).split(), row_start)
        else:
            tokens = np.array(bytes(data).split())
            key_tokens = tokens[row_start]
            if not np.strings.isdigit(key_tokens).all():
                raise ValueError("key")
            digits = np.strings.lstrip(key_tokens, b"0")
            lengths = np.strings.str_len(digits)
            if (lengths > 20).any() or ((lengths == 20) & (digits > b"18446744073709551615")).any():
                raise ValueError("key range")
            keys = key_tokens.astype(np.uint64)
            numbers = np.delete(tokens, row_start).astype(np.float64)
    except (ValueError, OverflowError):
        return _first_bad_line(data, layout, source, first)
    floats = np.zeros((used.shape[0], width), dtype=np.float64)
    offsets = np.concatenate(([0], np.cumsum(floats_per_row)[:-1]))
    if nan:  # a NaN only as Paddle writes it, where it writes it
        at = np.flatnonzero(np.isnan(numbers))
        if at.size:
            where = at - offsets[np.searchsorted(offsets, at, side="right") - 1]
            texts = np.delete(np.array(bytes(data).split()), row_start)[at]
            if not (np.isin(where, nan) & np.isin(texts, NAN_TOKENS)).all():
                return _first_bad_line(data, layout, source, first)
    for column in np.flatnonzero(targets >= 0).tolist():
        present = floats_per_row > column
        floats[present, targets[column]] = numbers[offsets[present] + column]
    _check_rows(floats, used, layout, plan, data, source, first)
    values = _to_dtype(floats[:, : plan.served], value, layout, source, used, first)
    return ParsedRows(keys, values, lines, int(np.count_nonzero(is_short)))


def _convert_long(tokens: list[bytes], row_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys and numbers of a buffer with a token too long for a fixed-width array (not
    something Paddle writes: the rare, slow path). ValueError for a token that is not one."""
    is_key = np.zeros(len(tokens), dtype=bool)
    is_key[row_start] = True
    keys = []
    for index in row_start.tolist():
        text = tokens[index]
        if not text.isdigit() or not text.isascii() or len(text.lstrip(b"0")) > 20:
            raise ValueError("key")
        keys.append(int(text))
    numbers = np.array(
        [t for t, k in zip(tokens, is_key.tolist(), strict=True) if not k], dtype=object
    )
    converted = numbers.astype(np.float64) if numbers.size else np.empty(0)
    return np.array(keys, dtype=np.uint64), converted


def _first_bad_line(data: Any, layout: TableLayout, source: str, first: int) -> ParsedRows:
    """The error path: the first line `describe_line` finds fault with (a loop over lines,
    run only once something is wrong)."""
    start = 0
    for number, line in enumerate(bytes(data).split(b"\n")):
        problem = describe_line(line, layout)
        if problem:
            raise _line_error(data, start, layout, source, first + number, problem)
        start += len(line) + 1
    raise PaddleRowError(f"{source}: cannot be read (a parser bug: no line is at fault)")
