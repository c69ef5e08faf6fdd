"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed),
`GET /v1/responses/{id}` and `DELETE /v1/responses/{id}`.

A request is translated into the chat request it means (`chat_request`)
and takes the chat completions' path: the chat template, sampling checks,
the tool plan (`tool_choice` "auto" reads the output with the server's
`--tool-call-parser`; "required" and a named function are written by a
grammar), structured outputs (`text.format`) and the reasoning parser.
`ChatOutput`'s pieces become output items (`OutputItems`): a `reasoning`
item (its text as `reasoning_text` content), `message` items
(`output_text`) and `function_call` items; a stream sends the events the
SDK's `responses.stream` accumulates, each with its `sequence_number`.

Input items: messages (with or without `type`; `input_text` and
`output_text` parts), `function_call` (an assistant turn's tool calls:
consecutive calls, and a message and reasoning before them, are one
assistant turn), `function_call_output` (a tool message) and `reasoning`
(the next assistant turn's reasoning). `instructions` is the system message
of this request alone, as OpenAI documents.

Stored responses (`store`, true unless the request says otherwise) live in
this process's `ResponseStore`: the most recent `--max-stored-responses`
of them, least recently used first out. `previous_response_id` continues
a stored response's conversation (its input and output, without its
instructions); an id that is not stored, or no longer, is a 404.

Refused by name: hosted tools (a tool `type` other than "function"), image,
file and audio inputs (text-only models), `item_reference` items,
`background`, `conversation`, `prompt`, `truncation` "auto" (prompts are
never truncated), reasoning `effort` and `summary`, `top_logprobs`,
`max_tool_calls`, `include` and `text.verbosity`.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ferrox.common.errors import InvalidArgumentError
from ferrox.frontend.request_run import RequestRun, merge
from ferrox.server import openai_protocol as op
from ferrox.server import responses_protocol as rp
from ferrox.server.chat_outputs import ChatOutput, ChatPiece
from ferrox.server.error_responses import describe, error_response
from ferrox.server.openai_protocol import BadRequest
from ferrox.server.output_constraints import ToolPlan, tool_plan
from ferrox.server.request_fields import FieldRules
from ferrox.server.serving import OpenAIServing

RESPONSES_FIELDS = FieldRules(
    unsupported={
        "conversation": "conversations are not stored; use previous_response_id",
        "prompt": "stored prompt templates are not supported",
        "context_management": "context compaction is not supported",
        "moderation": "moderation is not supported",
        "image": "ferrox serves text-only models",
    },
    ignored=frozenset(
        {
            "service_tier",
            "prompt_cache_key",
            "prompt_cache_retention",
            "prompt_cache_options",
            "safety_identifier",
            "stream_options",
        }
    ),
)
# The chat request's field names of a check's error, as the Responses API calls them.
_RENAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ---- stored responses ---------------------------------------------------------------


@dataclass
class StoredResponse:
    response: dict[str, Any]
    # The conversation without instructions, this response's output included.
    history: list[op.ChatMessageParam]


class ResponseStore:
    """The most recent `capacity` stored responses (0: none are kept)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise InvalidArgumentError(f"the response store's size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


# ---- the request, as a chat request ---------------------------------------------------


def check_served(req: rp.ResponsesRequest) -> None:
    """Refuses the fields whose values this server does not honour."""
    refusals = [
        (req.background, "background", "background responses are not supported"),
        (req.top_logprobs, "top_logprobs", "output logprobs are not supported here"),
        (req.max_tool_calls is not None, "max_tool_calls", "max_tool_calls is not enforced"),
        (req.include, "include", f"include {req.include} is not supported"),
        (
            req.truncation == "auto",
            "truncation",
            'prompts are never truncated: use "disabled" and shorten the input',
        ),
    ]
    if req.reasoning is not None:
        refusals += [
            (
                req.reasoning.effort is not None,
                "reasoning",
                "reasoning.effort is not supported: the model decides how long it reasons",
            ),
            (
                req.reasoning.summary is not None or req.reasoning.generate_summary is not None,
                "reasoning",
                "reasoning summaries are not generated; the reasoning comes as reasoning_text",
            ),
        ]
    if req.text is not None:
        refusals.append((req.text.verbosity is not None, "text", "text.verbosity is not supported"))
    for given, param, reason in refusals:
        if given:
            raise BadRequest(f"{param}: {reason}", param=param)


def chat_request(
    req: rp.ResponsesRequest, history: list[op.ChatMessageParam]
) -> tuple[op.ChatCompletionRequest, list[op.ChatMessageParam]]:
    """The chat request that `req` means after `history` (a previous
    response's conversation), and the conversation without instructions."""
    conversation = [*history, *input_messages(req.input)]
    if not conversation:
        raise BadRequest("input must not be empty", param="input")
    messages = list(conversation)
    if req.instructions:
        messages.insert(0, op.ChatMessageParam(role="system", content=req.instructions))
    fields: dict[str, Any] = {
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "priority": req.priority,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
    }
    if req.tools:
        fields["tools"] = [_tool(index, tool) for index, tool in enumerate(req.tools)]
    if isinstance(req.tool_choice, rp.NamedFunctionChoice):
        name = op.NamedFunction(name=req.tool_choice.name)
        fields["tool_choice"] = op.NamedToolChoice(type="function", function=name)
    elif req.tool_choice is not None:
        fields["tool_choice"] = req.tool_choice
    return op.ChatCompletionRequest(**fields), conversation


def input_messages(items: str | list[dict[str, Any]]) -> list[op.ChatMessageParam]:
    """`input` as chat messages (see the module's docstring)."""
    if isinstance(items, str):
        return [op.ChatMessageParam(role="user", content=items)]
    out: list[op.ChatMessageParam] = []
    reasoning: list[str] = []

    def assistant() -> op.ChatMessageParam:
        """The assistant turn the next item joins: the last message when it
        is one that carries no tool result, else a new one."""
        if not (out and out[-1].role == "assistant" and out[-1].tool_call_id is None):
            out.append(op.ChatMessageParam(role="assistant", content=""))
        turn = out[-1]
        if reasoning:
            turn.reasoning_content = "\n".join(reasoning)
            reasoning.clear()
        return turn

    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role, text = _message(index, item)
            if role == "assistant":
                turn = assistant()
                if turn.tool_calls:  # text after calls: a turn of its own
                    out.append(op.ChatMessageParam(role="assistant", content=text))
                else:
                    turn.content = f"{turn.content}\n{text}" if turn.content else text
            else:
                out.append(op.ChatMessageParam(role=role, content=text))
        elif kind == "function_call":
            call = op.ToolCallParam(
                id=_string(index, item, "call_id"),
                function=op.FunctionCallParam(
                    name=_string(index, item, "name"), arguments=_string(index, item, "arguments")
                ),
            )
            turn = assistant()
            turn.tool_calls = [*(turn.tool_calls or []), call]
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(index, output)
            out.append(
                op.ChatMessageParam(
                    role="tool", content=text, tool_call_id=_string(index, item, "call_id")
                )
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append(_parts_text(index, parts))
        elif kind == "item_reference":
            raise BadRequest(
                f"input[{index}] is an item_reference; send the items themselves, or continue "
                "a stored response with previous_response_id",
                param="input",
            )
        else:
            raise BadRequest(
                f"input[{index}] is a {kind!r} item, which this server does not serve (it runs "
                "no hosted tools)",
                param="input",
            )
    if reasoning:
        assistant()
    return out


_ROLES = ("user", "assistant", "system", "developer")


def _message(index: int, item: dict[str, Any]) -> tuple[Any, str]:
    role = item.get("role")
    if role not in _ROLES:
        raise BadRequest(
            f"input[{index}] has role {role!r}; a message's role is one of {list(_ROLES)}",
            param="input",
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(index, content)
    return ("system" if role == "developer" else role), text


def _parts_text(index: int, parts: Any) -> str:
    if not isinstance(parts, list):
        raise BadRequest(f"input[{index}] needs text or a list of parts", param="input")
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise BadRequest(
                f"input[{index}] has an {kind} part; this server serves text-only models",
                param="input",
            )
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "reasoning_text", "summary_text", "refusal"):
            raise BadRequest(f"input[{index}] has a part of type {kind!r}", param="input")
        if kind == "refusal":
            text = part.get("refusal")
        if not isinstance(text, str):
            raise BadRequest(f"input[{index}] has a {kind} part without text", param="input")
        texts.append(text)
    return "\n".join(texts)


def _string(index: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"input[{index}] ({item.get('type')}) needs a string {key}", "input")
    return value


def _tool(index: int, tool: rp.FunctionToolParam) -> op.ToolDefinition:
    if tool.type != "function":
        raise BadRequest(
            f"tools[{index}] is a hosted tool ({tool.type!r}); this server runs none: give "
            "function tools",
            param="tools",
        )
    if not tool.name:
        raise BadRequest(f"tools[{index}] needs a name", param="tools")
    function = op.FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
    )
    return op.ToolDefinition(type="function", function=function)


def _response_format(text: rp.TextConfig | None) -> op.ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return op.ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise BadRequest("text.format of type json_schema needs a schema", param="text")
    spec = op.JsonSchemaSpec(
        name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict
    )
    return op.ResponseFormat(type="json_schema", json_schema=spec)


# ---- the output, as items --------------------------------------------------------------


class OutputItems:
    """A reply's output items and the stream events that build them, from
    `ChatOutput`'s pieces: an item opens when the kind of output changes
    (reasoning, text, a new call) and closes when the next one opens or the
    reply ends. `items` holds the closed items, as the final response
    lists them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""

    @property
    def _index(self) -> int:
        return len(self.items)

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self._open, self._text = item, ""
        events.append(
            {"type": "response.output_item.added", "output_index": self._index, "item": item}
        )
        part = self._part("")
        if part is not None:
            events.append({"type": "response.content_part.added", **self._where(), "part": part})
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self._index, "content_index": 0}

    def _part(self, text: str) -> dict[str, Any] | None:
        kind = self._open["type"] if self._open is not None else None
        if kind == "message":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return None

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        events: list[dict[str, Any]] = []
        where = self._where()
        done = {**item, "status": status}
        if item["type"] == "function_call":
            done["arguments"] = self._text
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": self._index,
                    "arguments": self._text,
                    "name": item["name"],
                }
            )
        else:
            part = self._part(self._text)
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            text_done = {"type": f"response.{kind}.done", **where, "text": self._text}
            if item["type"] == "message":
                text_done["logprobs"] = []
            events.append(text_done)
            events.append({"type": "response.content_part.done", **where, "part": part})
            done["content"] = [part]
        events.append(
            {"type": "response.output_item.done", "output_index": self._index, "item": done}
        )
        self.items.append(done)
        self._open, self._text = None, ""
        return events

    def feed(self, piece: ChatPiece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                events += self._start(
                    {
                        "type": "reasoning",
                        "id": _id("rs"),
                        "summary": [],
                        "content": [],
                        "status": "in_progress",
                    }
                )
            self._text += piece.reasoning
            events.append(
                {"type": "response.reasoning_text.delta", **self._where(), "delta": piece.reasoning}
            )
        if piece.content:
            if self._open is None or self._open["type"] != "message":
                events += self._start(
                    {
                        "type": "message",
                        "id": _id("msg"),
                        "role": "assistant",
                        "content": [],
                        "status": "in_progress",
                    }
                )
            self._text += piece.content
            events.append(
                {
                    "type": "response.output_text.delta",
                    **self._where(),
                    "delta": piece.content,
                    "logprobs": [],
                }
            )
        for call in piece.tool_deltas:
            function = call.function or op.DeltaFunctionCall()
            if call.id is not None:
                events += self._start(
                    {
                        "type": "function_call",
                        "id": _id("fc"),
                        "call_id": call.id,
                        "name": function.name or "",
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            if function.arguments:
                assert self._open is not None
                self._text += function.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self._open["id"],
                        "output_index": self._index,
                        "delta": function.arguments,
                    }
                )
        return events


def _assistant_turn(out: ChatOutput) -> op.ChatMessageParam:
    """A reply as the assistant message a later request's history holds."""
    calls = [
        op.ToolCallParam(id=c.id, function=op.FunctionCallParam(name=c.name, arguments=c.arguments))
        for c in out.calls
    ]
    return op.ChatMessageParam(
        role="assistant",
        content=out.content,
        reasoning_content=out.reasoning_text or None,
        tool_calls=calls or None,
    )


def _event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def _error_event(exc: BaseException, sequence_number: int = 0) -> dict[str, Any]:
    _, message, param, code = describe(exc)
    return {
        "type": "error",
        "code": code,
        "message": message,
        "param": param,
        "sequence_number": sequence_number,
    }


# ---- the routes ---------------------------------------------------------------------------


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.ctx = serving.ctx
        self.store = ResponseStore(serving.ctx.max_stored_responses)

    async def create(self, http: Request) -> Response:
        async def build(body: bytes, admitted: list[int]) -> Response:
            return await self._create(http, body, admitted)

        return await self.serving.handle(http, build)

    async def retrieve(self, http: Request) -> Response:
        if "stream" in http.query_params:
            return error_response(
                400, "streaming a stored response again is not supported", param="stream"
            )
        entry = self.store.get(http.path_params["response_id"])
        if entry is None:
            return self._not_stored(http.path_params["response_id"], "response_id")
        return Response(msgspec.json.encode(entry.response), media_type="application/json")

    async def delete(self, http: Request) -> Response:
        response_id = http.path_params["response_id"]
        if not self.store.delete(response_id):
            return self._not_stored(response_id, "response_id")
        body = {"id": response_id, "object": "response.deleted", "deleted": True}
        return Response(msgspec.json.encode(body), media_type="application/json")

    def _not_stored(self, response_id: str, param: str) -> Response:
        return error_response(
            404,
            f"no stored response has the id {response_id!r} (responses are kept in memory, "
            f"the {self.store.capacity} most recent)",
            param=param,
            code="not_found",
        )

    async def _create(self, http: Request, body: bytes, admitted: list[int]) -> Response:
        req = self.serving.decode(body, rp.ResponsesRequest, RESPONSES_FIELDS)
        if (missing := self.serving.check_model(req.model)) is not None:
            return missing
        check_served(req)
        history: list[op.ChatMessageParam] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                return self._not_stored(req.previous_response_id, "previous_response_id")
            history = previous.history
        chat, conversation = chat_request(req, history)
        try:
            tools = tool_plan(chat, self.ctx.tool_parser, self.ctx.disable_additional_properties)
            self.ctx.admit(1)
            admitted.append(1)
            prompt = await self.serving.chat_prompt_async(chat)
            run = self.serving.new_run(_id("resp"), prompt, chat, tools)
        except BadRequest as e:
            raise e.renamed(_RENAMES) from None
        reply = _Reply(self, req, run, tools, conversation)
        if req.stream:
            return self.serving.stream(
                reply.events(),
                [run],
                admitted.pop(),
                done=b"",
                on_error=lambda e: _event(_error_event(e)),
            )
        await self.serving.run_all(http, [run])
        reply.items.feed(reply.output.feed(run.seqs[0].text, final=True))
        return Response(msgspec.json.encode(reply.finish()), media_type="application/json")


class _Reply:
    """One response being made: its output items, and the response object."""

    def __init__(
        self,
        serving: ResponsesServing,
        req: rp.ResponsesRequest,
        run: RequestRun,
        tools: ToolPlan,
        conversation: list[op.ChatMessageParam],
    ) -> None:
        self.serving = serving
        self.req = req
        self.run = run
        self.conversation = conversation
        self.output = serving.serving.chat_output(tools)
        self.items = OutputItems()
        self.created_at = int(time.time())
        self.stored = req.store and serving.store.capacity > 0

    def response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice: Any = req.tool_choice or "auto"
        return {
            "id": self.run.request_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.serving.ctx.model_name if req.model is None else req.model,
            "output": list(self.items.items),
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.stored,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            "tool_choice": msgspec.to_builtins(choice),
            "tools": [msgspec.to_builtins(t) for t in req.tools or []],
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
        }

    def _usage(self) -> dict[str, Any]:
        run = self.run
        prompt, output = len(run.prompt_token_ids), run.num_output_tokens
        reasoning = self.output.reasoning_text
        # The reasoning's tokens, counted by tokenizing its text again.
        encode = self.serving.ctx.tokenizer.encode
        reasoning_tokens = len(encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": run.state.num_cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output)},
            "total_tokens": prompt + output,
        }

    def _status(self) -> str:
        return "incomplete" if self.run.seqs[0].finish_reason == "length" else "completed"

    def finish(self) -> dict[str, Any]:
        """Closes the last item; the final response, stored if asked."""
        self.items.close(self._status())
        response = self.response(self._status(), self._usage())
        if self.stored:
            history = [*self.conversation, _assistant_turn(self.output)]
            self.serving.store.put(self.run.request_id, StoredResponse(response, history))
        return response

    async def events(self) -> AsyncIterator[bytes]:
        number = 0

        def sse(event: dict[str, Any]) -> bytes:
            nonlocal number
            event["sequence_number"] = number
            number += 1
            return _event(event)

        start = self.response("in_progress", None)
        yield sse({"type": "response.created", "response": start})
        yield sse({"type": "response.in_progress", "response": start})
        try:
            async for _, upd in merge([self.run]):
                if not (upd.text or upd.finish_reason):
                    continue
                piece = self.output.feed(upd.text, final=upd.finish_reason is not None)
                for event in self.items.feed(piece):
                    yield sse(event)
            for event in self.items.close(self._status()):
                yield sse(event)
            response = self.finish()
        except Exception as e:
            yield sse(_error_event(e))
            return
        yield sse({"type": f"response.{response['status']}", "response": response})


__all__ = ["OutputItems", "ResponseStore", "ResponsesServing", "chat_request", "input_messages"]
