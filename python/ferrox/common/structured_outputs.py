"""Structured outputs: what a request's output must match, as vLLM names it.

`StructuredOutputsParams` holds exactly one constraint: a JSON schema, any
JSON object, a regular expression, a choice among strings, or a grammar
(Lark, or GBNF / EBNF with ``::=`` rules). `grammar_source()` turns it into
the grammar text of the grammar engine (llguidance); `check_grammar()` says
whether that text compiles and whether it can end, without a tokenizer, so
that the server can answer a bad grammar with a 400 before the engine sees
it. With `disable_additional_properties` (OpenAI's `strict: true`) a JSON
schema's objects that list their properties allow no others unless they
say so. The engine
compiles it against the model's vocabulary (`ferrox.engine.structured_output.grammar`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.grammar_check import unending_rules

# The fields that each name one kind of constraint.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 1024
# Whitespace JSON outputs may put between two tokens: what pretty-printing
# writes (a line break at most, then indentation), because a small model can
# otherwise write newlines until max_tokens.
WHITESPACE = r"[\x20\x09]{0,2}(\x0D?\x0A[\x20\x09]{0,32})?"
# Characters that mean something in a regular expression; "/" delimits one in Lark.
_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}/-#&~")


@dataclass(kw_only=True)
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, as a dict or its text),
    `json_object` (any JSON object), `regex`, `choice` (one of these strings)
    or `grammar`. Between two JSON tokens the output may put what
    pretty-printing does (one line break at most, indentation); with
    `disable_any_whitespace` nothing. With `disable_additional_properties`
    an object of the `json` schema that lists `properties` and says nothing
    of `additionalProperties` allows no other property (JSON Schema's
    default allows any: a model can then add keys until max_tokens)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidArgumentError(
                "structured_outputs must give exactly one of "
                f"{', '.join(KINDS)}; got {given or 'none'}"
            )
        if isinstance(self.json, dict):
            self.json = _json_text(self.json)
        elif self.json is not None:
            if not isinstance(self.json, str):
                raise InvalidArgumentError(
                    "structured_outputs.json must be a JSON schema (an object or its text), "
                    f"got {type(self.json).__name__}"
                )
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise InvalidArgumentError(
                    f"structured_outputs.json is not valid JSON: {e}"
                ) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidArgumentError(
                    "structured_outputs.json must be a JSON schema object, "
                    f"got {type(schema).__name__}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(f"structured_outputs.{name} must be a non-empty str")
        if self.choice is not None:
            choice = self.choice
            if (
                not isinstance(choice, (list, tuple))
                or not choice
                or not all(isinstance(c, str) and c for c in choice)
            ):
                raise InvalidArgumentError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings"
                )
            if len(choice) > MAX_CHOICES:
                raise InvalidArgumentError(
                    f"structured_outputs.choice may hold at most {MAX_CHOICES} strings, "
                    f"got {len(choice)}"
                )
            self.choice = list(choice)
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"structured_outputs.{name} must be a bool")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def param(self) -> str:
        """The field that holds the constraint, for error messages."""
        return f"structured_outputs.{self.kind}"

    def grammar_source(self) -> str:
        """The constraint as a grammar of the grammar engine."""
        schema = self.json if isinstance(self.json, str) else ""
        if schema and self.disable_additional_properties:
            schema = _closed_schema_text(schema)
        return _grammar_source(
            self.kind,
            schema,
            self.regex or "",
            tuple(self.choice or ()),
            self.grammar or "",
            self.disable_any_whitespace,
        )


@functools.lru_cache(maxsize=256)
def _grammar_source(
    kind: str,
    schema: str,
    regex: str,
    choice: tuple[str, ...],
    grammar: str,
    compact: bool,
) -> str:
    from llguidance import LLMatcher

    overrides: Any = (
        {"whitespace_flexible": False} if compact else {"whitespace_pattern": WHITESPACE}
    )
    if kind == "json":
        return str(LLMatcher.grammar_from_json_schema(schema, overrides=overrides))
    if kind == "json_object":
        return str(LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=overrides))
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(regex))
    if kind == "choice":
        return str(LLMatcher.grammar_from_regex("|".join(f"({_literal(c)})" for c in choice)))
    if "::=" in grammar:  # GBNF / EBNF rules
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            grammar = any_to_lark(grammar)
        except Exception as e:
            raise InvalidArgumentError(
                f"structured_outputs.grammar: cannot read the GBNF grammar: {e}"
            ) from None
    return str(LLMatcher.grammar_from_lark(grammar))


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema
    that lists `properties` or `patternProperties` and does not say whether
    others are allowed (a copy; `schema` is unchanged)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if ("properties" in closed or "patternProperties" in closed) and (
        "additionalProperties" not in closed
    ):
        closed["additionalProperties"] = False
    return closed


@functools.lru_cache(maxsize=256)
def _closed_schema_text(schema: str) -> str:
    return json.dumps(closed_objects(json.loads(schema)))


@functools.lru_cache(maxsize=256)
def _grammar_error(source: str) -> str:
    from llguidance import LLMatcher

    error = str(LLMatcher.validate_grammar(source))
    if error:
        return error
    stuck = unending_rules(lark) if (lark := _lark_text(source)) is not None else None
    if stuck:
        rules = ", ".join(repr(name) for name in stuck)
        return (
            "it has no finite string, so no output could ever complete it: "
            f"{'rule' if len(stuck) == 1 else 'rules'} {rules} derive only strings that go on "
            "(give each recursion an alternative that ends)"
        )
    return ""


def _lark_text(source: str) -> str | None:
    """The Lark text of a grammar engine source: the source itself, or the
    `lark_grammar` of its first grammar when it is JSON; None if neither."""
    if not source.lstrip().startswith("{"):
        return source
    try:
        grammars = json.loads(source).get("grammars") or [{}]
    except (ValueError, AttributeError):
        return None
    lark = grammars[0].get("lark_grammar") if isinstance(grammars[0], dict) else None
    return lark if isinstance(lark, str) else None


def grammar_text(params: StructuredOutputsParams) -> str:
    """The grammar text of `params`, unchecked (cheap: cached); raises
    InvalidArgumentError naming the field when it cannot be written."""
    try:
        return params.grammar_source()
    except InvalidArgumentError:
        raise
    except (ValueError, TypeError) as e:
        raise InvalidArgumentError(f"{params.param}: {e}") from None


def check_grammar(params: StructuredOutputsParams) -> str:
    """The grammar text of `params`; raises InvalidArgumentError naming the
    field when it does not compile (results are cached by source)."""
    source = grammar_text(params)
    error = _grammar_error(source)
    if error:
        raise InvalidArgumentError(f"{params.param} does not compile: {error.strip()}")
    return source


def _literal(text: str) -> str:
    """`text` as a regular expression that matches exactly it."""
    return "".join(
        f"\\x{{{ord(c):02x}}}" if ord(c) < 32 else "\\" + c if c in _REGEX_SPECIAL else c
        for c in text
    )


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"structured_outputs.json is not JSON: {e}") from None
