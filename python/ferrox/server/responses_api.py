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
from ferrox.server.error_responses import error_response
from ferrox.server.openai_protocol import BadRequest
from ferrox.server.output_constraints import ToolPlan, tool_plan
from ferrox.server.request_fields import FieldRules
from ferrox.server.responses_input import chat_request, check_served
from ferrox.server.responses_output import (
    OutputItems,
    assistant_turn,
    error_event,
    event_bytes,
    item_id,
)
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
            run = self.serving.new_run(
                item_id("resp"), prompt.ids, chat, tools, images=prompt.images
            )
        except BadRequest as e:
            raise e.renamed(_RENAMES) from None
        reply = _Reply(self, req, run, tools, conversation)
        if req.stream:
            return self.serving.stream(
                reply.events(),
                [run],
                admitted.pop(),
                done=b"",
                on_error=lambda e: event_bytes(error_event(e)),
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
            history = [*self.conversation, assistant_turn(self.output)]
            self.serving.store.put(self.run.request_id, StoredResponse(response, history))
        return response

    async def events(self) -> AsyncIterator[bytes]:
        number = 0

        def sse(event: dict[str, Any]) -> bytes:
            nonlocal number
            event["sequence_number"] = number
            number += 1
            return event_bytes(event)

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
            yield sse(error_event(e))
            return
        yield sse({"type": f"response.{response['status']}", "response": response})


__all__ = ["ResponseStore", "ResponsesServing", "StoredResponse"]
