"""OpenAI-compatible request and response bodies, as msgspec Structs.

Requests decode with ``msgspec.json.decode(body, type=...)``: wrong JSON types
raise ``msgspec.ValidationError``; top-level fields the structs do not name are
sorted out by ``ferrox.server.request_fields`` (refused, or accepted and
ignored) before decoding. Decoding checks
types only; what the values mean (ranges, limits, the prompt's length) is checked
by ``ferrox.server.request_translation``, which raises ``BadRequest``.

Responses encode with ``msgspec.json.encode`` in the OpenAI wire format. The
``object`` field is the struct's tag, so it is always written and never passed.
"""

from __future__ import annotations

import copy
import secrets
import time
from typing import Any, Literal

import msgspec

from ferrox.common.errors import ContextLengthExceededError, InvalidArgumentError


class BadRequest(InvalidArgumentError):
    """A request field the server cannot serve; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def renamed(self, names: dict[str, str]) -> BadRequest:
        """This error with its field called as another API calls it
        (`{"max_tokens": "max_output_tokens"}`); the same error when its
        field is not in `names`."""
        new = names.get(self.param or "")
        if new is None or self.param is None:
            return self
        error = copy.copy(self)
        error.message = self.message.replace(self.param, new, 1)
        error.param = new
        error.args = (error.message,)
        return error


class ContextLengthBadRequest(BadRequest, ContextLengthExceededError):
    """The prompt, or the prompt plus the requested tokens, exceeds the context window."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


def random_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-<32 hex digits>``."""
    return f"{prefix}-{secrets.token_hex(16)}"


def _now() -> int:
    return int(time.time())


# ---- requests ----------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` field: exactly one constraint."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # with `json`


class _SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields that completions and chat completions share (OpenAI's, then vLLM's).

    ``None`` means the server's default, as OpenAI's schema allows null for each.
    """

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    seed: int | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    priority: int = 0
    spaces_between_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* fields (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


class CompletionRequest(_SamplingRequest, kw_only=True):
    """``POST /v1/completions``."""

    # A string, a list of strings, a list of token ids or a list of token-id lists;
    # msgspec allows one list type per union, so completion_prompts() sorts them out.
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # None: as many as the context window leaves
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ImageUrl(msgspec.Struct, kw_only=True):
    url: str
    # OpenAI's resolution hint; the model's image processor decides the size.
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content: ``{"type": "text", "text": ...}``, or
    for a vision-language model ``{"type": "image_url", "image_url": {"url":
    ...}}`` (a data URL, or http(s) from --allowed-media-domains)."""

    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


Role = Literal["system", "user", "assistant", "tool", "developer"]


class FunctionCallParam(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text, as the API returns it


class ToolCallParam(msgspec.Struct, kw_only=True):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(msgspec.Struct, kw_only=True):
    """One message of a chat request."""

    role: Role
    content: str | list[ContentPart] | None = None  # None only for assistant messages
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer
    reasoning_content: str | None = None  # assistant messages


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageParam]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # None: allowed
    include_reasoning: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: exactly one of ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None

    def __post_init__(self) -> None:
        # Raised while decoding, msgspec reports this as a ValidationError.
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give exactly one of 'prompt' or 'messages'", param="prompt")


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/embeddings``."""

    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extensions.
    add_special_tokens: bool = True
    priority: int = 0


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens served from the prefix cache


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for the first echoed prompt token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # written as null while streaming
    stop_reason: int | str | None = None  # the stop string or token id that ended it


class CompletionResponse(msgspec.Struct, kw_only=True, tag_field="object", tag="text_completion"):
    id: str
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(
    msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="object", tag="text_completion"
):
    """One server-sent event of a streamed completion (OpenAI reuses the Completion shape)."""

    id: str
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # only on the last chunk, with include_usage


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatLogprobToken(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str = msgspec.field(default_factory=lambda: random_id("call"))
    type: str = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of a tool call: the first of a call carries its id,
    type and name; later ones (same index) append to its arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(
    msgspec.Struct, kw_only=True, tag_field="object", tag="chat.completion"
):
    id: str
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The new part of a streamed message; the first chunk carries the role."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None  # written as null until the last chunk
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(
    msgspec.Struct,
    kw_only=True,
    omit_defaults=True,
    tag_field="object",
    tag="chat.completion.chunk",
):
    id: str
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None  # only on the last chunk, with include_usage


class EmbeddingData(msgspec.Struct, kw_only=True, tag_field="object", tag="embedding"):
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True, tag_field="object", tag="list"):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(msgspec.Struct, kw_only=True, tag_field="object", tag="model"):
    id: str
    created: int = msgspec.field(default_factory=_now)
    owned_by: str = "ferrox"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's directory
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(msgspec.Struct, kw_only=True, tag_field="object", tag="list"):
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
