"""What a chat completion's text holds besides its content: reasoning
(`--reasoning-parser`) and tool calls (`tools`, `tool_choice`).

Every parser here reads the text as a stream (`feed` each new piece, then
`finish`), so a streamed response and a whole one take the same path: a
whole response is one `feed` of all its text. Text that may still turn
into a tag (a partial "<tool_call>" at the end) is held back until the
next piece decides it.

Tool calls, by `tool_choice`:
- "required" and a named function are enforced by a grammar (see
  `tool_structured_outputs`): the output is a JSON list of
  {"name", "parameters"} objects, or the named function's arguments, so it
  always parses and matches the functions' parameter schemas;
- "auto" reads the model family's own format with `--tool-call-parser`:
  "hermes" (`<tool_call>{...}</tool_call>`, Qwen2.5 / Qwen3, Hermes) or
  "llama3_json" (a JSON object `{"name", "parameters"}`, Llama 3.1+).

A model that speaks the harmony format (gpt-oss) is read by
`harmony.HarmonyStream` instead: its channels are the reasoning, the
content and the calls, whatever `--reasoning-parser` says.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from ferrox.common.structured_outputs import StructuredOutputsParams, closed_objects
from ferrox.server import openai_protocol as op
from ferrox.server.harmony import HarmonyStream

REASONING_PARSERS = ("qwen3", "deepseek_r1")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_THINK_START, _THINK_END = "<think>", "</think>"
_CALL_START, _CALL_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=tool_call_id)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _call(obj: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    """A call from a parsed {"name", "arguments"/"parameters"} object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(args, str):
        return ParsedCall(obj["name"], args)
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


# ---- reasoning ------------------------------------------------------------


class ReasoningStream:
    """Splits `<think>...</think>` from the content.

    qwen3: the output reasons only when it starts with <think>.
    deepseek_r1: the output reasons from its start (the template opened the
    block) until </think>; a leading <think> is dropped.
    """

    def __init__(self, parser: str) -> None:
        self._state = "reasoning" if parser == "deepseek_r1" else "start"
        self._buffer = ""
        self._opened = False
        self._trim = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the new text."""
        self._buffer += text
        reasoning = content = ""
        while self._buffer:
            if self._state == "start" or (self._state == "reasoning" and not self._opened):
                stripped = self._buffer.lstrip()
                if stripped.startswith(_THINK_START):
                    self._buffer = stripped[len(_THINK_START) :]
                    self._state, self._opened = "reasoning", True
                    continue
                if _THINK_START.startswith(stripped):
                    break  # "<thi": wait
                self._opened = True
                if self._state == "start":
                    self._state = "content"
                continue
            if self._state == "reasoning":
                end = self._buffer.find(_THINK_END)
                if end >= 0:
                    reasoning += self._buffer[:end]
                    self._buffer = self._buffer[end + len(_THINK_END) :]
                    self._state, self._trim = "content", True
                    continue
                keep = _held_back(self._buffer, _THINK_END)
                reasoning += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            if self._trim:  # the blank lines after </think>
                self._buffer = self._buffer.lstrip("\n")
                self._trim = not self._buffer
            content += self._buffer
            self._buffer = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


# ---- tool calls -------------------------------------------------------------


class HermesToolStream:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the
    text around them is content."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content, calls = "", list[ParsedCall]()
        while True:
            if not self._in_call:
                start = self._buffer.find(_CALL_START)
                if start < 0:
                    keep = _held_back(self._buffer, _CALL_START)
                    content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return content, calls
                content += self._buffer[:start]
                self._buffer = self._buffer[start + len(_CALL_START) :]
                self._in_call = True
            end = self._buffer.find(_CALL_END)
            if end < 0:
                return content, calls
            body, self._buffer = self._buffer[:end], self._buffer[end + len(_CALL_END) :]
            self._in_call = False
            call = _parse_json_call(body)
            if call is None:  # not a call after all: keep the text
                content += _CALL_START + body + _CALL_END
            else:
                calls.append(call)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self._buffer = self._buffer, ""
        if self._in_call:  # the output ended inside a block
            call = _parse_json_call(rest)
            return ("", [call]) if call is not None else (_CALL_START + rest, [])
        return rest, []


class Llama3JsonToolStream:
    """An output that starts with a JSON object (after an optional
    <|python_tag|>) is one or more calls, separated by ";"; any other output
    is content."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "start"

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        if self._state == "start":
            head = self._buffer.lstrip()
            if not head or (len(head) < len(_PYTHON_TAG) and _PYTHON_TAG.startswith(head)):
                return "", []  # undecided yet
            self._state = "calls" if head.startswith(("{", _PYTHON_TAG)) else "content"
        if self._state == "calls":
            return "", []
        content, self._buffer = self._buffer, ""
        return content, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self._buffer = self._buffer, ""
        if self._state != "calls":
            return rest, []
        text = rest.strip().removeprefix(_PYTHON_TAG).strip()
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(text):
            try:
                obj, position = decoder.raw_decode(text, position)
            except ValueError:
                return rest, []
            call = _call(obj, "parameters")
            if call is None:
                return rest, []
            calls.append(call)
            while position < len(text) and text[position] in " \n\t;":
                position += 1
        return ("", calls) if calls else (rest, [])


def _parse_json_call(text: str) -> ParsedCall | None:
    try:
        return _call(json.loads(text))
    except ValueError:
        return None


# ---- tool_choice as a grammar ---------------------------------------------


def _parameters(tool: op.ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def tool_structured_outputs(
    tools: list[op.ToolDefinition],
    choice: op.ToolChoice,
    parallel: bool,
    disable_additional_properties: bool = False,
) -> StructuredOutputsParams:
    """The grammar of tool_choice "required" (a JSON list of calls to the
    tools; one call when `parallel` is false) or of a named function (its
    arguments). A `strict` function's arguments (every function's with
    `disable_additional_properties`) have no properties beyond those listed."""

    def parameters(tool: op.ToolDefinition) -> Any:
        schema = _parameters(tool)
        strict = disable_additional_properties or tool.function.strict is True
        return closed_objects(schema) if strict else schema

    if isinstance(choice, op.NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=parameters(tool))
    call_schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_schemas}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


class RequiredToolStream:
    """The output of tool_choice "required": a JSON list of calls, read when
    it is complete."""

    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self._buffer = self._buffer, ""
        try:
            items = json.loads(rest)
        except ValueError:
            return rest, []  # cut short (max_tokens): the text as it is
        calls = [c for c in (_call(item, "parameters") for item in items) if c is not None]
        return ("", calls) if calls else (rest, [])


class NamedToolStream:
    """The output of a named tool_choice: the function's arguments, streamed
    as the arguments of one call."""

    def __init__(self, name: str) -> None:
        self.call = ParsedCall(name, "")

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.call.arguments += text
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        return "", []


# ---- one choice's output ------------------------------------------------------


@dataclass
class ChatPiece:
    """What a piece of a choice's text adds to the message."""

    content: str = ""
    reasoning: str = ""
    tool_deltas: list[op.DeltaToolCall] = field(default_factory=list)


class ChatOutput:
    """One choice's text, split into reasoning, content and tool calls."""

    def __init__(
        self,
        *,
        reasoning_parser: str | None,
        tool_mode: str,  # "none", "auto", "required", "named"
        tool_parser: str | None = None,
        tool_name: str | None = None,
        harmony: bool = False,
    ) -> None:
        self.harmony = HarmonyStream() if harmony else None
        self.tool_mode = tool_mode
        self.reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self.tools: Any = None
        if tool_mode == "auto":
            self.tools = HermesToolStream() if tool_parser == "hermes" else Llama3JsonToolStream()
        elif tool_mode == "required":
            self.tools = RequiredToolStream()
        elif tool_mode == "named":
            self.tools = NamedToolStream(tool_name or "")
        self.calls: list[ParsedCall] = []
        self.content = ""
        self.reasoning_text = ""
        self._named_started = False

    @property
    def named(self) -> bool:
        return isinstance(self.tools, NamedToolStream)

    def feed(self, text: str, final: bool = False) -> ChatPiece:
        """What `text` adds; `final`: it is the last of the choice's text, so
        whatever was held back is released too."""
        if self.harmony is not None:
            return self._harmony(text, final)
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            rest_reasoning, rest_content = self.reasoning.finish()
            reasoning, content = reasoning + rest_reasoning, content + rest_content
        return self._content(reasoning, content, final)

    def finish(self) -> ChatPiece:
        return self.feed("", final=True)

    def _content(self, reasoning: str, content: str, final: bool) -> ChatPiece:
        piece = ChatPiece(reasoning=reasoning)
        self.reasoning_text += reasoning
        if self.tools is None:
            piece.content = content
            self.content += content
            return piece
        if isinstance(self.tools, NamedToolStream):
            return self._named(piece, content)
        text, calls = self.tools.feed(content)
        if final:
            rest, more = self.tools.finish()
            text, calls = text + rest, calls + more
        return self._emit(piece, text, calls)

    def _harmony(self, text: str, final: bool) -> ChatPiece:
        assert self.harmony is not None
        reasoning, content, calls = self.harmony.feed(text)
        if final:
            more_reasoning, more_content, more_calls = self.harmony.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
            calls = calls + more_calls
        piece = ChatPiece(reasoning=reasoning)
        self.reasoning_text += reasoning
        if self.tool_mode != "auto":  # (no tools offered: a call is just text)
            content += "".join(arguments for _, arguments in calls)
            calls = []
        return self._emit(piece, content, [ParsedCall(name, args) for name, args in calls])

    def _emit(self, piece: ChatPiece, text: str, calls: list[ParsedCall]) -> ChatPiece:
        piece.content = text
        self.content += text
        for call in calls:
            piece.tool_deltas.append(
                op.DeltaToolCall(
                    index=len(self.calls),
                    id=call.id,
                    type="function",
                    function=op.DeltaFunctionCall(name=call.name, arguments=call.arguments),
                )
            )
            self.calls.append(call)
        return piece

    def _named(self, piece: ChatPiece, content: str) -> ChatPiece:
        tools: NamedToolStream = self.tools
        tools.feed(content)
        if not self._named_started:
            self._named_started = True
            self.calls.append(tools.call)
            function = op.DeltaFunctionCall(name=tools.call.name, arguments=content)
            piece.tool_deltas.append(
                op.DeltaToolCall(index=0, id=tools.call.id, type="function", function=function)
            )
        elif content:
            piece.tool_deltas.append(
                op.DeltaToolCall(index=0, function=op.DeltaFunctionCall(arguments=content))
            )
        return piece

    def message(self) -> op.ChatMessage:
        calls = [
            op.ToolCall(id=c.id, function=op.FunctionCall(name=c.name, arguments=c.arguments))
            for c in self.calls
        ]
        return op.ChatMessage(
            content=self.content if (self.content or not calls) else None,
            reasoning_content=self.reasoning_text or None,
            tool_calls=calls,
        )

    def finish_reason(self, reason: str | None) -> str | None:
        """ "tool_calls" when the model chose to call tools (auto, required)."""
        if reason == "stop" and self.calls and not self.named:
            return "tool_calls"
        return reason
