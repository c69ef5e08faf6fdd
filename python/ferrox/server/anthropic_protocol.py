"""Anthropic Messages API request and response bodies, as msgspec Structs.

Content blocks are tagged unions on their ``type``. Image and document
blocks decode, so that `anthropic_messages` can refuse them by name (this
server serves text-only models); a block type not listed here is refused
while decoding, with the path of the block in the message.

Responses and stream events encode with ``msgspec.json.encode`` in
Anthropic's wire format; each struct's ``type`` is its tag, always written.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import msgspec


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


# ---- request content blocks ---------------------------------------------------


class TextBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None  # a hint; the prefix cache is automatic
    citations: list[dict[str, Any]] | None = None


class ImageBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="image"):
    source: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class DocumentBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="document"):
    source: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    """A tool call of an earlier assistant turn."""

    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_result"):
    """The result of a tool call, sent in a user turn."""

    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    """Reasoning of an earlier assistant turn; its signature is not checked."""

    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(
    msgspec.Struct, kw_only=True, tag_field="type", tag="redacted_thinking"
):
    data: str


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class MessageParam(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


# ---- request options ------------------------------------------------------------


class ToolParam(msgspec.Struct, kw_only=True):
    """A client tool; `type` is "custom" or absent (Anthropic's hosted tools,
    whose `type` names them, are refused)."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceParam(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool = False


class ThinkingParam(msgspec.Struct, kw_only=True):
    type: str  # "adaptive" and "disabled" are served
    budget_tokens: int | None = None


class OutputFormatParam(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = msgspec.field(name="schema")


class OutputConfigParam(msgspec.Struct, kw_only=True):
    format: OutputFormatParam | None = None
    effort: str | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: what the prompt is made of."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfigParam | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


# ---- responses ------------------------------------------------------------------


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int  # the prompt tokens not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class TextOut(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ThinkingOut(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class ToolUseOut(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut


class Message(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: str = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(msgspec.Struct, kw_only=True):
    input_tokens: int


# ---- stream events --------------------------------------------------------------


class MessageStart(msgspec.Struct, kw_only=True, tag_field="type", tag="message_start"):
    message: Message


class ContentBlockStart(msgspec.Struct, kw_only=True, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentOut


class TextDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="signature_delta"):
    signature: str


class InputJsonDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, kw_only=True, tag_field="type", tag="content_block_stop"):
    index: int


class StopInfo(msgspec.Struct, kw_only=True):
    stop_reason: str | None
    stop_sequence: str | None = None


class MessageDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="message_delta"):
    delta: StopInfo
    usage: Usage


class MessageStop(msgspec.Struct, kw_only=True, tag_field="type", tag="message_stop"):
    pass


class Ping(msgspec.Struct, kw_only=True, tag_field="type", tag="ping"):
    pass


Event = (
    MessageStart
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
    | Ping
)
