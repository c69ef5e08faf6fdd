"""Speculative decoding, on against off, in one run.

    python benches/speculative.py                      # every part
    python benches/speculative.py --parts single crossover
    python benches/speculative.py --parts serve --serve-concurrency 1 4 16

Parts:
  single     single-stream greedy decode of copy-heavy chat prompts (edit this
             code, repeat this text, fix this list) with the bundled model:
             tok/s without speculation, with n-gram speculation (adaptive and
             fixed-length), the ratio, and whether the tokens are identical.
  crossover  the same prompts at 1..32 concurrent streams: where fixed-length
             speculation starts to cost more than it saves, and what the
             adaptive draft length does there.
  serve      `ferrox bench serve`'s chat and agent archetypes at several
             concurrencies against `ferrox serve` with and without
             `--speculative-config` (generated text, so little to copy).
  draft      the draft-model path on random weights: the bundled model's shape
             as the target, drafts by the same weights (every draft accepted:
             the upper bound) and by a different random model (almost none
             accepted: what the cost model must stop paying for).

Figures repeat `--repeats` times, interleaved; ratios are medians with their
spread (min-max). `--json FILE` writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ferrox  # noqa: F401 (before torch: ferrox tunes OpenMP for its CPU kernels)

NGRAM = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2}
CONFIGS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "ngram": NGRAM,
    "ngram-fixed": {**NGRAM, "adaptive": False},
}

CODE = """def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def oldest_user(users):
    best = None
    for user in users:
        if best is None or user["age"] > best["age"]:
            best = user
    return best
"""
TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the library by ten percent, to "
    "keep the sports budget unchanged, and to postpone the decision on the new community "
    "garden until the spring meeting, when more information about the costs will be available."
)
ITEMS = "milk, eggs, bread, butter, apples, rice, coffee, tea, sugar, flour, onions, garlic"
CHAT_PROMPTS = [
    f"Rename the function load_users to read_users everywhere in this code and show the "
    f"whole result:\n\n{CODE}",
    f"Repeat the following paragraph exactly, word for word:\n\n{TEXT}",
    f"Here is a shopping list: {ITEMS}. Write it again as a numbered list, one item per line.",
]


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        for p in CHAT_PROMPTS
    ]


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": float(np.median(values)),
        "min": float(np.min(values)),
        "max": float(np.max(values)),
    }


def _llm(spec: dict[str, Any] | None, **options: Any) -> Any:
    from ferrox import LLM

    return LLM(speculative_config=spec, max_model_len=2048, **options)


def single(repeats: int, max_tokens: int) -> dict[str, Any]:
    """Single-stream greedy decode, one prompt at a time."""
    from ferrox import SamplingParams

    llms = {name: _llm(spec, max_num_seqs=8) for name, spec in CONFIGS.items()}
    prompts = chat_prompts(llms["off"].engine.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    speeds: dict[str, list[float]] = {name: [] for name in CONFIGS}
    tokens: dict[str, list[list[int]]] = {name: [] for name in CONFIGS}
    acceptance: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(repeats):
        for prompt in prompts:
            for name, llm in llms.items():
                start = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                elapsed = time.perf_counter() - start
                ids = out.outputs[0].token_ids
                speeds[name].append(len(ids) / elapsed)
                tokens[name].append(ids)
                if out.metrics and out.metrics.spec_acceptance_rate is not None:
                    acceptance[name].append(out.metrics.spec_acceptance_rate)
    identical = all(tokens[name] == tokens["off"] for name in CONFIGS)
    result: dict[str, Any] = {"identical_tokens": identical, "prompts": len(prompts)}
    print(f"\n== single stream, greedy, {len(prompts)} copy-heavy chat prompts x {repeats}")
    print(f"{'config':12} {'tok/s (median, min-max)':>26} {'ratio to off':>22} {'accepted':>9}")
    for name in CONFIGS:
        ratios = [s / o for s, o in zip(speeds[name], speeds["off"], strict=True)]
        sp, r = _spread(speeds[name]), _spread(ratios)
        acc = float(np.mean(acceptance[name])) if acceptance[name] else None
        result[name] = {"tok_s": sp, "ratio": r, "acceptance": acc}
        print(
            f"{name:12} {sp['median']:8.1f} ({sp['min']:6.1f}-{sp['max']:6.1f})      "
            f"{r['median']:5.2f}x ({r['min']:.2f}-{r['max']:.2f})   "
            f"{'' if acc is None else f'{acc:.0%}':>8}"
        )
    print(f"identical tokens with and without speculation: {identical}")
    return result


def crossover(streams: list[int], max_tokens: int, repeats: int) -> dict[str, Any]:
    """Output tok/s of N concurrent copy-heavy streams, per config."""
    from ferrox import SamplingParams

    llms = {name: _llm(spec, max_num_seqs=max(streams)) for name, spec in CONFIGS.items()}
    prompts = chat_prompts(llms["off"].engine.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    result: dict[str, Any] = {}
    print(f"\n== concurrent streams (copy-heavy prompts, {max_tokens} tokens each), output tok/s")
    print(f"{'streams':>7} " + " ".join(f"{n:>22}" for n in CONFIGS))
    for n in streams:
        batch = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(n)]
        speeds: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for _ in range(repeats):
            for name, llm in llms.items():
                start = time.perf_counter()
                out = llm.generate(batch, params, use_tqdm=False)
                total = sum(len(o.outputs[0].token_ids) for o in out)
                speeds[name].append(total / (time.perf_counter() - start))
        row = {}
        cells = []
        for name in CONFIGS:
            ratios = [s / o for s, o in zip(speeds[name], speeds["off"], strict=True)]
            row[name] = {"tok_s": _spread(speeds[name]), "ratio": _spread(ratios)}
            med = row[name]["ratio"]["median"]
            cells.append(f"{np.median(speeds[name]):8.1f} ({med:4.2f}x)")
        result[str(n)] = row
        print(f"{n:>7} " + " ".join(f"{c:>22}" for c in cells))
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(spec: dict[str, Any] | None, max_num_seqs: int) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "ferrox", "serve", "--port", str(port), "--log-level", "warning"]
    cmd += ["--max-num-seqs", str(max_num_seqs), "--max-model-len", "4096"]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not start")


ARCHETYPES = {
    "chat": [
        "--dataset-name", "chat", "--chat-system-prompt-len", "700", "--chat-num-turns", "2",
        "--chat-user-len", "60", "--chat-output-len-min", "48", "--chat-output-len-max", "96",
    ],
    "agent": [
        "--dataset-name", "agent", "--agent-context-len", "1500", "--agent-step-len", "120",
        "--agent-num-steps", "3", "--agent-output-len", "48",
    ],
}  # fmt: skip


def serve(concurrencies: list[int]) -> dict[str, Any]:
    """`ferrox bench serve` archetypes against servers with speculation on / off."""
    result: dict[str, Any] = {}
    configs = {"off": None, "ngram": NGRAM}
    print("\n== ferrox bench serve (output tok/s, median TPOT ms), speculation off vs ngram")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in configs.items():
            proc, base = _serve(spec, max(concurrencies))
            try:
                for archetype, flags in ARCHETYPES.items():
                    for c in concurrencies:
                        out = Path(tmp) / f"{name}-{archetype}-{c}.json"
                        cmd = [sys.executable, "-m", "ferrox", "bench", "serve", "--base-url", base]
                        cmd += [*flags, "--max-concurrency", str(c), "--request-rate", "inf"]
                        cmd += ["--num-prompts", str(max(6, 2 * c)), "--seed", "1"]
                        cmd += ["--temperature", "0", "--disable-tqdm", "--save-result"]
                        cmd += ["--result-dir", tmp, "--result-filename", out.name]
                        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                        r = json.loads(out.read_text())
                        key = f"{archetype}@{c}"
                        result.setdefault(key, {})[name] = {
                            "output_throughput": r["output_throughput"],
                            "median_tpot_ms": r.get("median_tpot_ms"),
                            "completed": r["completed"],
                        }
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print(
        f"{'run':>10} {'off tok/s':>10} {'ngram tok/s':>12} {'ratio':>6} {'TPOT off/ngram ms':>20}"
    )
    for key, row in result.items():
        off, on = row["off"], row["ngram"]
        row["ratio"] = on["output_throughput"] / off["output_throughput"]
        tpot = f"{off['median_tpot_ms'] or 0:.1f}/{on['median_tpot_ms'] or 0:.1f}"
        print(
            f"{key:>10} {off['output_throughput']:10.1f} {on['output_throughput']:12.1f} "
            f"{row['ratio']:5.2f}x {tpot:>20}"
        )
    return result


def draft(max_tokens: int, streams: list[int]) -> dict[str, Any]:
    """The draft-model path on random weights: the bundled model's shape as
    the target; drafts by the same weights, and by another random model."""
    from ferrox import SamplingParams
    from ferrox.loader import default_model_path

    target = str(default_model_path())
    same = {"method": "draft_model", "model": target, "load_format": "dummy"}
    configs: dict[str, dict[str, Any] | None] = {
        "off": None,
        "same-weights": {**same, "num_speculative_tokens": 4},
        "other-weights": {**same, "num_speculative_tokens": 4},
        "other-fixed": {**same, "num_speculative_tokens": 4, "adaptive": False},
    }
    result: dict[str, Any] = {}
    print(f"\n== draft model on random weights ({max_tokens} tokens per stream), output tok/s")
    for name, spec in configs.items():
        # Random weights come from the engine's seed: a draft loaded with the
        # target's seed has the target's weights, until _reseed_draft.
        llm = _llm(spec, load_format="dummy", max_num_seqs=max(streams))
        if name.startswith("other"):
            _reseed_draft(llm)
        row = {}
        for n in streams:
            prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(n)]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            tok_s = sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - start)
            s = llm.engine.stats()
            drafted = s.spec_num_draft_tokens
            acc = s.spec_num_accepted_tokens / drafted if drafted else None
            row[str(n)] = {"tok_s": tok_s, "acceptance": acc}
        result[name] = row
        del llm
    print(f"{'config':14} " + " ".join(f"{n:>20}" for n in streams))
    for name, row in result.items():
        cells = []
        for n in streams:
            r = row[str(n)]
            ratio = r["tok_s"] / result["off"][str(n)]["tok_s"]
            acc = "" if r["acceptance"] is None else f" {r['acceptance']:.0%}"
            cells.append(f"{r['tok_s']:6.1f} {ratio:4.2f}x{acc}")
        print(f"{name:14} " + " ".join(f"{c:>20}" for c in cells))
    return result


def _reseed_draft(llm: Any) -> None:
    """Gives the draft model other random weights than the target's."""
    import torch

    draft = llm.engine.runner.draft
    generator = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * p.std())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--parts", nargs="+", default=["single", "crossover", "serve", "draft"],
        choices=["single", "crossover", "serve", "draft"],
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--serve-concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "config": NGRAM,
    }
    if "single" in args.parts:
        results["single"] = single(args.repeats, args.max_tokens)
    if "crossover" in args.parts:
        results["crossover"] = crossover(args.streams, 96, 1)
    if "draft" in args.parts:
        results["draft"] = draft(64, [1, 8])
    if "serve" in args.parts:
        results["serve"] = serve(args.serve_concurrency)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
