"""Anthropic's Messages API on a live `ferrox serve`, driven with the official
anthropic SDK: replies equal to the chat completions of the same
conversation, streams that the SDK's accumulator rebuilds into the same
message, tool use, structured outputs, token counting, and errors in
Anthropic's shape with nothing leaked. The conversion of `ChatOutput`
pieces into content-block events is held to the whole reply's blocks
however the text is cut."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic._models import construct_type
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent

from ferrox.server import anthropic_protocol as ap
from ferrox.server.anthropic_messages import BlockEvents, chat_request, content_blocks
from ferrox.server.chat_outputs import ChatOutput
from ferrox.server.openai_protocol import BadRequest
from tests.live_server import API_KEY, HTTP, WEATHER_TOOLS, Server, tool_server, warm_prefix

MODEL = "smol"
TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in WEATHER_TOOLS
]
_SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# The Messages API of today's SDK has no sampling fields (older versions had
# temperature, top_p and top_k, which the server still reads).
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = tool_server(
        smollm2_path, tmp_path_factory.mktemp("template"), "--max-body-bytes", str(64 * 1024)
    )
    yield srv
    srv.stop()


def _client(server: Server, api_key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=60)


def _streamed(client: anthropic.Anthropic, **request: Any) -> tuple[Any, list[str]]:
    with client.messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        return stream.get_final_message(), kinds


def test_a_reply_equals_the_chat_completion_of_the_same_conversation(server: Server) -> None:
    client = _client(server)
    system = "You are terse."
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
        {"role": "user", "content": [{"type": "text", "text": "Another one, please."}]},
    ]
    as_chat = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, please."},
    ]
    warm_prefix(server, as_chat)
    chat = server.client().chat.completions.create(
        model=MODEL, messages=as_chat, max_tokens=12, temperature=0
    )
    reply = client.messages.create(
        model=MODEL, system=system, messages=turns, max_tokens=12, extra_body=GREEDY
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == chat.choices[0].message.content
    assert (
        reply.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    )
    usage = reply.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert prompt == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.cache_read_input_tokens > 0  # the chat request's prompt was cached
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=turns)
    assert counted.input_tokens == prompt

    streamed, kinds = _streamed(
        client, model=MODEL, system=system, messages=turns, max_tokens=12, extra_body=GREEDY
    )
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert [block.model_dump() for block in streamed.content] == [
        block.model_dump() for block in reply.content
    ]
    assert streamed.stop_reason == reply.stop_reason
    assert streamed.usage.output_tokens == usage.output_tokens
    server.wait_idle()


def test_prefill_and_stop_sequences(server: Server) -> None:
    client = _client(server)
    prefill = [*QUESTION, {"role": "assistant", "content": "The weather in Paris is"}]
    continued = {"continue_final_message": True, "add_generation_prompt": False}
    warm_prefix(server, prefill, **continued)
    reply = client.messages.create(model=MODEL, messages=prefill, max_tokens=10, extra_body=GREEDY)
    chat = server.client().chat.completions.create(
        model=MODEL, messages=prefill, max_tokens=10, temperature=0, extra_body=continued
    )
    assert reply.content[0].text == chat.choices[0].message.content
    text = reply.content[0].text
    word = text.split()[1]  # a word after the first: the reply stops before it
    stopped = client.messages.create(
        model=MODEL, messages=prefill, max_tokens=10, extra_body=GREEDY, stop_sequences=[word]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert text.startswith(stopped.content[0].text) and word not in stopped.content[0].text
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_enforced_by_tool_choice(server: Server, stream: bool) -> None:
    client = _client(server)
    for choice, names in (
        ({"type": "any"}, None),
        ({"type": "tool", "name": "get_time"}, ["get_time"]),
    ):
        request = {
            "model": MODEL,
            "messages": QUESTION,
            "tools": TOOLS,
            "tool_choice": choice,
            "max_tokens": 80,
            "extra_body": GREEDY,
        }
        reply = _streamed(client, **request)[0] if stream else client.messages.create(**request)
        calls = [block for block in reply.content if block.type == "tool_use"]
        assert calls and reply.stop_reason == "tool_use"
        assert all(block.type == "tool_use" for block in reply.content)
        for call in calls:
            assert call.id.startswith("toolu_")
            jsonschema.validate(call.input, _SCHEMAS[call.name])
        if names is not None:
            assert [call.name for call in calls] == names
    server.wait_idle()


def test_a_tool_use_round_trip(server: Server) -> None:
    """A forced tool call, its result sent back as a tool_result block, and
    the reply that reads it."""
    client = _client(server)
    first = client.messages.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=80,
        extra_body=GREEDY,
    )
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and first.stop_reason == "tool_use"
    second = client.messages.create(
        model=MODEL,
        messages=[
            *QUESTION,
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}],
            },
        ],
        tools=TOOLS,
        tool_choice={"type": "none"},
        max_tokens=8,
        extra_body=GREEDY,
    )
    assert [block.type for block in second.content] == ["text"]
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    )
    server.wait_idle()


def test_structured_output_format(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    reply = _client(server).messages.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=60,
        extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.content[0].text), schema)
    server.wait_idle()


def test_a_tool_conversation_renders_as_its_chat_equivalent(server: Server) -> None:
    """The tool_use / tool_result blocks of a conversation reach the chat
    template as the OpenAI conversation with the same calls and results."""
    anthropic_turns = [
        *QUESTION,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "look it up", "signature": "x"},
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "18 C"}],
                },
                {"type": "text", "text": "And in Lyon?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    chat_turns = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And in Lyon?"},
    ]
    counted = _client(server).messages.count_tokens(
        model=MODEL, messages=anthropic_turns, tools=TOOLS
    )
    tokens = server.post(
        "/tokenize", {"model": MODEL, "messages": chat_turns, "tools": WEATHER_TOOLS}
    ).json()
    assert counted.input_tokens == tokens["count"]
    failed = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "down", "is_error": True}
        ],
    }
    counted = _client(server).messages.count_tokens(
        model=MODEL, messages=[*anthropic_turns[:2], failed], tools=TOOLS
    )
    failed_chat = {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: down"}
    tokens = server.post(
        "/tokenize",
        {"model": MODEL, "messages": [*chat_turns[:2], failed_chat], "tools": WEATHER_TOOLS},
    ).json()
    assert counted.input_tokens == tokens["count"]


def _anthropic_error(response: httpx.Response, status: int, kind: str, words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert words in body["error"]["message"], body


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"messages": []}, "messages must not be empty"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "image block",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking budgets"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "hosted tool"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
        ({"mcp_servers": []}, "MCP"),
        ({"output_config": {"effort": "high"}}, "effort"),
        ({"stop_sequences": ["x"] * 40}, "stop_sequences may hold at most"),
        ({"temperature": -1}, "temperature"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
                    }
                ]
            },
            "tool_use block",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 8000}]}, "context length"),
    ],
)
def test_bad_requests_get_anthropic_errors(
    server: Server, extra: dict[str, Any], words: str
) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, **extra}
    _anthropic_error(
        HTTP.post(
            server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60
        ),
        400,
        "invalid_request_error",
        words,
    )
    server.wait_idle()


def test_errors_through_the_sdk_and_routes(server: Server) -> None:
    with pytest.raises(anthropic.AuthenticationError):
        _client(server, api_key="wrong").messages.create(
            model=MODEL, messages=QUESTION, max_tokens=4
        )
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        _client(server).messages.create(model="claude-x", messages=QUESTION, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match="takes no images"):
        _client(server).messages.count_tokens(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )
    headers = {"x-api-key": API_KEY}
    _anthropic_error(
        HTTP.post(server.url + "/v1/messages/nope", json={}, headers=headers),
        404,
        "not_found_error",
        "no such route",
    )
    _anthropic_error(
        HTTP.get(server.url + "/v1/messages", headers=headers),
        405,
        "invalid_request_error",
        "method",
    )
    _anthropic_error(
        HTTP.post(server.url + "/v1/messages", content=b"x" * (65 * 1024), headers=headers),
        413,
        "request_too_large",
        "exceeds",
    )
    _anthropic_error(
        HTTP.post(server.url + "/v1/messages", content=b"{", headers=headers),
        400,
        "invalid_request_error",
        "not valid JSON",
    )
    # The OpenAI routes keep their own envelope, and accept x-api-key too.
    models = HTTP.get(server.url + "/v1/models", headers=headers)
    assert models.status_code == 200
    assert HTTP.get(server.url + "/v1/nope", headers=headers).json()["error"]["code"] == "not_found"
    server.wait_idle()


def test_an_abandoned_stream_leaks_nothing(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 200,
        "stream": True,
        "temperature": 0,
    }
    with HTTP.stream(
        "POST", server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60
    ) as response:
        assert response.status_code == 200
        events = []
        for line in response.iter_lines():
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
            if events[-1:] == ["content_block_delta"]:
                break  # leave in the middle
        assert events[:3] == ["message_start", "ping", "content_block_start"]
    server.wait_idle()


# ---- the stream's blocks, without a server -----------------------------------------

_TEXTS = [
    "<think>\nplan the call\n</think>\n\nLet me check. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>',
    "<think>only thinking",
    "plain text, no tags at all",
    "",
]


def _accumulated(events: list[ap.Event]) -> Any:
    """The message the anthropic SDK's stream accumulator builds from the events."""
    import msgspec

    snapshot = None
    bufs: dict[int, bytes] = {}
    for event in events:
        raw = construct_type(type_=RawMessageStreamEvent, value=msgspec.to_builtins(event))
        snapshot = accumulate_event(event=raw, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", _TEXTS)
def test_block_events_rebuild_the_whole_reply_however_the_text_is_cut(text: str, seed: int) -> None:
    import msgspec

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(6, max(len(text) - 1, 0)))) if text else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    streamed = ChatOutput(reasoning_parser="qwen3", tool_mode="auto", tool_parser="hermes")
    blocks = BlockEvents()
    start = ap.Message(
        id="msg_1",
        model="m",
        content=[],
        stop_reason=None,
        usage=ap.Usage(input_tokens=1, output_tokens=0),
    )
    events: list[ap.Event] = [ap.MessageStart(message=start)]
    for i, piece in enumerate(pieces or [""]):
        events += blocks.feed(streamed.feed(piece, final=i == len(pieces or [""]) - 1))
    events += blocks.close()
    whole = ChatOutput(reasoning_parser="qwen3", tool_mode="auto", tool_parser="hermes")
    whole.feed(text, final=True)
    built = _accumulated(events)
    assert _summary([block.model_dump() for block in built.content]) == _summary(
        [msgspec.to_builtins(block) for block in content_blocks(whole)]
    )


def _summary(blocks: list[dict[str, Any]]) -> tuple[str, str, list[tuple[str, Any]]]:
    """A reply's reasoning, text and calls; a stream may split its text
    around the calls, where a whole reply has one text block."""
    thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    calls = [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
    assert all(b["id"].startswith("toolu_") for b in blocks if b["type"] == "tool_use")
    return thinking, text, calls


def test_translation_refusals_name_their_part() -> None:
    with pytest.raises(BadRequest, match="prefill"):
        chat_request(
            ap.CountTokensRequest(
                model="m",
                messages=[
                    ap.MessageParam(role="user", content="hi"),
                    ap.MessageParam(
                        role="assistant",
                        content=[ap.ToolUseBlock(id="t", name="f", input={})],
                    ),
                ],
            )
        )
    with pytest.raises(BadRequest, match=r"thinking\.type"):
        chat_request(
            ap.CountTokensRequest(
                model="m",
                messages=[ap.MessageParam(role="user", content="hi")],
                thinking=ap.ThinkingParam(type="between_tools"),
            )
        )
    plain = chat_request(
        ap.CountTokensRequest(model="m", messages=[ap.MessageParam(role="user", content="hi")])
    )
    assert plain.add_generation_prompt and not plain.continue_final_message
    disabled = chat_request(
        ap.CountTokensRequest(
            model="m",
            messages=[ap.MessageParam(role="user", content="hi")],
            thinking=ap.ThinkingParam(type="disabled"),
        )
    )
    assert disabled.chat_template_kwargs == {"enable_thinking": False}
