"""What the CPU weight formats cost in quality, on the bundled model.

    python benches/quant_quality.py [--json PATH]

For each way of holding the linear weights (`quantization=`):
  none  the GGUF file dequantized to float32 (matches transformers)
  gguf  the file's own blocks (Q4_1, Q8_0 embedding), the default
  gguf, float16 KV  the same with `kv_cache_dtype="float16"`
  q8_0  dequantized, then requantized to 8-bit blocks
  q4_1  dequantized, then requantized to 4-bit blocks
it prints the perplexity of a fixed text (prompt logprobs, in steps of at
most 32 tokens, so that the block kernels compute them), and, on chat
prompts decoded greedily, how many tokens agree with `none` before the
first difference (greedy decoding follows the argmax, so one near tie sends
the rest of the answer elsewhere: this counts, it does not judge).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import ferrox  # noqa: F401  (before torch: see docs/performance.md)
from ferrox import LLM, SamplingParams
from ferrox.layers.quant_linear import DEQUANTIZE_ABOVE_ROWS
from ferrox.model_files import default_model_path

# (label, quantization, kv_cache_dtype)
MODES = [
    ("none", "none", "auto"),
    ("gguf", "gguf", "auto"),
    ("gguf, float16 KV", "gguf", "float16"),
    ("q8_0", "q8_0", "auto"),
    ("q4_1", "q4_1", "auto"),
]
TEXT = (
    "The river town woke slowly. Before the sun cleared the hills, the baker had lit his "
    "ovens and the ferryman was already coiling wet rope on the landing. Children ran along "
    "the embankment with bread in their hands, and the smell of smoke and yeast drifted over "
    "the water. By the time the first barge came into view, the market square was full: "
    "farmers with baskets of apples and onions, a tinker mending pots, two old women arguing "
    "about the price of eggs. The mayor walked through the crowd, nodding to everyone, and "
    "stopped at the fountain to read a notice that had been pinned there overnight. It said "
    "that the bridge upstream had been damaged in the storm and that all goods would have to "
    "cross by ferry until the repairs were finished. The ferryman, when he heard the news, "
    "laughed and said that he would need a bigger boat. In the afternoon a group of engineers "
    "arrived from the city. They measured the broken arches, drew careful plans in their "
    "notebooks and estimated that the work would take six weeks if the weather held. The "
    "town council met that evening in the school hall to decide how to pay for it. Some "
    "wanted to raise the toll on the road, others to ask the province for help, and a few "
    "argued that the old bridge should be replaced by a new one made of steel."
)
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue?",
    "How do I reverse a list in Python?",
    "What are the main causes of inflation?",
    "Suggest a name for a friendly robot.",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "List four planets of the solar system.",
    "How many minutes are there in a day? Show the calculation.",
]
ANSWER_TOKENS = 48


def measure(label: str, mode: str, kv_cache_dtype: str, model: str) -> dict:
    start = time.perf_counter()
    # At most 32 tokens a step (DEQUANTIZE_ABOVE_ROWS is 32 or more): every
    # step runs the block kernels (larger batches may dequantize to float32
    # and would not measure them).
    llm = LLM(
        model,
        quantization=mode,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=len(QUESTIONS),
        enable_prefix_caching=False,
        max_num_batched_tokens=min(DEQUANTIZE_ABOVE_ROWS, 32),
    )
    load_s = time.perf_counter() - start
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(TEXT)
    scored = llm.generate(
        [ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False
    )[0]
    nll = [-next(iter(lp.values())).logprob for lp in scored.prompt_logprobs[1:]]
    chats = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    answers = [o.outputs[0].token_ids for o in llm.generate(chats, params, use_tqdm=False)]
    return {
        "mode": label,
        "load_s": round(load_s, 2),
        "text_tokens": len(ids),
        "perplexity": math.exp(statistics.fmean(nll)),
        "answers": answers,
        "first_answer": tokenizer.decode(answers[0]),
    }


def agreement(answers: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens equal the reference's."""
    counts = []
    for ours, theirs in zip(answers, reference, strict=True):
        same = 0
        while same < min(len(ours), len(theirs)) and ours[same] == theirs[same]:
            same += 1
        counts.append(same)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled model)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    results = [measure(*mode, model) for mode in MODES]
    reference = results[0]["answers"]
    print(f"{model}: perplexity of a {results[0]['text_tokens']}-token text; greedy chat answers")
    print(f"({len(QUESTIONS)} prompts, {ANSWER_TOKENS} tokens) against `none`\n")
    print("| quantization | perplexity | vs none | tokens equal before the first difference "
          "(median, min-max) | answers identical |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        counts = agreement(r["answers"], reference)
        r["agreement"] = counts
        identical = sum(c == ANSWER_TOKENS for c in counts)
        print(
            f"| {r['mode']} | {r['perplexity']:.3f} | "
            f"{r['perplexity'] / results[0]['perplexity']:.4f}x | "
            f"{statistics.median(counts):.0f} ({min(counts)}-{max(counts)}) | "
            f"{identical}/{len(counts)} |"
        )
    print()
    for r in results:
        print(f"{r['mode']:>16}: {r['first_answer']!r}")
    if args.json:
        for r in results:
            del r["answers"]
        args.json.write_text(json.dumps({"model": Path(model).name, "results": results}, indent=2))


if __name__ == "__main__":
    main()
