"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): the Llama decoder with its q/k/v and
gate/up projections stored fused (`qkv_proj`, `gate_up_proj`, which are
ferrox's own merged layout), and LongRoPE on the long-context checkpoints
(layers/rotary.py).

Sharding: a fused checkpoint tensor is split into Llama's q/k/v and
gate/up pieces, each sliced to this rank as Llama's are; on one rank it
loads whole. Phi-3's sliding window (the 4k models') is on every layer, as
for Mistral (`models.llama.layer_windows`). GGUF (llama.cpp's `phi3`): the
fused `attn_qkv` and `ffn_up` tensors, the rotary rows as transformers has
them; files with LongRoPE factor tensors are refused.
"""

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from transformers import Phi3Config

from ferrox.common.errors import UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM
from ferrox.parallel import state as distributed

_FUSED = {
    ".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
    ".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj."),
}


class Phi3ForCausalLM(LlamaForCausalLM):
    supports_lora = False  # (not yet verified against peft)
    architectures: ClassVar[tuple[str, ...]] = ("Phi3ForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "phi3"
    gguf_config_class: ClassVar[Any] = Phi3Config
    gguf_rotary_interleaved: ClassVar[bool] = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights if distributed.state().size == 1 else self._split(weights))

    def _split(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Fused tensors as Llama's pieces, each sliced to this rank."""
        d = self.head_dim
        for name, tensor in weights:
            fused = next((f for f in _FUSED if f in name), None)
            if fused is None:
                yield name, tensor
                continue
            if fused == ".self_attn.qkv_proj.":
                heads = self.config.num_attention_heads
                kv_heads = getattr(self.config, "num_key_value_heads", None) or heads
                sizes = [heads * d, kv_heads * d, kv_heads * d]
            else:
                sizes = [tensor.shape[0] // 2] * 2
            for piece_name, piece in zip(_FUSED[fused], tensor.split(sizes, dim=0), strict=True):
                full = name.replace(fused, piece_name)
                shard = self.shard_of(full, tuple(piece.shape))
                if shard is not None:
                    dim, start, length = shard
                    piece = piece.narrow(dim, start, length)
                yield full, piece

    @classmethod
    def _gguf_config_extra(cls, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        if "rope_factors_long.weight" in tensor_names:
            raise UnsupportedModelError(
                "GGUF Phi-3 files with LongRoPE factors (rope_factors_long / rope_factors_short) "
                "are not supported yet; the safetensors checkpoint is"
            )
        return {}

    @classmethod
    def config_from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> Any:
        config = super().config_from_gguf(metadata, tensor_names)
        window = metadata.get("phi3.attention.sliding_window")
        config.sliding_window = int(window) if window else None  # 0: none (Phi-4)
        return config

    @classmethod
    def gguf_layer_tensors(cls) -> dict[str, str]:
        return super().gguf_layer_tensors() | {
            "attn_qkv": "self_attn.qkv_proj",
            "ffn_up": "mlp.gate_up_proj",  # gate and up, fused
        }
