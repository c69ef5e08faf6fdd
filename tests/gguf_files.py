"""Synthetic GGUF files for tests: llama.cpp's tensor names and Q/K row
order, written with the gguf package from random Hugging Face weights."""

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, PretrainedConfig

_GGUF_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused tensors
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBALS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_SMALL = dict(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


# Gemma 3's four norms, as llama.cpp names them.
_GEMMA3_GGUF_PARTS = _GGUF_PARTS | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GGUF_GLOBALS:
        return _GGUF_GLOBALS[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    parts = {"gemma3": _GEMMA3_GGUF_PARTS, "hybrid": _HYBRID_GGUF_PARTS}.get(arch, _GGUF_PARTS)
    return f"blk.{layer}.{parts[module]}.{suffix}"


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Llama's Q/K rows: half-split -> interleaved."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def _write_gguf(
    path: Path,
    arch: str,
    config: PretrainedConfig,
    tensors: dict[str, np.ndarray],
    types: dict[str, Q] | None = None,
    tokenizer_model: str = "gpt2",
    pre: str = "qwen2",
    rope_freq_base: float = 10000.0,
    extra_metadata: dict[str, int | float | str] | None = None,
    rotary_dim: int | None = None,
) -> None:
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.rope.dimension_count", rotary_dim or head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", rope_freq_base)
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        else:
            writer.add_float32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([*_byte_alphabet(), "\u0120t", "<|endoftext|>"])
    writer.add_token_types([1] * 257 + [3])
    writer.add_token_merges(["\u0120 t"])
    writer.add_eos_token_id(257)
    for name, array in tensors.items():
        qtype = (types or {}).get(name, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif qtype == Q.Q4_K:  # (the gguf package cannot quantize to it)
            writer.add_tensor(name, quantize_q4_k(array), raw_dtype=qtype)
        elif qtype == Q.Q6_K:  # (nor to this)
            writer.add_tensor(name, quantize_q6_k(array), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """[rows, K] float (K a multiple of 256) -> Q4_K bytes [rows, K / 256 * 144]:
    per sub-block of 32 an unsigned 4-bit code over [min(x, 0), max(x)], its
    scale and minimum as 6-bit multiples of the super-block's d and dmin."""
    rows, k = weight.shape
    x = weight.astype(np.float32).reshape(rows, k // 256, 8, 32)
    low = np.minimum(x.min(-1), 0.0)  # [R, S, 8]
    scale = (x.max(-1) - low) / 15
    d = np.maximum(scale.max(-1, keepdims=True), 1e-8) / 63  # [R, S, 1]
    dmin = np.maximum((-low).max(-1, keepdims=True), 1e-8) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin), 0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    q = np.clip(np.round((x + (dmin * mn)[..., None]) / step), 0, 15).astype(np.uint8)
    packed = np.empty((rows, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    groups = q.reshape(rows, k // 256, 4, 2, 32)
    qs = (groups[:, :, :, 0] | (groups[:, :, :, 1] << 4)).reshape(rows, k // 256, 128)
    out = np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(rows, k // 256, 2),
            dmin.astype(np.float16).view(np.uint8).reshape(rows, k // 256, 2),
            packed,
            qs,
        ],
        axis=-1,
    )
    return out.reshape(rows, -1)


def _random_model(
    config_class: type[PretrainedConfig], tied: bool, **overrides: object
) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    config = config_class(**{**_SMALL, "tie_word_embeddings": tied, **overrides})
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    return config, weights


def write_qwen3_moe_gguf(
    path: Path, source: Path, expert_type: Q = Q.F32, arch: str = "qwen3moe"
) -> None:
    """The tiny Qwen3-MoE (or, `arch` "qwen2moe", Qwen2-MoE) checkpoint at
    `source` (every layer sparse, 258 tokens) as llama.cpp's converter writes
    it: the router as `ffn_gate_inp`, each layer's experts stacked into
    `ffn_{gate,up,down}_exps` [experts, rows, columns] in `expert_type`, a
    shared expert as `ffn_{gate,up,down}_shexp` and its gate as
    `ffn_gate_inp_shexp`, the rest in float32."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    weights = load_file(source / "model.safetensors")
    tensors: dict[str, np.ndarray] = {}
    types: dict[str, Q] = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp."
        tensors[f"blk.{layer}.ffn_gate_inp.weight"] = weights.pop(f"{prefix}gate.weight").numpy()
        for projection, stem in (("gate", "gate"), ("up", "up"), ("down", "down")):
            stacked = [
                weights.pop(f"{prefix}experts.{e}.{projection}_proj.weight")
                for e in range(config.num_experts)
            ]
            name = f"blk.{layer}.ffn_{stem}_exps.weight"
            tensors[name] = torch.stack(stacked).numpy()
            types[name] = expert_type
            shared = weights.pop(f"{prefix}shared_expert.{projection}_proj.weight", None)
            if shared is not None:
                tensors[f"blk.{layer}.ffn_{stem}_shexp.weight"] = shared.numpy()
        gate = weights.pop(f"{prefix}shared_expert_gate.weight", None)
        if gate is not None:
            tensors[f"blk.{layer}.ffn_gate_inp_shexp.weight"] = gate.numpy()
    tensors |= {_gguf_name(name): weight.numpy() for name, weight in weights.items()}
    metadata = {
        "expert_count": config.num_experts,
        "expert_used_count": config.num_experts_per_tok,
        "expert_feed_forward_length": config.moe_intermediate_size,
    }
    if arch == "qwen2moe":
        metadata["expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    _write_gguf(path, arch, config, tensors, types, extra_metadata=metadata)


def write_gpt_oss_gguf(path: Path, source: Path, expert_type: Q = Q.F32) -> None:
    """The tiny gpt-oss checkpoint at `source` (258 tokens) as llama.cpp's
    converter writes it: the sinks as `attn_sinks`, the router as
    `ffn_gate_inp` (with its bias), each layer's experts stacked and their
    interleaved gate/up columns split into `ffn_gate_exps` / `ffn_up_exps`
    [experts, rows, columns] (with biases) in `expert_type`, YaRN in
    `rope.scaling.*`; no Q/K row permutation."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    weights = load_file(source / "model.safetensors")
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.router": "ffn_gate_inp",
    }
    tensors: dict[str, np.ndarray] = {}
    types: dict[str, Q] = {}
    for name, weight in weights.items():
        if name in _GGUF_GLOBALS:
            tensors[_GGUF_GLOBALS[name]] = weight.numpy()
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "self_attn.sinks":
            tensors[f"{blk}.attn_sinks.weight"] = weight.numpy()
        elif rest == "mlp.experts.gate_up_proj":  # [E, hidden, 2 I]
            stacked = weight.transpose(1, 2)
            for stem, rows in (("gate", stacked[:, 0::2]), ("up", stacked[:, 1::2])):
                tensors[f"{blk}.ffn_{stem}_exps.weight"] = rows.contiguous().numpy()
                types[f"{blk}.ffn_{stem}_exps.weight"] = expert_type
        elif rest == "mlp.experts.gate_up_proj_bias":
            tensors[f"{blk}.ffn_gate_exps.bias"] = weight[:, 0::2].contiguous().numpy()
            tensors[f"{blk}.ffn_up_exps.bias"] = weight[:, 1::2].contiguous().numpy()
        elif rest == "mlp.experts.down_proj":  # [E, I, hidden]
            tensors[f"{blk}.ffn_down_exps.weight"] = weight.transpose(1, 2).contiguous().numpy()
            types[f"{blk}.ffn_down_exps.weight"] = expert_type
        elif rest == "mlp.experts.down_proj_bias":
            tensors[f"{blk}.ffn_down_exps.bias"] = weight.numpy()
        else:
            module, suffix = rest.rsplit(".", 1)
            tensors[f"{blk}.{parts[module]}.{suffix}"] = weight.numpy()
    rope = config.rope_parameters
    metadata: dict[str, int | float | str] = {
        "expert_count": config.num_local_experts,
        "expert_used_count": config.num_experts_per_tok,
        "expert_feed_forward_length": config.intermediate_size,
        "attention.sliding_window": config.sliding_window,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": int(rope["original_max_position_embeddings"]),
    }
    _write_gguf(
        path, "gpt-oss", config, tensors, types,
        rope_freq_base=float(rope["rope_theta"]), extra_metadata=metadata,
    )  # fmt: skip


# The hybrids' (Qwen3.5, Qwen3-Next) tensors as llama.cpp names them.
_HYBRID_GGUF_PARTS = _GGUF_PARTS | {
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def _tile_value_heads(t: torch.Tensor, dim: int, key_heads: int, head: int) -> torch.Tensor:
    """Value heads along `dim` from grouped order (value head j of key head
    g at g * per_key + j) to llama.cpp's tiled one (at j * key_heads + g)."""
    shape = list(t.shape)
    split = t.reshape(*shape[:dim], key_heads, -1, head, *shape[dim + 1 :])
    return split.transpose(dim, dim + 1).reshape(shape)


def write_hybrid_gguf(path: Path, source: Path, arch: str) -> None:
    """A tiny Qwen3.5 (`qwen35`) or Qwen3-Next (`qwen3next`) checkpoint as
    llama.cpp's converter writes it: 1 + w norms stored as 1 + w (not the
    linear layers' gated norm), A as -exp(A_log) in `ssm_a`, dt_bias as
    `ssm_dt.bias`, the convolution squeezed to [channels, kernel];
    Qwen3.5's value heads tiled in every tensor indexed by them; Qwen3-Next's
    fused `in_proj_qkvz` split into `attn_qkv` (all q, all k, all v) and
    `attn_gate`, its `in_proj_ba` kept as `ssm_ba`."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    tiled = arch == "qwen35" and hk != hv
    qk = 2 * hk * dk
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in load_file(source / "model.safetensors").items():
        if ".mlp.experts." in name:  # stacked per layer and projection, as llama.cpp does
            _, _, layer, _, _, e, proj, _ = name.split(".")
            experts.setdefault(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", {})[
                int(e)
            ] = w
            continue
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            w = w + 1
        if name.endswith(".A_log"):
            w = -torch.exp(w)
        if name.endswith(".in_proj_qkvz.weight"):  # (Qwen3-Next)
            per_key = w.reshape(hk, -1, w.shape[-1])
            q, k, v, z = per_key.split([dk, dk, hv // hk * dv, hv // hk * dv], dim=1)
            flat = [t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)]
            stem = name.removesuffix(".in_proj_qkvz.weight")
            tensors[_gguf_name(stem + ".in_proj_qkv.weight", "hybrid")] = torch.cat(
                flat[:3]
            ).numpy()
            tensors[_gguf_name(stem + ".in_proj_z.weight", "hybrid")] = flat[3].numpy()
            continue
        if tiled and ".linear_attn." in name:
            if name.endswith(".in_proj_qkv.weight"):
                w = torch.cat((w[:qk], _tile_value_heads(w[qk:], 0, hk, dv)))
            elif name.endswith(".in_proj_z.weight"):
                w = _tile_value_heads(w, 0, hk, dv)
            elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
                w = _tile_value_heads(w, 0, hk, 1)
            elif name.endswith(".conv1d.weight"):
                w = torch.cat((w[:qk], _tile_value_heads(w[qk:], 0, hk, dv)))
            elif name.endswith(".out_proj.weight"):
                w = _tile_value_heads(w, 1, hk, dv)
        if name.endswith(".conv1d.weight"):
            w = w.squeeze(1)
        if name.endswith(".A_log"):
            gguf_name = f"blk.{name.split('.')[2]}.ssm_a"
        elif name.endswith(".dt_bias"):
            gguf_name = f"blk.{name.split('.')[2]}.ssm_dt.bias"
        else:
            gguf_name = _gguf_name(name, "hybrid")
        tensors[gguf_name] = w.contiguous().numpy()
    for gguf_name, by_expert in experts.items():
        tensors[gguf_name] = torch.stack([by_expert[e] for e in sorted(by_expert)]).numpy()
    head_dim = config.head_dim
    rotary = int(head_dim * config.rope_parameters["partial_rotary_factor"])
    metadata: dict[str, int | float | str] = {
        "ssm.conv_kernel": config.linear_conv_kernel_dim,
        "ssm.state_size": dk,
        "ssm.group_count": hk,
        "ssm.time_step_rank": hv,
        "ssm.inner_size": hv * dv,
        "full_attention_interval": 4,
    }
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if getattr(config, key, None):
            gguf_key = {
                "num_experts": "expert_count",
                "num_experts_per_tok": "expert_used_count",
                "moe_intermediate_size": "expert_feed_forward_length",
            }[key]
            metadata[gguf_key] = getattr(config, key)
    if getattr(config, "shared_expert_intermediate_size", None):
        metadata["expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    _write_gguf(path, arch, config, tensors, extra_metadata=metadata, rotary_dim=rotary)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """[rows, K] float (K a multiple of 256) -> Q6_K bytes [rows, K / 256 * 210]:
    per sub-block of 16 a signed 6-bit code (stored plus 32) times its int8
    scale times the super-block's d; the codes' low nibbles in `ql`, their
    high two bits in `qh`, in ggml's order (each half of 128 values: four
    runs of 32, the first and third sharing `ql`'s bytes, ...)."""
    rows, k = weight.shape
    blocks = rows * (k // 256)
    x = weight.astype(np.float32).reshape(blocks, 16, 16)
    scale = np.abs(x).max(-1) / 31  # [B, 16]
    d = (np.maximum(scale.max(-1, keepdims=True), 1e-8) / 127).astype(np.float16)  # [B, 1]
    sc = np.clip(np.round(scale / d.astype(np.float32)), 1, 127).astype(np.int8)
    step = (d.astype(np.float32) * sc)[..., None]
    q = (np.clip(np.round(x / step), -32, 31) + 32).astype(np.uint8).reshape(blocks, 2, 4, 32)
    lo = q & 15
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], -1)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
    qh |= (q[:, :, 3] >> 4) << 6  # [B, 2, 32]
    out = np.concatenate(
        [ql.reshape(blocks, 128), qh.reshape(blocks, 64), sc.view(np.uint8), d.view(np.uint8)],
        axis=-1,
    )
    return out.reshape(rows, -1)
