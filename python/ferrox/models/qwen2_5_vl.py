"""Qwen2.5-VL: a vision transformer whose merged patches take the place of
a prompt's image placeholder tokens in the Qwen2 decoder, which rotates by
multimodal RoPE (three position streams: temporal, height, width).

The vision tower (`visual`):
- patch embedding: each patch of `temporal_patch_size x patch_size^2`
  pixels of three channels (the image processor's flattened rows) times one
  weight (a Conv3d whose stride is its kernel: a matmul);
- blocks of RMSNorm -> attention (2-D rotary over the patch's row and
  column, bidirectional) -> RMSNorm -> SwiGLU MLP with biases; most blocks
  attend inside windows of `window_size` pixels, those in
  `fullatt_block_indexes` over the whole image;
- the merger: RMSNorm, then each `spatial_merge_size^2` neighbouring
  patches concatenated -> Linear -> GELU -> Linear to the decoder's width:
  one placeholder token per merged patch.

The processor lays an image's patches out merge block by merge block, and
the windowed blocks see them reordered window by window (`window_order`);
the merged output is put back in the placeholders' order (merged rows
row-major). M-RoPE (`mrope_positions`): text tokens advance all three
streams together; an image's tokens take (start, start + row, start +
column), and the text after it starts at start + max(rows, columns). Past
the prompt every stream is the token's index plus the prompt's `delta`, so
decode steps rotate with plain RoPE at that position (and the CPU's fused
decode runs them).

Checkpoint names: transformers 5's (`model.visual.*`,
`model.language_model.*`, `lm_head.*`) and the original release's
(`visual.*`, `model.*`). Not supported: video inputs, tensor parallelism,
LoRA, GGUF (llama.cpp keeps the vision tower in a separate mmproj file).
"""

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ferrox.common.errors import UnsupportedModelError
from ferrox.common.multimodal import ImagePrompt
from ferrox.layers.attention import AttentionBackend
from ferrox.layers.norm import RMSNorm
from ferrox.layers.rotary import MRotaryEmbedding, RotaryEmbedding, rope_parameters
from ferrox.models.base import load_apart
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.qwen2 import Qwen2ForCausalLM
from ferrox.parallel import state as distributed


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        """x: [N, dim]; cos / sin: [N, head_dim]; `segments`: the lengths of
        the consecutive runs of patches that attend to each other."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate_half_form(q, cos, sin), _rotate_half_form(k, cos, sin)
        out = torch.empty_like(q)
        # Runs of equal length attend in one batched call.
        for length, starts in _runs_by_length(segments):
            index = (torch.tensor(starts)[:, None] + torch.arange(length)[None]).reshape(-1)
            qs, ks, vs = (t[index].view(len(starts), length, self.num_heads, -1) for t in (q, k, v))
            o = F.scaled_dot_product_attention(
                qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
            )
            out[index] = o.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        return self.proj(out.reshape(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act != "silu":
            raise UnsupportedModelError(f"vision hidden_act {act!r} is not supported")
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QuickGeluMlp(nn.Module):
    """Qwen2-VL's vision MLP: fc2(quick_gelu(fc1(x)))."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act != "quick_gelu":
            raise UnsupportedModelError(f"vision hidden_act {act!r} is not supported")
        self.fc1 = nn.Linear(dim, hidden, bias=True)
        self.fc2 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))


def _norm(dim: int, layer_norm: bool) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6) if layer_norm else RMSNorm(dim, 1e-6)


class VisionBlock(nn.Module):
    def __init__(self, config: Any, v1: bool) -> None:
        super().__init__()
        dim = vision_width(config, v1)
        self.norm1 = _norm(dim, v1)
        self.norm2 = _norm(dim, v1)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp: nn.Module = (
            QuickGeluMlp(dim, int(dim * config.mlp_ratio), config.hidden_act)
            if v1
            else VisionMlp(dim, config.intermediate_size, config.hidden_act)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int, layer_norm: bool) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = _norm(dim, layer_norm)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    """The Conv3d whose stride is its kernel, as one matmul over the
    processor's flattened patches (channels, time, rows, columns)."""

    def __init__(self, config: Any, v1: bool, bias: bool = False) -> None:
        super().__init__()
        self.in_features = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.proj = nn.Linear(self.in_features, vision_width(config, v1), bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.view(-1, self.in_features))


def vision_width(config: Any, v1: bool) -> int:
    """The vision blocks' width (Qwen2-VL names it embed_dim, its
    hidden_size being the merger's output)."""
    return int(config.embed_dim if v1 else config.hidden_size)


class VisionTransformer(nn.Module):
    """`v1`: Qwen2-VL's tower (LayerNorms, QuickGELU MLPs, every block over
    the whole image); else Qwen2.5-VL's."""

    def __init__(self, config: Any, v1: bool = False) -> None:
        super().__init__()
        width = vision_width(config, v1)
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        self.window_size = 0 if v1 else int(config.window_size)
        self.full_blocks = (
            set(range(config.depth)) if v1 else set(int(i) for i in config.fullatt_block_indexes)
        )
        self.head_dim = width // config.num_heads
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(params.get("rope_theta", 10000.0))
        self.patch_embed = PatchEmbed(config, v1)
        self.blocks = nn.ModuleList(VisionBlock(config, v1) for _ in range(config.depth))
        out = config.hidden_size if v1 else config.out_hidden_size
        self.merger = PatchMerger(out, width, self.merge, layer_norm=v1)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """pixels: [patches, in_features] of the images `grids` (t, h, w
        patches each), in the processor's order -> [merged patches, out]."""
        dtype = next(self.merger.ln_q.parameters()).dtype  # (linear layers may be packed)
        x = self.patch_embed(pixels.to(dtype))
        unit = self.merge * self.merge
        order, windows = window_order(
            grids, self.merge, max(self.window_size // self.patch_size, self.merge)
        )
        frames = [h * w for t, h, w in grids for _ in range(t)]
        cos, sin = rotary_angles(grids, self.merge, self.head_dim, self.rope_theta, x.device)
        perm = (torch.from_numpy(order)[:, None] * unit + torch.arange(unit)[None]).reshape(-1)
        perm = perm.to(x.device)
        x, cos, sin = x[perm], cos[perm], sin[perm]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_blocks else windows)
        merged = self.merger(x)
        return merged[torch.from_numpy(np.argsort(order)).to(x.device)]


def rotary_angles(
    grids: Sequence[Sequence[int]], merge: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's 2-D rotary cos / sin [N, head_dim]: its row over the
    first half of the rotated frequencies, its column over the second."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, dtype=torch.float32) * 4 / head_dim))
    rows, cols = patch_coordinates(grids, merge)
    freqs = torch.cat(
        (torch.from_numpy(rows)[:, None] * inv_freq, torch.from_numpy(cols)[:, None] * inv_freq),
        dim=-1,
    )
    freqs = torch.cat((freqs, freqs), dim=-1).to(device)
    return freqs.cos(), freqs.sin()


def _rotate_half_form(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, in float32. x: [N, H, D]; cos: [N, D]."""
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(dtype)


def _runs_by_length(segments: list[int]) -> list[tuple[int, list[int]]]:
    """Consecutive segments grouped by length: (length, their starts)."""
    groups: dict[int, list[int]] = {}
    start = 0
    for length in segments:
        if length:
            groups.setdefault(length, []).append(start)
        start += length
    return sorted(groups.items())


def patch_coordinates(grids: Sequence[Sequence[int]], merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, column) in its image, in the processor's order:
    merge block by merge block, each block's patches row-major."""
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    for t, h, w in grids:
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        for grid, out in ((r, rows), (c, cols)):
            out.append(np.tile(grid.reshape(shape).transpose(0, 2, 1, 3).reshape(-1), t))
    return np.concatenate(rows).astype(np.float32), np.concatenate(cols).astype(np.float32)


def window_order(
    grids: Sequence[Sequence[int]], merge: int, window_patches: int
) -> tuple[np.ndarray, list[int]]:
    """The merged patches (indices over all images) window by window, and
    each window's length in patches. A window is `window_patches // merge`
    merged patches on a side; windows tile each frame row-major, clipped at
    its edges."""
    side = max(1, window_patches // merge)
    order: list[np.ndarray] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grids:
        mh, mw = h // merge, w // merge
        index = np.arange(t * mh * mw).reshape(t, mh, mw) + base
        for frame in index:
            for top in range(0, mh, side):
                for left in range(0, mw, side):
                    block = frame[top : top + side, left : left + side].reshape(-1)
                    order.append(block)
                    lengths.append(block.size * merge * merge)
        base += t * mh * mw
    return np.concatenate(order), lengths


def mrope_positions(
    prompt_len: int, spans: Sequence[tuple[int, int, Sequence[int]]], merge: int
) -> tuple[np.ndarray, int]:
    """The [3, prompt_len] M-RoPE positions of a prompt whose images sit at
    `spans` (offset, tokens, (t, h, w) patches), and the delta that turns a
    later token's index into its position."""
    out = np.empty((3, prompt_len), dtype=np.int64)
    at = 0  # the next position
    done = 0  # tokens placed
    for offset, length, (t, h, w) in spans:
        out[:, done:offset] = np.arange(offset - done) + at
        at += offset - done
        mh, mw = h // merge, w // merge
        tt, rr, cc = np.meshgrid(np.arange(t), np.arange(mh), np.arange(mw), indexing="ij")
        out[:, offset : offset + length] = np.stack((tt, rr, cc)).reshape(3, -1) + at
        at += max(mh, mw)
        done = offset + length
    out[:, done:] = np.arange(prompt_len - done) + at
    return out, int(out.max()) + 1 - prompt_len if prompt_len else 0


class QwenVisionLanguage(LlamaForCausalLM):
    """What the Qwen VL families share over their decoder (the class after
    this one in a family's bases): the vision tower at `visual`, M-RoPE,
    the image interface the engine calls (models/base.py), and the
    checkpoint's vision tensors."""

    gguf_architecture: ClassVar[str | None] = None
    supports_lora = False
    supports_images: ClassVar[bool] = True
    # Parameters `load_weights` fills itself (the Llama loader skips them).
    own_modules: ClassVar[tuple[str, ...]] = ("visual.",)
    # M-RoPE's frequency sections when the config names none, and their layout.
    default_sections: ClassVar[list[int]] = [16, 24, 24]
    interleaved_sections: ClassVar[bool] = False
    partial_rotary: ClassVar[bool] = False  # the decoder rotates part of each head

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        if distributed.state().size > 1:
            raise UnsupportedModelError(
                f"{type(self).__name__} runs on one rank: its vision tower is not sharded "
                "(tensor_parallel_size must be 1)"
            )
        super().__init__(config, backend)
        vision = config.vision_config
        self.visual = self.vision_tower(vision)
        self.image_token_id = int(config.image_token_id)
        self.merge = int(vision.spatial_merge_size)
        self.patch_features = cast(PatchEmbed, self.visual.patch_embed).in_features

    def vision_tower(self, config: Any) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def language_config(cls, config: Any) -> Any:
        text = config.text_config
        text.architectures = list(config.architectures or [])
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        text.vision_config = config.vision_config
        text.image_token_id = config.image_token_id
        return text

    def rotary_tables(self, context_length: int | None) -> list[RotaryEmbedding]:
        config = self.config
        params = rope_parameters(config)
        sections = list(params.get("mrope_section") or self.default_sections)
        rotary = MRotaryEmbedding(
            self.head_dim,
            config.max_position_embeddings,
            params,
            sections,
            interleaved=self.interleaved_sections,
            partial=self.partial_rotary,
        )
        return [rotary] * config.num_hidden_layers

    # ---- images --------------------------------------------------------------

    def image_prompt(self) -> ImagePrompt:
        """The chat template writes the image token once per image; it is
        repeated for each of the image's merged patches."""
        return ImagePrompt(self.image_token_id, self.image_token_id)

    def image_tokens(self, grid: Sequence[int]) -> int:
        """The placeholder tokens of an image of (t, h, w) patches."""
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def check_image(self, grid: Sequence[int], shape: Sequence[int]) -> str | None:
        """Why an image of this grid and pixel shape cannot run, or None."""
        if len(grid) != 3 or len(shape) != 2:
            return "it needs a (t, h, w) grid and 2-D pixel rows"
        t, h, w = grid
        if min(t, h, w) <= 0 or h % self.merge or w % self.merge:
            return f"its grid {list(grid)} is not a positive multiple of the merge size"
        if list(shape) != [t * h * w, self.patch_features]:
            return (
                f"its pixel values have shape {list(shape)}, expected "
                f"[{t * h * w}, {self.patch_features}] for grid {list(grid)}"
            )
        return None

    def encode_images(self, pixels: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """[patches, features] of the images `grids` -> their placeholder
        embeddings [tokens, hidden], image after image."""
        return self.visual(pixels, grids)

    def mrope_positions(
        self, prompt_len: int, spans: Sequence[tuple[int, int, Sequence[int]]]
    ) -> tuple[np.ndarray, int]:
        return mrope_positions(prompt_len, spans, self.merge)

    # ---- weights ---------------------------------------------------------------

    @staticmethod
    def module_of(name: str) -> str:
        vision = _vision_name(name)
        if vision is not None:
            return "visual." + vision.removesuffix(".weight").removesuffix(".bias")
        return LlamaForCausalLM.module_of(_text_name(name))

    def shard_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        return None  # one rank (checked in __init__)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def own(name: str) -> str | None:
            vision = _vision_name(name)
            return None if vision is None else "visual." + vision

        def adjust(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if name == "visual.patch_embed.proj.weight":
                return tensor.reshape(tensor.shape[0], -1)  # the Conv3d as a matmul
            return tensor

        load_apart(self, weights, own, _text_name, adjust, super().load_weights)


def _vision_name(name: str) -> str | None:
    """The vision tower's own name of checkpoint tensor `name`, or None."""
    for prefix in ("model.visual.", "visual."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def _text_name(name: str) -> str:
    """transformers 5's decoder names as the Llama loader reads them."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


class Qwen2_5_VLForConditionalGeneration(QwenVisionLanguage, Qwen2ForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2_5_VLForConditionalGeneration",)

    def vision_tower(self, config: Any) -> nn.Module:
        return VisionTransformer(config)


class Qwen2VLForConditionalGeneration(QwenVisionLanguage, Qwen2ForCausalLM):
    """Qwen2-VL: the same decoder and M-RoPE under the first tower (LayerNorm,
    QuickGELU MLPs, no windows)."""

    architectures: ClassVar[tuple[str, ...]] = ("Qwen2VLForConditionalGeneration",)

    def vision_tower(self, config: Any) -> nn.Module:
        return VisionTransformer(config, v1=True)
