"""What structured outputs cost: grammar compile time, and decode speed per
stream with and without a JSON-schema constraint, on the bundled model.

    python benches/structured_outputs.py                  # 1, 8, 32 streams, 3 repeats
    python benches/structured_outputs.py --streams 8 --repeats 1 --tokens 24

Prints, in one run:
- grammar engines: llguidance's compile time and cost per token (mask,
  then consume) on the bundled vocabulary, beside xgrammar's when that
  optional peer is installed;
- compile: the first request's grammar (the vocabulary's index is built
  too), a new schema once the index exists, and a schema seen before (the
  cache);
- per step of the constrained runs: the time to compute the masks (on the
  worker thread, while the model runs), the sampler's wait for them, applying
  them to the logits, and the matchers consuming the sampled tokens, against
  the whole step;
- decode: output tokens/s per stream, greedy with EOS ignored, unconstrained
  and constrained (a schema that cannot end within the token budget, so both
  runs decode the same number of tokens), alternating, repeated; the ratio
  constrained / unconstrained with its spread (goal: >= 0.85).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import time
from typing import Any

import ferrox  # noqa: F401 (before torch work: ferrox tunes OpenMP for its CPU kernels)
from ferrox import LLM, SamplingParams
from ferrox.common.structured_outputs import StructuredOutputsParams
from ferrox.engine.structured_output.grammar import GrammarEngine
from ferrox.runner.token_bitmask import GrammarStats

# An extraction record, as a data-processing job would ask for: a list of
# them, long enough never to end inside the token budget.
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["engineer", "manager", "designer", "other"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "role", "skills"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 50}
OTHER_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}},
    "required": ["title"],
}
TOPICS = ["engineers", "a bakery", "a football team", "a hospital", "a school", "a startup"]


def compile_times(llm: LLM) -> dict[str, float]:
    engine = llm.engine
    grammar = GrammarEngine(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    times = {}
    for name, schema in (("first", SCHEMA), ("new_schema", OTHER_SCHEMA), ("cached", SCHEMA)):
        start = time.perf_counter()
        grammar.matcher(StructuredOutputsParams(json=schema))
        times[name] = (time.perf_counter() - start) * 1e3
    return times


# Records as the model might write them (the list left open: SCHEMA wants
# 50), for the engines' cost per token.
RECORDS = [
    {"name": "Ada", "age": 36, "email": "ada@example.org", "role": "engineer", "skills": ["c"]},
    {"name": "Grace Hopper", "age": 85, "email": "grace@navy.mil", "role": "other", "skills": []},
]
SAMPLE = json.dumps(RECORDS)[:-1]


def compare_engines(llm: LLM) -> dict[str, dict[str, float]]:
    """Compile time of SCHEMA and the cost of one token (mask, then
    consume) along SAMPLE: llguidance, and xgrammar when it is installed
    (an optional peer: `pip install xgrammar`; ferrox does not use it)."""
    tokenizer, vocab = llm.engine.tokenizer, llm.engine.vocab_size
    ids = tokenizer.encode(SAMPLE, add_special_tokens=False)
    grammar = GrammarEngine(tokenizer, vocab, llm.engine.eos_token_ids)
    grammar.matcher(StructuredOutputsParams(json=OTHER_SCHEMA))  # the vocabulary index
    import llguidance.torch as lgt

    start = time.perf_counter()
    matcher = grammar.matcher(StructuredOutputsParams(json=SCHEMA)).deep_copy()
    compiled = time.perf_counter() - start
    bitmask = lgt.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    for token in ids:
        lgt.fill_next_token_bitmask(matcher, bitmask, 0)
        assert matcher.consume_token(token), matcher.get_error()
    per_token = (time.perf_counter() - start) / len(ids)
    out = {"llguidance": {"compile_ms": compiled * 1e3, "token_us": per_token * 1e6}}
    if importlib.util.find_spec("xgrammar") is None:
        return out
    xgr = importlib.import_module("xgrammar")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    start = time.perf_counter()
    xmatcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    compiled = time.perf_counter() - start
    xbitmask = xgr.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    for token in ids:
        xmatcher.fill_next_token_bitmask(xbitmask, 0)
        assert xmatcher.accept_token(token)
    per_token = (time.perf_counter() - start) / len(ids)
    out["xgrammar"] = {"compile_ms": compiled * 1e3, "token_us": per_token * 1e6}
    return out


def decode_speed(llm: LLM, streams: int, tokens: int, constrained: bool) -> tuple[float, float]:
    """(output tokens/s per stream, seconds); the engine's grammar counters
    cover the run."""
    llm.engine.grammar.stats = GrammarStats()
    structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, structured_outputs=structured
    )
    prompts = [
        f"List the people of {TOPICS[i % len(TOPICS)]} (#{i}) as JSON records."
        for i in range(streams)
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == streams * tokens, "a run ended early: the comparison would be unfair"
    if constrained:
        text = outputs[0].outputs[0].text
        assert text.startswith("["), text
    return produced / elapsed / streams, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per stream")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()

    llm = LLM(max_num_seqs=max(args.streams), max_model_len=1024)
    # Warm-up, also of the engine's grammar engine (its vocabulary index).
    warm = StructuredOutputsParams(json=OTHER_SCHEMA)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.generate(["warm up"], SamplingParams(max_tokens=4, structured_outputs=warm), use_tqdm=False)
    results: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (bundled)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "compile_ms": compile_times(llm),
        "streams": {},
    }
    results["engines"] = compare_engines(llm)
    for name, figures in results["engines"].items():
        print(
            f"{name}: compiles the schema in {figures['compile_ms']:.1f} ms, "
            f"{figures['token_us']:.0f} us per token (mask + consume)"
        )
    if "xgrammar" not in results["engines"]:
        print("(pip install xgrammar to compare it too; ferrox does not need it)")
    c = results["compile_ms"]
    print(
        f"compile: first request {c['first']:.1f} ms (with the vocabulary index), "
        f"a new schema {c['new_schema']:.1f} ms, a cached one {c['cached']:.2f} ms"
    )
    print(
        f"{'streams':>7} {'step ms':>8} {'masks ms':>9} {'wait ms':>8} {'apply ms':>9} "
        f"{'advance ms':>11} {'free tok/s/stream':>18} {'json tok/s/stream':>18} "
        f"{'ratio (min-max)':>19}"
    )
    for streams in args.streams:
        free, constrained, ratios = [], [], []
        per_step: dict[str, list[float]] = {}
        for repeat in range(args.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            speeds = {}
            for flag in order:
                speeds[flag], elapsed = decode_speed(llm, streams, args.tokens, flag)
                if flag:
                    stats = llm.engine.grammar.stats
                    for name, value in (
                        ("step", elapsed * 1e3),
                        ("masks", stats.fill_seconds * 1e3),
                        ("wait", stats.wait_seconds * 1e3),
                        ("apply", stats.apply_seconds * 1e3),
                        ("advance", stats.advance_seconds * 1e3),
                    ):
                        per_step.setdefault(name, []).append(value / max(stats.steps, 1))
            free.append(speeds[False])
            constrained.append(speeds[True])
            ratios.append(speeds[True] / speeds[False])
        ms = {name: statistics.median(values) for name, values in per_step.items()}
        row = {
            "per_step_ms": ms,
            "free_tok_s_per_stream": free,
            "json_tok_s_per_stream": constrained,
            "ratios": ratios,
            "ratio_median": statistics.median(ratios),
        }
        results["streams"][str(streams)] = row
        print(
            f"{streams:>7} {ms['step']:>8.1f} {ms['masks']:>9.2f} {ms['wait']:>8.2f} "
            f"{ms['apply']:>9.2f} {ms['advance']:>11.2f} {statistics.median(free):>18.1f} "
            f"{statistics.median(constrained):>18.1f} {statistics.median(ratios):>8.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
