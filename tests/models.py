"""Tiny random-weight models for tests, and transformers as the oracle."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SmolLM3Config,
)

VOCAB_SIZE = 320
# The hybrid (Qwen3.5 / Qwen3-Next) layers of the tiny models: three linear
# layers, then attention.
QWEN3_5_LAYERS: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
# Four norms a layer (1 + w), GeGLU, a local and a global layer with their
# own rotary bases (the global one scaled); the window lies beyond the test
# prompts.
GEMMA3: dict[str, Any] = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    tie_word_embeddings=True,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=128,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    },
)

# name -> (config class, options): GQA, odd head counts, tied and untied.
TINY_SPECS: dict[str, tuple[type, dict[str, Any]]] = {
    "llama-gqa-tied": (
        LlamaConfig,
        dict(
            hidden_size=96, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True
        ),
    ),
    "llama-mha-untied": (
        LlamaConfig,
        dict(
            hidden_size=80, num_attention_heads=5, num_key_value_heads=5, tie_word_embeddings=False
        ),
    ),
    "llama3-rope-scaling": (
        LlamaConfig,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            rope_theta=500000.0,
        ),
    ),
    "qwen2": (
        Qwen2Config,
        dict(
            hidden_size=96, num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=False
        ),
    ),
    "qwen3": (
        Qwen3Config,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ),
    # The second of its two layers has no position encoding (NoPE).
    "smollm3": (
        SmolLM3Config,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            no_rope_layers=[1, 0],
            pad_token_id=None,  # its default, 128004, lies outside this vocabulary
        ),
    ),
    # Fused qkv and gate/up tensors.
    "phi3": (
        Phi3Config,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            pad_token_id=None,
        ),
    ),
    # Granite's four scalars, each far from 1 (a multiplier left out moves
    # every logprob); the logits' divisor small, so greedy picks stay clear.
    "granite": (
        GraniteConfig,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            embedding_multiplier=6.0,
            attention_multiplier=0.4,
            residual_multiplier=0.3,
            logits_scaling=1.5,
            pad_token_id=None,
        ),
    ),
    "gemma3": (Gemma3TextConfig, GEMMA3),
    # The same with a window of 8 positions, well inside the test prompts:
    # the local layer reads the window pool, whose blocks behind the window
    # go back while a request runs.
    "gemma3-window": (
        Gemma3TextConfig,
        dict(
            GEMMA3,
            sliding_window=8,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        ),
    ),
    # Every layer with a sliding window of 6 (Mistral 7B v0.1's kind): no
    # full-attention memory at all.
    "mistral-window": (
        MistralConfig,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            sliding_window=6,
        ),
    ),
    # Attention sinks, a window of 8 on every other layer, q/k/v/o biases,
    # YaRN, four experts (two a token) with biases and clamped SwiGLUs behind
    # a router with a bias.
    "gpt-oss": (
        GptOssConfig,
        dict(
            hidden_size=64,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=1.0,  # (small: the clamps bite)
            sliding_window=8,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
                "rope_theta": 150000.0,
            },
        ),
    ),
    # Eight experts, two a token, their weights as the router's softmax gives them.
    "qwen3-moe": (
        Qwen3MoeConfig,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
        ),
    ),
    # Qwen2-MoE: q/k/v biases, four experts (two a token, not renormalised)
    # and a shared expert behind a sigmoid gate; the first layer dense.
    "qwen2-moe": (
        Qwen2MoeConfig,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
    ),
    # A dense first layer, then experts (three of six a token, renormalised).
    "qwen3-moe-dense-layer": (
        Qwen3MoeConfig,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    # Qwen3.5: three Gated DeltaNet layers then an attention layer (gated
    # queries, partial rotary); two value heads per key head.
    "qwen3.5": (
        Qwen3_5TextConfig,
        dict(
            architectures=["Qwen3_5ForCausalLM"],
            **QWEN3_5_LAYERS,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        ),
    ),
    # Qwen3.5-MoE: the same layers with eight experts (two a token,
    # renormalised) and a shared expert in each.
    "qwen3.5-moe": (
        Qwen3_5MoeTextConfig,
        dict(
            architectures=["Qwen3_5MoeForCausalLM"],
            **QWEN3_5_LAYERS,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
    # Qwen3-Next: fused linear-attention projections (three value heads per
    # key head), a dense first layer, experts without renormalisation.
    "qwen3-next": (
        Qwen3NextConfig,
        dict(
            architectures=["Qwen3NextForCausalLM"],
            **(QWEN3_5_LAYERS | dict(linear_num_value_heads=6)),
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            mlp_only_layers=[0],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        ),
    ),
    # LongRoPE, inside the pretraining length: the short factors.
    "phi3-longrope": (
        Phi3Config,
        dict(
            hidden_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            pad_token_id=None,
            original_max_position_embeddings=256,
            rope_scaling=dict(
                rope_type="longrope",
                short_factor=[1.0 + 0.25 * i for i in range(16)],
                long_factor=[1.0 + 3.0 * i for i in range(16)],
                original_max_position_embeddings=256,
            ),
        ),
    ),
}

TEXT = [
    "The quick brown fox jumps over the lazy dog. ",
    "Pack my box with five dozen liquor jugs! ",
    "Über café naïve — 中文 测试 😀 emoji 🚀. ",
    "def add(a, b):\n    return a + b\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 3.14159. ",
]


def train_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def build_tiny_model(path: Path, name: str, **overrides: Any) -> Path:
    """TINY_SPECS[name] (its config options replaced by `overrides`), saved
    with a tokenizer."""
    config_cls, spec = TINY_SPECS[name]
    options: dict[str, Any] = {"vocab_size": VOCAB_SIZE, **spec, **overrides}
    tokenizer = train_tokenizer()
    defaults: dict[str, Any] = dict(
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # Large weights make logits spread out, so greedy choices are not
        # near-ties that rounding could flip.
        initializer_range=0.25,
    )
    config = config_cls(**(defaults | options))
    torch.manual_seed(zlib.crc32(name.encode()))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if "qwen2" in name:
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
    if "gemma" in name or "qwen3.5" in name or "qwen3-next" in name:
        with torch.no_grad():  # its norms start at 1 + 0: make them matter
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    if name == "gpt-oss":
        with torch.no_grad():  # sinks that matter, expert and router biases
            for param_name, param in model.named_parameters():
                if param_name.endswith("sinks"):
                    param.normal_(1.0, 2.0)
                elif param_name.endswith(("_bias", "router.bias")):
                    param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_model_with_rounded_weights(path: Path, fmt: str) -> torch.nn.Module:
    """transformers with every linear weight rounded to the block format
    `fmt` and back (a tied head gets its own rounded copy; the embedding
    stays float): what ferrox's quantization=fmt computes with."""
    from ferrox.layers.quant_linear import dequantize, quantize

    hf = hf_model(path)
    with torch.no_grad():
        for module in list(hf.modules()):
            if isinstance(module, torch.nn.Linear):
                rounded = dequantize(quantize(module.weight, fmt), fmt, module.in_features)
                module.weight = torch.nn.Parameter(rounded, requires_grad=False)
    return hf


def round_like_the_block_kernel(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded the way the block kernel rounds activations: per 32-wide
    block, int8 with scale max|x| / 127."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return ((blocks * inverse).round() * scale).reshape(x.shape)


@torch.inference_mode()
def hf_greedy(
    model: torch.nn.Module, prompt: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers' forward pass with
    its own KV cache, one prompt alone; EOS does not stop it."""
    ids = torch.tensor([prompt])
    tokens: list[int] = []
    logprobs: list[float] = []
    past = None
    for _ in range(max_tokens):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        step = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tok = int(step.argmax())
        tokens.append(tok)
        logprobs.append(float(step[tok]))
        ids = torch.tensor([[tok]])
    return tokens, logprobs


def build_lora_adapter(
    base: Path,
    path: Path,
    *,
    rank: int,
    targets: list[str],
    alpha: float = 16.0,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """A random LoRA adapter for the model at `base`, saved by peft (its own
    format), with weights large enough to change greedy tokens. They are
    float16 values (the CPU holds adapters as float16), so that the oracle
    computes with the same weights."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    model = get_peft_model(hf_model(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_((torch.randn(param.shape, generator=gen) * 0.3).half().float())
    model.save_pretrained(path)
    return path


def hf_merged(base: Path, adapter: Path) -> torch.nn.Module:
    """transformers with peft's adapter merged into the base weights: the
    oracle of a request under that adapter."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(base), adapter).merge_and_unload().eval()


# The tiny Qwen2.5-VL: its image tokens, a chat template that writes an
# image part as Qwen's placeholder, and an image processor whose patches are
# few (images of up to 112 x 112 pixels: at most 16 merged patches each).
VL_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
VL_IMAGE_TOKEN = "<|image_pad|>"
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_vl_model(
    path: Path,
    text_options: dict[str, Any] | None = None,
    vision_options: dict[str, Any] | None = None,
    max_pixels: int = 112 * 112,
    test_weights: bool = True,
    family: str = "qwen2.5-vl",
) -> Path:
    """A random-weight Qwen2.5-VL (by default two decoder layers, two vision
    blocks: one windowed, one over the whole image), saved with its
    processor (images resized to at most `max_pixels`). The options replace
    the text and vision configs' sizes (benches/vision_chat.py's shapes);
    `test_weights=False` keeps transformers' initialisation (weights whose
    activations stay finite through many layers) instead of the large
    weights and biases that make greedy choices clear in tests. `family`:
    qwen2.5-vl, qwen2-vl (LayerNorms, QuickGELU MLPs, no windows) or
    qwen3-vl (DeepStack, interleaved M-RoPE, learned positions, 16-pixel
    patches), qwen3-vl-moe (the same over Qwen3-MoE's decoder), qwen3.5-vl
    (Qwen3-VL's tower without DeepStack under the hybrid decoder, partial
    interleaved M-RoPE) or qwen3.5-moe-vl."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [*VL_SPECIAL_TOKENS, VL_IMAGE_TOKEN]}
    )
    image_token_id = tokenizer.convert_tokens_to_ids(VL_IMAGE_TOKEN)
    start_id = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    text = dict(
        vocab_size=VOCAB_SIZE + 8,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # A small base: every frequency turns fast, so each M-RoPE stream matters.
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    ) | (text_options or {})
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
    ) | (vision_options or {})
    config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    patch = 14
    # Qwen3-VL's tower (Qwen3.5's is the same without DeepStack).
    qwen3_tower = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=36,
        hidden_act="gelu_pytorch_tanh",
    )
    if family in ("qwen3.5-vl", "qwen3.5-moe-vl"):
        config_class, model_class = Qwen3_5Config, Qwen3_5ForConditionalGeneration
        patch = 16
        text = text | QWEN3_5_LAYERS
        if family == "qwen3.5-moe-vl":
            config_class, model_class = Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
            moe = TINY_SPECS["qwen3.5-moe"][1]
            text |= {k: moe[k] for k in ("num_experts", "num_experts_per_tok")}
            text |= {
                k: moe[k] for k in ("moe_intermediate_size", "shared_expert_intermediate_size")
            }
        text["rope_parameters"] = TINY_SPECS["qwen3.5"][1]["rope_parameters"] | {
            "rope_theta": 100.0
        }
        vision = qwen3_tower | (vision_options or {})
    elif family in ("qwen3-vl", "qwen3-vl-moe"):
        config_class, model_class = Qwen3VLConfig, Qwen3VLForConditionalGeneration
        patch = 16
        text["head_dim"] = 16
        text["rope_parameters"] = text["rope_parameters"] | {"mrope_interleaved": True}
        vision = qwen3_tower | {"deepstack_visual_indexes": [0, 1]} | (vision_options or {})
        if family == "qwen3-vl-moe":
            config_class, model_class = Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
            # (experts 48 wide: their stacked tensors are not square)
            text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    elif family == "qwen2-vl":
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            mlp_ratio=2,
            num_heads=2,
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
        ) | (vision_options or {})
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=image_token_id,
        vision_start_token_id=start_id,
        tie_word_embeddings=False,
        initializer_range=0.25 if test_weights else 0.02,
    )
    config.text_config.initializer_range = config.initializer_range
    torch.manual_seed(7)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():  # make the biases and the norms matter
        for name, param in model.named_parameters() if test_weights else []:
            if name.endswith("bias") or name.endswith("norm.weight") or "ln_q" in name:
                param.normal_(0.0, 0.3 if "bias" in name else 1.0)
            elif "visual" in name and param.dim() == 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    side = 2 * patch  # the processor resizes to multiples of the merged patch
    processor = Qwen2VLImageProcessorPil(
        patch_size=patch, min_pixels=side * side, max_pixels=max_pixels
    )
    processor.save_pretrained(path)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


GEMMA3_VL_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_VL_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_tiny_gemma3_vl(
    path: Path,
    window: int = 24,
    tokens_per_image: int = 16,
    text_options: dict[str, Any] | None = None,
    vision_options: dict[str, Any] | None = None,
    test_weights: bool = True,
) -> Path:
    """A random-weight Gemma 3 with images: two decoder layers (one local,
    of `window` positions, one global), a two-block SigLIP tower over 64x64
    images in 8-pixel patches, pooled to `tokens_per_image` rows; saved with
    transformers' own Gemma 3 processor (which writes each image as
    `\\n\\n<start_of_image>`, the image tokens, `<end_of_image>\\n\\n`).
    The options replace the text and vision configs' (benches/vision_chat.py's
    shapes); `test_weights=False` keeps transformers' initialisation."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}
    )
    tokenizer.save_pretrained(path)
    boi, eoi, image = GEMMA3_VL_TOKENS
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        path, extra_special_tokens={"boi_token": boi, "eoi_token": eoi, "image_token": image}
    )
    tokenizer.chat_template = GEMMA3_VL_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(GEMMA3_VL_TOKENS)
    text = dict(
        GEMMA3,
        vocab_size=len(tokenizer),
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=window,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.15 if test_weights else 0.02,
    ) | (text_options or {})
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=64,
        patch_size=8,
        vision_use_head=False,
        hidden_act="gelu_pytorch_tanh",
    ) | (vision_options or {})
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=ids[0],
        eoi_token_index=ids[1],
        image_token_index=ids[2],
    )
    torch.manual_seed(11)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # make the biases, the norms and the projection matter
        for name, param in model.named_parameters() if test_weights else []:
            if name.endswith("bias") or "norm" in name:
                param.normal_(0.0, 0.3 if "bias" in name else 1.0)
            elif "vision_tower" in name and param.dim() >= 2:
                param.normal_(0.0, 0.2)
            elif "mm_input_projection" in name:
                param.normal_(0.0, 1.0)
    model.save_pretrained(path)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(
            size={"height": vision["image_size"], "width": vision["image_size"]}
        ),
        tokenizer=tokenizer,
        image_seq_length=tokens_per_image,
    )
    processor.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_image(seed: int, size: tuple[int, int] = (84, 112)) -> Any:
    """A deterministic RGB image (PIL) of `size` (width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    base = rng.integers(0, 256, (h // 7 + 1, w // 7 + 1, 3), dtype=np.uint8)
    return Image.fromarray(np.kron(base, np.ones((7, 7, 1), dtype=np.uint8))[:h, :w])
