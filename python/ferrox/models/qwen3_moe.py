"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's
attention (q/k norms, no biases) with a mixture of experts in place of the
MLP (layers/moe.py): a softmax router picks `num_experts_per_tok` of
`num_experts` SwiGLU experts per token, their weights rescaled to sum to one
when `norm_topk_prob`. A layer listed in `mlp_only_layers`, or off the
`decoder_sparse_step` grid, keeps a dense MLP. The family has no shared
experts (Qwen2-MoE, models/qwen2_moe.py, adds them).

Checkpoint names: the router `mlp.gate`, the experts
`mlp.experts.{e}.{gate,up,down}_proj`. Under tensor parallelism every expert
is split by its intermediate columns (gate/up by rows, down by columns) and
the router is replicated.

GGUF (llama.cpp's `qwen3moe`): the router `ffn_gate_inp`, a layer's experts
stacked into `ffn_{gate,up,down}_exps` ([experts, rows, columns]), which load
as one matrix per expert (kept in their blocks where the CPU kernels run
them); llama.cpp's graph makes every layer sparse and always renormalises.
"""

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from transformers import Qwen3MoeConfig

from ferrox.common.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.attention import AttentionBackend
from ferrox.layers.moe import SparseMoe
from ferrox.models.base import gguf_value
from ferrox.models.llama import GatedMlp
from ferrox.models.qwen3 import Qwen3ForCausalLM
from ferrox.parallel import state as distributed

# llama.cpp's stacked expert tensors -> each expert's projection.
_STACKED_EXPERTS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}


def sparse_layers(config: Any) -> list[bool]:
    """Which layers have experts (transformers' rule)."""
    num_experts = int(getattr(config, "num_experts", 0) or 0)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return [
        num_experts > 0 and i not in dense and (i + 1) % step == 0
        for i in range(config.num_hidden_layers)
    ]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    supports_lora = False  # (not yet verified against peft)
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3MoeForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "qwen3moe"
    gguf_config_class: ClassVar[Any] = Qwen3MoeConfig
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        super().__init__(config, backend)
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"Qwen3-MoE with hidden_act={hidden_act!r}")
        width = int(config.moe_intermediate_size)

        def expert() -> GatedMlp:
            return GatedMlp(config, width, reduce=False)

        for layer, sparse in zip(self.decoder_layers(), sparse_layers(config), strict=True):
            if sparse:
                layer.mlp = SparseMoe(
                    config.hidden_size,
                    int(config.num_experts),
                    int(config.num_experts_per_tok),
                    bool(config.norm_topk_prob),
                    expert,
                )

    def prepare_fused_decode(self) -> bool:
        """Block-format experts on the CPU run natively (layers/moe.py);
        then decode steps fuse each layer's attention half as Llama's whole
        layers are (layers/cpu_decoder.py)."""
        for layer in self.decoder_layers():
            if isinstance(layer.mlp, SparseMoe):
                layer.mlp.prepare_native()
        return super().prepare_fused_decode()

    def shard_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        if ".mlp.experts." in name:
            width = int(self.config.moe_intermediate_size)
            return gated_mlp_shard(name, width, "expert intermediate size")
        return super().shard_of(name, shape)

    # ---- GGUF --------------------------------------------------------------

    # llama.cpp's graph for the family: whether it renormalises the top-k weights.
    gguf_renormalizes: ClassVar[bool] = True

    @classmethod
    def _gguf_config_extra(cls, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        arch = cls.gguf_architecture
        assert arch is not None

        def value(key: str, default: Any = None) -> Any:
            return gguf_value(metadata, arch, key, default)

        scale = float(value("expert_weights_scale", 0.0))
        if scale not in (0.0, 1.0):
            raise UnsupportedModelError(f"{arch} GGUF with expert_weights_scale={scale}")
        num_layers = int(value("block_count"))
        if any(f"blk.{i}.ffn_gate_inp.weight" not in tensor_names for i in range(num_layers)):
            raise ModelLoadError(f"a {arch} GGUF needs a router (ffn_gate_inp) in every layer")
        return (
            super()._gguf_config_extra(metadata, tensor_names)
            | {
                "num_experts": int(value("expert_count")),
                "num_experts_per_tok": int(value("expert_used_count")),
                "moe_intermediate_size": int(value("expert_feed_forward_length")),
                "norm_topk_prob": cls.gguf_renormalizes,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
            | cls._gguf_shared_experts(value)
        )

    @classmethod
    def _gguf_shared_experts(cls, value: Any) -> dict[str, Any]:
        if int(value("expert_shared_count", 0)):
            raise UnsupportedModelError(f"{cls.gguf_architecture} GGUF with shared experts")
        return {}

    @classmethod
    def gguf_layer_tensors(cls) -> dict[str, str]:
        return super().gguf_layer_tensors() | {"ffn_gate_inp": "mlp.gate"}

    @classmethod
    def checkpoint_tensors(
        cls, gguf_name: str, weight: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        experts = split_stacked_experts(gguf_name, weight)
        yield from experts if experts is not None else super().checkpoint_tensors(gguf_name, weight)


def gated_mlp_shard(name: str, width: int, what: str) -> tuple[int, int, int] | None:
    """The slice of an expert's (or shared expert's) tensor this rank
    loads: gate/up rows and down columns of its share of `width`."""
    if distributed.state().size == 1:
        return None
    first, count = distributed.even_shard(width, what)
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, first, count
    if ".down_proj.weight" in name:
        return 1, first, count
    return None


def split_stacked_experts(
    gguf_name: str, weight: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """`blk.3.ffn_up_exps.weight` (or `.bias`) [experts, rows, ...] -> one
    `model.layers.3.mlp.experts.{e}.up_proj.weight` per expert; None for a
    tensor that is not a stack of experts."""
    parts = gguf_name.split(".")
    if not (len(parts) == 4 and parts[0] == "blk" and parts[2] in _STACKED_EXPERTS):
        return None
    _, layer, stem, suffix = parts
    projection = _STACKED_EXPERTS[stem]
    return (
        (f"model.layers.{layer}.mlp.experts.{e}.{projection}.{suffix}", weight[e])
        for e in range(weight.shape[0])
    )
