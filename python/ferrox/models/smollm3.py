"""SmolLM3: the Llama decoder in which some layers use no position encoding
(NoPE: `no_rope_layers[i] == 0`, every fourth layer by default); the others
rotate queries and keys as Llama does.

Its optional sliding window (`use_sliding_window`, on the NoPE layers only)
is handled as for every model with one: the context is capped at the window
(`loader.model_loader.resolve_max_model_len`), inside which it changes
nothing. GGUF files of this family are not read yet (llama.cpp's `smollm3`
architecture is refused by name).
"""

from typing import Any, ClassVar

from ferrox.common.errors import ModelLoadError
from ferrox.layers.attention import AttentionBackend
from ferrox.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("SmolLM3ForCausalLM",)
    gguf_architecture: ClassVar[str | None] = None

    def __init__(self, config: Any, backend: type[AttentionBackend]) -> None:
        super().__init__(config, backend)
        rope_layers = list(getattr(config, "no_rope_layers", None) or [])
        layers = self.decoder_layers()
        if len(rope_layers) != len(layers):
            raise ModelLoadError(
                f"no_rope_layers has {len(rope_layers)} entries for {len(layers)} layers"
            )
        for layer, use_rope in zip(layers, rope_layers, strict=True):
            layer.self_attn.use_rope = bool(use_rope)
