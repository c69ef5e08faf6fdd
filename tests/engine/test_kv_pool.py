"""The CPU KV pool's default size (common/config.py): the floor of
CPU_KV_CACHE_TOKENS tokens, and, where pages cost memory only once written,
room for the batch the scheduler admits."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrox import LLM
from ferrox.common.config import CPU_KV_CACHE_TOKENS, CPU_KV_CACHE_TOKENS_PER_SEQ
from ferrox.runner import model_runner


def _pool_tokens(path: str, **options: object) -> int:
    runner = LLM(path, **options).engine.runner
    return runner.num_kv_blocks * runner.config.block_size


def test_an_unzeroed_cpu_pool_holds_every_admitted_sequence(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a tiny model's blocks are so small that the byte floor would hide the rule)
    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_MIN_BYTES", 0)
    path = str(tiny_models["llama-gqa-tied"])
    batch = 4 * CPU_KV_CACHE_TOKENS // CPU_KV_CACHE_TOKENS_PER_SEQ  # past the floor
    # the CPU backend in float32: not zeroed, sized for the batch
    assert _pool_tokens(path, max_num_seqs=batch) >= batch * CPU_KV_CACHE_TOKENS_PER_SEQ
    # a small batch keeps the floor
    floor = _pool_tokens(path, max_num_seqs=4)
    assert CPU_KV_CACHE_TOKENS <= floor < 2 * CPU_KV_CACHE_TOKENS
    # the torch backend's pool is zeroed (every page resident from the
    # start): the floor whatever the batch
    assert _pool_tokens(path, max_num_seqs=batch, attention_backend="torch") == floor
    # an explicit size wins
    assert _pool_tokens(path, max_num_seqs=batch, num_kv_blocks=64) == 64 * 16
