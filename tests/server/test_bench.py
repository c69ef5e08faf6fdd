"""`ferrox bench serve` against a live tiny-model server, the dataset
generators, and `ferrox bench latency`."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrox import cli
from ferrox.bench import datasets, serve
from ferrox.common import errors
from tests.live_server import API_KEY, Server


@pytest.fixture(scope="module")
def bench_server(model_dir: Path) -> Iterator[Server]:
    s = Server(model_dir)
    yield s
    s.stop()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(list(argv))
    serve.apply_presets(args)
    return args


def test_datasets_have_the_requested_shapes(model_dir: Path) -> None:
    tok = serve.load_tokenizer(str(model_dir))
    args = parse("--dataset-name", "random", "--num-prompts", "20", "--random-input-len", "40",
                 "--random-output-len", "10", "--random-range-ratio", "0.5")  # fmt: skip
    sessions = datasets.build_sessions(args, tok)
    assert len(sessions) == 20 and all(len(s.turns) == 1 for s in sessions)
    for s in sessions:
        assert 5 <= s.turns[0].output_len <= 15
        assert len(tok.encode(s.turns[0].user, add_special_tokens=False)) <= 60
    chat = datasets.build_sessions(parse("--dataset-name", "chat", "--num-prompts", "7"), tok)
    assert [len(s.turns) for s in chat] == [3, 3, 1]
    assert all(s.turns[0].system == chat[0].turns[0].system for s in chat)
    assert all(50 <= t.output_len <= 300 for s in chat for t in s.turns)
    agent = datasets.build_sessions(
        parse("--dataset-name", "agent", "--num-prompts", "10", "--agent-context-len", "100"), tok
    )
    assert [len(s.turns) for s in agent] == [8, 2]
    batch = datasets.build_sessions(parse("--dataset-name", "batch", "--num-prompts", "3"), tok)
    assert all(10 <= s.turns[0].output_len <= 50 for s in batch)
    assert parse("--dataset-name", "chat").endpoint == "chat"
    assert parse("--dataset-name", "agent").max_concurrency == 4
    fan = parse("--dataset-name", "fan-out", "--num-prompts", "4", "--fan-out-prefix-len", "50")
    assert fan.request_rate == [float("inf")]  # all at once
    prompts = [s.turns[0].user for s in datasets.build_sessions(fan, tok)]
    assert len(prompts) == 4 and all(len(s.turns) == 1 for s in datasets.build_sessions(fan, tok))
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    shared = next((i for i in range(min(map(len, ids))) if len({x[i] for x in ids}) > 1), 0)
    assert shared >= 45  # one prefix, then tasks of their own
    assert len(set(prompts)) == 4


def test_bench_serve_reports_and_plots(
    bench_server: Server, tmp_path: Path, model_dir: Path
) -> None:
    argv = [
        "bench", "serve", "--base-url", bench_server.url, "--api-key", API_KEY,
        "--tokenizer", str(model_dir), "--dataset-name", "shared-prefix", "--num-prompts", "8",
        "--shared-prefix-num-groups", "2", "--shared-prefix-len", "32",
        "--shared-prefix-question-len", "8", "--shared-prefix-output-len", "6",
        "--request-rate", "20", "inf", "--ignore-eos", "--disable-tqdm",
        "--result-dir", str(tmp_path), "--label", "t",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    reports = json.loads((tmp_path / "t-shared-prefix.json").read_text())
    assert [r["request_rate"] for r in reports] == [20.0, float("inf")]
    for r in reports:
        assert r["completed"] == 8 and r["failed"] == 0
        assert r["total_output_tokens"] == 8 * 6
        assert r["median_ttft_ms"] > 0 and r["p99_e2el_ms"] >= r["p99_ttft_ms"]
        assert 0 < r["prefix_cache_hit_rate"] <= 1  # the groups share their system prompt
    assert (tmp_path / "t-shared-prefix-latency-cdf.png").stat().st_size > 0
    assert (tmp_path / "t-shared-prefix-sweep.png").stat().st_size > 0


def test_bench_serve_chat_turns_resend_history(bench_server: Server, model_dir: Path) -> None:
    args = parse(
        "--base-url", bench_server.url, "--api-key", API_KEY, "--tokenizer", str(model_dir),
        "--dataset-name", "chat", "--num-prompts", "4", "--chat-num-turns", "2",
        "--chat-system-prompt-len", "64", "--chat-user-len", "4",
        "--chat-output-len-min", "3", "--chat-output-len-max", "5", "--request-rate", "inf",
        "--disable-tqdm",
    )  # fmt: skip
    report = asyncio.run(serve.run_once(args, serve.load_tokenizer(args.tokenizer), float("inf")))
    assert report["completed"] == 4
    # Second turns carry the system prompt, the first turn and its answer.
    assert min(report["input_lens"]) > 64
    assert max(report["input_lens"]) > min(report["input_lens"])


def test_bench_serve_counts_failures(tmp_path: Path, model_dir: Path) -> None:
    args = parse("--base-url", "http://127.0.0.1:9", "--model", "x", "--tokenizer", str(model_dir),
                 "--num-prompts", "2", "--random-input-len", "4", "--disable-tqdm")  # fmt: skip
    report = asyncio.run(serve.run_once(args, serve.load_tokenizer(args.tokenizer), float("inf")))
    assert report["failed"] == 2 and report["completed"] == 0 and all(report["errors"])


def test_bench_latency_writes_json(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    argv = [
        "bench", "latency", "--model", str(tiny_models["qwen2"]), "--batch-size", "3",
        "--input-len", "20", "--output-len", "4", "--runs", "1", "--json", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["batch_size"] == 3 and result["prefill_s"] > 0 and result["decode_step_ms"] > 0


VLLM_KEYS = {
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "input_lens",
    "output_lens", "ttfts", "itls", "errors",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
      for m in ("ttft", "tpot", "itl", "e2el")),
}  # fmt: skip


def test_bench_serve_saves_vllms_result_keys(
    bench_server: Server, model_dir: Path, tmp_path: Path
) -> None:
    argv = [
        "bench", "serve", "--base-url", bench_server.url, "--api-key", API_KEY,
        "--tokenizer", str(model_dir), "--num-prompts", "6", "--random-input-len", "12",
        "--random-output-len", "5", "--disable-tqdm", "--save-result", "--result-dir",
        str(tmp_path), "--result-filename", "run.json", "--metric-percentiles", "50,90",
        "--percentile-metrics", "ttft,e2el", "--goodput", "ttft:60000", "e2el:1",
        "--metadata", "gpu=none", "note=x",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "run.json").read_text())
    assert set(result) >= VLLM_KEYS
    assert {"p50_ttft_ms", "p90_ttft_ms", "p90_e2el_ms"} <= set(result)
    assert result["completed"] == 6 and result["output_lens"] == [5] * 6  # ignore_eos: random
    assert result["output_throughput"] == pytest.approx(30 / result["duration"])
    assert result["request_goodput"] == 0.0  # nobody finishes within 1 ms
    assert result["gpu"] == "none" and result["note"] == "x"


def test_sharegpt_dataset(model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    conversations = [
        {"conversations": [{"from": "human", "value": f"question number {i} " * 3},
                           {"from": "gpt", "value": "an answer of some length " * (i + 1)}]}
        for i in range(10)
    ] + [{"conversations": [{"from": "human", "value": "hi"}]}]  # fmt: skip
    path.write_text(json.dumps(conversations))
    tok = serve.load_tokenizer(str(model_dir))
    args = parse("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "4")
    sessions = datasets.build_sessions(args, tok)
    assert len(sessions) == 4
    for session in sessions:
        (turn,) = session.turns
        assert turn.user.startswith("question number")
        i = int(turn.user.split()[2])
        assert turn.output_len == len(tok.encode("an answer of some length " * (i + 1),
                                                 add_special_tokens=False))  # fmt: skip
    missing = parse("--dataset-name", "sharegpt", "--num-prompts", "4")
    with pytest.raises(errors.InvalidArgumentError, match="--dataset-path"):
        datasets.build_sessions(missing, tok)


def test_bench_serve_json_schema(bench_server: Server, model_dir: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["a", "b"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    common = ["--base-url", bench_server.url, "--api-key", API_KEY, "--tokenizer",
              str(model_dir), "--num-prompts", "3", "--random-input-len", "8",
              "--random-output-len", "120", "--disable-tqdm",
              "--json-schema", json.dumps(schema)]  # fmt: skip
    for endpoint in ("chat", "completions"):
        args = parse(*common, "--endpoint", endpoint)
        report = asyncio.run(serve.run_once(args, serve.load_tokenizer(args.tokenizer), 1e9))
        assert report["completed"] == 3
        assert report["json_valid_fraction"] == 1.0  # the grammar ends it (ignore_eos)
    with pytest.raises(SystemExit):
        parse("--json-schema", "[1, 2]")
