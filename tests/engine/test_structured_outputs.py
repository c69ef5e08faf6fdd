"""Structured outputs, tool calling and reasoning: the grammar engine in the
step loop (bundled model and a tiny one), the OpenAI fields through the
server and the official SDK, the output parsers, and request fields that
ferrox does not serve."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import torch

from ferrox import LLM, SamplingParams
from ferrox.common import errors
from ferrox.common.structured_outputs import (
    StructuredOutputsParams,
    check_grammar,
    closed_objects,
)
from ferrox.runner.token_bitmask import apply_token_bitmask, apply_token_bitmask_torch
from ferrox.server import openai_protocol as op
from ferrox.server.chat_outputs import ChatOutput, tool_structured_outputs
from tests.live_server import WEATHER_TOOLS as TOOLS
from tests.live_server import Server, tool_server

# ---- parameters -------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1]"}, "schema object"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty strings"),
        ({"regex": 5}, "non-empty str"),
    ],
)
def test_params_are_checked(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=message):
        StructuredOutputsParams(**fields)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"regex": "[unclosed"}, "structured_outputs.regex"),
        ({"json": {"type": "objectx"}}, "structured_outputs.json"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        ({"grammar": 'root ::= "a'}, "structured_outputs.grammar"),
        # No finite string: every output would run to max_tokens.
        ({"grammar": 'start: "x" start'}, "structured_outputs.grammar"),
        ({"grammar": 'root ::= "a" root'}, "structured_outputs.grammar"),
    ],
)
def test_a_grammar_that_does_not_compile_names_its_field(fields: dict, field: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=re.escape(field)):
        check_grammar(StructuredOutputsParams(**fields))


def test_closed_objects_close_only_objects_that_say_nothing() -> None:
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"anyOf": [{"properties": {"c": {}}}]}},
        },
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy

    def arguments(strict: bool | None) -> Any:
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        if strict is not None:
            tool["function"]["strict"] = strict
        tools = [msgspec.convert(tool, op.ToolDefinition)]
        calls = json.loads(str(tool_structured_outputs(tools, "required", parallel=True).json))
        return calls["items"]["anyOf"][0]["properties"]["parameters"]

    assert arguments(True)["additionalProperties"] is False
    assert "additionalProperties" not in arguments(None)
    assert "additionalProperties" not in arguments(False)


_STRICT = {"schema": {}, "strict": True}


@pytest.mark.parametrize(
    ("fields", "server_default", "closed"),
    [
        ({"guided_json": {"type": "object"}}, False, False),
        ({"guided_json": {"type": "object"}}, True, True),
        ({"structured_outputs": {"json": {}, "disable_additional_properties": True}}, False, True),
        ({"structured_outputs": {"regex": "a"}}, True, False),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, False, False),
        ({"response_format": {"type": "json_schema", "json_schema": _STRICT}}, False, True),
    ],
)
def test_strict_and_the_server_default_close_json_schemas(
    fields: dict[str, Any], server_default: bool, closed: bool
) -> None:
    from ferrox.server.output_constraints import structured_outputs_from

    request = msgspec.convert({"prompt": "x", **fields}, op.CompletionRequest)
    params = structured_outputs_from(request, server_default)
    assert params is not None and params.disable_additional_properties is closed


def test_params_travel_to_the_engine_process_and_back() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert wire.structured_outputs == params.structured_outputs
    with pytest.raises(errors.InvalidArgumentError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


@pytest.mark.parametrize("apply", [apply_token_bitmask, apply_token_bitmask_torch])
def test_bitmask_sets_every_other_token_to_minus_infinity(apply: Any) -> None:
    vocab = 70
    logits = torch.randn(3, vocab)
    allowed = [[0, 31, 32, 69], [5], list(range(vocab))]
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for row, ids in enumerate(allowed[:2]):
        for i in ids:
            bitmask[row, i // 32] |= torch.tensor(1 << (i % 32), dtype=torch.int64).to(torch.int32)
    expected = logits.clone()
    out = logits.clone()
    apply(out, torch.tensor([0, 2]), bitmask)  # rows 0 and 2; row 1 free
    for row, ids in ((0, allowed[0]), (2, allowed[1])):
        keep = torch.full((vocab,), float("-inf"))
        keep[ids] = expected[row, ids]
        assert torch.equal(out[row], keep)
    assert torch.equal(out[1], expected[1])


# ---- the engine, on the bundled model ----------------------------------------

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum_and_bounded_array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "sizes": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": 99},
                "minItems": 2,
                "maxItems": 3,
            },
        },
        "required": ["color", "sizes"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "id": {
                "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 6}]
            },
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> LLM:
    return LLM(str(smollm2_path), max_num_seqs=8, max_model_len=512)


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.stats()
    assert stats.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def test_json_schema_outputs_validate(smol: LLM) -> None:
    names = list(SCHEMAS)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=96,
            structured_outputs=StructuredOutputsParams(
                json=SCHEMAS[name], disable_any_whitespace=True
            ),
        )
        for name in names
    ]
    prompts = [f"Write a JSON object ({name.replace('_', ' ')}) about a person." for name in names]
    params.append(
        SamplingParams(
            temperature=0.8,
            seed=7,
            n=2,
            max_tokens=96,
            logprobs=2,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS["any_of"]),
        )
    )
    prompts.append("Give me a JSON record.")
    outputs = smol.generate(prompts, params)
    schemas = [SCHEMAS[name] for name in names] + [SCHEMAS["any_of"]]
    for out, schema in zip(outputs, schemas, strict=True):
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)
    sampled = outputs[-1].outputs
    assert sampled[0].logprobs is not None and len(sampled[0].logprobs) == len(sampled[0].token_ids)
    _assert_idle(smol)


def test_regex_choice_and_the_end_of_a_grammar(smol: LLM) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["yes", "no", "not sure / maybe"]
    outputs = smol.generate(
        ["Call me at", "Is water wet? Answer:", "Three letters:"],
        [
            SamplingParams(
                temperature=1.0,
                seed=3,
                max_tokens=30,
                structured_outputs=StructuredOutputsParams(regex=phone),
            ),
            SamplingParams(
                temperature=1.0,
                seed=5,
                n=3,
                max_tokens=10,
                structured_outputs=StructuredOutputsParams(choice=choices),
            ),
            # Under ignore_eos the grammar's end ends the sequence.
            SamplingParams(
                temperature=0.0,
                max_tokens=30,
                ignore_eos=True,
                structured_outputs=StructuredOutputsParams(regex="[a-z]{3}"),
            ),
        ],
    )
    assert re.fullmatch(phone, outputs[0].outputs[0].text)
    assert all(c.text in choices for c in outputs[1].outputs)
    last = outputs[2].outputs[0]
    assert re.fullmatch("[a-z]{3}", last.text) and last.finish_reason == "stop"
    assert last.token_ids[-1] in smol.engine.eos_token_ids
    _assert_idle(smol)


def test_a_cached_grammar_is_not_compiled_again(smol: LLM) -> None:
    grammar = smol.engine.grammar
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(regex="(ab){1,2}c"),
    )
    smol.generate(["x"], params)
    compiled = grammar.num_compiled
    out = smol.generate(["x", "y"], params)
    assert grammar.num_compiled == compiled and grammar.num_cache_hits >= 2
    assert all(re.fullmatch("(ab){1,2}c", o.outputs[0].text) for o in out)


def _slow_compiles(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    from ferrox.engine.structured_output.grammar import GrammarEngine

    compile_now = GrammarEngine._compile

    def slow(self: GrammarEngine, source: str, param: str) -> Any:
        time.sleep(seconds)
        return compile_now(self, source, param)

    monkeypatch.setattr(GrammarEngine, "_compile", slow)


def test_grammars_compile_off_the_step(smol: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new grammar compiles on its own thread: the running request goes on
    decoding meanwhile; the constrained one joins when its grammar is ready."""
    _slow_compiles(monkeypatch, 1.0)
    engine = smol.engine
    plain = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    engine.add_request("plain", [1, 2, 3, 4], plain)
    schema = {"type": "object", "properties": {"late": {"type": "boolean"}}, "required": ["late"]}
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )
    started = time.monotonic()
    engine.add_request("late", [5, 6, 7], constrained)
    assert time.monotonic() - started < 0.5  # adding it did not wait for the compile
    assert sorted(engine.request_ids()) == ["late", "plain"]
    plain_tokens, waited, late, finish = 0, None, [], None
    while engine.has_unfinished_requests():
        deltas, _ = engine.step()
        for delta in deltas:
            if delta.request_id == "plain":
                plain_tokens += len(delta.token_ids)
                continue
            if waited is None:
                waited = plain_tokens  # the plain tokens decoded before "late" joined
            late += delta.token_ids
            finish = delta.finish_reason or finish
        if finish is not None:
            engine.abort_request("plain")
    assert waited is not None and waited >= 5, waited
    assert finish == "stop" and not engine.take_failures()
    text = smol.get_tokenizer().decode(late, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    _assert_idle(smol)


def test_a_grammar_compile_past_its_bound_fails_the_request(
    smol: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ferrox.engine.structured_output.grammar as grammar

    _slow_compiles(monkeypatch, 1.0)
    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.2)
    engine = smol.engine
    params = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(slow){1,3}")
    )
    engine.add_request("slow", [5, 6, 7], params)
    engine.add_request("gone", [5, 6], SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(gone){1,3}")
    ))  # fmt: skip
    assert engine.abort_request("gone")  # aborted while it waits: nothing held
    deadline = time.monotonic() + 10
    failures: list[tuple[str, str, str]] = []
    while not failures and time.monotonic() < deadline:
        engine.step()
        failures = engine.take_failures()
    assert failures == [
        ("slow", "InvalidArgumentError", "structured_outputs.regex did not compile within 0.2 s")
    ]
    assert not engine.has_unfinished_requests()
    _assert_idle(smol)


def test_a_bad_grammar_fails_before_any_work(smol: LLM) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(errors.InvalidArgumentError, match=r"structured_outputs\.regex"):
        smol.generate(["a", "b"], [SamplingParams(max_tokens=2), bad])
    _assert_idle(smol)


def _one_more_property(smol: LLM, closed: bool) -> Any:
    """A schema of one property; a bias towards "," pushes the model to add another."""
    comma = smol.get_tokenizer().encode(",", add_special_tokens=False)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        logit_bias={comma[0]: 40.0},
        structured_outputs=StructuredOutputsParams(
            json=schema, disable_any_whitespace=True, disable_additional_properties=closed
        ),
    )
    return smol.generate(["A JSON object:"], params)[0].outputs[0]


def test_a_closed_schema_allows_no_other_property(smol: LLM) -> None:
    loose = _one_more_property(smol, closed=False)
    assert re.match(r'\{"ok":(true|false),', loose.text), loose.text  # the bias works
    closed = _one_more_property(smol, closed=True)
    assert closed.finish_reason == "stop", closed.text
    assert list(json.loads(closed.text)) == ["ok"]
    _assert_idle(smol)


def test_a_grammar_dead_end_ends_the_sequence_with_error(smol: LLM) -> None:
    """An empty lexeme (an intersection of two strings) compiles, but no
    token continues the output: the sequence ends, nothing is held."""
    empty = StructuredOutputsParams(grammar='start: "a" B\nB: "b" & "c"')
    outputs = smol.generate(
        ["x", "y"],
        [
            SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=empty),
            SamplingParams(temperature=0.0, max_tokens=8),
        ],
    )
    dead = outputs[0].outputs[0]
    assert dead.finish_reason == "error" and dead.text == "a", dead
    assert not set(dead.token_ids) & set(smol.engine.eos_token_ids)  # no EOS: it did not end
    assert outputs[1].outputs[0].finish_reason == "length"
    _assert_idle(smol)


def test_grammar_under_preemption_and_prefix_caching(tiny_models: dict[str, Path]) -> None:
    """A random-weight model with a KV pool too small for the batch: the
    sequences are preempted and recomputed, and still match their regex."""
    llm = LLM(
        str(tiny_models["llama-gqa-tied"]),
        max_num_seqs=8,
        num_kv_blocks=24,
        block_size=4,
        max_model_len=96,
    )
    pattern = "[a-z]{20,30}"
    params = SamplingParams(
        temperature=1.0,
        seed=11,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(regex=pattern),
    )
    prompt = "a shared prompt of some length " * 2
    outputs = llm.generate([prompt] * 8, params)
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outputs)
    assert sum(o.metrics.num_preemptions for o in outputs if o.metrics) > 0
    assert sum(o.metrics.num_cached_tokens for o in outputs if o.metrics) > 0
    _assert_idle(llm)


# ---- the output parsers ---------------------------------------------------------


def _feed_in_pieces(out: ChatOutput, text: str, seed: int) -> tuple[str, str, list[Any]]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    reasoning = content = ""
    deltas: list[Any] = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        piece = out.feed(text[start:end])
        reasoning, content, deltas = (
            reasoning + piece.reasoning,
            content + piece.content,
            deltas + piece.tool_deltas,
        )
    piece = out.finish()
    return reasoning + piece.reasoning, content + piece.content, deltas + piece.tool_deltas


def _accumulate(deltas: list[Any]) -> list[dict[str, str]]:
    """Tool-call deltas as the OpenAI SDK accumulates them."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = d.id or call["id"]
        call["name"] += (d.function.name or "") if d.function else ""
        call["arguments"] += (d.function.arguments or "") if d.function else ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("seed", range(6))
def test_parsers_give_the_same_result_however_the_text_is_cut(seed: int) -> None:
    hermes = (
        "<think>\nplan the call\n</think>\n\nLet me check. <tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    )
    out = ChatOutput(reasoning_parser="qwen3", tool_mode="auto", tool_parser="hermes")
    reasoning, content, deltas = _feed_in_pieces(out, hermes, seed)
    assert reasoning == "\nplan the call\n"
    assert content.strip() == "Let me check."
    calls = _accumulate(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert out.finish_reason("stop") == "tool_calls"

    llama = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'
    out = ChatOutput(reasoning_parser=None, tool_mode="auto", tool_parser="llama3_json")
    _, content, deltas = _feed_in_pieces(out, llama, seed)
    assert content == "" and [c["name"] for c in _accumulate(deltas)] == ["f", "g"]

    out = ChatOutput(reasoning_parser="deepseek_r1", tool_mode="named", tool_name="f")
    reasoning, content, deltas = _feed_in_pieces(out, 'hmm, think</think>{"a": [1, 2]}', seed)
    assert reasoning == "hmm, think" and content == ""
    assert _accumulate(deltas)[0]["name"] == "f"
    assert json.loads(_accumulate(deltas)[0]["arguments"]) == {"a": [1, 2]}
    assert out.finish_reason("stop") == "stop"

    for text in ("Just <b>text</b> <tool_call without a call", "a < b and <think> later"):
        for mode, parser in (("auto", "hermes"), ("auto", "llama3_json"), ("none", None)):
            out = ChatOutput(reasoning_parser="qwen3", tool_mode=mode, tool_parser=parser)
            reasoning, content, deltas = _feed_in_pieces(out, text, seed)
            assert (reasoning, content, deltas) == ("", text, [])


def test_required_output_cut_short_stays_text() -> None:
    out = ChatOutput(reasoning_parser=None, tool_mode="required")
    out.feed('[{"name": "f", "parameters": {"a"')
    piece = out.finish()
    assert piece.tool_deltas == [] and out.message().content == '[{"name": "f", "parameters": {"a"'
    assert out.finish_reason("length") == "length"


# ---- through the server ------------------------------------------------------

_PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = tool_server(smollm2_path, tmp_path_factory.mktemp("template"))
    yield srv
    srv.stop()


def _check_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), _PARAMETERS[call.function.name])


def _stream_message(stream: Any) -> Any:
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


def test_response_format_through_the_sdk(server: Server) -> None:
    client = server.client()
    schema = SCHEMAS["enum_and_bounded_array"]
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(
        model="smol", messages=QUESTION, max_tokens=80, temperature=0, response_format=fmt
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    # Where a greedy reply ends turns on near ties (a JSON object may go on
    # for ever); a bias toward "}" ends it as soon as the grammar lets it,
    # and without the grammar the reply would start with that "}".
    close = server.post("/tokenize", {"model": "smol", "prompt": "}"}).json()["tokens"]
    ask = [{"role": "user", "content": 'Reply with a JSON object like {"city": "Paris"}.'}]
    streamed = _stream_message(
        client.chat.completions.create(
            model="smol",
            messages=ask,
            max_tokens=120,
            temperature=0,
            logit_bias={str(close[0]): 100},
            response_format={"type": "json_object"},
            stream=True,
        )
    )
    assert isinstance(json.loads(streamed.message.content), dict)
    completion = client.completions.create(
        model="smol",
        prompt="The capital of France is",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["Paris", "Lyon"]},
    )
    assert completion.choices[0].text in ("Paris", "Lyon")
    server.wait_idle()


def test_strict_schemas_and_unending_grammars_through_the_sdk(server: Server) -> None:
    import openai

    client = server.client()
    comma = server.post("/tokenize", {"model": "smol", "prompt": ","}).json()["tokens"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    ask = [{"role": "user", "content": "Reply with a JSON object."}]

    def reply(strict: bool) -> str:
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": schema, "strict": strict},
        }
        out = client.chat.completions.create(
            model="smol",
            messages=ask,
            max_tokens=40,
            temperature=0,
            logit_bias={str(comma[0]): 40},
            response_format=fmt,
        )
        return str(out.choices[0].message.content)

    assert re.match(r'\{\s*"ok"\s*:\s*(true|false)\s*,', reply(strict=False))
    assert list(json.loads(reply(strict=True))) == ["ok"]
    with pytest.raises(openai.BadRequestError, match="no finite string"):
        client.completions.create(
            model="smol",
            prompt="x",
            max_tokens=4,
            extra_body={"structured_outputs": {"grammar": 'start: "x" start'}},
        )
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_parse_and_validate(server: Server, stream: bool) -> None:
    client = server.client()
    for choice, finish in (
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_time"}}, "stop"),
    ):
        reply = client.chat.completions.create(
            model="smol",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=80,
            temperature=0,
            stream=stream,
        )
        choice0 = _stream_message(reply) if stream else reply.choices[0]
        _check_calls(choice0.message.tool_calls)
        assert choice0.finish_reason == finish
        assert not choice0.message.content
        if isinstance(choice, dict):
            assert [c.function.name for c in choice0.message.tool_calls] == ["get_time"]
    reply = client.chat.completions.create(
        model="smol",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    assert len(reply.choices[0].message.tool_calls) == 1
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_and_reasoning_are_parsed(server: Server, stream: bool) -> None:
    """The output is steered by a regex into the Hermes format with a
    <think> block: the parsers must find the call and the reasoning."""
    steer = (
        r"<think>[a-z ]{3,20}</think>\n\nChecking\. <tool_call>\n"
        r'\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", '
        r'"unit": "celsius"\}\}\n</tool_call>'
    )
    reply = server.client().chat.completions.create(
        model="smol",
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=80,
        temperature=0,
        stream=stream,
        extra_body={"guided_regex": steer},
    )
    choice = _stream_message(reply) if stream else reply.choices[0]
    message = choice.message
    assert choice.finish_reason == "tool_calls"
    _check_calls(message.tool_calls)
    assert message.content.strip() == "Checking."
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning is None and message.model_extra:
        reasoning = message.model_extra.get("reasoning_content")
    if stream:  # the SDK's accumulator keeps only the fields it knows
        assert reasoning is None or re.fullmatch("[a-z ]{3,20}", reasoning)
    else:
        assert re.fullmatch("[a-z ]{3,20}", reasoning)
    server.wait_idle()


def test_streamed_reasoning_arrives_as_reasoning_content(server: Server) -> None:
    body = {
        "model": "smol",
        "messages": QUESTION,
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "guided_regex": "<think>[a-z ]{3,12}</think>\n\n[A-Z][a-z]{2,8}",
    }
    with server.client()._client.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=server.headers
    ) as response:
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert re.fullmatch("[a-z ]{3,12}", reasoning) and re.fullmatch("[A-Z][a-z]{2,8}", content)
    body.update(stream=False, include_reasoning=False)
    message = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and re.fullmatch(
        "[A-Z][a-z]{2,8}", message["content"]
    )


def test_tool_messages_and_template_arguments_reach_the_chat_template(server: Server) -> None:
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is"},
    ]

    def rendered(**extra: Any) -> str:
        body = {"model": "smol", "messages": messages, "tools": TOOLS, **extra}
        tokens = server.post("/tokenize", body).json()["tokens"]
        return server.post("/detokenize", {"model": "smol", "tokens": tokens}).json()["prompt"]

    text = rendered(add_generation_prompt=False, continue_final_message=True)
    assert "Tools: get_weather get_time" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "[result of call_1]\n18 C, sunny" in text
    assert text.endswith("It is")  # continued, not closed
    messages.pop()
    assert rendered(chat_template_kwargs={"enable_thinking": False}).endswith(
        "<think>\n\n</think>\n\n"
    )
    reply = server.post(
        "/v1/chat/completions",
        {
            "model": "smol",
            "messages": messages,
            "max_tokens": 4,
            "tools": TOOLS,
            "tool_choice": "none",
            "chat_template_kwargs": {"tokenize": True},
        },
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"audio": {"voice": "x"}}, "audio"),
        ({"functions": []}, "functions"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "surprise": 1}}, "structured_outputs"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "auto",
                "response_format": {"type": "json_object"},
                "tool_choice_": 1,
            },
            None,
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objectx"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"min_tokens": 3, "guided_regex": "a+"}, "min_tokens"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ],
)
def test_fields_not_served_get_a_400_naming_them(
    server: Server, body: dict[str, Any], param: str | None
) -> None:
    full = {"model": "smol", "messages": QUESTION, "max_tokens": 4, **body}
    reply = server.post("/v1/chat/completions", full)
    if param is None:  # an unknown field is accepted (and logged once)
        assert reply.status_code == 200, reply.text
        return
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_ignored_fields_are_accepted(server: Server) -> None:
    body = {
        "model": "smol",
        "messages": QUESTION,
        "max_tokens": 2,
        "store": False,
        "metadata": {"k": "v"},
        "user": "u",
        "service_tier": "auto",
    }
    assert server.post("/v1/chat/completions", body).status_code == 200
    server.wait_idle()


def test_tool_and_backend_flags_are_checked(capsys: pytest.CaptureFixture) -> None:
    from ferrox.server.launch import build_parser
    from ferrox.server.vllm_options import disable_additional_properties_option, tool_parser_option

    parser = build_parser()
    with pytest.raises(SystemExit, match="go together"):
        tool_parser_option(parser.parse_args(["--enable-auto-tool-choice"]))
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert tool_parser_option(args) == "hermes"
    assert parser.parse_args(["--structured-outputs-config", '{"backend": "guidance"}'])
    assert not disable_additional_properties_option(parser.parse_args([]))
    closed = parser.parse_args(
        ["--structured-outputs-config", '{"disable_additional_properties": true}']
    )
    assert disable_additional_properties_option(closed)
    for bad in (
        ["--structured-outputs-config", '{"backend": "xgrammar"}'],
        ["--structured-outputs-config", '{"disable_additional_properties": "yes"}'],
        ["--tool-call-parser", "mistral"],
        ["--reasoning-parser", "nope"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "invalid" in capsys.readouterr().err
