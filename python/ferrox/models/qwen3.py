"""Qwen3: the Llama decoder with a per-head RMSNorm on queries and keys."""

from ferrox.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
