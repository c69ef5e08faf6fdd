"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`.

A request is translated into the chat request it means (`chat_request`) and
then takes the chat completions' path: the same chat template, sampling
checks, tool plan (`tool_choice` "auto" reads the output with the server's
`--tool-call-parser`, "any" and a named tool are enforced by a grammar),
structured outputs (`output_config.format`) and reasoning parser. The output
is split by `ChatOutput` as a chat completion's is, then written as
Anthropic content blocks: `thinking` (with `--reasoning-parser`), `text`
and `tool_use`; a stream sends the events the SDK's stream accumulator
reads (`message_start`, `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`, a `ping`).

How the translation reads the request:
- `system` is the first message; a user turn's `tool_result` blocks become
  tool messages (`tool_call_id` is the `tool_use_id`; `is_error` puts
  "Error: " before the result), its text blocks a user message; an
  assistant turn's `tool_use` blocks become its tool calls and its
  `thinking` blocks its reasoning (signatures are not checked; redacted
  thinking, unreadable here, is left out).
- A final assistant turn is a prefill: the reply continues its text.
- `thinking`: {"type": "adaptive"} leaves reasoning to the model and its
  chat template, {"type": "disabled"} renders the template with
  `enable_thinking` false; a thinking budget ({"type": "enabled"}) is
  refused, as ferrox does not bound reasoning apart from `max_tokens`.
- `cache_control` marks are accepted: the prefix cache is automatic, and
  usage reports its hits as `cache_read_input_tokens` (`input_tokens` are
  the prompt tokens computed anew).
- Image and document blocks, hosted tools (a `type` other than "custom")
  and `output_config.effort` are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ferrox.frontend.request_run import RequestRun, merge
from ferrox.server import anthropic_protocol as ap
from ferrox.server import openai_protocol as op
from ferrox.server.chat_outputs import ChatOutput, ChatPiece
from ferrox.server.error_responses import (
    anthropic_error_response,
    anthropic_exception_response,
    anthropic_sse_error,
)
from ferrox.server.openai_protocol import BadRequest
from ferrox.server.output_constraints import ToolPlan, tool_plan
from ferrox.server.request_fields import FieldRules
from ferrox.server.serving import OpenAIServing

MESSAGES_FIELDS = FieldRules(
    unsupported={
        "container": "code-execution containers are not supported",
        "mcp_servers": "the MCP connector is not supported; run MCP tools on the client",
        "context_management": "context editing is not supported",
        "diagnostics": "prompt-cache diagnostics are not supported",
    },
    # Bookkeeping and hints that cannot change the output.
    ignored=frozenset(
        {"metadata", "service_tier", "inference_geo", "cache_control", "speed", "user_profile_id"}
    ),
)
_THINKING_SERVED = ("adaptive", "disabled")


# ---- the request, as a chat request ----------------------------------------------


def chat_request(req: ap.CountTokensRequest) -> op.ChatCompletionRequest:
    """The chat completions request that `req` means; a BadRequest names
    what cannot be served."""
    if not req.messages:
        raise BadRequest("messages must not be empty", param="messages")
    messages: list[op.ChatMessageParam] = []
    if req.system:
        messages.append(op.ChatMessageParam(role="system", content=_system_text(req.system)))
    for index, turn in enumerate(req.messages):
        messages += _turn(index, turn)
    prefill = req.messages[-1].role == "assistant"
    if prefill and messages[-1].tool_calls:
        raise BadRequest(
            "the final assistant turn (a prefill) may hold only text", param="messages"
        )
    fields: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "chat_template_kwargs": _thinking(req.thinking),
        "response_format": _output_format(req.output_config),
    }
    if req.tools:
        fields["tools"] = [_tool(index, tool) for index, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields["tool_choice"], fields["parallel_tool_calls"] = _tool_choice(req.tool_choice)
    if isinstance(req, ap.MessagesRequest):
        if req.max_tokens < 1:
            raise BadRequest(
                f"max_tokens must be at least 1 (requests that only warm the prompt cache are "
                f"not supported), got {req.max_tokens}",
                param="max_tokens",
            )
        fields |= {
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "stream": req.stream,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
        }
    return op.ChatCompletionRequest(**fields)


def _system_text(system: str | list[ap.TextBlock]) -> str:
    return system if isinstance(system, str) else "\n".join(block.text for block in system)


def _refused(index: int, block: Any) -> BadRequest:
    if isinstance(block, ap.DocumentBlock):
        return BadRequest(
            f"messages[{index}] has a document block; this server takes no documents",
            param="messages",
        )
    kind = block.__struct_config__.tag
    return BadRequest(f"messages[{index}] may not hold a {kind} block here", param="messages")


def _turn(index: int, turn: ap.MessageParam) -> list[op.ChatMessageParam]:
    if isinstance(turn.content, str):
        return [op.ChatMessageParam(role=turn.role, content=turn.content)]
    if turn.role == "assistant":
        return [_assistant_turn(index, turn.content)]
    return _user_turn(index, turn.content)


def _assistant_turn(index: int, blocks: list[ap.ContentBlock]) -> op.ChatMessageParam:
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[op.ToolCallParam] = []
    for block in blocks:
        if isinstance(block, ap.TextBlock):
            text.append(block.text)
        elif isinstance(block, ap.ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ap.ToolUseBlock):
            function = op.FunctionCallParam(name=block.name, arguments=block.input)
            calls.append(op.ToolCallParam(id=block.id, function=function))
        elif not isinstance(block, ap.RedactedThinkingBlock):
            raise _refused(index, block)
    return op.ChatMessageParam(
        role="assistant",
        content="\n".join(text),
        reasoning_content="\n".join(reasoning) or None,
        tool_calls=calls or None,
    )


def _user_turn(index: int, blocks: list[ap.ContentBlock]) -> list[op.ChatMessageParam]:
    out: list[op.ChatMessageParam] = []
    parts: list[op.ContentPart] = []

    def flush() -> None:
        if any(part.type == "image_url" for part in parts):
            out.append(op.ChatMessageParam(role="user", content=list(parts)))
        elif parts:
            text = "\n".join(part.text or "" for part in parts)
            out.append(op.ChatMessageParam(role="user", content=text))
        parts.clear()

    for block in blocks:
        if isinstance(block, ap.TextBlock):
            parts.append(op.ContentPart(type="text", text=block.text))
        elif isinstance(block, ap.ImageBlock):
            url = op.ImageUrl(url=_image_url(index, block.source))
            parts.append(op.ContentPart(type="image_url", image_url=url))
        elif isinstance(block, ap.ToolResultBlock):
            flush()
            result = _result_text(index, block.content)
            if block.is_error:
                result = f"Error: {result}"
            out.append(
                op.ChatMessageParam(role="tool", content=result, tool_call_id=block.tool_use_id)
            )
        else:
            raise _refused(index, block)
    flush()
    if not out:
        raise BadRequest(f"messages[{index}] (user) has no content", param="messages")
    return out


def _image_url(index: int, source: dict[str, Any] | None) -> str:
    """An image block's source as the chat API's image URL."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and source is not None:
        media, data = source.get("media_type"), source.get("data")
        if isinstance(media, str) and isinstance(data, str):
            return f"data:{media};base64,{data}"
    elif kind == "url" and source is not None and isinstance(source.get("url"), str):
        return str(source["url"])
    raise BadRequest(
        f"messages[{index}] has an image block whose source is not "
        '{"type": "base64", "media_type": ..., "data": ...} or {"type": "url", "url": ...}',
        param="messages",
    )


def _result_text(index: int, content: str | list[Any] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for block in content:
        if not isinstance(block, ap.TextBlock):
            raise _refused(index, block)
    return "\n".join(block.text for block in content)


def _thinking(thinking: ap.ThinkingParam | None) -> dict[str, Any] | None:
    if thinking is None or thinking.type == "adaptive":
        return None
    if thinking.type == "disabled":
        return {"enable_thinking": False}
    if thinking.type == "enabled":
        raise BadRequest(
            'thinking budgets ({"type": "enabled"}) are not supported: the model decides how '
            'long it reasons within max_tokens; use {"type": "adaptive"}, or '
            '{"type": "disabled"} to turn reasoning off where the chat template allows',
            param="thinking",
        )
    raise BadRequest(
        f"thinking.type must be one of {list(_THINKING_SERVED)}, got {thinking.type!r}",
        param="thinking",
    )


def _output_format(config: ap.OutputConfigParam | None) -> op.ResponseFormat | None:
    if config is None:
        return None
    if config.effort is not None:
        raise BadRequest(
            "output_config.effort is not supported: the model decides how long it reasons",
            param="output_config",
        )
    if config.format is None:
        return None
    schema = op.JsonSchemaSpec(name="output", schema_=config.format.schema_, strict=True)
    return op.ResponseFormat(type="json_schema", json_schema=schema)


def _tool(index: int, tool: ap.ToolParam) -> op.ToolDefinition:
    if tool.type not in (None, "custom"):
        raise BadRequest(
            f"tools[{index}] is a hosted tool ({tool.type!r}); this server runs none: give "
            "client tools with an input_schema",
            param="tools",
        )
    if tool.input_schema is None:
        raise BadRequest(f"tools[{index}] ({tool.name!r}) needs an input_schema", param="tools")
    function = op.FunctionDefinition(
        name=tool.name,
        description=tool.description,
        parameters=tool.input_schema,
        strict=tool.strict,
    )
    return op.ToolDefinition(type="function", function=function)


def _tool_choice(choice: ap.ToolChoiceParam) -> tuple[op.ToolChoice, bool | None]:
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise BadRequest('tool_choice of type "tool" needs a name', param="tool_choice")
        named = op.NamedToolChoice(type="function", function=op.NamedFunction(name=choice.name))
        return named, parallel
    return {"any": "required"}.get(choice.type, choice.type), parallel  # type: ignore[return-value]


# ---- the output, as content blocks -----------------------------------------------


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(out: ChatOutput) -> list[ap.ContentOut]:
    """A whole reply's blocks: its reasoning, its text, its tool calls (a
    call whose arguments were cut short, by max_tokens, stays text)."""
    blocks: list[ap.ContentOut] = []
    if out.reasoning_text:
        blocks.append(ap.ThinkingOut(thinking=out.reasoning_text))
    if out.content:
        blocks.append(ap.TextOut(text=out.content))
    for call in out.calls:
        arguments = _input(call.arguments)
        if arguments is None:
            blocks.append(ap.TextOut(text=call.arguments))
        else:
            blocks.append(ap.ToolUseOut(id=_tool_use_id(call.id), name=call.name, input=arguments))
    return blocks


def stop_reason(out: ChatOutput, finish_reason: str | None, stop: int | str | None) -> ap.StopInfo:
    if finish_reason == "length":
        return ap.StopInfo(stop_reason="max_tokens")
    if out.calls:
        return ap.StopInfo(stop_reason="tool_use")
    if isinstance(stop, str):
        return ap.StopInfo(stop_reason="stop_sequence", stop_sequence=stop)
    return ap.StopInfo(stop_reason="end_turn")


class BlockEvents:
    """A streamed reply's content-block events, from `ChatOutput`'s pieces:
    a block opens when the kind of output changes (reasoning, text, a new
    tool call) and closes when the next one opens or the reply ends."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def _open(self, kind: str, block: ap.ContentOut) -> list[ap.Event]:
        events = self.close()
        self.index += 1
        self.kind = kind
        events.append(ap.ContentBlockStart(index=self.index, content_block=block))
        return events

    def _delta(self, delta: Any) -> ap.ContentBlockDelta:
        return ap.ContentBlockDelta(index=self.index, delta=delta)

    def close(self) -> list[ap.Event]:
        if self.kind is None:
            return []
        events: list[ap.Event] = []
        if self.kind == "thinking":
            events.append(self._delta(ap.SignatureDelta(signature="")))
        events.append(ap.ContentBlockStop(index=self.index))
        self.kind = None
        return events

    def feed(self, piece: ChatPiece) -> list[ap.Event]:
        events: list[ap.Event] = []
        if piece.reasoning:
            if self.kind != "thinking":
                events += self._open("thinking", ap.ThinkingOut(thinking=""))
            events.append(self._delta(ap.ThinkingDelta(thinking=piece.reasoning)))
        if piece.content:
            if self.kind != "text":
                events += self._open("text", ap.TextOut(text=""))
            events.append(self._delta(ap.TextDelta(text=piece.content)))
        for call in piece.tool_deltas:
            function = call.function or op.DeltaFunctionCall()
            if call.id is not None:
                block = ap.ToolUseOut(id=_tool_use_id(call.id), name=function.name or "", input={})
                events += self._open("tool_use", block)
            if function.arguments:
                events.append(self._delta(ap.InputJsonDelta(partial_json=function.arguments)))
        return events


def _event(event: ap.Event) -> bytes:
    name = event.__struct_config__.tag
    return b"event: " + str(name).encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def _json(value: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(value), media_type="application/json")


# ---- the routes -------------------------------------------------------------------


class AnthropicServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.ctx = serving.ctx

    def _model_missing(self, model: str) -> Response | None:
        if self.ctx.serves(model):
            return None
        return anthropic_error_response(
            404, f"the model {model!r} does not exist; this server has {self.ctx.all_models}"
        )

    async def count_tokens(self, http: Request) -> Response:
        try:
            req = self.serving.decode(await http.body(), ap.CountTokensRequest, MESSAGES_FIELDS)
            if (missing := self._model_missing(req.model)) is not None:
                return missing
            chat = chat_request(req)
            tool_plan(chat, self.ctx.tool_parser, self.ctx.disable_additional_properties)
            prompt = (await self.serving.chat_prompt_async(chat)).ids
            return _json(ap.CountTokensResponse(input_tokens=len(prompt)))
        except Exception as e:
            return anthropic_exception_response(e)

    async def messages(self, http: Request) -> Response:
        async def build(body: bytes, admitted: list[int]) -> Response:
            return await self._messages(http, body, admitted)

        return await self.serving.handle(http, build, on_error=anthropic_exception_response)

    async def _messages(self, http: Request, body: bytes, admitted: list[int]) -> Response:
        req = self.serving.decode(body, ap.MessagesRequest, MESSAGES_FIELDS)
        if (missing := self._model_missing(req.model)) is not None:
            return missing
        chat = chat_request(req)
        tools = tool_plan(chat, self.ctx.tool_parser, self.ctx.disable_additional_properties)
        self.ctx.admit(1)
        admitted.append(1)
        prompt = await self.serving.chat_prompt_async(chat)
        try:
            run = self.serving.new_run(
                ap.message_id(), prompt.ids, chat, tools, images=prompt.images
            )
        except BadRequest as e:
            raise e.renamed({"stop": "stop_sequences"}) from None
        if req.stream:
            events = self._events(req.model, run, tools)
            return self.serving.stream(
                events, [run], admitted.pop(), done=b"", on_error=anthropic_sse_error
            )
        await self.serving.run_all(http, [run])
        seq = run.seqs[0]
        out = self.serving.chat_output(tools)
        out.feed(seq.text, final=True)
        stop = stop_reason(out, seq.finish_reason, seq.stop_reason)
        message = ap.Message(
            id=run.request_id,
            model=req.model,
            content=content_blocks(out),
            stop_reason=stop.stop_reason,
            stop_sequence=stop.stop_sequence,
            usage=_usage(run),
        )
        return _json(message)

    async def _events(self, model: str, run: RequestRun, tools: ToolPlan) -> AsyncIterator[bytes]:
        out = self.serving.chat_output(tools)
        blocks = BlockEvents()
        started = False

        def start() -> list[bytes]:
            # Sent with the first output, when the prefix cache's share is known.
            message = ap.Message(
                id=run.request_id, model=model, content=[], stop_reason=None, usage=_usage(run)
            )
            return [_event(ap.MessageStart(message=message)), _event(ap.Ping())]

        async for _, upd in merge([run]):
            if not started:
                started = True
                for chunk in start():
                    yield chunk
            if not (upd.text or upd.finish_reason):
                continue
            piece = out.feed(upd.text, final=upd.finish_reason is not None)
            for event in blocks.feed(piece):
                yield _event(event)
        if not started:
            for chunk in start():
                yield chunk
        for event in blocks.close():
            yield _event(event)
        seq = run.seqs[0]
        stop = stop_reason(out, seq.finish_reason, seq.stop_reason)
        yield _event(ap.MessageDelta(delta=stop, usage=_usage(run)))
        yield _event(ap.MessageStop())


def _usage(run: RequestRun) -> ap.Usage:
    cached = run.state.num_cached_tokens
    return ap.Usage(
        input_tokens=len(run.prompt_token_ids) - cached,
        output_tokens=run.num_output_tokens,
        cache_read_input_tokens=cached,
    )


__all__ = ["AnthropicServing", "BlockEvents", "chat_request", "content_blocks"]
