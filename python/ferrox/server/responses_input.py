"""The Responses API's request as the chat request it means: its input
items as chat messages (see `responses_api` for how each is read), its
tools, output format and the fields this server refuses."""

from __future__ import annotations

from typing import Any

from ferrox.server import openai_protocol as op
from ferrox.server import responses_protocol as rp
from ferrox.server.openai_protocol import BadRequest
from ferrox.server.request_translation import check_detail


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
            if role == "assistant" and not isinstance(text, str):
                raise BadRequest(f"input[{index}]: an assistant message holds no images", "input")
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


def _message(index: int, item: dict[str, Any]) -> tuple[Any, str | list[op.ContentPart]]:
    role = item.get("role")
    if role not in _ROLES:
        raise BadRequest(
            f"input[{index}] has role {role!r}; a message's role is one of {list(_ROLES)}",
            param="input",
        )
    content = item.get("content")
    if isinstance(content, list) and any(_kind(part) == "input_image" for part in content):
        return ("system" if role == "developer" else role), _parts(index, content)
    text = content if isinstance(content, str) else _parts_text(index, content)
    return ("system" if role == "developer" else role), text


def _kind(part: Any) -> Any:
    return part.get("type") if isinstance(part, dict) else None


def _parts(index: int, parts: list[Any]) -> list[op.ContentPart]:
    """Text and image parts as the chat API's (an input_image's URL: a data
    URL, or http(s) from --allowed-media-domains)."""
    out = []
    for part in parts:
        if _kind(part) != "input_image":
            out.append(op.ContentPart(type="text", text=_parts_text(index, [part])))
            continue
        url = part.get("image_url")
        if not isinstance(url, str) or part.get("file_id") is not None:
            raise BadRequest(
                f"input[{index}] has an input_image part without an image_url (file ids are "
                "not served)",
                param="input",
            )
        check_detail(part.get("detail"), f"input[{index}]", "input")
        out.append(op.ContentPart(type="image_url", image_url=op.ImageUrl(url=url)))
    return out


def _parts_text(index: int, parts: Any) -> str:
    if not isinstance(parts, list):
        raise BadRequest(f"input[{index}] needs text or a list of parts", param="input")
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_file", "input_audio"):
            raise BadRequest(
                f"input[{index}] has an {kind} part; this server takes no files or audio",
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


__all__ = ["chat_request", "check_served", "input_messages"]
