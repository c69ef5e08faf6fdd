"""Hybrid models (Gated DeltaNet linear attention beside attention layers)
against transformers on the same weights: greedy tokens equal and logprobs
close in a mixed batch, with prefix-cache hits (resumed from state
snapshots), chunked prefill (the state carried across chunks), under
preemption (the state recomputed), with fewer state slots than requests;
the state pool comes back whole; what is not supported yet is refused
clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ferrox import LLM
from ferrox.common.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.layers.attention.base import AttentionMetadata
from ferrox.layers.gated_delta import CHUNK, causal_conv1d, gated_delta_rule
from tests import models
from tests.engine.test_model_correctness import assert_matches_hf, greedy, prompts

HYBRIDS = ["qwen3.5", "qwen3.5-moe", "qwen3-next"]


@pytest.mark.parametrize(
    ("label", "options"),
    [
        ("one-batch", dict()),
        ("prefix-cache", dict(block_size=4)),
        ("no-prefix-cache", dict(enable_prefix_caching=False)),
        ("chunked-prefill", dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4)),
        ("preemption", dict(num_kv_blocks=12, block_size=8, max_model_len=96)),
        ("few-state-slots", dict(max_num_seqs=3, max_num_batched_tokens=64)),
    ],
)
@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_models_match_transformers(
    tiny_models: dict[str, Path], label: str, options: dict, name: str
) -> None:
    path = tiny_models[name]
    hf = models.hf_model(path)
    batch = prompts(models.VOCAB_SIZE, seed=2)
    llm = LLM(str(path), **{"num_kv_blocks": 256, "max_num_seqs": 8, **options})
    outputs = llm.generate(batch, greedy(logprobs=1), use_tqdm=False)
    assert_matches_hf(outputs, hf, batch, check_logprobs=True)
    if label == "prefix-cache":
        # Again: now the prompts resume from the snapshots the first run left.
        again = llm.generate(batch, greedy(logprobs=1), use_tqdm=False)
        assert_matches_hf(again, hf, batch, check_logprobs=True)
        assert sum(o.metrics.num_cached_tokens for o in again) > sum(map(len, batch)) // 2
    stats = llm.engine.stats()
    if label == "preemption":
        assert stats.num_preemptions > 0
    slots = options.get("max_num_seqs", 8)
    assert stats.num_state_slots == slots
    assert stats.num_free_state_slots == slots
    caching = options.get("enable_prefix_caching", True)
    assert stats.num_state_snapshots == (slots if caching else 0)
    assert 0 < stats.num_cached_state_snapshots <= slots or not caching
    assert stats.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def test_an_aborted_hybrid_request_gives_its_state_slot_back(
    tiny_models: dict[str, Path],
) -> None:
    path = tiny_models["qwen3.5"]
    llm = LLM(str(path), max_num_seqs=2, num_kv_blocks=64, max_num_batched_tokens=48)
    engine = llm.engine
    engine.add_request("a", prompts(models.VOCAB_SIZE)[6], greedy(max_tokens=50))
    engine.add_request("b", prompts(models.VOCAB_SIZE)[5], greedy(max_tokens=50))
    engine.step()  # both hold a slot: one decodes, one is mid-prefill
    assert engine.stats().num_free_state_slots == 0
    engine.abort_request("a")
    engine.step()
    engine.abort_request("b")
    engine.step()
    assert engine.stats().num_free_state_slots == 2
    # The slots serve new requests from zero: same tokens as a fresh engine.
    batch = prompts(models.VOCAB_SIZE, seed=3)[:4]
    again = llm.generate(batch, greedy(), use_tqdm=False)
    assert_matches_hf(again, models.hf_model(path), batch, check_logprobs=False)


def test_what_hybrids_do_not_support_yet_is_refused(tiny_models: dict[str, Path]) -> None:
    path = str(tiny_models["qwen3.5"])
    with pytest.raises(InvalidArgumentError, match="recurrent state"):
        LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(UnsupportedModelError, match="tensor parallelism"):
        LLM(path, tensor_parallel_size=2)
    with pytest.raises(UnsupportedModelError, match="LoRA"):
        LLM(path, enable_lora=True)
    # (their decode steps run fused, their prefill does not)
    with pytest.raises(InvalidArgumentError, match="hybrid"):
        LLM(path, batch_invariant=True, quantization="q8_0")


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next"])
def test_a_bfloat16_state_pool_stays_close_to_transformers(
    tiny_models: dict[str, Path], name: str
) -> None:
    """mamba_ssm_cache_dtype="bfloat16": the pool keeps the recurrent
    matrices in half the bytes; each step computes in float32 from them, so
    the first token (its prompt's one step) is transformers' exactly, and
    every later token's logprob, scored by transformers on the same
    sequence, stays close (the state is rounded once a step). Prefix hits,
    chunked prefill and decode batches all read and write the bfloat16 pool;
    every slot and block comes back."""
    path = tiny_models[name]
    hf = models.hf_model(path)
    batch = prompts(models.VOCAB_SIZE, seed=2)
    options = dict(num_kv_blocks=256, max_num_seqs=8, block_size=4)
    wide = LLM(str(path), **options)
    llm = LLM(str(path), mamba_ssm_cache_dtype="bfloat16", max_num_batched_tokens=40, **options)
    pool = llm.engine.runner.kv_cache.state
    assert pool is not None and {rec.dtype for _, rec in pool.layers} == {torch.bfloat16}
    wide_pool = wide.engine.runner.kv_cache.state
    assert wide_pool is not None
    groups, wide_groups = llm.engine.runner.kv_groups, wide.engine.runner.kv_groups
    matrices = sum(s.num_heads * s.k_head_dim * s.v_head_dim for s in groups.states)
    assert wide_groups.state_bytes - groups.state_bytes == 2 * matrices  # 4 bytes each -> 2
    assert pool.num_bytes < wide_pool.num_bytes
    for _ in range(2):  # the second time from the prefix cache's snapshots
        outputs = llm.generate(batch, greedy(logprobs=1), use_tqdm=False)
        for prompt, out in zip(batch, outputs, strict=True):
            tokens = out.outputs[0].token_ids
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            scored = logits.float().log_softmax(-1)
            want = scored.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            chosen = zip(out.outputs[0].logprobs, tokens, strict=True)
            got = torch.tensor([lp[t].logprob for lp, t in chosen])
            torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
            # each token transformers' greedy choice, up to that closeness
            assert bool((scored.max(-1).values - want <= 2e-2).all())
    assert sum(o.metrics.num_cached_tokens for o in outputs) > sum(map(len, batch)) // 2
    stats = llm.engine.stats()
    assert stats.num_free_state_slots == stats.num_state_slots == 8
    assert stats.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def test_the_state_dtype_is_checked(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(InvalidArgumentError, match="mamba_ssm_cache_dtype must be one of"):
        LLM(str(tiny_models["qwen3.5"]), mamba_ssm_cache_dtype="float16")
    with pytest.raises(InvalidArgumentError, match="linear-attention layers"):
        LLM(str(tiny_models["llama-gqa-tied"]), mamba_ssm_cache_dtype="bfloat16")


# ---- the kernels against transformers' reference implementation ---------------


def _meta(lengths: list[int], computed: list[int], slots: list[int]) -> AttentionMetadata:
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    seq = (np.array(lengths) + np.array(computed)).astype(np.int32)
    slot_array = np.array(slots, dtype=np.int64)
    return AttentionMetadata(
        num_reqs=len(lengths),
        num_decodes=sum(1 for n in lengths if n == 1),  # (rows of one token come first)
        num_tokens=int(qsl[-1]),
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_table=torch.zeros(len(lengths), 1, dtype=torch.int32),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
        num_computed_cpu=np.array(computed, dtype=np.int32),
        max_query_len=max(lengths),
        max_seq_len=int(seq.max()),
        state_slots=torch.from_numpy(slot_array),
        state_slots_cpu=slot_array,
    )


@pytest.mark.parametrize(
    ("state_dtype", "tolerance"), [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)]
)
@pytest.mark.parametrize("split", [[1], [CHUNK], [CHUNK + 5], [3, 1, 1, 70], [130, 1], [1, 2, 1]])
def test_the_kernels_match_the_reference_in_pieces(
    split: list[int], state_dtype: torch.dtype, tolerance: float
) -> None:
    """One sequence fed to the kernels in pieces (prefill chunks of odd
    sizes, decode steps) equals transformers' reference over the whole
    sequence: the state carries from piece to piece through its slot. Beside
    it in every step runs a one-token request that starts afresh from a slot
    full of NaN (a row with no computed tokens must not read its slot). A
    bfloat16 pool rounds the state each piece leaves: close, not equal."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
    )

    torch.manual_seed(sum(split))
    total, hk, hv, dk, dv, channels, width = sum(split), 2, 4, 16, 8, 24, 4
    q, k = torch.randn(total, hk, dk), torch.randn(total, hk, dk)
    v = torch.randn(total, hv, dv)
    g = -torch.rand(total, hv) * 2
    beta = torch.rand(total, hv)
    x = torch.randn(total, channels)
    weight = torch.randn(channels, width)
    want, _ = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], use_qk_l2norm_in_kernel=True
    )
    padded = torch.cat((torch.zeros(channels, width - 1), x.T), dim=1)
    conv = torch.nn.functional.conv1d(padded[None], weight[:, None, :], groups=channels)
    want_conv = torch.nn.functional.silu(conv[0].T)
    states = torch.full((2, hv, dk, dv), float("nan"), dtype=state_dtype)
    conv_states = torch.full((2, channels, width - 1), float("nan"))
    got, got_conv, done = [], [], 0
    for piece in split:
        # Row 0: the decoy (one fresh token, slot 1); row 1: this piece (slot 0).
        meta = _meta([1, piece], [0, done], slots=[1, 0])
        sl = slice(done, done + piece)

        def rows(t: torch.Tensor, sl: slice = sl) -> torch.Tensor:
            return torch.cat((torch.randn(1, *t.shape[1:]), t[sl]))

        o = gated_delta_rule(
            rows(q), rows(k), rows(v), rows(g).clamp(max=0), rows(beta).abs(), states, meta
        )
        c = causal_conv1d(rows(x), weight, conv_states, meta)
        states[1] = float("nan")  # (the decoy's slot, as another sequence may leave it)
        conv_states[1] = float("nan")
        got.append(o[1:])
        got_conv.append(c[1:])
        done += piece
    torch.testing.assert_close(torch.cat(got), want[0], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(torch.cat(got_conv), want_conv, atol=1e-5, rtol=1e-5)
