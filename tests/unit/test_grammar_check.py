"""The reader that finds grammars no output can complete (rules that derive
no finite string), and its conservative refusals to judge."""

from __future__ import annotations

import pytest
from llguidance.gbnf_to_lark import any_to_lark

from ferrox.common.grammar_check import unending_rules


@pytest.mark.parametrize(
    ("lark", "unending"),
    [
        ('start: "x" start', ["start"]),
        ('start: a\na: "y" a', ["start", "a"]),
        ('start.2: "a" start', ["start"]),
        ('start: "a"{2,3} start', ["start"]),
        ('start: "a"{0,3} B\nB: "x" B', ["start", "B"]),
        ('start: item+\nitem: "(" start ")"', ["start", "item"]),
        (any_to_lark('root ::= "a" root\n'), ["start"]),
        # These can end.
        ('start: "x" | "x" start', None),
        ('start: a\na: "y" a\n    | b\nb: "z"', None),
        ('start: item+\nitem: /[a-z]/ | "(" start ")"', None),
        ('start: ("a" start)*', None),
        ('start: [start] "a"', None),
        ('start: ("a" start){0,1}', None),
        ('start: "a".."z" start?', None),
        (
            '?start: value\nvalue: NUMBER | "[" [value ("," value)*] "]"\n%import common.NUMBER',
            None,
        ),
        (any_to_lark("root ::= [a-z]+ root?\n"), None),
        # No verdict: constructs the reader does not know.
        ('start: A start\nA: "a" & "b"', None),
        ('start: %json {"type": "object"} start', None),
        ("start: -> nothing", None),
    ],
)
def test_unending_rules(lark: str, unending: list[str] | None) -> None:
    assert unending_rules(lark) == unending
