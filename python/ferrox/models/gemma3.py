"""Gemma 3, text only (`Gemma3ForCausalLM`: the 1B model and text
checkpoints): the Llama decoder with

- four norms per layer: the attention output and the MLP output are
  normalised before they join the residual stream, the MLP input has a norm
  of its own (`pre_feedforward_layernorm`);
- RMSNorms that scale by `1 + w`: folded into the weights at load, so the
  layers run ferrox's plain RMSNorm (llama.cpp's GGUF files store `1 + w`
  already);
- RMSNorm on queries and keys, scores scaled by `query_pre_attn_scalar`,
  GeGLU (tanh GELU) MLPs, embeddings multiplied by sqrt(hidden_size);
- interleaved local and global layers (`layer_types`): each kind has its own
  rotary base (and scaling). The local layers attend over a sliding window
  (`models.llama.layer_windows`), their KV in the window pool whose blocks
  behind the window go back while a request runs (docs/architecture.md,
  "Sliding windows"); under an attention backend without windows the
  context is capped at the window, inside which local and global attention
  are the same.

Decode steps on the CPU run fused (layers/cpu_decoder.py: the native
layer takes the two extra norms and the GELU gate). Logit soft-capping
(Gemma 2) and bidirectional attention are refused.

GGUF (llama.cpp's `gemma3`): its files store the norms as `1 + w` and leave
three things to the reader, which this family reads as llama.cpp does: the
layer pattern (`attention.sliding_window_pattern`, default every sixth layer
global), the local rotary base (`rope.freq_base_swa`, default 10000), and
the score scale (head_dim, except the 62-layer 27B model's hidden / heads).
"""

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma3TextConfig

from ferrox.common.errors import UnsupportedModelError
from ferrox.common.multimodal import ImagePrompt
from ferrox.layers.attention import AttentionBackend, AttentionMetadata
from ferrox.layers.attention.base import KvCache
from ferrox.layers.norm import RMSNorm
from ferrox.layers.rotary import RotaryEmbedding, rope_parameters
from ferrox.models.base import gguf_token_fields, gguf_value, load_apart
from ferrox.models.llama import DecoderAttention, GatedMlp, LlamaForCausalLM
from ferrox.parallel import state as distributed

LAYER_TYPES = ("sliding_attention", "full_attention")


class GeGluMlp(GatedMlp):
    activation: ClassVar[str] = "gelu_tanh"


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, backend: type[AttentionBackend]):
        super().__init__()
        scale = float(config.query_pre_attn_scalar) ** -0.5
        self.self_attn = DecoderAttention(
            config, rotary, backend, bool(config.attention_bias), qk_norm=True, scale=scale
        )
        self.mlp = GeGluMlp(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,  # [T, hidden]: the previous layer's (normalised) MLP output
        residual: torch.Tensor | None,  # [T, hidden]: the stream before it
        kv: KvCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm.add_forward(residual, x)
        attn = self.post_attention_layernorm(self.self_attn(positions, normed, kv, meta))
        normed, residual = self.pre_feedforward_layernorm.add_forward(residual, attn)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual

    def fused_norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        return (
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )


class Gemma3ForCausalLM(LlamaForCausalLM):
    supports_lora = False  # (not yet verified against peft)
    architectures: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "gemma3"
    gguf_config_class: ClassVar[Any] = Gemma3TextConfig
    gguf_rotary_interleaved: ClassVar[bool] = False

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise UnsupportedModelError(f"Gemma: {name} is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("Gemma: bidirectional attention is not supported")
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers or set(types) - set(LAYER_TYPES):
            raise UnsupportedModelError(
                f"Gemma: layer_types must give one of {LAYER_TYPES} per layer, got {types}"
            )
        super().__init__(config, backend)
        self.embed_scale = float(config.hidden_size) ** 0.5

    def decoder_layer(
        self, config: Any, rotary: RotaryEmbedding, backend: type[AttentionBackend], index: int
    ) -> nn.Module:
        return Gemma3DecoderLayer(config, rotary, backend)

    def rotary_tables(self, context_length: int | None) -> list[RotaryEmbedding]:
        """One table per kind of layer (its own base and scaling)."""
        config = self.config
        tables = {
            kind: RotaryEmbedding(
                self.head_dim,
                config.max_position_embeddings,
                rope_parameters(config, kind),
                context_length,
            )
            for kind in set(config.layer_types)
        }
        return [tables[kind] for kind in config.layer_types]

    def decoder_layers(self) -> list[Any]:
        return cast(list[Any], list(self.layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_norms_plus_one(weights))

    # ---- GGUF --------------------------------------------------------------

    @classmethod
    def config_from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> Any:
        def value(key: str, default: Any = None) -> Any:
            return gguf_value(metadata, "gemma3", key, default)

        hidden, heads = int(value("embedding_length")), int(value("attention.head_count"))
        num_layers = int(value("block_count"))
        head_dim = int(value("attention.key_length", 256))
        window = int(value("attention.sliding_window", 0) or 0)
        pattern = value("attention.sliding_window_pattern", 6)
        if not window:
            local = [False] * num_layers
        elif isinstance(pattern, list):
            local = [bool(p) for p in pattern][:num_layers]
        else:
            n = int(pattern)
            local = [n == 0 or i % n < n - 1 for i in range(num_layers)]
        scaling = value("rope.scaling.type", "none")
        global_rope: dict[str, Any] = {"rope_type": "default"}
        if scaling == "linear":
            global_rope = {"rope_type": "linear", "factor": float(value("rope.scaling.factor"))}
        elif scaling != "none":
            raise UnsupportedModelError(f"Gemma 3 GGUF with rope scaling {scaling!r}")
        global_rope["rope_theta"] = float(value("rope.freq_base", 1_000_000.0))
        local_rope = {"rope_type": "default", "rope_theta": float(value("rope.freq_base_swa", 1e4))}
        return Gemma3TextConfig(
            architectures=[cls.architectures[0]],
            vocab_size=value("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
            hidden_size=hidden,
            intermediate_size=int(value("feed_forward_length")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(value("attention.head_count_kv", heads)),
            head_dim=head_dim,
            query_pre_attn_scalar=hidden // heads if num_layers == 62 else head_dim,
            max_position_embeddings=int(value("context_length")),
            rms_norm_eps=float(value("attention.layer_norm_rms_epsilon")),
            sliding_window=window or None,
            layer_types=["sliding_attention" if w else "full_attention" for w in local],
            rope_parameters={"sliding_attention": local_rope, "full_attention": global_rope},
            final_logit_softcapping=metadata.get("gemma3.final_logit_softcapping"),
            **gguf_token_fields(metadata, tensor_names),
        )

    @classmethod
    def gguf_layer_tensors(cls) -> dict[str, str]:
        return super().gguf_layer_tensors() | {
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        }

    @classmethod
    def from_gguf_tensor(cls, name: str, weight: torch.Tensor, config: Any) -> torch.Tensor:
        """llama.cpp stores Gemma's norms as 1 + w: back to the checkpoint's w."""
        return weight - 1 if name.endswith("norm.weight") else weight


def _norms_plus_one(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma's RMSNorms scale by 1 + w: ferrox's scale by w."""
    for name, tensor in weights:
        yield name, (tensor + 1 if name.endswith("norm.weight") else tensor)


# ---- Gemma 3 with images ---------------------------------------------------


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape  # [images, patches, dim]: each image's patches see each other

        def heads(proj: nn.Module) -> torch.Tensor:
            return proj(x).view(n, length, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        )
        return self.out_proj(out.transpose(1, 2).reshape(n, length, dim))


class SiglipMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, eps = int(config.hidden_size), float(config.layer_norm_eps)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = SiglipAttention(dim, int(config.num_attention_heads))
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = SiglipMlp(dim, int(config.intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVision(nn.Module):
    """SigLIP's vision transformer (without its pooling head): patches of
    `patch_size` pixels (a Conv2d whose stride is its kernel), learned
    positions, pre-norm blocks over the whole image, a final LayerNorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh",):
            raise UnsupportedModelError(f"SigLIP with activation {config.hidden_act!r}")
        dim, patch = int(config.hidden_size), int(config.patch_size)
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(
            int(config.num_channels), dim, kernel_size=patch, stride=patch
        )
        num_patches = (int(config.image_size) // patch) ** 2
        self.embeddings.position_embedding = nn.Embedding(num_patches, dim)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            SiglipLayer(config) for _ in range(int(config.num_hidden_layers))
        )
        self.post_layernorm = nn.LayerNorm(dim, eps=float(config.layer_norm_eps))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, patches, dim]
        embeddings = cast(Any, self.embeddings)
        x = embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        x = x + embeddings.position_embedding.weight
        for layer in cast(Any, self.encoder).layers:
            x = layer(x)
        return cast(torch.Tensor, self.post_layernorm(x))


class Gemma3Projector(nn.Module):
    """Each image's patch grid average-pooled to `tokens` cells, RMSNorm
    (`1 + w`, folded at load), then one matmul to the decoder's width."""

    def __init__(self, vision: Any, text_width: int, tokens: int) -> None:
        super().__init__()
        self.patches_per_side = int(vision.image_size) // int(vision.patch_size)
        side = math.isqrt(tokens)
        if side * side != tokens or self.patches_per_side % side:
            raise UnsupportedModelError(
                f"Gemma 3: {tokens} tokens per image do not pool a "
                f"{self.patches_per_side}x{self.patches_per_side} patch grid evenly"
            )
        self.kernel = self.patches_per_side // side
        dim = int(vision.hidden_size)
        self.mm_soft_emb_norm = RMSNorm(dim, float(vision.layer_norm_eps))
        self.mm_input_projection_weight = nn.Parameter(torch.empty(dim, text_width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, patches, dim] -> [N, tokens, width]
        n, _, dim = x.shape
        grid = x.transpose(1, 2).reshape(n, dim, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 with images (the 4B, 12B and 27B models): SigLIP's tower
    over each image resized to `image_size` square, pooled to
    `mm_tokens_per_image` rows that take the place of the image tokens.
    The processor writes each image as `\\n\\n<start_of_image>`, the image
    tokens, `<end_of_image>\\n\\n`; an image's tokens attend to each other in
    both directions in every decoder layer (the scheduler computes each
    image in one chunk; the attention backend masks by `image_spans`), the
    rest of the prompt causally. Positions are plain (1-D RoPE), and image
    rows are not scaled by the embedding scale.

    Checkpoint names: the released ones (`language_model.model.*`,
    `vision_tower.vision_model.*`, `multi_modal_projector.*`) and
    transformers 5's (`model.language_model.*`, `model.vision_tower.*`).
    SigLIP's pooling head, when a checkpoint has one, is unused (Gemma reads
    the last hidden state). Not supported: pan-and-scan crops, tensor
    parallelism, LoRA, GGUF (llama.cpp keeps the tower in an mmproj file).
    """

    architectures: ClassVar[tuple[str, ...]] = ("Gemma3ForConditionalGeneration",)
    gguf_architecture: ClassVar[str | None] = None
    supports_images: ClassVar[bool] = True
    bidirectional_images: ClassVar[bool] = True
    own_modules: ClassVar[tuple[str, ...]] = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        if distributed.state().size > 1:
            raise UnsupportedModelError(
                "Gemma 3 with images runs on one rank: its vision tower is not sharded "
                "(tensor_parallel_size must be 1)"
            )
        super().__init__(config, backend)
        vision = config.vision_config
        self.tokens_per_image = int(config.mm_tokens_per_image)
        window = getattr(config, "sliding_window", None)
        if window and self.tokens_per_image > int(window):
            raise UnsupportedModelError(
                f"Gemma 3: {self.tokens_per_image} tokens per image exceed the sliding "
                f"window of {window}"
            )
        self.vision_tower = SiglipVision(vision)
        self.multi_modal_projector = Gemma3Projector(
            vision, int(config.hidden_size), self.tokens_per_image
        )
        self.image_token_id = int(config.image_token_id)
        self.boi_token_id = int(config.boi_token_id)
        self.eoi_token_id = int(config.eoi_token_id)
        self.image_size = int(vision.image_size)
        if not backend.supports_image_spans:
            self.image_refusal = (
                "Gemma 3's image tokens attend to each other in both directions, which the "
                f"{backend.name!r} attention backend does not implement yet "
                "(attention_backend='torch' runs them); its prompts are text only"
            )

    @classmethod
    def language_config(cls, config: Any) -> Any:
        text = config.text_config
        text.architectures = list(config.architectures or [])
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        text.vision_config = config.vision_config
        for name in ("image_token_id", "boi_token_id", "eoi_token_id", "mm_tokens_per_image"):
            setattr(text, name, getattr(config, name))
        return text

    # ---- images --------------------------------------------------------------

    def image_prompt(self) -> ImagePrompt:
        return ImagePrompt(
            self.boi_token_id,
            self.image_token_id,
            before=["\n\n", self.boi_token_id],
            after=[self.eoi_token_id, "\n\n"],
            tokens=self.tokens_per_image,
        )

    def image_tokens(self, grid: Sequence[int]) -> int:
        return self.tokens_per_image

    def check_image(self, grid: Sequence[int], shape: Sequence[int]) -> str | None:
        side = self.image_size
        if list(grid) or list(shape) != [1, 3, side, side]:
            return (
                f"its pixel values have shape {list(shape)} (grid {list(grid)}), expected "
                f"[1, 3, {side}, {side}] and no grid"
            )
        return None

    def encode_images(self, pixels: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """[N, 3, S, S] -> the images' placeholder embeddings [N * tokens, hidden]."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        rows = self.multi_modal_projector(self.vision_tower(pixels.to(dtype)))
        return rows.reshape(-1, rows.shape[-1])

    # ---- weights ---------------------------------------------------------------

    @staticmethod
    def module_of(name: str) -> str:
        own = _gemma_vision_name(name)
        if own is not None:
            return own.removesuffix(".weight").removesuffix(".bias")
        return LlamaForCausalLM.module_of(_gemma_text_name(name))

    def shard_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        return None  # one rank (checked in __init__)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def adjust(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
            if name.startswith("vision_tower.head."):
                return None  # SigLIP's pooling head: Gemma reads the last hidden state
            if name.endswith("mm_soft_emb_norm.weight"):
                return tensor + 1  # Gemma's RMSNorm scales by 1 + w
            return tensor

        load_apart(
            self, weights, _gemma_vision_name, _gemma_text_name, adjust, super().load_weights
        )


def _gemma_vision_name(name: str) -> str | None:
    """Our name of a vision tower or projector tensor, or None for the decoder's."""
    for prefix, ours in (
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return None


def _gemma_text_name(name: str) -> str:
    """The decoder's tensors as the Llama loader names them."""
    for prefix, ours in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name
