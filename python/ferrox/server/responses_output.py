"""The Responses API's output items and the stream events that build
them, from `ChatOutput`'s pieces."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from ferrox.server import openai_protocol as op
from ferrox.server.chat_outputs import ChatOutput, ChatPiece
from ferrox.server.error_responses import describe


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


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
                        "id": item_id("rs"),
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
                        "id": item_id("msg"),
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
                        "id": item_id("fc"),
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


def assistant_turn(out: ChatOutput) -> op.ChatMessageParam:
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


def event_bytes(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def error_event(exc: BaseException, sequence_number: int = 0) -> dict[str, Any]:
    _, message, param, code = describe(exc)
    return {
        "type": "error",
        "code": code,
        "message": message,
        "param": param,
        "sequence_number": sequence_number,
    }


__all__ = ["OutputItems", "assistant_turn", "error_event", "event_bytes", "item_id"]
