"""Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5-MoE's hybrid decoder
(models/qwen3_5.py) with two differences:

- a layer has experts where Qwen3-MoE's rule says so (`decoder_sparse_step`,
  `mlp_only_layers`; models/qwen3_moe.sparse_layers), else a dense MLP, and
  the router renormalises its top-k weights only with `norm_topk_prob`;
- a linear layer's input projections are fused per key head:
  `in_proj_qkvz` holds, for each key head in turn, its query and key rows
  and the value and gate rows of the value heads it serves; `in_proj_ba` the
  step-size and decay rows of those value heads. They are split at load into
  Qwen3.5's `in_proj_qkv` (all queries, all keys, all values), `in_proj_z`,
  `in_proj_b` and `in_proj_a`.
"""

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import Qwen3NextConfig

from ferrox.common.errors import ModelLoadError
from ferrox.models.llama import GatedMlp
from ferrox.models.qwen3_5 import Qwen3_5MoeForCausalLM
from ferrox.models.qwen3_moe import sparse_layers


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3NextForCausalLM",)
    # llama.cpp's `qwen3next`: its converter splits `in_proj_qkvz` into
    # `attn_qkv` and `attn_gate` (value heads in grouped order, as here) and
    # keeps `in_proj_ba` as `ssm_ba`.
    gguf_architecture: ClassVar[str | None] = "qwen3next"
    gguf_config_class: ClassVar[Any] = Qwen3NextConfig
    gguf_tiles_value_heads: ClassVar[bool] = False

    @classmethod
    def _gguf_moe_fields(cls, value: Any) -> dict[str, Any]:
        # llama.cpp's graph makes every layer sparse and renormalises.
        return super()._gguf_moe_fields(value) | {
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }

    def mlp_of(self, config: Any, index: int) -> nn.Module:
        if sparse_layers(config)[index]:
            return self.sparse_moe(config, renormalize=bool(config.norm_topk_prob))
        return GatedMlp(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        hk, hv = int(c.linear_num_key_heads), int(c.linear_num_value_heads)
        dk, dv = int(c.linear_key_head_dim), int(c.linear_value_head_dim)
        per_head = hv // hk  # value heads per key head
        for name, tensor in weights:
            stem = name.rpartition(".linear_attn.")[0]
            if name.endswith(".linear_attn.in_proj_qkvz.weight"):
                rows = tensor.reshape(hk, 2 * dk + 2 * per_head * dv, -1)
                q, k, v, z = rows.split([dk, dk, per_head * dv, per_head * dv], dim=1)
                flat = [t.reshape(-1, tensor.shape[-1]) for t in (q, k, v, z)]
                yield f"{stem}.linear_attn.in_proj_qkv.weight", torch.cat(flat[:3])
                yield f"{stem}.linear_attn.in_proj_z.weight", flat[3]
            elif name.endswith(".linear_attn.in_proj_ba.weight"):
                rows = tensor.reshape(hk, 2 * per_head, -1)
                b, a = rows.split([per_head, per_head], dim=1)
                yield f"{stem}.linear_attn.in_proj_b.weight", b.reshape(hv, -1)
                yield f"{stem}.linear_attn.in_proj_a.weight", a.reshape(hv, -1)
            elif ".linear_attn.in_proj_" in name and not name.endswith(
                (".in_proj_qkv.weight", ".in_proj_z.weight")  # (from GGUF: split already)
            ):
                raise ModelLoadError(f"unexpected tensor {name!r} in a Qwen3-Next checkpoint")
            else:
                yield name, tensor
