"""The Responses API on a live `ferrox serve`, driven with the official
openai SDK: replies equal to the chat completions of the same conversation,
streams the SDK's `responses.stream` rebuilds into the same response, stored
responses continued with `previous_response_id`, retrieved and deleted,
function calls and their outputs, structured outputs, and refusals with
nothing leaked. Without a server: input items as chat messages, output
items however the text is cut, and the store's bound."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from ferrox.server import openai_protocol as op
from ferrox.server.chat_outputs import ChatOutput
from ferrox.server.openai_protocol import BadRequest
from ferrox.server.responses_api import ResponseStore, StoredResponse
from ferrox.server.responses_input import input_messages
from ferrox.server.responses_output import OutputItems
from tests.live_server import HTTP, WEATHER_TOOLS, Server, tool_server, warm_prefix

MODEL = "smol"
TOOLS = [{"type": "function", **t["function"]} for t in WEATHER_TOOLS]
_SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = tool_server(
        smollm2_path, tmp_path_factory.mktemp("template"), "--max-stored-responses", "8"
    )
    yield srv
    srv.stop()


def _chat_text(server: Server, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    return server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def _streamed(client: openai.OpenAI, **request: Any) -> tuple[Any, list[Any]]:
    with client.responses.stream(**request) as stream:
        events = list(stream)
        return stream.get_final_response(), events


def test_a_response_equals_the_chat_completion_of_the_same_conversation(server: Server) -> None:
    client = server.client()
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More?"}]},
    ]
    request = {
        "model": MODEL,
        "input": turns,
        "instructions": "You are terse.",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    as_chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "More?"},
    ]
    warm_prefix(server, as_chat)
    reply = client.responses.create(**request)
    chat = _chat_text(server, as_chat, 12)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == chat.choices[0].message.content
    assert [item.type for item in reply.output] == ["message"]
    finish = chat.choices[0].finish_reason
    assert reply.status == {"stop": "completed", "length": "incomplete"}[finish]
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens

    streamed, events = _streamed(client, **request)
    assert streamed.output_text == reply.output_text and streamed.status == reply.status
    assert streamed.usage.input_tokens_details.cached_tokens > 0  # the same prompt again
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{reply.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    server.wait_idle()


def test_stored_responses_continue_and_can_be_deleted(server: Server) -> None:
    client = server.client()
    first = client.responses.create(
        model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0
    )
    assert first.store
    as_chat = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another one, please."},
    ]
    warm_prefix(server, as_chat)
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="Another one, please.",
        max_output_tokens=6,
        temperature=0,
    )
    chat = _chat_text(server, as_chat, 6)
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text) == (first.id, first.output_text)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.create(model=MODEL, previous_response_id=first.id, input="x")
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_enforced_by_tool_choice(server: Server, stream: bool) -> None:
    client = server.client()
    for choice, names in (
        ("required", None),
        ({"type": "function", "name": "get_time"}, ["get_time"]),
    ):
        request = {
            "model": MODEL,
            "input": QUESTION,
            "tools": TOOLS,
            "tool_choice": choice,
            "max_output_tokens": 80,
            "temperature": 0,
        }
        reply = _streamed(client, **request)[0] if stream else client.responses.create(**request)
        calls = [item for item in reply.output if item.type == "function_call"]
        assert calls and all(item.type == "function_call" for item in reply.output)
        for call in calls:
            assert call.call_id and call.id.startswith("fc_")
            jsonschema.validate(json.loads(call.arguments), _SCHEMAS[call.name])
        if names is not None:
            assert [call.name for call in calls] == names
    # The calls and their outputs go back as input items.
    follow = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": QUESTION},
            *[
                {
                    "type": "function_call",
                    "call_id": c.call_id,
                    "name": c.name,
                    "arguments": c.arguments,
                }
                for c in calls
            ],
            *[
                {"type": "function_call_output", "call_id": c.call_id, "output": "18 C"}
                for c in calls
            ],
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert follow.output_text
    server.wait_idle()


def test_structured_output_format(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    reply = server.client().responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=60,
        temperature=0,
        text={
            "format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}
        },
    )
    jsonschema.validate(json.loads(reply.output_text), schema)
    server.wait_idle()


def test_parse_with_a_pydantic_model(server: Server) -> None:
    """`responses.parse(text_format=Model)`: the SDK sends the model's
    strict schema and reads the reply back into the model."""
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=12)
        sunny: bool

    reply = server.client().responses.parse(
        model=MODEL, input=QUESTION, text_format=Weather, max_output_tokens=60, temperature=0
    )
    assert isinstance(reply.output_parsed, Weather)
    assert Weather.model_validate_json(reply.output_text) == reply.output_parsed
    server.wait_idle()


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "hosted tool"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "takes no images",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "hosted tools"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "role"),
        ({"input": []}, "input", "must not be empty"),
        ({"background": True}, "background", "background"),
        ({"truncation": "auto"}, "truncation", "never truncated"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "effort"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens=5000"),
        ({"temperature": -1}, "temperature", "temperature"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)
def test_bad_requests_name_their_field(
    server: Server, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 8, **extra}
    response = server.post("/v1/responses", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    server.wait_idle()


def test_unknown_ids_and_models(server: Server) -> None:
    for response in (
        server.post("/v1/responses", {"model": "nope", "input": "x"}),
        HTTP.get(server.url + "/v1/responses/resp_nope", headers=server.headers),
        HTTP.delete(server.url + "/v1/responses/resp_nope", headers=server.headers),
        server.post("/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": "r"}),
    ):
        assert response.status_code == 404, response.text
        assert response.json()["error"]["message"]


def test_an_abandoned_stream_leaks_nothing(server: Server) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 200, "stream": True}
    with HTTP.stream(
        "POST", server.url + "/v1/responses", json=body, headers=server.headers, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if "response.output_text.delta" in line:
                break  # leave in the middle
    server.wait_idle()


# ---- without a server -----------------------------------------------------------------


def test_input_items_become_the_chat_messages_they_mean() -> None:
    messages = input_messages(
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "look up"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "noon"}],
            },
        ]
    )
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Be brief."),
        ("user", "Weather?"),
        ("assistant", "Checking."),
        ("tool", "18 C"),
        ("tool", "noon"),
    ]
    turn = messages[2]
    assert turn.reasoning_content == "look up"
    assert [(c.id, c.function.name) for c in turn.tool_calls or []] == [
        ("c1", "get_weather"),
        ("c2", "get_time"),
    ]
    assert [m.tool_call_id for m in messages[3:]] == ["c1", "c2"]
    assert input_messages("hi") == [op.ChatMessageParam(role="user", content="hi")]
    with pytest.raises(BadRequest, match="needs a string call_id"):
        input_messages([{"type": "function_call", "name": "f", "arguments": "{}"}])


_TEXTS = [
    "<think>\nplan the call\n</think>\n\nLet me check. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>',
    "<think>only thinking",
    "plain text, no tags at all",
]


def _summary(items: list[dict[str, Any]]) -> tuple[str, str, list[tuple[str, Any]]]:
    def text(kind: str) -> str:
        return "".join(p["text"] for i in items if i["type"] == kind for p in i["content"])

    calls = [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]
    return text("reasoning"), text("message"), calls


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", _TEXTS)
def test_output_items_are_the_same_however_the_text_is_cut(text: str, seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 6))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    streamed, items = (
        ChatOutput(reasoning_parser="qwen3", tool_mode="auto", tool_parser="hermes"),
        OutputItems(),
    )
    events: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        events += items.feed(streamed.feed(piece, final=i == len(pieces) - 1))
    events += items.close()
    whole, whole_items = (
        ChatOutput(reasoning_parser="qwen3", tool_mode="auto", tool_parser="hermes"),
        OutputItems(),
    )
    whole_items.feed(whole.feed(text, final=True))
    whole_items.close()
    assert _summary(items.items) == _summary(whole_items.items)
    # Every item is added, then done, at its index, and deltas add up to it.
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert added == [e["output_index"] for e in done] == list(range(len(items.items)))
    assert [e["item"] for e in done] == items.items
    deltas = "".join(e["delta"] for e in events if e["type"].endswith("_text.delta"))
    assert deltas == "".join(p["text"] for i in items.items if "content" in i for p in i["content"])


def test_the_store_keeps_the_most_recently_used() -> None:
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # "b" is now the least recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert (store.get("b"), len(store)) == (None, 2)
    assert store.delete("a") and not store.delete("a")
    none = ResponseStore(0)
    none.put("a", StoredResponse({"id": "a"}, []))
    assert none.get("a") is None
