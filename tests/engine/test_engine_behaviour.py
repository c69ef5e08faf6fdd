"""Engine behaviour on tiny models: sampling reproducibility, stop rules,
n > 1, text, prompt logprobs, bad input and leak-free recovery."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ferrox import LLM, SamplingParams
from ferrox.common import errors
from tests import models


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["llama-gqa-tied"]), max_num_seqs=16, num_kv_blocks=256, block_size=4)


def assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
    llm.engine.scheduler.check_integrity()


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [[10 + i, 20 + i, 30 + i] for i in range(6)]
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(
        [*others[:3], prompt, *others[3:]], [noisy] * 3 + [params] + [noisy] * 3, use_tqdm=False
    )
    assert batch[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_idle(llm)


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    prompt = [11, 12, 13]
    free = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    text = free[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert len(kept.token_ids) < 20
    assert_idle(llm)


def test_min_tokens_ignore_eos_and_stop_token_ids(llm: LLM) -> None:
    eos = llm.engine.eos_token_ids[0]
    prompt = [40, 41, 42]
    # Bias EOS up so that it would be chosen at once.
    bias = {eos: 100.0}
    early = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, logit_bias=bias), use_tqdm=False
    )
    assert early[0].outputs[0].token_ids == [eos] and early[0].outputs[0].finish_reason == "stop"
    late = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=10, logit_bias=bias, min_tokens=4),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(late.token_ids) == 5 and late.token_ids[-1] == eos and eos not in late.token_ids[:4]
    ignored = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=10, logit_bias=bias, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(ignored.token_ids) == 10 and ignored.finish_reason == "length"
    free = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    stop_id = free[0].outputs[0].token_ids[2]
    stopped = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    first = free[0].outputs[0].token_ids.index(stop_id)
    assert stopped.token_ids == free[0].outputs[0].token_ids[: first + 1]
    assert stopped.stop_reason == stop_id
    assert_idle(llm)


def test_n_completions(llm: LLM) -> None:
    prompt = list(range(30, 50))  # long enough to be shared through the prefix cache
    out = llm.generate(
        prompt,
        SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=8), use_tqdm=False)[
        0
    ]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_idle(llm)


def test_text_matches_the_tokenizer_for_random_bytes(llm: LLM) -> None:
    # Random tokens of a byte-level vocabulary split multi-byte characters
    # across tokens; the streamed text must still equal one decode.
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(
        temperature=1.5, max_tokens=40, seed=3, ignore_eos=True, skip_special_tokens=False
    )
    outs = llm.generate([[i, i + 1] for i in range(50, 58)], params, use_tqdm=False)
    multibyte = 0
    for out in outs:
        c = out.outputs[0]
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=False)
        multibyte += any(ord(ch) > 127 for ch in c.text)
    assert multibyte > 0, "no multi-byte characters were produced"


def test_logprobs_and_prompt_logprobs_match_transformers(
    tiny_models: dict[str, Path], llm: LLM
) -> None:
    hf = models.hf_model(tiny_models["llama-gqa-tied"])
    prompt = list(range(60, 90))
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=3, logprobs=3, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(
            float(expected[pos - 1, prompt[pos]]), abs=1e-3
        )
        assert len(entry) >= 2
    for entry in out.outputs[0].logprobs:
        assert 3 <= len(entry) <= 4
        assert sorted(e.rank for e in entry.values())[:3] == [1, 2, 3]
    assert_idle(llm)


def test_chunked_prompt_logprobs(tiny_models: dict[str, Path]) -> None:
    small = LLM(
        str(tiny_models["llama-gqa-tied"]), max_num_batched_tokens=8, max_num_seqs=4, block_size=4
    )
    whole = LLM(str(tiny_models["llama-gqa-tied"]), block_size=4)
    prompt = list(range(100, 125))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    a = small.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    b = whole.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    assert a is not None and b is not None and len(a) == len(b) == len(prompt)
    for x, y in zip(a[1:], b[1:], strict=True):
        tok = next(iter(y))
        assert x[tok].logprob == pytest.approx(y[tok].logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(logprobs=-2), "logprobs"),
    ],
)
def test_bad_sampling_values_name_the_parameter(params: dict, message: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=message):
        SamplingParams(**params)


def test_bad_requests_leave_the_engine_serving(llm: LLM) -> None:
    long_prompt = [5] * (llm.engine.max_model_len + 1)
    with pytest.raises(errors.ContextLengthExceededError):
        llm.generate(long_prompt, use_tqdm=False)
    with pytest.raises(errors.InvalidArgumentError, match="vocabulary"):
        llm.generate([[1, 2, models.VOCAB_SIZE + 5]], use_tqdm=False)
    with pytest.raises(errors.InvalidArgumentError, match="logprobs"):
        llm.generate([1, 2], SamplingParams(logprobs=1000), use_tqdm=False)
    with pytest.raises(errors.InvalidArgumentError):
        llm.generate([[1, 2], [3]], [SamplingParams()], use_tqdm=False)
    # A bad prompt in a batch rejects the whole call before anything runs.
    with pytest.raises(errors.InvalidArgumentError):
        llm.generate([[1, 2, 3], []], use_tqdm=False)
    assert_idle(llm)
    ok = llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 4
    assert_idle(llm)


def test_abort_returns_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(1, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().num_used_blocks > 0
    assert engine.abort_request("a") and engine.abort_request("b")
    assert not engine.abort_request("a")
    engine.step()  # the scheduler reports the aborts
    assert_idle(llm)


def test_unknown_model_and_architecture(tmp_path: Path) -> None:
    with pytest.raises(errors.ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1})
    )
    with pytest.raises(errors.UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), load_format="dummy")
    with pytest.raises(errors.InvalidArgumentError, match="unknown engine option"):
        LLM(str(tmp_path), max_num_sequences=3)


def test_reset_prefix_cache(llm: LLM) -> None:
    prompt = list(range(150, 190))
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.stats().num_cached_blocks > 0
    assert llm.reset_prefix_cache() > 0
    assert llm.engine.stats().num_cached_blocks == 0
    hits = llm.engine.stats().prefix_hit_tokens
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.stats().prefix_hit_tokens == hits  # nothing left to hit
    assert_idle(llm)


@torch.inference_mode()
def _hf_penalised_greedy(
    hf: torch.nn.Module, prompt: list[int], n: int, rep: float, freq: float, pres: float
) -> list[int]:
    """Greedy decoding with the penalties applied by hand to transformers'
    logits: repetition on prompt and output tokens, frequency and presence
    on output tokens."""
    out: list[int] = []
    for _ in range(n):
        logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt + out] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel())
        logits = logits - freq * counts - pres * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


def test_penalties_match_a_reference(tiny_models: dict[str, Path], llm: LLM) -> None:
    hf = models.hf_model(tiny_models["llama-gqa-tied"])
    prompts = [[5, 6, 7, 8, 5, 6], [40, 41, 42], [9, 9, 9, 9]]
    cases = [(1.8, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 2.0), (1.3, 0.5, 0.5)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
        )
        for rep, freq, pres in cases
    ]
    # Every prompt with every case, alongside unpenalised rows, in one batch.
    batch = [(p, sp) for p in prompts for sp in params] + [
        (prompts[0], SamplingParams(max_tokens=12, temperature=0.0))
    ]
    outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    for (prompt, sp), out in zip(batch[:-1], outs, strict=False):
        expected = _hf_penalised_greedy(
            hf, prompt, 12, sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty
        )
        assert out.outputs[0].token_ids == expected, (prompt, sp)
    plain = outs[-1].outputs[0].token_ids
    assert plain != outs[0].outputs[0].token_ids  # the penalty changed something
    assert_idle(llm)


def test_final_only_and_streamed_runs_agree(llm: LLM) -> None:
    """generate() hands the engine final-only requests (one delta at the end,
    text decoded once); streaming takes a delta a step. Same tokens, text,
    logprobs and metrics either way."""
    prompts = [[7, 8, 9, 10, 11], [30, 31]]
    params = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=9, logprobs=2, ignore_eos=True)
    final = llm.generate(prompts, params, use_tqdm=False)
    streamed: dict[str, dict[int, list]] = {}
    requests = [(None, p) for p in prompts]
    for out in llm.stream_outputs(["s0", "s1"], requests, [params, params], stream=True):
        for c in out.outputs:
            entry = streamed.setdefault(out.request_id, {}).setdefault(c.index, ["", [], []])
            entry[0] += c.text
            entry[1] += c.token_ids
            entry[2] += c.logprobs or []
    for rid, out in zip(["s0", "s1"], final, strict=True):
        assert out.metrics is not None and out.metrics.first_token_time is not None
        assert out.metrics.arrival_time <= out.metrics.first_token_time
        assert out.metrics.num_generation_tokens == 2 * 9
        for c in out.outputs:
            text, tokens, logprobs = streamed[rid][c.index]
            assert (c.text, c.token_ids) == (text, tokens)
            # (the second run reads the prompt from the prefix cache: rounding differs)
            assert [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs or []] == [
                {t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in e.items()} for e in logprobs
            ]
    assert_idle(llm)


def test_generate_keeps_the_engine_queue_bounded(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        str(tiny_models["llama-gqa-tied"]),
        max_num_seqs=2,
        max_queued_requests=1,
        num_kv_blocks=64,
        block_size=4,
    )
    engine = llm.engine
    held: list[int] = []
    real_step = engine.step

    def step() -> Any:
        held.append(engine.num_unfinished_requests)
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    prompts = [[3 + i, 4 + i, 5 + i] for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5] * 10
    assert max(held) == 3  # 2 running + 1 queued, never more
    unbounded = LLM(
        str(tiny_models["llama-gqa-tied"]), max_queued_requests=-1, num_kv_blocks=64, block_size=4
    )
    assert [o.outputs[0].token_ids for o in unbounded.generate(prompts, params, False)] == [
        o.outputs[0].token_ids for o in outs
    ]
    with pytest.raises(errors.InvalidArgumentError, match="max_queued_requests"):
        LLM(str(tiny_models["llama-gqa-tied"]), max_queued_requests=-2)
    # A bad prompt anywhere in the batch fails before any work is done.
    with pytest.raises(errors.InvalidArgumentError):
        llm.generate([*prompts, [10**6]], params, use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.stats().num_used_blocks == 0


def test_lpm_serves_a_cached_prefix_before_a_miss(tiny_models: dict[str, Path]) -> None:
    # One sequence at a time and a pool of about one request's blocks: in
    # arrival order the unrelated prompt evicts the shared prefix before the
    # second request of that prefix runs; longest prefix match serves that
    # request first, from the cache. The tokens do not depend on the order.
    shared = list(range(30, 46))  # 4 blocks of 4
    prompts = [[*shared, 50, 51], list(range(60, 78)), [*shared, 52, 53]]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    results = {}
    for policy in ("fcfs", "lpm"):
        llm = LLM(
            str(tiny_models["llama-gqa-tied"]),
            scheduling_policy=policy,
            max_num_seqs=1,
            num_kv_blocks=6,
            block_size=4,
            max_model_len=24,
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[policy] = [(o.outputs[0].token_ids, o.metrics.num_cached_tokens) for o in outputs]
        assert_idle(llm)
    assert [r[0] for r in results["fcfs"]] == [r[0] for r in results["lpm"]]
    first, _, again = [r[1] for r in results["fcfs"]]
    assert first == 0 and again < 16  # (the unrelated prompt evicted most of the prefix)
    assert [r[1] for r in results["lpm"]] == [0, 0, 16]


def test_scheduling_policy_and_priority_are_checked(llm: LLM, tiny_models: dict[str, Path]) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="scheduling_policy"):
        LLM(str(tiny_models["llama-gqa-tied"]), scheduling_policy="longest")
    # A priority the engine would not honour is refused, not ignored.
    params = SamplingParams(max_tokens=2)
    with pytest.raises(errors.InvalidArgumentError, match="needs scheduling_policy 'priority'"):
        llm.engine.add_request("prio", [5, 6, 7], params, priority=1)
    llm.engine.add_request("prio0", [5, 6, 7], params, priority=0)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert_idle(llm)
