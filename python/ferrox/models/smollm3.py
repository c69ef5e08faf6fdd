"""SmolLM3: the Llama decoder in which some layers use no position encoding
(NoPE: `no_rope_layers[i] == 0`, every fourth layer by default); the others
rotate queries and keys as Llama does.

Its optional sliding window (`use_sliding_window`, on the NoPE layers only)
is handled as for every model with one: transformers' `layer_types` say
which layers keep a window (`models.llama.layer_windows`).

GGUF (llama.cpp's `smollm3`): Llama's tensors, names and Q/K row order; the
file records no NoPE pattern, llama.cpp's graph fixes it at every fourth
layer (the transformers default), and so does this reader.
"""

from typing import Any, ClassVar

from transformers import SmolLM3Config

from ferrox.common.errors import ModelLoadError
from ferrox.layers.attention import AttentionBackend
from ferrox.models.base import gguf_value
from ferrox.models.llama import LlamaForCausalLM

# llama.cpp's smollm3 graph: layer i rotates unless (i + 1) % 4 == 0.
GGUF_NO_ROPE_INTERVAL = 4


class SmolLM3ForCausalLM(LlamaForCausalLM):
    supports_lora = False  # (not yet verified against peft)
    architectures: ClassVar[tuple[str, ...]] = ("SmolLM3ForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "smollm3"
    gguf_config_class: ClassVar[Any] = SmolLM3Config

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

    @classmethod
    def _gguf_config_extra(cls, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        layers = int(gguf_value(metadata, "smollm3", "block_count"))
        no_rope = [int((i + 1) % GGUF_NO_ROPE_INTERVAL != 0) for i in range(layers)]
        return super()._gguf_config_extra(metadata, tensor_names) | {
            "no_rope_layers": no_rope,
            "no_rope_layer_interval": GGUF_NO_ROPE_INTERVAL,
            "use_sliding_window": False,
        }
