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
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in CHAT_PROMPTS
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": float(np.median(values)),
        "min": float(np.min(values)),
        "max": float(np.max(values)),
    }


def _llm(spec: dict[str, Any] | None, **options: Any) -> Any:
    from ferrox import LLM

    return LLM(speculative_config=spec, max_model_len=2048, **options)


def _warm_up(llms: Any, prompts: list[dict[str, Any]]) -> None:
    """One short run per engine: the cost model's first fit, the allocator's
    first touches; not timed (it is a one-off per engine)."""
    from ferrox import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for llm in llms:
        llm.generate(prompts, params, use_tqdm=False)


PROMPT_NAMES = ("rename in code", "repeat paragraph", "list to numbered")


def single(repeats: int, max_tokens: int) -> dict[str, Any]:
    """Single-stream greedy decode, one prompt at a time: per prompt, and all
    prompts together (total tokens over total time, per repeat)."""
    from ferrox import SamplingParams

    llms = {name: _llm(spec, max_num_seqs=8) for name, spec in CONFIGS.items()}
    prompts = chat_prompts(llms["off"].engine.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    _warm_up(llms.values(), [{"prompt_token_ids": prompts[0]}])
    # [config][prompt] -> (tokens, seconds) per repeat
    runs: dict[str, list[list[tuple[int, float]]]] = {n: [[] for _ in prompts] for n in CONFIGS}
    tokens: dict[str, list[list[int]]] = {name: [] for name in CONFIGS}
    acceptance: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            for name, llm in llms.items():
                start = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                elapsed = time.perf_counter() - start
                ids = out.outputs[0].token_ids
                runs[name][i].append((len(ids), elapsed))
                tokens[name].append(ids)
                if out.metrics and out.metrics.spec_acceptance_rate is not None:
                    acceptance[name].append(out.metrics.spec_acceptance_rate)
    identical = all(tokens[name] == tokens["off"] for name in CONFIGS)
    result: dict[str, Any] = {"identical_tokens": identical, "prompts": list(PROMPT_NAMES)}
    print(f"\n== single stream, greedy, {len(prompts)} copy-heavy chat prompts x {repeats}")
    print("output tok/s (median of repeats) and ratio to off (median, min-max)")
    header = " ".join(f"{p:>26}" for p in [*PROMPT_NAMES, "all three"])
    print(f"{'config':12} {header} {'accepted':>9}")

    def speeds(name: str, i: int | None) -> list[float]:
        if i is not None:
            return [n / t for n, t in runs[name][i]]
        return [  # all prompts of one repeat: total tokens over total time
            sum(runs[name][p][r][0] for p in range(len(prompts)))
            / sum(runs[name][p][r][1] for p in range(len(prompts)))
            for r in range(repeats)
        ]

    for name in CONFIGS:
        acc = float(np.mean(acceptance[name])) if acceptance[name] else None
        row: dict[str, Any] = {"acceptance": acc}
        cells = []
        for i, label in enumerate([*PROMPT_NAMES, "all"]):
            index = i if i < len(prompts) else None
            mine, off = speeds(name, index), speeds("off", index)
            ratio = _spread([a / b for a, b in zip(mine, off, strict=True)])
            row[label] = {"tok_s": _spread(mine), "ratio": ratio}
            cells.append(
                f"{np.median(mine):5.1f} {ratio['median']:4.2f}x "
                f"({ratio['min']:.2f}-{ratio['max']:.2f})"
            )
        result[name] = row
        shown = "" if acc is None else f"{acc:.0%}"
        print(f"{name:12} " + " ".join(f"{c:>26}" for c in cells) + f" {shown:>9}")
    print(f"identical tokens with and without speculation: {identical}")
    return result


def crossover(streams: list[int], max_tokens: int, repeats: int) -> dict[str, Any]:
    """Output tok/s of N concurrent copy-heavy streams, per config."""
    from ferrox import SamplingParams

    llms = {name: _llm(spec, max_num_seqs=max(streams)) for name, spec in CONFIGS.items()}
    prompts = chat_prompts(llms["off"].engine.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _warm_up(llms.values(), [{"prompt_token_ids": p} for p in prompts])
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


def draft(max_tokens: int, streams: list[int], repeats: int) -> dict[str, Any]:
    """The draft-model path on random weights, the bundled model's shape as
    the target: a draft with the target's weights (every greedy draft is
    accepted, but each costs a full forward pass) and a cheap 2-layer random
    draft (almost nothing accepted); adaptive against fixed draft lengths."""
    from transformers import LlamaConfig

    from ferrox import SamplingParams
    from ferrox.model_files import default_model_path

    target = str(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "draft-2-layers"
        LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
            num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
            max_position_embeddings=8192, architectures=["LlamaForCausalLM"],
        ).save_pretrained(small)  # fmt: skip
        k = {"num_speculative_tokens": 4}
        same = {"method": "draft_model", "model": target, "load_format": "dummy", **k}
        cheap = {"method": "draft_model", "model": str(small), "load_format": "dummy", **k}
        configs: dict[str, dict[str, Any] | None] = {
            "off": None,
            "same-weights": same,
            "same-weights-fixed": {**same, "adaptive": False},
            "2-layer": cheap,
            "2-layer-fixed": {**cheap, "adaptive": False},
        }
        # Random weights come from the engine's seed: the draft loaded from
        # the target's file gets the target's weights.
        llms = {
            name: _llm(spec, load_format="dummy", max_num_seqs=max(streams))
            for name, spec in configs.items()
        }
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        _warm_up(llms.values(), [{"prompt_token_ids": list(range(50, 114))}] * 2)
        speeds: dict[str, dict[int, list[float]]] = {n: {s: [] for s in streams} for n in configs}
        for _ in range(repeats):
            for n in streams:
                prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(n)]
                for name, llm in llms.items():
                    start = time.perf_counter()
                    out = llm.generate(prompts, params, use_tqdm=False)
                    total = sum(len(o.outputs[0].token_ids) for o in out)
                    speeds[name][n].append(total / (time.perf_counter() - start))
    result: dict[str, Any] = {}
    print(f"\n== draft model, random weights ({max_tokens} tokens per stream): output tok/s")
    print(f"{'config':20} {'accepted':>9} " + " ".join(f"{f'{n} streams':>20}" for n in streams))
    for name, llm in llms.items():
        s = llm.engine.stats()
        drafted = s.spec_num_draft_tokens
        acc = s.spec_num_accepted_tokens / drafted if drafted else None
        row: dict[str, Any] = {"acceptance": acc, "draft_tokens": drafted}
        cells = []
        for n in streams:
            ratios = [a / b for a, b in zip(speeds[name][n], speeds["off"][n], strict=True)]
            row[str(n)] = {"tok_s": _spread(speeds[name][n]), "ratio": _spread(ratios)}
            cells.append(f"{np.median(speeds[name][n]):7.1f} ({np.median(ratios):4.2f}x)")
        result[name] = row
        shown = "" if acc is None else f"{acc:.0%}"
        print(f"{name:20} {shown:>9} " + " ".join(f"{c:>20}" for c in cells))
    return result


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
        results["crossover"] = crossover(args.streams, 96, args.repeats)
    if "draft" in args.parts:
        results["draft"] = draft(96, [1, 8], args.repeats)
    if "serve" in args.parts:
        results["serve"] = serve(args.serve_concurrency)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
