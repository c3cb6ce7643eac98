"""Donefile lines built to break the parser (issue 36 item 6): each is one failed record
naming its file and line, and the transfer goes on to the next line."""

from __future__ import annotations

import pytest

from cube.donefile import BadLine, DonefileEntry, parse_lines, split_complete_lines
from cube.transfer.state import TransferState, ingest, next_version

GOOD = '{"id": "1700000000", "key": "1700000000", "input": "/saves/1"}'
POISON = [
    "[" * 10_000 + "]" * 10_000,  # json's decoder recursed once per level: RecursionError
    '{"id": ' * 10_000,
    '{"id": "1", "key": "1", "input": "/x", "deep": ' + "[" * 50_000 + "]" * 50_000 + "}",
]


@pytest.mark.parametrize("poison", POISON, ids=["brackets", "objects", "deep_field"])
def test_a_poison_line_fails_alone_and_the_next_line_is_taken(poison: str) -> None:
    parsed = parse_lines("base.txt", poison + "\n" + GOOD + "\n")
    assert isinstance(parsed[0], BadLine) and parsed[0].reason.startswith("base.txt:1: not JSON")
    assert "[[" not in parsed[0].reason and "{" not in parsed[0].reason  # nothing echoed
    assert isinstance(parsed[1], DonefileEntry) and parsed[1].where == "base.txt:2"
    state = TransferState()
    ingest(state, parsed, 1.0)
    assert state.history[0].status == "failed" and state.history[0].line == "base.txt:1"
    chosen = next_version(state, 1.0)[0]
    assert chosen is not None and chosen.version == "1700000000"


def test_a_deep_unterminated_last_line_is_left_for_later() -> None:
    """The last line without its newline is judged only once it parses; a deep one does not
    parse (nor raise): it waits for its newline like any half-written line."""
    assert split_complete_lines(GOOD + "\n" + "[" * 10_000) == [GOOD]
