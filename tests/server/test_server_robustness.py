"""No request can take the server down: every field of every route fuzzed
with extreme values, HTTP limits, admission control, liveness, per-request
timeouts and draining on signals. After each case the engine is alive and,
once idle, no request runs and no KV block is in use."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrox.server.error_responses import describe
from tests.live_server import HTTP, Server, engine_processes

# CI runs a fixed sequence of examples; FERROX_FUZZ_EXAMPLES=N runs N random ones.
FUZZ_EXAMPLES = int(os.environ.get("FERROX_FUZZ_EXAMPLES", "120"))
FUZZ_RANDOM = "FERROX_FUZZ_EXAMPLES" in os.environ
ROUTES = {
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 3},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
    },
    "/tokenize": {"model": "tiny", "prompt": "hello"},
    "/detokenize": {"model": "tiny", "tokens": [1, 2, 3]},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 3},
    "/v1/messages": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
    },
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"model": "tiny", "input": "hello"},
    "/v1/score": {"model": "tiny", "text_1": "a", "text_2": ["b", "c"]},
    "/v1/rerank": {"model": "tiny", "query": "q", "documents": ["a", "b"]},
    "/v1/classify": {"model": "tiny", "input": "hello"},
}
FIELDS = {
    "/v1/completions": [
        "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
        "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "top_k", "min_p",
        "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
        "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "priority",
        "logprobs", "echo", "best_of", "suffix", "model", "response_format",
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "spaces_between_special_tokens",
    ],
    "/v1/chat/completions": [
        "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
        "stop", "logit_bias", "seed", "top_k", "min_tokens", "stop_token_ids", "logprobs",
        "top_logprobs", "prompt_logprobs", "priority", "add_generation_prompt", "chat_template",
        "repetition_penalty", "ignore_eos", "model", "response_format", "structured_outputs",
        "guided_json", "guided_regex", "guided_choice", "tools", "tool_choice",
        "parallel_tool_calls", "chat_template_kwargs", "continue_final_message",
        "include_reasoning",
    ],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "model"],
    "/detokenize": ["tokens", "model"],
    "/v1/responses": [
        "input", "instructions", "previous_response_id", "tools", "tool_choice",
        "parallel_tool_calls", "text", "reasoning", "max_output_tokens", "temperature", "top_p",
        "stream", "store", "metadata", "truncation", "include", "background", "top_logprobs",
        "max_tool_calls", "user", "top_k", "min_p", "repetition_penalty", "seed", "priority",
        "model", "conversation",
    ],
    "/v1/messages": [
        "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p",
        "top_k", "tools", "tool_choice", "thinking", "output_config", "metadata", "model",
        "mcp_servers", "cache_control",
    ],
    "/v1/messages/count_tokens": [
        "messages", "system", "tools", "tool_choice", "thinking", "output_config", "model",
    ],
    "/v1/embeddings": [
        "input", "model", "encoding_format", "dimensions", "user", "add_special_tokens",
        "priority",
    ],
    "/v1/score": ["text_1", "text_2", "model", "priority"],
    "/v1/rerank": ["query", "documents", "model", "top_n", "return_documents", "priority"],
    "/v1/classify": ["input", "model", "add_special_tokens", "priority"],
}  # fmt: skip
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")
# The last line of a whole stream, by route.
STREAM_ENDS = {
    "/v1/responses": ("event: response.completed", "event: response.incomplete"),
    "/v1/messages": ("event: message_stop",),
}
# Raw JSON for the values the json module cannot write as standard JSON.
SPECIAL = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]
EXTREME_INTS = [
    -(2**70), -(2**63) - 1, -(2**63), -(2**31) - 1, -(2**31), -1, 0, 1, 2, 255,
    2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**70, 10**30,
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EXTREME_INTS),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "x" * 5000, "tiny", "user", "text", "\x00", "😀" * 100]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
        st.lists(st.sampled_from(EXTREME_INTS), min_size=1, max_size=3),
        st.builds(lambda k, v: {str(k): v}, st.sampled_from(EXTREME_INTS), inner),
        st.builds(lambda r, c: [{"role": r, "content": c}], st.sampled_from(["user", "x"]), inner),
        st.builds(lambda n: [7] * n, st.sampled_from([1, 300, 5000])),
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    s = Server(model_dir, "--log-level", "warning", api_key=None)
    yield s
    s.stop()


def body_with(route: str, changes: dict[str, Any], special: dict[str, str]) -> bytes:
    body = dict(ROUTES[route])
    body.update(changes)
    text = json.dumps(body)
    for name, raw in special.items():  # non-standard JSON numbers, appended by hand
        text = text[:-1] + f', "{name}": {raw}}}'
    return text.encode()


def check_answer(response: httpx.Response, streamed: bool, route: str = "") -> None:
    """A served answer, or an error in the route's API's envelope; a stream
    that ends as its API ends a whole one (or with an error event)."""
    assert response.status_code in (200, 400, 404, 408, 413), response.text[:500]
    if response.status_code != 200:
        body = response.json()
        error = body["error"]
        if route in ANTHROPIC:
            assert body["type"] == "error" and set(error) == {"type", "message"}, body
        else:
            assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] in ("invalid_request_error", "not_found_error", "timeout_error")
    elif streamed:
        events = [line for line in response.text.splitlines() if line.startswith("event: ")]
        if route in STREAM_ENDS:
            assert events and events[-1] in (*STREAM_ENDS[route], "event: error"), events[-3:]
        else:
            assert response.text.rstrip().endswith("data: [DONE]")


@settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=not FUZZ_RANDOM,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_fields_never_stop_the_server(server: Server, data: st.DataObject) -> None:
    route = data.draw(st.sampled_from(sorted(ROUTES)))
    names = data.draw(st.lists(st.sampled_from(FIELDS[route]), min_size=1, max_size=3, unique=True))
    changes: dict[str, Any] = {}
    special: dict[str, str] = {}
    for name in names:
        if data.draw(st.integers(0, 9)) == 0:
            special[name] = data.draw(st.sampled_from(SPECIAL))
        else:
            changes[name] = data.draw(values)
    body = body_with(route, changes, special)
    streamed = changes.get("stream") is True and route.startswith("/v1")
    r = HTTP.post(
        server.url + route,
        content=body,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    check_answer(r, streamed, route)
    if r.status_code == 400 and route not in ANTHROPIC:  # (Anthropic's errors name no field)
        error = r.json()["error"]
        # Every field-level error names its field; a body that is not JSON
        # (NaN and Infinity are not JSON numbers) has no field to name.
        if "not valid JSON" not in error["message"]:
            assert error["param"] in FIELDS[route] or error["param"] in ROUTES[route], error
    assert HTTP.get(server.url + "/health", timeout=10).status_code == 200
    assert server.proc.poll() is None
    server.wait_idle()


# The switches that close a JSON schema's objects, nested where the fuzzer
# above rarely reaches: a bool is served (and null where OpenAI allows it:
# `strict`), anything else is a 400 naming the field.
_CLOSED_OBJECT_SWITCHES = {
    "response_format": lambda v: {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": {"type": "object"}, "strict": v},
        }
    },
    "structured_outputs": lambda v: {
        "structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": v}
    },
    "tools": lambda v: {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "strict": v}}],
        "tool_choice": "required",
    },
}


@pytest.mark.parametrize("field", sorted(_CLOSED_OBJECT_SWITCHES))
@pytest.mark.parametrize("value", [None, True, False, 1, 2**70, "true", {}])
def test_closed_object_switches_take_a_bool_or_a_400(
    server: Server, field: str, value: Any
) -> None:
    body = dict(ROUTES["/v1/chat/completions"]) | _CLOSED_OBJECT_SWITCHES[field](value)
    r = HTTP.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    check_answer(r, streamed=False)
    served = isinstance(value, bool) or (value is None and field != "structured_outputs")
    assert r.status_code == (200 if served else 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] == field
    assert HTTP.get(server.url + "/health", timeout=10).status_code == 200
    server.wait_idle()


def test_after_fuzzing_nothing_is_left_running(server: Server) -> None:
    server.wait_idle()
    assert len(engine_processes(server)) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", 2**31), ("priority", -(2**31) - 1), ("top_k", 2**64), ("seed", 2**64),
        ("n", 2**40), ("min_tokens", 2**40), ("stop_token_ids", [2**40]),
        ("logit_bias", {str(2**40): 1}), ("logprobs", 2**63), ("prompt_logprobs", -1),
        ("max_tokens", 2**64), ("prompt", [2**40]),
    ],
)  # fmt: skip
def test_integers_out_of_range_are_400_naming_the_field(
    server: Server, field: str, value: Any
) -> None:
    r = HTTP.post(
        server.url + "/v1/completions",
        json={**ROUTES["/v1/completions"], field: value},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert HTTP.get(server.url + "/health", timeout=10).status_code == 200


def test_http_limits(model_dir: Path, own_servers: list[Server]) -> None:
    s = Server(model_dir, "--max-body-bytes", str(64 * 1024), api_key=None)
    own_servers.append(s)

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    r = HTTP.post(s.url + "/v1/completions", content=chunks(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    big_headers = {f"x-pad-{i}": "y" * 1000 for i in range(64)}
    r = HTTP.post(s.url + "/v1/completions", json=ROUTES["/v1/completions"], headers=big_headers)
    assert r.status_code == 431
    deep = b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = HTTP.post(s.url + "/v1/completions", content=deep, timeout=60)
    assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"]
    assert HTTP.get(s.url + "/health").status_code == 200


def test_request_chat_templates_need_the_operators_consent(
    server: Server, model_dir: Path, own_servers: list[Server]
) -> None:
    body = {**ROUTES["/v1/chat/completions"], "chat_template": "{{ messages[0]['content'] }}!"}
    r = HTTP.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    trusting = Server(model_dir, "--trust-request-chat-template", api_key=None)
    own_servers.append(trusting)
    r = HTTP.post(trusting.url + "/tokenize", json={**body, "prompt": None}, timeout=60)
    assert r.status_code == 200, r.text


def test_internal_errors_keep_their_details_in_the_log() -> None:
    status, message, _, code = describe(KeyError("secret-detail"))
    assert status == 500 and "secret-detail" not in message and code == "internal_error"


@pytest.fixture
def own_servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for s in started:
        engines = engine_processes(s)
        for p in engines:
            if p.is_running():
                p.resume()
        s.stop()
        for p in engines:
            if p.is_running():
                p.kill()


def stream_lines(url: str, body: dict[str, Any], out: list[str]) -> threading.Thread:
    def run() -> None:
        try:
            with HTTP.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
                out.append(f"status {r.status_code}")
                out.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError as e:
            out.append(f"error {e}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for(predicate: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


LONG = {"model": "tiny", "prompt": "x", "max_tokens": 200, "ignore_eos": True}


def test_a_full_queue_answers_503_with_retry_after(
    model_dir: Path, own_servers: list[Server]
) -> None:
    s = Server(
        model_dir, "--max-num-seqs", "2", "--max-queued-requests", "1", api_key=None
    )  # the last --max-num-seqs wins: 2 running + 1 queued
    own_servers.append(s)
    (engine,) = engine_processes(s)
    engine.suspend()  # nothing finishes while the queue fills
    outs: list[list[str]] = [[] for _ in range(3)]
    threads = [stream_lines(s.url + "/v1/completions", LONG, out) for out in outs]
    wait_for(lambda: all(out for out in outs))  # each got its response headers
    r = HTTP.post(s.url + "/v1/completions", json=LONG, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_busy"
    engine.resume()
    for t in threads:
        t.join(60)
    assert all(out[-1] == "data: [DONE]" for out in outs)
    s.wait_idle()
    assert HTTP.post(s.url + "/v1/completions", json=LONG, timeout=60).status_code == 200


def test_a_stopped_engine_turns_health_to_503_and_back(
    model_dir: Path, own_servers: list[Server]
) -> None:
    s = Server(model_dir, "--engine-stall-timeout", "2", "--request-timeout", "3", api_key=None)
    own_servers.append(s)
    (engine,) = engine_processes(s)
    engine.suspend()
    started = time.monotonic()
    r = HTTP.post(s.url + "/v1/completions", json=LONG, timeout=30)
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 20
    wait_for(lambda: HTTP.get(s.url + "/health").status_code == 503)
    assert "no progress" in HTTP.get(s.url + "/health").json()["error"]["message"]
    engine.resume()
    wait_for(lambda: HTTP.get(s.url + "/health").status_code == 200)
    s.wait_idle()


def test_sigint_to_the_process_group_drains_then_exits_0(
    model_dir: Path, own_servers: list[Server]
) -> None:
    s = Server(model_dir, "--shutdown-timeout", "30", api_key=None, new_session=True)
    own_servers.append(s)
    (engine,) = engine_processes(s)
    out: list[str] = []
    thread = stream_lines(s.url + "/v1/completions", LONG, out)
    wait_for(lambda: len(out) >= 2)  # tokens are flowing
    engine.suspend()  # hold the request in flight while the drain starts
    os.killpg(s.proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal signals
    wait_for(lambda: HTTP.get(s.url + "/health").status_code == 503)
    r = HTTP.post(s.url + "/v1/completions", json=LONG, timeout=30)
    assert r.status_code == 503 and "retry-after" in r.headers
    assert engine.is_running()  # the engine ignored the signal
    engine.resume()
    thread.join(60)
    finish = json.loads(out[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
    assert finish == "length" and out[-1] == "data: [DONE]"
    assert s.proc.wait(60) == 0


def test_drain_timeout_ends_the_rest_with_an_error_event(
    model_dir: Path, own_servers: list[Server]
) -> None:
    s = Server(model_dir, "--shutdown-timeout", "1", api_key=None)
    own_servers.append(s)
    (engine,) = engine_processes(s)
    engine.suspend()
    out: list[str] = []
    thread = stream_lines(s.url + "/v1/completions", LONG, out)
    wait_for(lambda: len(out) >= 1)
    s.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert out[-1] == "data: [DONE]"
    error = json.loads(out[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_busy" and "shut down" in error["message"]
    engine.resume()
    assert s.proc.wait(60) == 0
    wait_for(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE)


def test_thousands_of_requests_at_once_are_bounded(
    model_dir: Path, own_servers: list[Server]
) -> None:
    s = Server(model_dir, "--max-queued-requests", "64", "--log-level", "warning", api_key=None)
    own_servers.append(s)

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=2000)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "ignore_eos": True}

            async def one() -> int:
                return (await client.post(s.url + "/v1/completions", json=body)).status_code

            return await asyncio.gather(*(one() for _ in range(1000)))

    codes = asyncio.run(main())
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes
    s.wait_idle()
