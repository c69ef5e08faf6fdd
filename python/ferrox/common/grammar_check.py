"""Whether a Lark grammar can end: the rules that derive no finite string.

A grammar such as ``start: "x" start`` compiles, but no output ever
completes it: every string it accepts is the prefix of a longer one, so a
constrained sequence can only run until max_tokens. `unending_rules()`
finds that before any token is sampled (a context-free grammar's
productive rules are a fixpoint: a rule is productive when one of its
alternatives has only productive items), so that such a grammar is a 400.

The reader is conservative: a construct it does not know (llguidance's
``&`` and ``~`` operators, aliases, anything unexpected) makes it give no
verdict rather than a wrong one; it never refuses a grammar that can end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\r]+|//[^\n]*|\#[^\n]*)
  | (?P<newline>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><[^<>\s]+>)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>-?\d+)
  | (?P<range>\.\.)
  | (?P<punct>[:|()\[\]?*+{},.%])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    line_start: bool  # first token of its line


class _Unknown(Exception):
    """A construct the reader does not know: no verdict."""


def unending_rules(lark: str) -> list[str] | None:
    """The rules of `lark` (the start rule first) that derive no finite
    string when `start` is one of them; None when `start` can end or when
    the text holds a construct this reader does not know."""
    try:
        definitions = _definitions(_tokens(lark))
        bodies = {name: _Parser(body).alternatives_until_end() for name, body in definitions}
    except _Unknown:
        return None
    if "start" not in bodies:
        return None
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in bodies.items():
            if name not in productive and _ends(alternatives, productive, bodies):
                productive.add(name)
                changed = True
    if "start" in productive:
        return None
    stuck = [name for name in bodies if name not in productive]
    return ["start", *sorted(n for n in stuck if n != "start")]


# An expression: ("seq", [items]) | ("alt", [exprs]) | ("opt", expr) |
# ("plus", expr) | ("ref", name) | ("end",) for an item that always ends.
Expr = tuple


def _ends(alternatives: Expr, productive: set[str], bodies: dict[str, Expr]) -> bool:
    kind = alternatives[0]
    if kind == "end" or kind == "opt":
        return True
    if kind == "ref":
        name = alternatives[1]
        return name in productive or name not in bodies  # imported names end
    if kind == "plus":
        return _ends(alternatives[1], productive, bodies)
    if kind == "seq":
        return all(_ends(item, productive, bodies) for item in alternatives[1])
    return any(_ends(alt, productive, bodies) for alt in alternatives[1])


def _tokens(text: str) -> list[_Tok]:
    tokens: list[_Tok] = []
    pos, line_start = 0, True
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise _Unknown
        kind, pos = match.lastgroup or "", match.end()
        if kind == "newline":
            line_start = True
            tokens.append(_Tok("newline", "\n", False))
        elif kind != "space":
            tokens.append(_Tok(kind, match.group(), line_start))
            line_start = False
    return tokens


def _definitions(tokens: list[_Tok]) -> list[tuple[str, list[_Tok]]]:
    """(name, body tokens) of each rule and terminal; directives dropped."""
    definitions: list[tuple[str, list[_Tok]]] = []
    current: list[_Tok] | None = None
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.line_start and tok.kind == "punct" and tok.text == "%":
            current = None  # %import, %ignore, %llguidance ...: to the end of the line
            while i < len(tokens) and tokens[i].kind != "newline":
                i += 1
            continue
        if tok.kind == "name":  # `name:` starts a definition (":" means nothing else)
            j = i + 1
            if j + 1 < len(tokens) and tokens[j].text == "." and tokens[j + 1].kind == "number":
                j += 2  # a priority
            if j < len(tokens) and tokens[j].text == ":":
                current = []
                definitions.append((tok.text.lstrip("?!"), current))
                i = j + 1
                continue
        if tok.kind != "newline":
            if current is None:
                raise _Unknown
            current.append(tok)
        i += 1
    return definitions


class _Parser:
    def __init__(self, body: list[_Tok]) -> None:
        self._toks = body
        self._pos = 0

    def _peek(self) -> _Tok | None:
        return self._toks[self._pos] if self._pos < len(self._toks) else None

    def _take(self, text: str) -> bool:
        tok = self._peek()
        if tok is not None and tok.kind in ("punct", "range") and tok.text == text:
            self._pos += 1
            return True
        return False

    def alternatives_until_end(self) -> Expr:
        expr = self._alternatives()
        if self._peek() is not None:
            raise _Unknown
        return expr

    def _alternatives(self) -> Expr:
        alternatives = [self._sequence()]
        while self._take("|"):
            alternatives.append(self._sequence())
        return ("alt", alternatives)

    def _sequence(self) -> Expr:
        items: list[Expr] = []
        while (tok := self._peek()) is not None and tok.text not in ("|", ")", "]"):
            items.append(self._item())
        return ("seq", items)

    def _item(self) -> Expr:
        atom = self._atom()
        while True:
            if self._take("?") or self._take("*"):
                atom = ("opt", atom)
            elif self._take("+"):
                atom = ("plus", atom)
            elif self._take("{"):
                atom = self._repeat(atom)
            else:
                return atom

    def _repeat(self, atom: Expr) -> Expr:
        """`atom{n}` / `atom{n,m}` / `atom{n,}`: optional when n is 0."""
        tok = self._peek()
        if tok is None or tok.kind != "number":
            raise _Unknown
        self._pos += 1
        least = int(tok.text)
        if self._take(",") and (tok := self._peek()) is not None and tok.kind == "number":
            self._pos += 1  # the upper bound
        if not self._take("}"):
            raise _Unknown
        return ("opt", atom) if least == 0 else ("plus", atom)

    def _atom(self) -> Expr:
        tok = self._peek()
        if tok is None:
            raise _Unknown
        self._pos += 1
        if tok.kind == "string":
            if self._take(".."):
                self._expect_kind("string")
            return ("end",)
        if tok.kind in ("regex", "special"):
            return ("end",)
        if tok.kind == "name" and tok.text[0] not in "?!":
            return ("ref", tok.text)
        if tok.text == "(":
            expr = self._alternatives()
            if not self._take(")"):
                raise _Unknown
            return expr
        if tok.text == "[":
            expr = self._alternatives()
            if not self._take("]"):
                raise _Unknown
            return ("opt", expr)
        raise _Unknown  # %json {...}, &, ~, ->, ...: no verdict

    def _expect_kind(self, kind: str) -> None:
        tok = self._peek()
        if tok is None or tok.kind != kind:
            raise _Unknown
        self._pos += 1
