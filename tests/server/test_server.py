"""A live `ferrox serve` on loopback, driven with the official openai SDK and
raw HTTP: endpoints, errors, concurrency, disconnects, shutdown and engine
death. Every server here runs a tiny random model on the CPU."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.live_server import API_KEY, HTTP, MODEL, Server, engine_processes, engine_processes_of


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    s = Server(model_dir, "--max-body-bytes", str(64 * 1024))
    yield s
    s.stop()


def _torch_libraries(process: psutil.Process) -> set[str]:
    return {
        m.path for m in process.memory_maps() if os.path.basename(m.path).startswith("libtorch")
    }


def test_frontend_process_never_loads_torch(server: Server) -> None:
    """The frontend tokenizes, renders chat templates, detokenizes and routes;
    the model (and torch) live in the engine process alone."""
    out = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert out.choices[0].message.content is not None
    engines = engine_processes(server)
    assert engines and all(_torch_libraries(p) for p in engines)  # the check sees torch there
    assert _torch_libraries(psutil.Process(server.proc.pid)) == set()


def test_completions_and_usage(server: Server, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.usage.prompt_tokens == len(tok.encode("Hello world"))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=6, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == r.choices[0].text
    many = c.completions.create(
        model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2, temperature=0
    )
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2, 3]
    echo = c.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=2, echo=True, logprobs=2, temperature=0
    )
    assert echo.choices[0].text.startswith("Hello world")
    assert echo.choices[0].logprobs.token_logprobs[0] is None
    assert len(echo.choices[0].logprobs.tokens) == r.usage.prompt_tokens + 2
    server.wait_idle()


def test_chat_streaming_and_logprobs(server: Server) -> None:
    c = server.client()
    messages = [{"role": "user", "content": "hi"}]
    full = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    assert full.choices[0].message.role == "assistant"
    assert len(full.choices[0].logprobs.content) == 5
    assert all(len(t.top_logprobs) == 2 for t in full.choices[0].logprobs.content)
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] in ("stop", "length") and all(f is None for f in finish[:-1])
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    r = c.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=3, n=2, temperature=1.0, seed=5
    )
    assert len(r.choices) == 2 and r.usage.completion_tokens <= 6


def test_stop_strings_and_seeds(server: Server) -> None:
    c = server.client()
    base = c.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[4:7]
    stopped = c.completions.create(
        model=MODEL, prompt="abc", max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    kw = dict(model=MODEL, prompt="seeded", max_tokens=8, temperature=1.0, seed=42)
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text
    server.wait_idle()


def test_a_seed_gives_the_same_tokens_offline_and_served(server: Server, model_dir: Path) -> None:
    from ferrox import LLM, SamplingParams

    c = server.client()
    kw = dict(model=MODEL, prompt="seeded", max_tokens=10, temperature=1.0, seed=42, n=2)
    served = sorted(c.completions.create(**kw).choices, key=lambda ch: ch.index)
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4)
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=42)
    busy = [SamplingParams(max_tokens=10, temperature=0.9)] * 3  # other rows beside it
    offline = llm.generate(["seeded", "other", "rows", "here"], [params, *busy], use_tqdm=False)
    assert [ch.text for ch in served] == [o.text for o in offline[0].outputs]
    assert served[0].text != served[1].text  # each completion draws its own stream
    server.wait_idle()


def test_other_endpoints(server: Server) -> None:
    h = server.headers
    assert HTTP.get(server.url + "/health").status_code == 200  # open without a key
    assert HTTP.get(server.url + "/version", headers=h).json()["version"]
    models = HTTP.get(server.url + "/v1/models", headers=h).json()
    assert models["data"][0]["id"] == MODEL
    card = server.client().models.retrieve(MODEL)  # GET /v1/models/{id}
    assert card.id == MODEL and card.object == "model"
    missing = HTTP.get(server.url + "/v1/models/org/absent", headers=h)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    toks = server.post("/tokenize", {"prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert server.post("/detokenize", {"tokens": toks["tokens"]}).json()["prompt"] == "Hello world"
    chat_toks = server.post("/tokenize", {"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat_toks["count"] > 3


def test_embeddings_equal_transformers_and_come_as_floats_or_base64(
    server: Server, model_dir: Path
) -> None:
    """/v1/embeddings through the SDK (which asks for base64 and decodes it)
    and as floats: each input's normalised last hidden state, as
    transformers computes it on the served weights."""
    import numpy as np

    from tests.engine.test_embeddings import hf_embeddings

    client = server.client()
    ids = server.post("/tokenize", {"prompt": "Hello world"}).json()["tokens"]
    packed = client.embeddings.create(model=MODEL, input=["Hello world", "Hello"])
    as_ids = [ids, server.post("/tokenize", {"prompt": "Hello"}).json()["tokens"]]
    floats = server.post("/v1/embeddings", {"model": MODEL, "input": as_ids}).json()
    assert floats["object"] == "list" and [d["index"] for d in floats["data"]] == [0, 1]
    expected = hf_embeddings(model_dir, as_ids)
    for got_packed, got, want in zip(packed.data, floats["data"], expected, strict=True):
        np.testing.assert_allclose(np.asarray(got["embedding"]), want, atol=2e-5)
        np.testing.assert_allclose(np.asarray(got_packed.embedding), got["embedding"], atol=2e-6)
    assert packed.usage.prompt_tokens == sum(len(i) for i in as_ids)
    for body, words in (
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": []}, "must not be empty"),
        ({"input": [[10**9]]}, "outside the vocabulary"),
        ({"input": "x" * 20000}, "embeds at most"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ):
        response = server.post("/v1/embeddings", {"model": MODEL, **body})
        assert response.status_code == 400 and words in response.json()["error"]["message"], (
            response.text
        )
    server.wait_idle()


def test_score_and_rerank_order_by_the_cosine_of_embeddings(
    server: Server, model_dir: Path
) -> None:
    from tests.engine.test_embeddings import hf_embeddings

    query, docs = "the weather", ["sunny and warm", "the weather", "a recipe for bread"]
    ids = [server.post("/tokenize", {"prompt": t}).json()["tokens"] for t in (query, *docs)]
    vectors = hf_embeddings(model_dir, ids)
    expected = [float(vectors[0] @ v) for v in vectors[1:]]
    score = server.post("/v1/score", {"model": MODEL, "text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-5)
    order = sorted(range(3), key=lambda i: -expected[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = {"model": MODEL, "query": query, "documents": docs, "top_n": 2}
        ranked = server.post(path, body).json()
        assert [r["index"] for r in ranked["results"]] == order[:2]
        assert ranked["results"][0]["document"]["text"] == docs[order[0]]
        assert ranked["results"][0]["relevance_score"] == pytest.approx(expected[order[0]], 1e-5)
    bare = server.post(
        "/v1/rerank", {"query": query, "documents": docs, "return_documents": False}
    ).json()
    assert "document" not in bare["results"][0] and len(bare["results"]) == 3
    for path, body, words in (
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "give one text_1"),
        ("/v1/score", {"text_1": [], "text_2": "c"}, "must not be empty"),
        ("/v1/rerank", {"query": "q", "documents": []}, "must not be empty"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
        ("/v1/rerank", {"query": "q" * 20000, "documents": ["d"]}, "embeds at most"),
        ("/v1/classify", {"input": "x"}, "no sequence-classification head"),
    ):
        response = server.post(path, body)
        assert response.status_code == 400 and words in response.json()["error"]["message"], (
            response.text
        )
    server.wait_idle()


def test_a_cross_encoder_scores_and_reranks_pairs(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """A one-label sequence classifier served: /v1/score and /v1/rerank give
    its probability for each (query, document) pair as transformers does,
    /v1/classify its probabilities; embeddings and generation are refused."""
    import numpy as np
    from transformers import AutoTokenizer

    from tests.engine.test_embeddings import _classifier, _hf_logits

    path = _classifier(tiny_models, tmp_path, 1)
    tok = AutoTokenizer.from_pretrained(path)
    query, docs = "the weather", ["sunny and warm", "the weather", "a recipe"]
    pairs = [list(tok(query, text_pair=d)["input_ids"]) for d in docs]
    want = [float(1 / (1 + np.exp(-x[0]))) for x in _hf_logits(path, pairs)]
    server = Server(path)
    try:
        score = server.post("/v1/score", {"text_1": query, "text_2": docs}).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=2e-5)
        ranked = server.post("/v1/rerank", {"query": query, "documents": docs}).json()
        order = sorted(range(3), key=lambda i: -want[i])
        assert [r["index"] for r in ranked["results"]] == order
        classes = server.post("/v1/classify", {"input": [pairs[0]]}).json()["data"]
        assert classes[0]["probs"] == pytest.approx([want[0]], abs=2e-5)
        assert classes[0]["num_classes"] == 1
        for route, body, words in (
            ("/v1/embeddings", {"input": "x"}, "sequence classifier"),
            ("/v1/completions", {"prompt": "x", "max_tokens": 2}, "no LM head"),
        ):
            response = server.post(route, body)
            assert response.status_code == 400 and words in response.text, response.text
        server.wait_idle()
    finally:
        server.stop()


def _scrape(server: Server) -> dict[str, float]:
    """Every sample of /metrics: `name{labels}` -> value."""
    text = HTTP.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def _total(samples: dict[str, float], name: str, *label: str) -> float:
    return sum(
        v
        for k, v in samples.items()
        if k.split("{", 1)[0] == f"ferrox:{name}" and all(x in k for x in label)
    )


def test_metrics_follow_requests(server: Server) -> None:
    before = _scrape(server)
    required = [
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
        "prompt_tokens_total", "generation_tokens_total", "request_success_total",
        "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
        "request_prompt_tokens_count", "request_generation_tokens_count",
        "frontend_token_latency_seconds_count",
    ]  # fmt: skip
    names = {k.split("{", 1)[0] for k in before}
    assert {f"ferrox:{n}" for n in required} <= names
    prompt_ids = server.post("/tokenize", {"prompt": "count the metrics"}).json()["tokens"]
    stream = server.client().completions.create(
        model=MODEL,
        prompt="count the metrics",
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert len([ch for ch in stream if ch.choices]) >= 1
    server.wait_idle()
    deadline = time.monotonic() + 10
    while True:  # the frontend records a request just after its last event
        after = _scrape(server)
        done = _total(after, "request_success_total", 'finished_reason="length"')
        if done > _total(before, "request_success_total", 'finished_reason="length"'):
            break
        assert time.monotonic() < deadline, "the finished request was never counted"
        time.sleep(0.05)

    def grew(name: str) -> float:
        return _total(after, name) - _total(before, name)

    assert grew("request_success_total") == 1
    assert grew("prompt_tokens_total") == len(prompt_ids)
    assert grew("generation_tokens_total") == 8
    assert grew("request_generation_tokens_sum") == 8
    assert grew("request_prompt_tokens_sum") == len(prompt_ids)
    assert grew("time_to_first_token_seconds_count") == 1
    assert grew("inter_token_latency_seconds_count") == 7
    assert grew("e2e_request_latency_seconds_count") == 1
    assert grew("frontend_token_latency_seconds_count") == 8
    # Each token's frontend latency lies within the request's lifetime. (Their
    # sum may exceed it: the engine can send a step before the frontend has
    # handed on the last one, so the intervals overlap.)
    frontend = grew("frontend_token_latency_seconds_sum")
    assert 0 < frontend < 8 * grew("e2e_request_latency_seconds_sum")
    assert grew("prefix_cache_queries_total") == len(prompt_ids)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code_or_param"),
    [
        ("post", "/v1/completions", b"{not json", 400, None),
        ("post", "/v1/completions", {"prompt": 5}, 400, None),
        ("post", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("post", "/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
        ("post", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("post", "/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
        (
            "post",
            "/v1/completions",
            {"prompt": "x", "max_tokens": 100000},
            400,
            "context_length_exceeded",
        ),
        ("post", "/v1/completions", {"prompt": [[1] * 300]}, 400, "context_length_exceeded"),
        ("post", "/v1/completions", {"prompt": [[99999]]}, 400, "prompt"),
        ("post", "/v1/completions", {"prompt": "x", "model": "other"}, 404, "model_not_found"),
        ("post", "/v1/chat/completions", {"messages": []}, 400, None),
        ("post", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, None),
        (
            "post",
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            400,
            "messages",
        ),
        ("post", "/v1/nowhere", {}, 404, None),
        ("get", "/v1/completions", None, 405, None),
        ("post", "/detokenize", {"tokens": [-1]}, 400, None),
        ("post", "/v1/completions", {"prompt": "x" * 70000}, 413, None),
    ],
)
def test_bad_input_gets_an_envelope(
    server: Server, method: str, path: str, body: object, status: int, code_or_param: str | None
) -> None:
    kw: dict = {"headers": {**server.headers, "content-type": "application/json"}, "timeout": 30}
    if isinstance(body, bytes):
        kw["content"] = body
    elif body is not None:
        kw["content"] = json.dumps(body).encode()
    r = HTTP.request(method.upper(), server.url + path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code_or_param is not None:
        assert code_or_param in (err["code"], err["param"])
    assert HTTP.get(server.url + "/health").status_code == 200
    server.wait_idle()


def test_authentication(server: Server) -> None:
    r = HTTP.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = HTTP.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_concurrent_streams(server: Server) -> None:
    c = server.client()
    expected = (
        c.completions.create(model=MODEL, prompt="stream me", max_tokens=10, temperature=0)
        .choices[0]
        .text
    )

    async def one(client: openai.AsyncOpenAI) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt="stream me", max_tokens=10, temperature=0, stream=True
        )
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
        )
        return await asyncio.gather(*(one(client) for _ in range(64)))

    results = asyncio.run(main())
    assert results == [expected] * 64
    server.wait_idle()


def test_disconnects_abort_requests(server: Server) -> None:
    body = {"prompt": "long answer", "max_tokens": 200, "ignore_eos": True}

    async def leave(client: httpx.AsyncClient, stream: bool) -> bool:
        async def request() -> None:
            if stream:
                async with client.stream(
                    "POST",
                    server.url + "/v1/completions",
                    headers=server.headers,
                    json={**body, "stream": True},
                ) as r:
                    async for _ in r.aiter_bytes():
                        pass
            else:
                await client.post(server.url + "/v1/completions", headers=server.headers, json=body)

        try:
            await asyncio.wait_for(request(), 0.3)  # the client gives up and disconnects
        except asyncio.TimeoutError:
            return True
        return False  # (a fast machine may finish an answer first)

    async def main() -> list[bool]:
        async with httpx.AsyncClient(
            timeout=30, limits=httpx.Limits(max_connections=100)
        ) as client:
            return await asyncio.gather(*(leave(client, i % 2 == 0) for i in range(50)))

    left = asyncio.run(main())
    assert sum(left) >= 25, f"only {sum(left)} of 50 clients left mid-answer"
    start = time.monotonic()
    r = server.client().completions.create(model=MODEL, prompt="after", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 and time.monotonic() - start < 20
    server.wait_idle()


@pytest.fixture
def own_server(model_dir: Path) -> Iterator[list[Server]]:
    """Servers a test starts itself; stopped whatever the test's outcome."""
    started: list[Server] = []
    yield started
    for s in started:
        engines = engine_processes_of(s.proc.pid)
        s.stop()
        for p in engines:
            if p.is_running():
                p.kill()


def test_sigterm_finishes_in_flight_requests(model_dir: Path, own_server: list[Server]) -> None:
    s = Server(model_dir, "--shutdown-timeout", "20", api_key=None)
    own_server.append(s)
    engine = engine_processes(s)

    async def one() -> int:
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.post(
                s.url + "/v1/completions",
                json={"prompt": "x", "max_tokens": 40, "ignore_eos": True},
            )
            return r.status_code

    async def main() -> list[int]:
        tasks = [asyncio.create_task(one()) for _ in range(4)]
        await asyncio.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*tasks)

    codes = asyncio.run(main())
    assert codes == [200] * 4
    assert s.proc.wait(30) == 0
    assert engine and all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in engine)


def test_engine_death_fails_requests_and_exits(model_dir: Path, own_server: list[Server]) -> None:
    s = Server(model_dir, api_key=None)
    own_server.append(s)
    (engine,) = engine_processes(s)
    body = {"prompt": "x", "max_tokens": 250, "ignore_eos": True}

    async def plain() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(s.url + "/v1/completions", json=body)

    async def streamed() -> list[str]:
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}) as r,
        ):
            return [line async for line in r.aiter_lines() if line]

    async def main() -> tuple[httpx.Response, list[str], int]:
        tasks = asyncio.gather(plain(), streamed())
        while s.metric("num_requests_running") < 2:
            await asyncio.sleep(0.01)
        engine.kill()
        response, lines = await tasks
        async with httpx.AsyncClient(timeout=5) as client:
            health = (await client.get(s.url + "/health")).status_code
        return response, lines, health

    response, lines, health = asyncio.run(main())
    assert response.status_code >= 500 and response.json()["error"]["message"]
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
    assert health == 503
    assert s.proc.wait(30) != 0
