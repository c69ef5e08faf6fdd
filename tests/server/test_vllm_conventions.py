"""What a vLLM user types works the same: `ferrox serve MODEL` (a path or a
hub id from the local hub cache), several served names, CORS, a chat
template flag, /ping, POST /reset_prefix_cache, usage with cached tokens,
vLLM's request metrics, the profiler, and a clear refusal of vLLM flags
ferrox cannot honour."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ferrox import LLM, RequestOutput, SamplingParams
from ferrox.common import errors
from ferrox.server.vllm_options import check_unsupported_flags
from tests.live_server import API_KEY, HTTP, Server


def hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """A Hugging Face hub cache holding `model` as `repo_id`."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model, repo / "snapshots" / commit)
    return root


def test_a_hub_id_loads_from_the_local_cache(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = hub_cache(tmp_path / "hub", "test-org/tiny-llama", tiny_models["llama-gqa-tied"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    by_id = LLM("test-org/tiny-llama", num_kv_blocks=64, block_size=4)
    by_path = LLM(str(tiny_models["llama-gqa-tied"]), num_kv_blocks=64, block_size=4)
    assert (
        by_id.generate([[1, 2, 3]], params, False)[0].outputs[0].token_ids
        == by_path.generate([[1, 2, 3]], params, False)[0].outputs[0].token_ids
    )
    with pytest.raises(errors.ModelLoadError, match="HF_HUB_OFFLINE"):
        LLM("test-org/not-there")


@pytest.mark.parametrize(
    "flag", ["--request-timeout=0", "--engine-stall-timeout=-1", "--max-log-len=-2",
             "--max-body-bytes=-1", "--request-timeout=nan"],
)  # fmt: skip
def test_server_flags_are_checked(flag: str, capsys: pytest.CaptureFixture) -> None:
    from ferrox.server.launch import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([flag])
    assert "expected" in capsys.readouterr().err


def test_unsupported_vllm_flags_are_refused_with_a_reason() -> None:
    with pytest.raises(SystemExit, match="--pipeline-parallel-size is a vLLM option"):
        check_unsupported_flags(["--model", "x", "--pipeline-parallel-size=2"])
    with pytest.raises(SystemExit, match="no pipeline parallelism"):
        check_unsupported_flags(["--pipeline-parallel-size", "2"])
    check_unsupported_flags(["--max-num-seqs", "4", "--enable-lora"])


def test_llm_profiler_writes_a_trace(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    llm = LLM(str(tiny_models["qwen3"]), num_kv_blocks=64, block_size=4, profiler_dir=str(tmp_path))
    llm.start_profile()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    trace = json.loads(llm.stop_profile().read_text())
    assert any(event.get("name") for event in trace["traceEvents"])
    with pytest.raises(errors.InvalidArgumentError, match="no profile is running"):
        llm.stop_profile()
    plain = LLM(str(tiny_models["qwen3"]), num_kv_blocks=64, block_size=4)
    with pytest.raises(errors.InvalidArgumentError, match="profiler_dir"):
        plain.start_profile()
    (tmp_path / "a-file").write_text("")
    unwritable = LLM(
        str(tiny_models["qwen3"]), num_kv_blocks=64, block_size=4,
        profiler_dir=str(tmp_path / "a-file" / "traces"),
    )  # fmt: skip
    unwritable.start_profile()
    with pytest.raises(errors.InvalidArgumentError, match="cannot write the profile"):
        unwritable.stop_profile()
    unwritable.start_profile()  # the engine goes on, and can profile again
    unwritable.engine.close()  # stops it: a profile left running crashes torch at exit
    assert not unwritable.engine.profiler.is_running


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("conventions")
    template = root / "template.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    s = Server(
        model_dir,
        "--chat-template", str(template), "--profiler-dir", str(root / "profiles"),
        served_names=("first-name", "second-name"),
    )  # fmt: skip
    s.profiles = root / "profiles"  # type: ignore[attr-defined]
    yield s
    s.stop()


def test_every_served_name_is_accepted(server: Server) -> None:
    body = {"prompt": "hello", "max_tokens": 2}
    for name in ("first-name", "second-name"):
        r = server.post("/v1/completions", {**body, "model": name})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "first-name"
    assert server.post("/v1/completions", {**body, "model": "other"}).status_code == 404


def test_cors_preflight_is_answered_before_the_api_key(server: Server) -> None:
    r = httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] in ("*", "https://app.example")
    r = HTTP.get(server.url + "/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 401  # CORS does not open the API key's door
    assert "access-control-allow-origin" in r.headers


def test_chat_template_flag_replaces_the_models(server: Server) -> None:
    r = server.post("/tokenize", {"messages": [{"role": "user", "content": "hey"}]})
    text = server.post("/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.startswith("[user] hey") and text.endswith("[assistant]")


def test_ping_reset_prefix_cache_and_cached_usage(server: Server) -> None:
    assert HTTP.get(server.url + "/ping").status_code == 200  # no API key needed
    assert HTTP.post(server.url + "/ping").status_code == 200
    body = {"prompt": "a shared prefix that is long enough to fill blocks " * 3, "max_tokens": 2}
    first = server.post("/v1/completions", body).json()["usage"]
    second = server.post("/v1/completions", body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] > 0
    server.wait_idle()
    assert server.metric("kv_cache_cached_blocks") > 0
    assert server.post("/reset_prefix_cache", {}).status_code == 200
    deadline = time.monotonic() + 10
    while server.metric("kv_cache_cached_blocks") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    third = server.post("/v1/completions", body).json()["usage"]
    assert third["prompt_tokens_details"]["cached_tokens"] == 0


def test_vllm_request_metrics(server: Server) -> None:
    server.post("/v1/completions", {"prompt": "metrics", "max_tokens": 3, "n": 2})
    text = HTTP.get(server.url + "/metrics", headers=server.headers).text
    for name in (
        "ferrox:request_prefill_time_seconds_count",
        "ferrox:request_decode_time_seconds_count",
        "ferrox:request_inference_time_seconds_count",
        "ferrox:iteration_tokens_total_count",
        "ferrox:request_params_n_bucket",
        "ferrox:request_params_max_tokens_count",
        "ferrox:cache_config_info{",
    ):
        assert name in text, name
    assert 'enable_prefix_caching="True"' in text
    assert 'cache_dtype="float32"' in text  # a float32 model's cache


def test_cache_config_metric_names_the_cache_dtype(model_dir: Path) -> None:
    # The cache's own dtype, not the model's (a float32 model here).
    s = Server(model_dir, "--kv-cache-dtype", "float16", api_key=None)
    try:
        text = HTTP.get(s.url + "/metrics").text
        assert 'cache_dtype="float16"' in text
    finally:
        s.stop()


def test_profiler_routes_write_a_trace(server: Server) -> None:
    profiles: Path = server.profiles  # type: ignore[attr-defined]
    assert server.post("/start_profile", {}).status_code == 200
    server.post("/v1/completions", {"prompt": "profile me", "max_tokens": 3})
    assert server.post("/stop_profile", {}).status_code == 200
    deadline = time.monotonic() + 30
    while not list(profiles.glob("ferrox-engine-*.json")):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(0.5)  # the writer may still be flushing
    trace = json.loads(next(profiles.glob("ferrox-engine-*.json")).read_text())
    assert trace["traceEvents"]


def test_profiler_routes_are_absent_without_the_flag(model_dir: Path) -> None:
    s = Server(model_dir, api_key=None)
    try:
        assert s.post("/start_profile", {}).status_code == 404
    finally:
        s.stop()
    assert API_KEY  # the module's other server requires it


def test_generation_config_supplies_sampling_defaults(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from ferrox.server import openai_protocol as op
    from ferrox.server.request_translation import ServerLimits, sampling_params_from
    from ferrox.server.vllm_options import generation_defaults

    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama-gqa-tied"], model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.0, top_p=0.8, max_new_tokens=3, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(config))
    defaults = generation_defaults("auto", str(model))
    assert defaults == {"temperature": 0.0, "top_p": 0.8, "max_tokens": 3}
    assert generation_defaults("vllm", str(model)) == {}
    assert generation_defaults(str(model / "generation_config.json"), None) == defaults

    def params(**fields: object) -> SamplingParams:
        request = op.ChatCompletionRequest(messages=[], **fields)  # type: ignore[arg-type]
        return sampling_params_from(
            request, max_model_len=100, prompt_len=10, limits=ServerLimits(), defaults=defaults
        )

    plain = params()
    assert (plain.temperature, plain.top_p, plain.max_tokens) == (0.0, 0.8, 3)
    chosen = params(temperature=0.7, max_tokens=20)
    assert (chosen.temperature, chosen.top_p, chosen.max_tokens) == (0.7, 0.8, 20)
    with pytest.raises(SystemExit, match="no generation config"):
        generation_defaults(str(tmp_path / "nothing"), None)


_UNGUARDED_SCRIPT = """
import asyncio
from ferrox import AsyncLLM, SamplingParams

async def main():
    async with AsyncLLM(MODEL, num_kv_blocks=64, block_size=4) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        outputs = [o async for o in llm.generate([5, 6, 7], params, "a")]
        print("TOKENS", outputs[-1].outputs[0].token_ids)

asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_async_llm_runs_from_a_script_without_a_main_guard(
    tiny_models: dict[str, Path], tmp_path: Path, how: str
) -> None:
    """The engine process never imports the caller's main module again."""
    path = str(tiny_models["llama-gqa-tied"])
    script = f"MODEL = {path!r}\n" + _UNGUARDED_SCRIPT
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = LLM(path, num_kv_blocks=64, block_size=4).generate([[5, 6, 7]], greedy, False)
    if how == "file":
        (tmp_path / "script.py").write_text(script)
        run = subprocess.run(
            [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
    else:
        run = subprocess.run(
            [sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300
        )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("TOKENS") == 1  # one engine, one run of main
    assert f"TOKENS {expected[0].outputs[0].token_ids}" in run.stdout


def test_async_llm_streams_cumulative_outputs_and_aborts(tiny_models: dict[str, Path]) -> None:
    from ferrox import AsyncLLM

    path = str(tiny_models["llama-gqa-tied"])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = LLM(path, num_kv_blocks=64, block_size=4).generate([[5, 6, 7]], greedy, False)

    async def main() -> None:
        async with AsyncLLM(path, num_kv_blocks=64, block_size=4) as llm:
            outputs = [o async for o in llm.generate([5, 6, 7], greedy, "a")]
            lengths = [len(o.outputs[0].token_ids) for o in outputs]
            assert lengths == sorted(lengths) and lengths[-1] == 12  # cumulative
            assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
            assert outputs[-1].outputs[0].token_ids == expected[0].outputs[0].token_ids
            assert outputs[-1].outputs[0].text == expected[0].outputs[0].text

            # Two at once, one aborted part way: it ends with "abort", the other runs on.
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            seen: list[RequestOutput] = []

            async def follow(rid: str) -> None:
                async for out in llm.generate("a story", long, rid):
                    seen.append(out)
                    if rid == "b" and len(out.outputs[0].token_ids) >= 3:
                        await llm.abort("b")

            await asyncio.gather(follow("b"), follow("c"))
            last = {o.request_id: o for o in seen}
            assert last["b"].finished and last["b"].outputs[0].finish_reason == "abort"
            assert len(last["b"].outputs[0].token_ids) < 200
            assert last["c"].outputs[0].finish_reason == "length"
            with pytest.raises(errors.DuplicateRequestError):
                async for _ in llm.generate("x", greedy, "d"):
                    async for _ in llm.generate("x", greedy, "d"):
                        pass
            for _ in range(100):  # the engine gives back every block
                if llm.client.stats.num_used_blocks == 0:
                    break
                await asyncio.sleep(0.05)
            assert llm.client.stats.num_used_blocks == 0
        assert not llm.is_running

    asyncio.run(main())
