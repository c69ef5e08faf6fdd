"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v
biases) with Qwen3-MoE's sparse blocks (models/qwen3_moe.py) plus a shared
expert in each: a SwiGLU every token runs, its output scaled by
sigmoid(`shared_expert_gate`(x)) and added to the routed experts'
(layers/moe.py). The router's top-k weights are not renormalised unless
`norm_topk_prob`.

Checkpoint names: `mlp.shared_expert.{gate,up,down}_proj`,
`mlp.shared_expert_gate`. Under tensor parallelism the shared expert is
split by its columns as the routed ones are; its gate is replicated.

GGUF (llama.cpp's `qwen2moe`): the shared expert as `ffn_{gate,up,down}_shexp`
and its gate as `ffn_gate_inp_shexp`; its width in
`expert_shared_feed_forward_length`; llama.cpp's graph does not renormalise.
"""

from typing import Any, ClassVar

from transformers import Qwen2MoeConfig

from ferrox.layers.attention import AttentionBackend
from ferrox.layers.moe import SparseMoe
from ferrox.models.llama import GatedMlp
from ferrox.models.qwen3_moe import Qwen3MoeForCausalLM, gated_mlp_shard


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2MoeForCausalLM",)
    qkv_bias = True
    qk_norm = False
    gguf_architecture: ClassVar[str | None] = "qwen2moe"
    gguf_config_class: ClassVar[Any] = Qwen2MoeConfig
    gguf_renormalizes: ClassVar[bool] = False

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        super().__init__(config, backend)
        width = int(config.shared_expert_intermediate_size)
        for layer in self.decoder_layers():
            if isinstance(layer.mlp, SparseMoe) and width > 0:
                layer.mlp.add_shared_expert(GatedMlp(config, width, reduce=False))

    def shard_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        if ".mlp.shared_expert." in name:
            width = int(self.config.shared_expert_intermediate_size)
            return gated_mlp_shard(name, width, "shared expert width")
        return super().shard_of(name, shape)

    # ---- GGUF --------------------------------------------------------------

    @classmethod
    def _gguf_config_extra(cls, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        # (the q/k/v biases are the family's; o has none)
        return super()._gguf_config_extra(metadata, tensor_names) | {"attention_bias": False}

    @classmethod
    def _gguf_shared_experts(cls, value: Any) -> dict[str, Any]:
        return {
            "shared_expert_intermediate_size": int(value("expert_shared_feed_forward_length", 0))
        }

    @classmethod
    def gguf_layer_tensors(cls) -> dict[str, str]:
        return super().gguf_layer_tensors() | {
            "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
            "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
            "ffn_up_shexp": "mlp.shared_expert.up_proj",
            "ffn_down_shexp": "mlp.shared_expert.down_proj",
        }
