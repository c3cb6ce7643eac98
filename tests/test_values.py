"""Value columns: fixed and variable layouts, gathers, concatenation."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from cube.values import ValueColumn, gather_ranges


def test_from_list_compacts_to_fixed_width() -> None:
    column = ValueColumn.from_list([b"ab", b"cd", b"ef"])
    assert column.width == 2 and column.to_list() == [b"ab", b"cd", b"ef"]
    assert ValueColumn.from_list([b"", b""]).width == 0


@given(st.lists(st.binary(max_size=20), max_size=30), st.data())
def test_take_matches_python(values: list[bytes], data: st.DataObject) -> None:
    column = ValueColumn.from_list(values)
    rows = data.draw(st.lists(st.integers(0, max(0, len(values) - 1)), max_size=40))
    if not values:
        rows = []
    assert column.take(np.array(rows, dtype=np.int64)).to_list() == [values[r] for r in rows]


@given(st.lists(st.binary(max_size=8), max_size=10), st.lists(st.binary(max_size=8), max_size=10))
def test_concat(a: list[bytes], b: list[bytes]) -> None:
    joined = ValueColumn.from_list(a).concat(ValueColumn.from_list(b))
    assert joined.to_list() == a + b


def test_gather_ranges() -> None:
    blob = np.frombuffer(b"0123456789", dtype=np.uint8)
    out, offsets = gather_ranges(blob, np.array([8, 0, 3]), np.array([2, 0, 3]))
    assert out.tobytes() == b"89345" and offsets.tolist() == [0, 2, 2, 5]
