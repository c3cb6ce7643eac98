"""The compiled row parser of cube.paddle_ps: one pass over the bytes of a parameter-server
text table, keys and served columns out.

Why compiled: the numpy parser (split into tokens, numpy's string-to-double) runs at ~0.2M rows
per second for a CtrCommonAccessor row of 14 fields; this loop reads each byte once and does
~3M (bench/RESULTS.md). Imported only when cube.paddle_ps decides to use it (numba installed,
CUBE_KERNEL not numpy, a large enough input).

Numbers: a decimal of at most 19 significant digits whose power of ten is within 10^+-22 is
the double `m * 10^e` (or `m / 10^-e`): both factors exact, one IEEE operation, so correctly
rounded (Clinger's fast path). Paddle writes 6 digits, so that is every number it writes but
subnormal-range ones; the others are noted in `slow` (row, column, start, end) for Python's
`float` to convert. Columns neither served nor checked are checked for form, not converted.

Invariants (`TableLayout.checks`: a whole slot, a whole unseen_days >= 0, show >= click >= 0,
g2sum >= 0, beta powers in [0, 1]; `nan` or `-nan` read only in the columns whose kind allows
it, a table without embedx_w's) are checked here, on each number as it is read: the first
row that breaks one is noted and the pass goes on, since a line that cannot be read further on
in the same pass is reported first (as the numpy parser does). The caller words the error, and
checks again the rows with a checked number noted in `slow` (not converted here).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cube._jit import jit

_POW10 = np.array([10.0**i for i in range(23)])
_MAX_EXACT = np.uint64(1 << 53)
_TEN = np.uint64(10)
_U64_DIV10 = np.uint64(1844674407370955161)  # (2^64 - 1) // 10; its last digit is 5
# The invariants of `parse`'s `kinds` (cube.paddle_ps.CHECK_KINDS numbers them by name);
# NONNEG_OR_NAN and ANY_OR_NAN: a column where Paddle writes -nan (or nan), read as NaN
NONE, INTEGER, COUNT, NONNEG, POW, NONNEG_OR_NAN, ANY_OR_NAN = 0, 1, 2, 3, 4, 5, 6


@jit
def _blank(c: Any) -> Any:
    return c == 32 or c == 9 or c == 13


@jit
def _breaks(kind: Any, number: Any) -> Any:
    """Whether a number breaks its column's invariant (cube.paddle_ps._check_rows' rules)."""
    if kind == INTEGER:
        return number != np.floor(number)
    if kind == COUNT:
        return number != np.floor(number) or number < 0.0
    if kind in (NONNEG, NONNEG_OR_NAN):
        return number < 0.0  # (False for NaN)
    if kind == POW:
        return number < 0.0 or number > 1.0
    return False


@jit
def parse(
    buf, start, first_line, full, short, targets, kinds, show, click, keys, floats, row_lines,
    row_starts, slow,
):  # fmt: skip
    """Parse whole lines of `buf` from byte `start` (a line's start; `first_line` its number,
    0-based in `buf`) until the end or until `keys` (the rows' capacity) is full. Returns
    (rows, position reached, lines, short rows, error line, error line's start offset, slow
    count, first row breaking an invariant): error line -1 when every line read fits (key:
    unsigned decimal < 2^64; then `full` or `short` decimal numbers, separated by spaces, tabs
    or CR); else the caller describes the line. `targets[c]`: the value place of float column
    c, or -1; `kinds[c]`: its invariant (NONE, INTEGER, COUNT, NONNEG, POW); `show`, `click`:
    their columns (-1: show >= click not checked); `row_lines`, `row_starts`: each row's line
    (0-based) and the offset of its start. The row breaking an invariant is -1 when none does
    among the numbers converted here (checked ones noted in `slow` are not). The caller
    resumes at the position reached while it is short of the end: its arrays are sized by a
    budget, not by the buffer's line count (blank-line padding would ask for gigabytes).

    Long: the byte loop of a compiled kernel, one pass over the text; its state (position,
    row, line, counts) lives in locals across the key, the numbers and the line's end, and
    splitting it into calls would pass that state in and out for every field."""
    n = buf.shape[0]
    pos = start
    row = 0
    line = first_line
    short_rows = 0
    slow_count = 0
    slow_room = slow.shape[0]
    capacity = keys.shape[0]
    broken = -1
    while pos < n and row < capacity:
        line_start = pos
        while pos < n and _blank(buf[pos]):
            pos += 1
        if pos >= n:
            break
        if buf[pos] == 10:  # a blank line
            pos += 1
            line += 1
            continue
        # the key
        key = np.uint64(0)
        digits = 0
        overflow = False
        while pos < n and 48 <= buf[pos] <= 57:
            d = np.uint64(buf[pos] - 48)
            if key > _U64_DIV10 or (key == _U64_DIV10 and d > np.uint64(5)):
                overflow = True
            key = key * _TEN + d
            digits += 1
            pos += 1
        if digits == 0 or overflow or (pos < n and not _blank(buf[pos]) and buf[pos] != 10):
            return row, pos, line, short_rows, line, line_start, slow_count, broken
        keys[row] = key
        column = 0
        show_number = 0.0
        click_number = 0.0
        exact = True  # show and click both converted here
        while True:
            while pos < n and _blank(buf[pos]):
                pos += 1
            if pos >= n or buf[pos] == 10:
                break
            start = pos
            negative = False
            if buf[pos] == 45 or buf[pos] == 43:
                negative = buf[pos] == 45
                pos += 1
            if (
                pos + 2 < n
                and buf[pos] == 110
                and buf[pos + 1] == 97
                and buf[pos + 2] == 110
                and (negative or pos == start)
                and column < full
                and (kinds[column] == NONNEG_OR_NAN or kinds[column] == ANY_OR_NAN)
                and (pos + 3 >= n or _blank(buf[pos + 3]) or buf[pos + 3] == 10)
            ):  # nan or -nan (not +nan: glibc never writes it), where Paddle writes it
                pos += 3
                if targets[column] >= 0:
                    floats[row, targets[column]] = np.nan
                column += 1
                continue
            mantissa = np.uint64(0)
            significant = 0  # digits in the mantissa, leading zeros not counted
            scale = 0  # the decimal exponent of the mantissa's last digit
            seen = 0
            dropped = False  # a non-zero digit beyond the 19 the mantissa holds
            while pos < n and 48 <= buf[pos] <= 57:
                seen += 1
                if significant < 19:
                    mantissa = mantissa * _TEN + np.uint64(buf[pos] - 48)
                    if mantissa != 0:
                        significant += 1
                else:
                    scale += 1
                    if buf[pos] != 48:
                        dropped = True
                pos += 1
            if pos < n and buf[pos] == 46:
                pos += 1
                while pos < n and 48 <= buf[pos] <= 57:
                    seen += 1
                    if significant < 19:
                        mantissa = mantissa * _TEN + np.uint64(buf[pos] - 48)
                        if mantissa != 0:
                            significant += 1
                        scale -= 1
                    elif buf[pos] != 48:
                        dropped = True
                    pos += 1
            if seen == 0:
                return row, pos, line, short_rows, line, line_start, slow_count, broken
            if pos < n and (buf[pos] == 101 or buf[pos] == 69):
                pos += 1
                exponent_negative = False
                if pos < n and (buf[pos] == 45 or buf[pos] == 43):
                    exponent_negative = buf[pos] == 45
                    pos += 1
                exponent = 0
                exponent_digits = 0
                while pos < n and 48 <= buf[pos] <= 57:
                    if exponent < 100000:
                        exponent = exponent * 10 + (buf[pos] - 48)
                    exponent_digits += 1
                    pos += 1
                if exponent_digits == 0:
                    return row, pos, line, short_rows, line, line_start, slow_count, broken
                scale += -exponent if exponent_negative else exponent
            if pos < n and not _blank(buf[pos]) and buf[pos] != 10:
                return row, pos, line, short_rows, line, line_start, slow_count, broken
            if column < full:
                place = targets[column]
                kind = kinds[column]
                if place >= 0 or kind != NONE:
                    fast = mantissa == 0 and not dropped
                    if not fast:
                        fast = not dropped and mantissa <= _MAX_EXACT and -22 <= scale <= 22
                    if not fast:
                        if slow_count < slow_room:
                            slow[slow_count, 0] = row
                            slow[slow_count, 1] = column
                            slow[slow_count, 2] = start
                            slow[slow_count, 3] = pos
                        slow_count += 1
                        if column in (show, click):
                            exact = False
                    else:
                        if (
                            place >= 0
                            or column in (show, click)
                            or kind == POW
                            or (scale < 0 and kind in (INTEGER, COUNT))
                        ):
                            number = 0.0
                            if mantissa != 0:  # two exact factors, one rounding
                                factor = float(mantissa)
                                if scale >= 0:
                                    number = factor * _POW10[scale]
                                else:
                                    number = factor / _POW10[-scale]
                            if negative:
                                number = -number
                        else:
                            # only checked for its sign, and whole (a whole number of the fast
                            # path: no fraction): a whole stand-in of its sign, not converted
                            # (a non-zero number of the fast path is not rounded to 0)
                            number = -1.0 if negative and mantissa != 0 else 0.0
                        if place >= 0:
                            floats[row, place] = number
                        if broken < 0 and kind != NONE and _breaks(kind, number):
                            broken = row
                        if column == show:
                            show_number = number
                        elif column == click:
                            click_number = number
            column += 1
        if column != full and column != short:
            return row, pos, line, short_rows, line, line_start, slow_count, broken
        if column == short:
            short_rows += 1
        if broken < 0 and show >= 0 and exact and click_number > show_number:
            broken = row
        row_lines[row] = line
        row_starts[row] = line_start
        row += 1
        line += 1
        pos += 1
    return row, pos, line, short_rows, -1, 0, slow_count, broken
