"""The output constraints of a request: its structured-output field
(`response_format`, `structured_outputs`, `guided_*`: at most one), and how a
chat request uses its `tools` (`tool_plan`). Each is compiled once here to
check it, so that one that does not compile is a 400 naming its field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import cast

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.structured_outputs import StructuredOutputsParams, check_grammar
from ferrox.server import openai_protocol as op
from ferrox.server.chat_outputs import tool_structured_outputs
from ferrox.server.openai_protocol import BadRequest, ChatCompletionRequest, CompletionRequest

# The request fields that constrain the output, at most one per request.
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# What guided_decoding_backend may name: the one grammar engine ferrox has.
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")
MAX_TOOLS = 128


def structured_outputs_from(
    request: CompletionRequest | ChatCompletionRequest, disable_additional_properties: bool = False
) -> StructuredOutputsParams | None:
    """The request's output constraint, compiled once to check it (a
    constraint that does not compile is a 400 naming its field). A JSON
    schema's objects allow no properties beyond those they list under
    `strict: true`, `structured_outputs.disable_additional_properties`, or
    `disable_additional_properties` (the server's default)."""
    text_format = request.response_format is not None and request.response_format.type == "text"
    given = [
        name
        for name in STRUCTURED_FIELDS
        if getattr(request, name) is not None and not (name == "response_format" and text_format)
    ]
    backend = request.guided_decoding_backend
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise BadRequest(
            f"guided_decoding_backend must be one of {list(GRAMMAR_BACKENDS)} (ferrox's grammar "
            f"engine is llguidance), got {backend!r}",
            param="guided_decoding_backend",
        )
    if not given:
        return None
    if len(given) > 1:
        raise BadRequest(
            f"give at most one output constraint; got {', '.join(given)}", param=given[1]
        )
    name = given[0]
    try:
        params = _structured_params(request, name, disable_additional_properties)
        check_grammar(params)
    except InvalidArgumentError as exc:
        raise BadRequest(str(exc), param=name) from exc
    return params


def _structured_params(
    request: CompletionRequest | ChatCompletionRequest, name: str, closed: bool
) -> StructuredOutputsParams:
    if name == "response_format":
        fmt = cast(op.ResponseFormat, request.response_format)
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise BadRequest(
                "response_format of type json_schema needs json_schema.schema",
                param="response_format",
            )
        return StructuredOutputsParams(
            json=json.dumps(fmt.json_schema.schema_),
            disable_additional_properties=closed or fmt.json_schema.strict is True,
        )
    if name == "structured_outputs":
        so = cast(op.StructuredOutputsRequest, request.structured_outputs)
        return StructuredOutputsParams(
            json=so.json,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=bool(so.json_object),
            disable_any_whitespace=so.disable_any_whitespace,
            disable_additional_properties=so.json is not None
            and (closed or so.disable_additional_properties),
        )
    kind = name.removeprefix("guided_")
    if kind == "json":
        json_schema = request.guided_json
        return StructuredOutputsParams(json=json_schema, disable_additional_properties=closed)
    return StructuredOutputsParams(**{kind: getattr(request, name)})


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses its tools: "none", "auto" (the server's tool
    parser reads the output), "required" or "named" (a grammar writes it)."""

    mode: str = "none"
    name: str | None = None  # the named function
    structured: StructuredOutputsParams | None = None


def tool_plan(
    request: ChatCompletionRequest,
    tool_parser: str | None,
    disable_additional_properties: bool = False,
) -> ToolPlan:
    """Checks `tools` and `tool_choice`; `tool_parser` is the server's
    (--tool-call-parser with --enable-auto-tool-choice), or None. The
    arguments of a `strict` function (of every function with
    `disable_additional_properties`) have no properties beyond those listed."""
    tools = request.tools or []
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"tools may hold at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    names = [t.function.name for t in tools]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise BadRequest("every tool needs a name of its own", param="tools")
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise BadRequest(f"tool_choice {_choice_text(choice)} needs tools", param="tool_choice")
    if choice == "auto":
        if tool_parser is None:
            raise BadRequest(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        return ToolPlan(mode="auto")
    name = None
    if isinstance(choice, op.NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise BadRequest(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    try:
        structured = tool_structured_outputs(
            tools, choice, request.parallel_tool_calls is not False, disable_additional_properties
        )
        check_grammar(structured)
    except InvalidArgumentError as exc:
        raise BadRequest(f"the tools' parameters: {exc}", param="tools") from exc
    return ToolPlan(mode="named" if name else "required", name=name, structured=structured)


def _choice_text(choice: op.ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
