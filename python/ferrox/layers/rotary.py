"""Rotary position embeddings (half-split layout), with the `linear`,
`llama3` and YaRN (`yarn`: gpt-oss) frequency scalings and LongRoPE
(`longrope`: Phi-3). Reads both the older (`rope_theta`
/ `rope_scaling`) and the newer (`rope_parameters`) Hugging Face config
styles.

LongRoPE divides each frequency by a factor: the short factors while the
context fits the pretraining length (`original_max_position_embeddings`),
the long ones beyond it, and scales cos and sin by an attention factor.
transformers switches per forward pass, by the longest position in it;
ferrox decides once, by the engine's context length (as llama.cpp does by
its context size), so that a request's keys never mix the two sets and its
tokens do not depend on what else runs."""

import math
from typing import Any

import torch
from torch import nn

from ferrox._native import rotary_in_place_cpu
from ferrox.common.errors import UnsupportedModelError
from ferrox.layers.native import kernel_threads, on_cpu_fp32


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of a HF config as one dict with `rope_type` and
    `rope_theta`; `layer_type`: those of one kind of layer, for configs that
    give each its own (Gemma 3: "sliding_attention", "full_attention")."""
    params = getattr(config, "rope_parameters", None)
    if layer_type is not None and isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    return out


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    inv_freq: torch.Tensor, head_dim: int, max_position: int, params: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the
    pretraining length are divided by `factor`, those turning more than
    `beta_fast` times are kept, a linear ramp blends the ones between; cos
    and sin are scaled by the attention factor (0.1 ln(factor) + 1, or as the
    config's mscales say)."""
    base = float(params["rope_theta"])
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency as pretrained (extrapolated)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention)


def _longrope(
    head_dim: int, max_position: int, params: dict[str, Any], context_length: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE's per-frequency factors (short or long, by `context_length`)
    and its attention factor."""
    original = int(params["original_max_position_embeddings"])
    key = "long_factor" if context_length > original else "short_factor"
    factors = torch.tensor(params[key], dtype=torch.float32)
    if factors.shape != (head_dim // 2,):
        raise UnsupportedModelError(
            f"rope {key} has {factors.numel()} entries, expected {head_dim // 2}"
        )
    attention = params.get("attention_factor")
    if attention is None:
        scale = params.get("factor") or max_position / original
        attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    return factors, float(attention)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        context_length: int | None = None,
        partial: bool = False,
    ) -> None:
        """`context_length`: the longest sequence the engine runs (LongRoPE
        picks its factors by it; default `max_position`). `partial`: the
        family honours `partial_rotary_factor` (only the first
        `rotary_dim` dimensions of each head rotate, the rest pass)."""
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in ("default", "linear", "llama3", "longrope", "yarn"):
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported")
        factor = float(params.get("partial_rotary_factor", 1.0))
        if factor != 1.0 and not (partial and rope_type in ("default", "linear")):
            raise UnsupportedModelError(
                "partial rotary embeddings (partial_rotary_factor < 1) are not supported for "
                f"this family{' with rope type ' + repr(rope_type) if partial else ''}"
            )
        self.head_dim = head_dim
        head_dim = self.rotary_dim = int(head_dim * factor)
        if head_dim <= 0 or head_dim % 2:
            raise UnsupportedModelError(
                f"rotary dimension {head_dim} is not a positive even number"
            )
        base = float(params["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponents)  # [head_dim / 2]
        attention = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq, attention = _yarn(inv_freq, head_dim, max_position, params)
        elif rope_type == "longrope":
            factors, attention = _longrope(
                head_dim, max_position, params, context_length or max_position
            )
            inv_freq = inv_freq / factors
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos_cache", freqs.cos() * attention, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention, persistent=False)

    cos_cache: torch.Tensor  # [max_position, head_dim / 2]
    sin_cache: torch.Tensor

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        """Rotates the first `num_heads` heads of x in place.

        positions: [T]; x: [T, heads, D] (queries, then keys, then others)."""
        if self.rotary_dim != self.head_dim:  # partial: the first rotary_dim rotate
            cos = self.cos_cache[positions].unsqueeze(1)
            sin = self.sin_cache[positions].unsqueeze(1)
            part = x[:, :num_heads, : self.rotary_dim]
            x[:, :num_heads, : self.rotary_dim] = _rotate(part, cos, sin)
            return
        if on_cpu_fp32(x, self.cos_cache) and x.is_contiguous() and positions.dtype == torch.int64:
            rotary_in_place_cpu(
                x.numpy(),
                num_heads,
                positions.contiguous().numpy(),
                self.cos_cache.numpy(),
                self.sin_cache.numpy(),
                kernel_threads(),
            )
            return
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D / 2]
        sin = self.sin_cache[positions].unsqueeze(1)
        x[:, :num_heads] = _rotate(x[:, :num_heads], cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    cos, sin = cos.to(dtype), sin.to(dtype)
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D / 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (the Qwen VL families): three position streams
    (temporal, height, width), each rotating its share of a head's
    frequencies: `sections` (summing to head_dim / 2) as consecutive runs
    (Qwen2-VL, Qwen2.5-VL), or `interleaved` (Qwen3-VL: frequency j of the
    first 3 x sections[1] takes the height stream when j % 3 == 1, of the
    first 3 x sections[2] the width stream when j % 3 == 2, the rest the
    temporal one). Positions [3, T] for a step with image tokens; [T] where
    the three streams agree (text: then this is plain RoPE, and the native
    rotary kernel runs)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        sections: list[int],
        interleaved: bool = False,
        partial: bool = False,
    ) -> None:
        """`partial`: as RotaryEmbedding's (Qwen3.5: only the first
        `partial_rotary_factor` of each head rotates; the sections cover
        those dimensions)."""
        super().__init__(head_dim, max_position, params, partial=partial)
        half = self.rotary_dim // 2
        if len(sections) != 3 or sum(sections) != half:
            raise UnsupportedModelError(
                f"mrope_section {sections} must be three sections summing to the rotary "
                f"dimension / 2 ({half})"
            )
        axis = torch.zeros(half, dtype=torch.int64)
        if interleaved:
            for stream in (1, 2):
                axis[stream : 3 * sections[stream] : 3] = stream
        else:
            axis[sections[0] : sections[0] + sections[1]] = 1
            axis[sections[0] + sections[1] :] = 2
        self.register_buffer("axis_of", axis, persistent=False)  # each frequency's stream

    axis_of: torch.Tensor

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        if positions.dim() == 1:
            super().rotate_(positions, x, num_heads)
            return
        t = positions.shape[1]
        index = self.axis_of.view(1, 1, -1).expand(1, t, -1)
        cos = self.cos_cache[positions].gather(0, index)[0].unsqueeze(1)  # [T, 1, D / 2]
        sin = self.sin_cache[positions].gather(0, index)[0].unsqueeze(1)
        d = self.rotary_dim
        x[:, :num_heads, :d] = _rotate(x[:, :num_heads, :d], cos, sin)
