"""LoRA adapters through a live `ferrox serve` and the official OpenAI SDK:
`model` names an adapter, /v1/models lists it with its parent, runtime
loading and unloading behind --allow-runtime-lora-updating with paths
confined to --lora-dir, and each bad input a clear 4xx with nothing leaked."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tests import models
from tests.live_server import MODEL, Server

PROMPT = [5, 17, 33, 61, 2, 99, 140, 12, 8, 250, 31]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Path, Path]]:
    root = tmp_path_factory.mktemp("lora")
    allowed = root / "allowed"
    allowed.mkdir()
    static = models.build_lora_adapter(model_dir, root / "static", rank=8, targets=ALL, seed=3)
    models.build_lora_adapter(model_dir, allowed / "runtime", rank=4, targets=["q_proj"], seed=4)
    models.build_lora_adapter(model_dir, allowed / "other", rank=4, targets=["q_proj"], seed=5)
    models.build_lora_adapter(model_dir, allowed / "rank16", rank=16, targets=["q_proj"])
    models.build_lora_adapter(model_dir, root / "outside", rank=4, targets=["q_proj"])
    (allowed / "escape").symlink_to(root / "outside")
    server = Server(
        model_dir,
        "--enable-lora",
        "--max-loras", "2",
        "--max-lora-rank", "8",
        "--lora-modules", f"static={static}",
        "--allow-runtime-lora-updating",
        "--lora-dir", str(allowed),
    )  # fmt: skip
    try:
        yield server, static, allowed
    finally:
        server.stop()


def _completion(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].text


def _expected(model_dir: Path, adapter: Path | None) -> str:
    hf = models.hf_model(model_dir) if adapter is None else models.hf_merged(model_dir, adapter)
    tokens, _ = models.hf_greedy(hf, PROMPT, 8)
    return str(AutoTokenizer.from_pretrained(model_dir).decode(tokens))


def test_a_model_name_picks_the_adapter(setup, model_dir: Path) -> None:
    server, static, _ = setup
    client = server.client()
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "static"}
    assert cards["static"].model_extra["parent"] == MODEL
    assert cards["static"].model_extra["root"] == str(static)
    assert client.models.retrieve("static").id == "static"
    base, adapted = _completion(client, MODEL), _completion(client, "static")
    assert base == _expected(model_dir, None)
    assert adapted == _expected(model_dir, static) != base
    chat = client.chat.completions.create(
        model="static", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "static"
    with pytest.raises(openai.NotFoundError) as e:
        _completion(client, "no-such-adapter")
    assert e.value.body["code"] == "model_not_found"
    server.wait_idle()


def test_runtime_loading_is_confined_and_checked(setup, model_dir: Path) -> None:
    server, _, allowed = setup
    client = server.client()

    def load(name: str, path: str):
        return server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    for path, message in [
        ("../outside", "outside --lora-dir"),
        ("escape", "outside --lora-dir"),  # a symlink out of it
        ("missing", "is not a directory"),
        ("rank16", "exceeds max_lora_rank=8"),
    ]:
        r = load("x", path)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
    assert server.post("/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    assert load("static", "runtime").status_code == 400  # the name is taken
    assert load("runtime", "runtime").status_code == 200
    assert "runtime" in {m.id for m in client.models.list().data}
    text = _completion(client, "runtime")
    assert text == _expected(model_dir, allowed / "runtime")
    # An adapter in use stays; once idle it goes.
    stream = client.completions.create(
        model="runtime", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    r = server.post("/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert r.status_code == 400 and "in use by 1 request" in r.json()["error"]["message"]
    stream.close()
    server.wait_idle()
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "runtime"}).status_code == 200
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "runtime"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        _completion(client, "runtime")
    # The name again, for other weights: their tokens, never the old KV.
    assert load("runtime", "other").status_code == 200
    assert _completion(client, "runtime") == _expected(model_dir, allowed / "other") != text
    server.wait_idle()


def test_runtime_updates_need_the_flag(model_dir: Path, tmp_path: Path) -> None:
    adapter = models.build_lora_adapter(model_dir, tmp_path / "a", rank=4, targets=["v_proj"])
    server = Server(model_dir, "--enable-lora", "--max-lora-rank", "4",
                    "--lora-modules", f'{{"name": "a", "path": "{adapter}"}}')  # fmt: skip
    try:
        r = server.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapter)})
        assert r.status_code == 400
        assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        # Requests of two adapters-in-waiting and the base at once: all answered.
        client = server.client()
        results: list[str] = []
        threads = [
            threading.Thread(target=lambda m=m: results.append(_completion(client, m)))
            for m in ("a", MODEL, "a", MODEL)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 4
        server.wait_idle()
    finally:
        server.stop()


def test_a_bad_start_up_adapter_stops_the_server(model_dir: Path, tmp_path: Path) -> None:
    adapter = models.build_lora_adapter(model_dir, tmp_path / "a", rank=8, targets=["q_proj"])
    with pytest.raises(RuntimeError, match="exceeds max_lora_rank=4"):
        Server(model_dir, "--enable-lora", "--max-lora-rank", "4", "--lora-modules",
               f"a={adapter}")  # fmt: skip
    with pytest.raises(RuntimeError, match="need --enable-lora"):
        Server(model_dir, "--lora-modules", f"a={adapter}")


@settings(max_examples=60, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    route=st.sampled_from(["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]),
    body=st.dictionaries(
        st.sampled_from(["lora_name", "lora_path", "lora_int_id", "load_inplace", "x"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.text(max_size=12),
            st.sampled_from(["runtime", "other", "/", "..", "static", "\x00"]),
            st.lists(st.integers(), max_size=2),
        ),
        max_size=3,
    ),
)
def test_fuzzed_adapter_requests_never_stop_the_server(setup, route: str, body: dict) -> None:
    server, _, _ = setup
    r = server.post(route, body)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        assert r.json()["error"]["message"]
    assert server.proc.poll() is None
