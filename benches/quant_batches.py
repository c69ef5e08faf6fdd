"""The bundled quantized model where batches are large, the current code
against a git revision's (`--baseline REF`), under each instruction-set cap
(`FERROX_CPU_ISA`: the CPU's own, and `avx2` to run as a CPU without
AVX-512 would), every version and cap in its own process, interleaved:

  offline   64 requests of 64-256 random prompt tokens, 128 greedy tokens
            each (EOS ignored), one `LLM.generate`: output tok/s, and the
            requests the scheduler preempted for want of KV blocks
  single    one 256-token prompt (`--prompt-len`), 128 greedy tokens: tok/s
            over the whole request, and of its decode alone (first to last
            token, from the request's metrics)
  prefill   32 prompts of 256 random tokens (`--prefill 32x256`; 4x2048: four
            long prompts), one output token each, in one `LLM.generate`
            (one step of 8,192 prompt tokens), the prefix cache emptied
            before each of three runs: prompt tok/s, the best
  shared    16 requests with a common 700-token system prompt (already in
            the prefix cache) and 60 tokens of their own, 128 greedy tokens
            each, one `LLM.generate`: output tok/s (the chat archetype's many
            streams over long contexts, where decode attention weighs most)

Also reports whether the first offline request's tokens, run alone, equal
its tokens in the batch (by default they need not: a request's logprobs
move a little with its batch, which can flip a near tie; with
`batch_invariant=True` they are the same bits: docs/performance.md, "Batch
invariance").

    python benches/quant_batches.py [--baseline REF] [--isa native,avx2] [--repeats 3] [--json FILE]
    python benches/quant_batches.py --model FILE --workloads single  # another GGUF, one stream
    python benches/quant_batches.py --model FILE --quantization gguf  # and the blocks as stored
    python benches/quant_batches.py --block-size 32 --workloads shared  # and 32-token KV blocks
    python benches/quant_batches.py --model DIR --quantize-all q8_0 --baseline REF  # both quantized

`--model` takes a GGUF with the bundled model's vocabulary (the files
`benches/make_bench_gguf.py` writes); `--workloads single` skips the
offline batch and the invariance check. `--quantization Q` runs the current
code a second time with `LLM(quantization=Q)` (for a GGUF, "gguf" keeps
its K-quant blocks as stored), interleaved with the others;
`--block-size N` likewise with `LLM(block_size=N)`. `--quantize-all Q`
runs every version, the baseline too, with `LLM(quantization=Q)` (a float
checkpoint's block kernels before and after a change).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from baseline import ROOT, build_baseline, remove_baseline, run_child  # isort: skip
from machine import spread, write_record  # isort: skip

NUM_REQUESTS = 64
OUTPUT_LEN = 128
SHARED_REQUESTS, SYSTEM_LEN, QUESTION_LEN = 16, 700, 60
PREFILL_REQUESTS, PREFILL_LEN = 32, 256
WORKLOADS = ("offline", "single", "prefill", "shared")


def measure(
    model: str | None,
    workloads: list[str],
    prompt_len: int,
    quantization: str | None,
    block_size: int | None,
    prefill: tuple[int, int] = (PREFILL_REQUESTS, PREFILL_LEN),
) -> dict[str, object]:
    import numpy as np

    import ferrox  # noqa: F401  # isort: skip  (before torch)
    from ferrox import LLM, SamplingParams
    from ferrox._native import cpu_isa

    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(100, 49000, size=int(rng.integers(64, 257))).tolist()
        for _ in range(NUM_REQUESTS)
    ]
    options: dict[str, Any] = {"model": model} if model else {}
    if quantization:
        options["quantization"] = quantization
    if block_size:
        options["block_size"] = block_size
    llm = LLM(max_num_seqs=NUM_REQUESTS, **options)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    result: dict[str, object] = {"isa": cpu_isa()}
    if "offline" in workloads:
        llm.reset_prefix_cache()
        preempted = llm.engine.stats().num_preemptions
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        offline_s = time.perf_counter() - start
        result["offline_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / offline_s
        # pages the kernel faulted in (and zeroed) during the batch
        result["offline_minor_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        # requests the scheduler preempted for want of KV blocks (and recomputed)
        result["offline_preemptions"] = llm.engine.stats().num_preemptions - preempted
        llm.reset_prefix_cache()
        alone = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
        result["alone_equals_batch"] = list(alone) == list(outs[0].outputs[0].token_ids)
    if "single" in workloads:
        llm.reset_prefix_cache()
        single = [1, *range(1000, 1000 + prompt_len - 1)]
        start = time.perf_counter()
        out = llm.generate([single], params, use_tqdm=False)[0]
        result["single_tok_s"] = OUTPUT_LEN / (time.perf_counter() - start)
        m = out.metrics
        assert m is not None and m.first_token_time and m.last_token_time
        decode_s = m.last_token_time - m.first_token_time
        result["single_decode_tok_s"] = (OUTPUT_LEN - 1) / decode_s
    if "prefill" in workloads:
        requests, length = prefill
        fresh = [rng.integers(100, 49000, size=length).tolist() for _ in range(requests)]
        once = SamplingParams(temperature=0.0, max_tokens=1)
        times = []
        for _ in range(3):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(fresh, once, use_tqdm=False)
            times.append(time.perf_counter() - start)
        result["prefill_tok_s"] = requests * length / min(times)
    if "shared" in workloads:
        llm.reset_prefix_cache()
        system = rng.integers(100, 49000, size=SYSTEM_LEN).tolist()
        llm.generate([system], SamplingParams(max_tokens=1), use_tqdm=False)
        questions = [
            system + rng.integers(100, 49000, size=QUESTION_LEN).tolist()
            for _ in range(SHARED_REQUESTS)
        ]
        start = time.perf_counter()
        outs = llm.generate(questions, params, use_tqdm=False)
        shared_s = time.perf_counter() - start
        result["shared_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / shared_s
    return result


def measure_in_child(python_path: Path, isa: str, child_args: list[str]) -> dict[str, object]:
    # (torch's caps too: ferrox sets them from FERROX_CPU_ISA in each child)
    caps = (
        "FERROX_CPU_ISA",
        "ATEN_CPU_CAPABILITY",
        "ONEDNN_MAX_CPU_ISA",
        "MKL_ENABLE_INSTRUCTIONS",
    )
    env: dict[str, str | None] = dict.fromkeys(caps)
    if isa != "native":
        env["FERROX_CPU_ISA"] = isa
    result: dict[str, object] = run_child(__file__, python_path, ["--child", *child_args], env)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=None, help="git revision to compare against")
    parser.add_argument("--isa", default="native,avx2", help="FERROX_CPU_ISA caps to run under")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled model)")
    parser.add_argument("--workloads", default="offline,single")
    parser.add_argument("--prompt-len", type=int, default=256, help="the single stream's prompt")
    parser.add_argument(
        "--prefill",
        default=f"{PREFILL_REQUESTS}x{PREFILL_LEN}",
        help="the prefill workload's prompts: REQUESTSxTOKENS",
    )
    parser.add_argument("--quantization", default=None, help="also run the current code so")
    parser.add_argument("--block-size", type=int, default=None, help="also run it so")
    parser.add_argument(
        "--quantize-all", default=None, help="run every version, the baseline too, so"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-quantization", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-block-size", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if not workloads or not set(workloads) <= set(WORKLOADS):
        parser.error(f"--workloads: a comma-separated list of {', '.join(WORKLOADS)}")
    try:
        requests, length = (int(n) for n in args.prefill.split("x"))
    except ValueError:
        parser.error("--prefill: REQUESTSxTOKENS, such as 4x2048")
    if args.child:
        result = measure(
            args.model,
            workloads,
            args.prompt_len,
            args.child_quantization,
            args.child_block_size,
            (requests, length),
        )
        print(json.dumps(result))
        return 0
    child_args = ["--workloads", args.workloads, "--prompt-len", str(args.prompt_len)]
    child_args += ["--prefill", args.prefill]
    if args.quantize_all:
        if args.quantization:
            parser.error("--quantize-all and --quantization: one or the other")
        child_args += ["--child-quantization", args.quantize_all]
    if args.model:
        child_args += ["--model", str(Path(args.model).expanduser().resolve())]
    work = Path(tempfile.mkdtemp(prefix="ferrox-quant-batches-"))
    try:
        # name: (the package's path, the child's extra arguments)
        versions: dict[str, tuple[Path, list[str]]] = {"current": (ROOT / "python", [])}
        if args.baseline:
            built = build_baseline(args.baseline, work / "baseline")
            versions = {"baseline": (built, []), **versions}
        if args.quantization:
            quantized = ["--child-quantization", args.quantization]
            versions[args.quantization] = (ROOT / "python", quantized)
        blocks = f"block-size-{args.block_size}"
        if args.block_size:
            versions[blocks] = (ROOT / "python", ["--child-block-size", str(args.block_size)])
        caps = args.isa.split(",")
        runs: dict[str, dict[str, list[dict[str, object]]]] = {
            cap: {name: [] for name in versions} for cap in caps
        }
        for r in range(args.repeats):
            for cap in caps:
                for name, (path, extra) in versions.items():
                    result = measure_in_child(path, cap, [*child_args, *extra])
                    runs[cap][name].append(result)
                    print(f"run {r + 1} {cap:>6} {name:>8}: {result}", flush=True)
        keys = [f"{w}_tok_s" for w in WORKLOADS if w in workloads]
        keys += ["single_decode_tok_s"] if "single" in workloads else []
        header = "".join(f"{k.replace('_tok_s', ' tok/s'):>24}" for k in keys)
        print(f"\n{'cap':>6} {'version':>13}{header} invariant")
        for cap in caps:
            for name, results in runs[cap].items():
                cells = "".join(
                    f"{spread([float(x[k]) for x in results]):>24}"  # type: ignore[arg-type]
                    for k in keys
                )
                same = all(x.get("alone_equals_batch", True) for x in results)
                print(f"{cap:>6} {name:>13}{cells} {same if 'offline' in workloads else '-'}")
            compared = [("current", "baseline")] if args.baseline else []
            compared += [(args.quantization, "current")] if args.quantization else []
            compared += [("current", blocks)] if args.block_size else []
            for top, bottom in compared:
                for key in keys:
                    pairs = zip(runs[cap][top], runs[cap][bottom], strict=True)
                    ratios = [float(c[key]) / float(b[key]) for c, b in pairs]  # type: ignore[arg-type]
                    print(f"{cap:>6} {top}/{bottom} {key}: {spread(ratios, 'x', 2)}")
        if args.json:
            write_record(
                args.json,
                baseline=args.baseline,
                quantization=args.quantization,
                quantize_all=args.quantize_all,
                block_size=args.block_size,
                runs=runs,
            )
    finally:
        if args.baseline:
            remove_baseline(work / "baseline")
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
