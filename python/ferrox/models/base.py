"""What a model family's file declares, and what the generic loader and the
runner ask of a model (`models/llama.py` is the reference implementation;
docs/adding-a-model.md walks through adding one).

A family is one class (with subclasses for close relatives) that says:
- its Hugging Face `architectures` names and, if llama.cpp has it, its GGUF
  architecture name, how GGUF metadata becomes its config and how llama.cpp's
  tensor names become checkpoint names (`config_from_gguf`, `checkpoint_name`,
  `checkpoint_tensors`, `from_gguf_tensor`);
- its layers (the module tree built in `__init__` at this rank's size);
- where each checkpoint tensor goes (`module_of`, `load_weights`) and which
  slice of it a tensor-parallel rank loads (`shard_of`);
- the per-request state each layer needs (`layer_states`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ferrox.common.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.attention.base import AttentionBackend, AttentionMetadata, KvCache


@dataclass(frozen=True)
class FullAttention:
    """A layer whose per-request state is the paged KV of every position
    (this rank's KV heads)."""

    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class SlidingWindowAttention:
    """A layer that attends over the last `window` positions only (each
    position sees itself and the `window - 1` before it): paged KV in the
    window pool, whose blocks behind every window go back while a request
    runs."""

    num_kv_heads: int
    head_dim: int
    window: int


@dataclass(frozen=True)
class LinearAttentionState:
    """A linear-attention layer (Gated DeltaNet) whose per-request state has
    a fixed size whatever the sequence's length: the last `conv_kernel - 1`
    inputs of its causal convolution over `conv_dim` channels, and a
    `k_head_dim x v_head_dim` matrix per value head. It lives in the state
    pool, one slot per running sequence (the Rust core's state slots): the
    convolution's inputs in float32, the matrices in float32 or bfloat16
    (`EngineConfig.mamba_ssm_cache_dtype`)."""

    conv_dim: int
    conv_kernel: int
    num_heads: int
    k_head_dim: int
    v_head_dim: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.k_head_dim, self.v_head_dim)

    def num_bytes(self, recurrent_itemsize: int = 4) -> int:
        """One sequence's state in this layer, its matrices' elements of
        `recurrent_itemsize` bytes."""
        conv = self.conv_dim * (self.conv_kernel - 1)
        return 4 * conv + recurrent_itemsize * self.num_heads * self.k_head_dim * self.v_head_dim


# The kinds of per-layer state the runner and the Rust core manage.
LayerState = FullAttention | SlidingWindowAttention | LinearAttentionState


def gguf_token_fields(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The config fields every GGUF family reads alike: whether the LM head
    is the embedding (no `output.weight`), and the special token ids."""
    return {
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def gguf_value(metadata: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    """`{arch}.{key}` from GGUF metadata; a missing key without a default is
    a ModelLoadError."""
    found = metadata.get(f"{arch}.{key}", default)
    if found is None:
        raise ModelLoadError(f"GGUF metadata lacks '{arch}.{key}'")
    return found


class CausalLM(nn.Module):
    """The interface of a model family's class. The loader builds it on the
    meta device (`cls(hf_config, attention_backend)`), materialises it, calls
    `reset_buffers`, feeds `load_weights` the checkpoint's (name, tensor)
    pairs (each narrowed by `shard_of` under tensor parallelism) and
    `prepare_fused_decode`; the runner sizes the KV cache from
    `layer_states` and calls `forward` and `compute_logits`."""

    # Hugging Face `architectures` names the class serves.
    architectures: ClassVar[tuple[str, ...]] = ()
    # Whether the family's layers honour a config's sliding window (where
    # the attention backend does too); otherwise the loader caps the
    # context at the window.
    implements_sliding_window: ClassVar[bool] = False
    # llama.cpp's name for the family in GGUF files; None: no GGUF support.
    gguf_architecture: ClassVar[str | None] = None
    vocab_size: int
    fused_decode: Any
    # Whether decode steps may be captured in CUDA graphs (False where a
    # layer's work depends on values read back to the host: MoE routing).
    supports_cuda_graphs: ClassVar[bool] = True
    # False for a checkpoint without an LM head (an embedding model's base
    # model): it serves embedding requests only.
    generates: bool = True
    # A sequence classifier's labels (`*ForSequenceClassification`; its
    # head is the submodule `score`, as Hugging Face names it); None for
    # other models.
    labels: list[str] | None = None
    # A head made from LM-head rows (classifier_from_token): those tokens.
    score_from_tokens: list[str] | None = None
    # Whether LoRA adapters run on this family (`lora_targets`, `lora_sites`).
    supports_lora: ClassVar[bool] = False
    # Whether prompts may hold images (a vision-language family: it has
    # `image_token_id`, `image_prompt`, `image_tokens`, `check_image`,
    # `encode_images` and, for M-RoPE, `mrope_positions`;
    # docs/architecture.md, "Images").
    supports_images: ClassVar[bool] = False
    # Whether an image's tokens attend to each other in both directions
    # (Gemma 3): each image is then computed in one prefill chunk.
    bidirectional_images: ClassVar[bool] = False
    # Why this model, as loaded, refuses images (its attention backend
    # lacks what they need), or None.
    image_refusal: str | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KvCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden] (a family with images)
    ) -> torch.Tensor:  # [T, hidden]
        raise NotImplementedError

    @classmethod
    def language_config(cls, config: Any) -> Any:
        """The config the engine reads (sizes, context, special tokens) and
        the model is built from: the checkpoint's own, or, for a family that
        nests its decoder's (a vision-language one's `text_config`), that
        one, carrying what the family needs of the rest."""
        return config

    def derive_score_head(self, token_ids: list[int]) -> None:
        """Fills the classifier head from the LM-head rows of `token_ids`
        (the ids of `score_from_tokens`)."""
        raise NotImplementedError

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """[P, hidden] final hidden states of pooled rows -> what a pooling
        request returns: the classifier's logits [P, labels], else the
        states themselves."""
        head = self._modules.get("score")
        return hidden if head is None else head(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab] float32 (every rank's vocabulary)."""
        raise NotImplementedError

    def layer_states(self) -> list[LayerState]:
        raise NotImplementedError

    @property
    def attention_backend(self) -> AttentionBackend:
        """The attention backend the layers run (one for the whole model)."""
        raise NotImplementedError

    @staticmethod
    def module_of(name: str) -> str:
        """The module (our name) checkpoint tensor `name` loads into."""
        raise NotImplementedError

    def shard_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """The (dim, start, length) slice of checkpoint tensor `name` this
        rank loads, or None for the whole tensor."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def reset_buffers(self, device: torch.device, context_length: int) -> None:
        """After the parameters were materialised: builds the buffers on
        `device`. `context_length`: the engine's longest sequence
        (max_model_len), for schemes that depend on it (LongRoPE)."""
        raise NotImplementedError

    @classmethod
    def checkpoint_block_plan(cls, config: Any) -> dict[str, str]:
        """Modules (our names) a safetensors checkpoint holds in a block
        format the kernels run (gpt-oss's MXFP4 experts), and that format."""
        return {}

    def prepare_fused_decode(self) -> bool:
        """Once the weights are loaded: whether decode steps run one native
        call per layer (the CPU's fused decode)."""
        return False

    def lora_targets(self) -> Any:
        """The modules a LoRA adapter may adapt (a `common.lora.LoraTargets`)."""
        raise UnsupportedModelError(f"{type(self).__name__} serves no LoRA adapters")

    def lora_sites(self) -> list[Any]:
        """The linear layers those modules live in (`layers.lora.LoraSite`s)."""
        raise UnsupportedModelError(f"{type(self).__name__} serves no LoRA adapters")

    # GGUF (only for a family with a gguf_architecture)

    @classmethod
    def config_from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> Any:
        raise UnsupportedModelError(f"{cls.__name__} has no GGUF support")

    @classmethod
    def checkpoint_name(cls, gguf_name: str) -> str:
        raise UnsupportedModelError(f"{cls.__name__} has no GGUF support")

    @classmethod
    def checkpoint_tensors(
        cls, gguf_name: str, weight: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors (name, tensor) one GGUF tensor holds: by
        default itself, named by `checkpoint_name`; a family that stacks
        tensors (a layer's experts) splits them here."""
        yield cls.checkpoint_name(gguf_name), weight

    @classmethod
    def from_gguf_tensor(cls, name: str, weight: torch.Tensor, config: Any) -> torch.Tensor:
        return weight


def load_apart(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    own_name: Callable[[str], str | None],
    text_name: Callable[[str], str],
    adjust: Callable[[str, torch.Tensor], torch.Tensor | None],
    load_text: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
) -> None:
    """Loads a checkpoint whose tensors of the family's own modules
    (`own_modules`: a vision tower) the family copies itself: `own_name`
    gives such a tensor's parameter name (None for the decoder's, renamed by
    `text_name` and passed on to `load_text`), `adjust` its value as the
    parameter holds it (None: a tensor the model does not use). Every own
    parameter must be filled (ModelLoadError)."""
    own_modules = tuple(getattr(model, "own_modules", ()))
    params = {k: p for k, p in model.named_parameters() if k.startswith(own_modules)}
    loaded: set[str] = set()

    def text() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            own = own_name(name)
            if own is None:
                yield text_name(name), tensor
                continue
            value = adjust(own, tensor)
            if value is None:
                continue
            param = params.get(own)
            if param is None:
                raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint")
            if param.shape != value.shape:
                raise ModelLoadError(
                    f"tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value)
            loaded.add(own)

    load_text(text())
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
