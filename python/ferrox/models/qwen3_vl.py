"""Qwen3-VL (dense): the Qwen3 decoder (q/k norms) with interleaved M-RoPE
under a vision tower that adds DeepStack: the merged patches of some of its
blocks are added to the decoder's hidden states at the image's tokens after
its first layers.

The vision tower (`visual`, models/qwen2_5_vl.py has the shared parts):
- patch embedding with a bias, plus a learned square grid of position
  embeddings resized bilinearly (corners aligned) to each image's grid;
- blocks of LayerNorm -> attention (2-D rotary, over the whole image) ->
  LayerNorm -> MLP (tanh GELU), no windows;
- the merger: LayerNorm, the `spatial_merge_size^2` neighbours concatenated,
  Linear -> GELU -> Linear; the DeepStack mergers (one per block in
  `deepstack_visual_indexes`) normalise after concatenating.

`encode_images` returns each placeholder's embedding followed by its
DeepStack rows ([tokens, hidden x (1 + levels)]); the runner writes them
over the step's placeholders (text tokens get zeros there), and `forward`
adds level i to the hidden states after decoder layer i.

Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`: Qwen3-VL-30B-A3B,
235B-A22B) is the same over Qwen3-MoE's decoder (models/qwen3_moe.py), its
router always renormalising the top-k weights; its checkpoints stack each
layer's experts (`mlp.experts.gate_up_proj`, gate rows before up rows, and
`mlp.experts.down_proj`), as [experts, out, in] (transformers 5) or
transposed (the original release), told apart by shape (by the checkpoint's
transformers version when the two agree).

Videos, tensor parallelism and LoRA are not supported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.common.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.attention import AttentionMetadata
from ferrox.layers.attention.base import KvCache
from ferrox.models.qwen2_5_vl import (
    PatchEmbed,
    QwenVisionLanguage,
    VisionAttention,
    rotary_angles,
)
from ferrox.models.qwen3 import Qwen3ForCausalLM
from ferrox.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from ferrox.models.qwen3_moe import Qwen3MoeForCausalLM


class TanhGeluMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise UnsupportedModelError(f"vision hidden_act {act!r} is not supported")
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = TanhGeluMlp(dim, config.intermediate_size, config.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """`after_shuffle`: the norm runs over the concatenated neighbours (the
    DeepStack mergers) rather than over each patch."""

    def __init__(self, config: Any, after_shuffle: bool) -> None:
        super().__init__()
        dim = config.hidden_size
        self.width = dim * config.spatial_merge_size**2
        self.after_shuffle = after_shuffle
        self.norm = nn.LayerNorm(self.width if after_shuffle else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.after_shuffle else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.width))))


class VisionTower(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = int(config.spatial_merge_size)
        self.head_dim = config.hidden_size // config.num_heads
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(params.get("rope_theta", 10000.0))
        self.patch_embed = PatchEmbed(config, v1=False, bias=True)
        self.side = int(config.num_position_embeddings**0.5)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.merger = Merger(config, after_shuffle=False)
        # (Qwen3.5's tower has none)
        self.deepstack_layers = [int(i) for i in getattr(config, "deepstack_visual_indexes", [])]
        self.deepstack_merger_list = nn.ModuleList(
            Merger(config, after_shuffle=True) for _ in self.deepstack_layers
        )

    def forward(self, pixels: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        dtype = self.pos_embed.weight.dtype
        x = self.patch_embed(pixels.to(dtype)) + self._positions(grids).to(dtype)
        cos, sin = rotary_angles(grids, self.merge, self.head_dim, self.rope_theta, x.device)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_layers:
                levels.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](x))
        return torch.cat([self.merger(x), *levels], dim=1)

    def _positions(self, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """The learned grid resized to each image's patches, in the
        processor's merge-block order."""
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None]
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)
            m = self.merge
            grid = grid[0].view(-1, h // m, m, w // m, m).permute(1, 3, 2, 4, 0)
            out.append(grid.reshape(h * w, -1).repeat(t, 1))
        return torch.cat(out)


class Qwen3VLForConditionalGeneration(QwenVisionLanguage, Qwen3ForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3VLForConditionalGeneration",)
    default_sections: ClassVar[list[int]] = [24, 20, 20]
    interleaved_sections: ClassVar[bool] = True

    def vision_tower(self, config: Any) -> nn.Module:
        return VisionTower(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KvCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.config.hidden_size
        if inputs_embeds is None or inputs_embeds.shape[1] == hidden:
            return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds)
        t = inputs_embeds.shape[0]
        x = inputs_embeds[:, :hidden].contiguous()
        levels = inputs_embeds[:, hidden:].reshape(t, -1, hidden)  # zeros at text tokens
        residual: torch.Tensor | None = None
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(positions, x, residual, kv, meta)
            if i < levels.shape[1]:
                x = x + levels[:, i]
        return self.norm.add_forward(residual, x)[0]


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration, Qwen3MoeForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3VLMoeForConditionalGeneration",)

    @classmethod
    def language_config(cls, config: Any) -> Any:
        text = super().language_config(config)
        text.norm_topk_prob = True  # (the family's router always renormalises)
        text.stacked_experts_linear = _transformers_major(config) >= 5
        return text

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unstacked(weights))

    def _unstacked(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each layer's stacked experts as Qwen3-MoE's per-expert tensors."""
        config = self.config
        hidden, width = int(config.hidden_size), int(config.moe_intermediate_size)
        experts = int(config.num_experts)
        for name, tensor in weights:
            stem, _, leaf = name.rpartition(".experts.")
            if leaf not in ("gate_up_proj", "down_proj"):
                yield name, tensor
                continue
            out, inner = (2 * width, hidden) if leaf == "gate_up_proj" else (hidden, width)
            shape = tuple(tensor.shape)
            if shape == (experts, out, inner) and (out != inner or config.stacked_experts_linear):
                stacked = tensor
            elif shape == (experts, inner, out):
                stacked = tensor.transpose(1, 2)
            else:
                raise ModelLoadError(
                    f"tensor {name!r} has shape {shape}, expected {(experts, out, inner)} "
                    f"or {(experts, inner, out)}"
                )
            for e in range(experts):
                base = f"{stem}.experts.{e}"
                if leaf == "down_proj":
                    yield f"{base}.down_proj.weight", stacked[e]
                else:
                    yield f"{base}.gate_proj.weight", stacked[e, :width]
                    yield f"{base}.up_proj.weight", stacked[e, width:]


def _transformers_major(config: Any) -> int:
    version = str(getattr(config, "transformers_version", None) or "0")
    head = version.split(".")[0]
    return int(head) if head.isdigit() else 0


class Qwen3_5ForConditionalGeneration(QwenVisionLanguage, Qwen3_5ForCausalLM):
    """Qwen3.5 with its vision tower: Qwen3-VL's without DeepStack, under the
    hybrid decoder (models/qwen3_5.py), whose attention layers rotate the
    first `partial_rotary_factor` of each head by interleaved M-RoPE."""

    architectures: ClassVar[tuple[str, ...]] = ("Qwen3_5ForConditionalGeneration",)
    default_sections: ClassVar[list[int]] = [11, 11, 10]
    interleaved_sections: ClassVar[bool] = True
    partial_rotary: ClassVar[bool] = True

    def vision_tower(self, config: Any) -> nn.Module:
        return VisionTower(config)


class Qwen3_5MoeForConditionalGeneration(QwenVisionLanguage, Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE with its vision tower (as Qwen3_5ForConditionalGeneration)."""

    architectures: ClassVar[tuple[str, ...]] = ("Qwen3_5MoeForConditionalGeneration",)
    default_sections: ClassVar[list[int]] = [11, 11, 10]
    interleaved_sections: ClassVar[bool] = True
    partial_rotary: ClassVar[bool] = True

    def vision_tower(self, config: Any) -> nn.Module:
        return VisionTower(config)
