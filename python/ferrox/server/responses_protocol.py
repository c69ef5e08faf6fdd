"""OpenAI Responses API request bodies, as msgspec Structs.

`input` items are decoded as plain mappings and read by
`responses_api.input_messages`, which names the item it refuses: the API's
items (messages with or without a `type`, function calls and their outputs,
reasoning, and the hosted tools' items this server refuses) do not all carry
a tag that a msgspec union could dispatch on. Output items and stream events
are written as mappings too (`responses_api.OutputItems`)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class FunctionToolParam(msgspec.Struct, kw_only=True):
    """A tool; only `type` "function" is served (the others are hosted tools)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    user: str | None = None
    # vLLM extensions, as on the chat route.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    priority: int = 0
