"""Speculative decoding: configuration, exactness (greedy and seeded outputs
identical with and without speculation, for every sampling feature), the
statistics of rejection sampling, the draft model's KV, grammars, preemption,
and metrics. The scheduler's side has property tests in Rust
(`scheduler_tests.rs`)."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ferrox import LLM, SamplingParams, StructuredOutputsParams
from ferrox.common import errors
from ferrox.common.config import EngineConfig
from ferrox.common.protocol import EngineStats
from ferrox.common.speculative_config import SpeculativeConfig
from ferrox.server.metrics import Metrics

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
# Prompts with repeats, so that prompt lookup proposes.
PROMPTS = [
    "one two three four five one two three four five one two three",
    "abc abc abc abc abc abc abc",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "at most 16"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "lookup_min"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5},
            "prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "temperature": 1}, "unsupported key"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "be 1"),
        ({"method": "ngram", "num_speculative_tokens": True}, "integer"),
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_configurations_are_refused(config: Any, message: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=re.escape(message)):
        EngineConfig.create(speculative_config=config)


def test_configuration_as_vllm_spells_it() -> None:
    spec = EngineConfig.create(
        speculative_config='{"model": "[ngram]", "num_speculative_tokens": 3}'
    ).speculation
    assert spec == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    draft = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2})
    assert draft is not None and draft.method == "draft_model"


@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama-gqa-tied"]


def _engine(path: Path, spec: Any = None, **options: Any) -> LLM:
    options = {"max_num_seqs": 16, "block_size": 4, "num_kv_blocks": 512, **options}
    return LLM(str(path), speculative_config=spec, **options)


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def _assert_same(plain: list[Any], spec: list[Any]) -> None:
    for a, b in zip(plain, spec, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids, a.prompt
            assert x.text == y.text and x.finish_reason == y.finish_reason
            if x.logprobs is not None:
                assert y.logprobs is not None and len(x.logprobs) == len(y.logprobs)
                for p, q in zip(x.logprobs, y.logprobs, strict=True):
                    assert p.keys() == q.keys()
                    for t in p:
                        assert math.isclose(p[t].logprob, q[t].logprob, abs_tol=1e-4)


# One request per sampling feature; seeded, so that each gives the same
# tokens in any batch: with speculation it must give exactly those tokens.
# Low temperatures: the random-weight model's drafts are then often kept,
# so that every feature meets verified positions past the first.
FEATURE_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40),
    SamplingParams(temperature=0.0, max_tokens=40, logprobs=3),
    SamplingParams(temperature=0.3, seed=1, max_tokens=40, top_p=0.9, top_k=20, min_p=0.05),
    SamplingParams(temperature=0.3, seed=2, n=3, max_tokens=30),
    SamplingParams(
        temperature=0.3,
        seed=3,
        max_tokens=40,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
    ),
    SamplingParams(temperature=0.0, max_tokens=40, logit_bias={5: 3.0, 9: -2.0}, min_tokens=20),
    SamplingParams(temperature=0.0, max_tokens=40, stop=["b a"], include_stop_str_in_output=True),
    SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[7, 11]),
]


def test_outputs_are_those_of_plain_decoding(tiny: Path) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(FEATURE_PARAMS))]
    plain = _engine(tiny).generate(prompts, FEATURE_PARAMS, use_tqdm=False)
    # A draft model with the target's weights proposes the target's greedy
    # tokens: kept often, at every position, for every request.
    self_draft = {
        "method": "draft_model",
        "model": str(tiny),
        "num_speculative_tokens": 4,
        "adaptive": False,  # a draft as large as the target never pays: always draft here
    }
    for spec in (NGRAM, {**NGRAM, "adaptive": True, "num_speculative_tokens": 7}, self_draft):
        llm = _engine(tiny, spec)
        outputs = llm.generate(prompts, FEATURE_PARAMS, use_tqdm=False)
        _assert_same(plain, outputs)
        if spec is self_draft:
            accepted = [o.metrics.num_accepted_tokens for o in outputs if o.metrics]
            assert min(accepted) >= 4, accepted
        stats = llm.engine.stats()
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        _assert_idle(llm)


def test_preemption_and_aborts_in_the_middle_of_speculation(tiny: Path) -> None:
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=48, ignore_eos=True)
    prompts = [PROMPTS[i % 3] + " x" * i for i in range(10)]
    plain = _engine(tiny, max_model_len=128).generate(prompts, params, use_tqdm=False)
    llm = _engine(tiny, NGRAM, num_kv_blocks=40, max_model_len=128)
    _assert_same(plain, llm.generate(prompts, params, use_tqdm=False))
    assert llm.engine.stats().num_preemptions > 0
    # Aborts while drafts are being verified return every block.
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", engine.tokenizer.encode(prompt), params)
    for _ in range(6):
        engine.step()
    assert engine.stats().spec_num_drafts > 0
    for i in range(len(prompts)):
        engine.abort_request(f"a{i}")
    engine.step()
    _assert_idle(llm)


def test_a_draft_model_of_the_same_weights_is_always_accepted(tiny_models: dict[str, Path]) -> None:
    """The draft's own KV cache (same blocks as the target's) must be right
    at every position, or a draft with the target's weights would miss."""
    target = tiny_models["llama-gqa-tied"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = _engine(target).generate(PROMPTS, params, use_tqdm=False)
    same = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    llm = _engine(target, {**same, "adaptive": False})
    _assert_same(plain, llm.generate(PROMPTS, params, use_tqdm=False))
    # Again: the prompts now come from the prefix cache, drafts' KV included.
    _assert_same(plain, llm.generate(PROMPTS, params, use_tqdm=False))
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 100
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    _assert_idle(llm)
    # Another model as the draft: fewer accepted, the same outputs.
    other = {**same, "model": str(tiny_models["qwen3"])}
    llm = _engine(target, other)
    _assert_same(plain, llm.generate(PROMPTS, params, use_tqdm=False))
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    _assert_idle(llm)


def test_a_draft_model_must_share_the_vocabulary(tiny: Path, smollm2_path: Path) -> None:
    spec = {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 2}
    with pytest.raises(errors.InvalidArgumentError, match="vocabulary"):
        LLM(str(smollm2_path), speculative_config=spec, max_model_len=256)


def test_rejection_sampling_keeps_the_target_distribution(tiny_models: dict[str, Path]) -> None:
    """Unseeded draws with a random-weight draft model: the token sampled at a
    verified position (the second output token: drafted, then accepted or
    replaced) must follow the target's distribution given the first. A rule
    that kept drafts too often, or replaced them from the wrong distribution,
    fails the chi-square test (3 degrees of freedom, p = 0.001)."""
    target = tiny_models["llama-gqa-tied"]
    spec = {
        "method": "draft_model",
        "model": str(target),
        "load_format": "dummy",
        "num_speculative_tokens": 1,
        "adaptive": False,
    }
    llm = _engine(target, spec, max_num_seqs=256, num_kv_blocks=4096, seed=123)
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([prompt] * 2400, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    pairs = Counter((o.outputs[0].token_ids[0], o.outputs[0].token_ids[1]) for o in outputs)
    firsts = Counter(first for first, _ in pairs.elements())
    reference = _engine(target)
    prompt_ids = reference.engine.tokenizer.encode(prompt)
    for first, count in firsts.most_common(2):
        # The target's next-token distribution after `first`, within its top 4.
        probe = SamplingParams(temperature=0.0, max_tokens=1, logprobs=4)
        extended = [{"prompt_token_ids": [*prompt_ids, first]}]
        out = reference.generate(extended, probe, use_tqdm=False)[0].outputs[0]
        assert out.logprobs is not None
        top = out.logprobs[0]
        probs = np.exp([lp.logprob for lp in top.values()])
        probs /= probs.sum()
        observed = np.array([pairs[(first, t)] for t in top])
        assert observed.sum() == count, "a token outside the top 4 was sampled"
        expected = probs * count
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 16.27, (first, observed, expected)


def test_grammars_hold_at_every_verified_position(tiny: Path) -> None:
    pattern = "(abc ){3,6}[a-z]{2}"
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(regex=pattern),
        ),
        SamplingParams(
            temperature=1.0,
            seed=9,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(choice=["abc abc abc", "abc abd"]),
        ),
    ]
    # Under ignore_eos the grammar's end (its EOS) ends the sequence.
    params.append(
        SamplingParams(
            temperature=0.0,
            max_tokens=30,
            ignore_eos=True,
            structured_outputs=StructuredOutputsParams(regex="[a-z]{3}"),
        )
    )
    prompts = [*PROMPTS[1:3], PROMPTS[1]]
    plain = _engine(tiny).generate(prompts, params, use_tqdm=False)
    llm = _engine(tiny, NGRAM)
    spec = llm.generate(prompts, params, use_tqdm=False)
    _assert_same(plain, spec)
    assert re.fullmatch(pattern, spec[0].outputs[0].text)
    assert spec[2].outputs[0].finish_reason == "stop"
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    _assert_idle(llm)


def test_metrics_and_request_counts(tiny: Path) -> None:
    llm = _engine(tiny, NGRAM)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    metrics = [o.metrics for o in out if o.metrics is not None]
    assert sum(m.num_draft_tokens for m in metrics) == llm.engine.stats().spec_num_draft_tokens
    assert any(m.spec_acceptance_rate for m in metrics)
    s = llm.engine.stats()
    stats = EngineStats(
        spec_num_drafts=s.spec_num_drafts,
        spec_num_draft_tokens=s.spec_num_draft_tokens,
        spec_num_accepted_tokens=s.spec_num_accepted_tokens,
        spec_accepted_lengths=s.spec_accepted_lengths,
        spec_accepted_per_position=s.spec_accepted_per_position,
    )
    text = Metrics("m", lambda: [stats]).render().decode()
    labels = 'model_name="m",replica="0"'
    assert f"ferrox:spec_decode_num_drafts_total{{{labels}}} {s.spec_num_drafts}.0" in text
    assert "ferrox:spec_decode_num_accepted_tokens_per_pos_total" in text
    count = f"ferrox:spec_decode_acceptance_length_count{{{labels}}} {s.spec_num_drafts}.0"
    assert count in text
    assert sum(s.spec_accepted_lengths) == s.spec_num_drafts
    assert sum(s.spec_accepted_per_position) == s.spec_num_accepted_tokens
