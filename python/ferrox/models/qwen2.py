"""Qwen2: the Llama decoder with biases on the Q, K and V projections."""

from ferrox.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
