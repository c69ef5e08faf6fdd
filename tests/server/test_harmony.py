"""The harmony format (gpt-oss) read back from a chat completion's text:
reasoning, content and tool calls, whole and split at every point."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest

from ferrox.server.chat_outputs import ChatOutput
from tests import models
from tests.live_server import MODEL, Server

THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"


def parse(text: str, pieces: list[int] | None = None, tool_mode: str = "auto") -> tuple:
    """(reasoning, content, calls) of `text`, fed whole or cut at `pieces`."""
    out = ChatOutput(reasoning_parser=None, tool_mode=tool_mode, harmony=True)
    cuts = [0, *(pieces or []), len(text)]
    reasoning = content = ""
    for start, end in itertools.pairwise(cuts):
        piece = out.feed(text[start:end], final=end == len(text))
        reasoning += piece.reasoning
        content += piece.content
    message = out.message()
    assert (message.reasoning_content or "") == reasoning
    assert (message.content or "") == content
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in out.calls]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            THINK + FINAL,
            ("The user wants the weather.", "It is sunny in Paris.", []),
        ),
        (
            THINK + CALL,
            ("The user wants the weather.", "", [("get_weather", {"city": "Paris"})]),
        ),
        # The recipient before the channel; two calls; no end tokens in the text.
        (
            "<|channel|>analysis<|message|>two<|end|><|start|>assistant to=functions.a"
            '<|channel|>commentary json<|message|>{"x": 1}<|call|><|start|>assistant'
            '<|channel|>commentary to=functions.b<|message|>{"y": [2]}',
            ("two", "", [("a", {"x": 1}), ("b", {"y": [2]})]),
        ),
        # A preamble on commentary is content; the final answer follows.
        (
            "<|channel|>commentary<|message|>Let me check. <|end|>" + FINAL,
            ("", "Let me check. It is sunny in Paris.", []),
        ),
        # No harmony at all (a grammar shaped the output): content as it stands.
        ('{"answer": 42}', ("", '{"answer": 42}', [])),
        # Cut short inside the reasoning (max_tokens).
        ("<|channel|>analysis<|message|>Still thin", ("Still thin", "", [])),
    ],
)
def test_harmony_splits_reasoning_content_and_calls(text: str, expected: tuple) -> None:
    assert parse(text) == expected
    for cut in range(1, len(text)):  # every split point, as a stream
        assert parse(text, [cut]) == expected, cut
    assert parse(text, list(range(1, len(text)))) == expected  # a character at a time


def test_a_call_cut_short_is_text_and_calls_without_tools_are_text() -> None:
    cut = THINK + '<|start|>assistant<|channel|>commentary to=functions.f<|message|>{"a":'
    assert parse(cut) == ("The user wants the weather.", '{"a":', [])
    _, content, calls = parse(THINK + CALL, tool_mode="none")
    assert calls == [] and content == '{"city": "Paris"}'


def test_a_harmony_call_finishes_with_tool_calls() -> None:
    out = ChatOutput(reasoning_parser=None, tool_mode="auto", harmony=True)
    out.feed(THINK + CALL, final=True)
    assert out.finish_reason("stop") == "tool_calls"
    assert out.message().content is None


# ---- through the server, with the official SDK -----------------------------

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"]
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _grammar(*parts: str) -> str:
    """A Lark grammar for exactly this output: markers as special tokens."""
    items = [p if p in HARMONY_TOKENS or p == "<|constrain|>" else json.dumps(p) for p in parts]
    return "start: " + " ".join(items)


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A tiny gpt-oss whose tokenizer has harmony's markers, as special
    tokens, and a harmony chat template; outputs are shaped by grammars."""
    from transformers import AutoTokenizer

    path = models.build_tiny_model(
        tmp_path_factory.mktemp("harmony") / "gpt-oss", "gpt-oss", vocab_size=336
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [*HARMONY_TOKENS, "<|constrain|>"]})
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(path)
    server = Server(path, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_channels_through_the_sdk(harmony_server: Server, stream: bool) -> None:
    client = harmony_server.client()
    answer = _grammar(
        "<|channel|>", "analysis", "<|message|>", "thinking", "<|end|>",
        "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "hi there", "<|return|>",
    )  # fmt: skip
    call = _grammar(
        "<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json",
        "<|message|>", '{"city": "Paris"}', "<|call|>",
    )  # fmt: skip
    request: dict[str, Any] = dict(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], max_tokens=60
    )
    for grammar, tools in ((answer, None), (call, [WEATHER])):
        extra = {"structured_outputs": {"grammar": grammar}}
        if tools:
            request["tools"] = tools
        if not stream:
            reply = client.chat.completions.create(**request, extra_body=extra)
            message, finish = reply.choices[0].message, reply.choices[0].finish_reason
            reasoning = getattr(message, "reasoning_content", None)
            content, calls = message.content, message.tool_calls or []
        else:
            reasoning = content = ""
            calls, finish = [], None
            for chunk in client.chat.completions.create(**request, extra_body=extra, stream=True):
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
                calls += delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        assert reasoning in ("thinking", None, "") and ("<|" not in (content or ""))
        if tools is None:
            assert (reasoning, content, finish) == ("thinking", "hi there", "stop")
        else:
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                ("get_weather", {"city": "Paris"})
            ]
            assert finish == "tool_calls" and not content
    harmony_server.wait_idle()


def test_harmony_refuses_forced_tool_choice(harmony_server: Server) -> None:
    response = harmony_server.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
        },
    )
    assert response.status_code == 400
    assert "harmony" in response.json()["error"]["message"]
