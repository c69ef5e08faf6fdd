//! CPU kernels for the ferrox model runner. Pure Rust on plain slices; the
//! Python bindings hand in numpy views of torch tensors.

pub mod activation;
pub mod decoder_layer;
pub mod elementwise;
pub mod f32_matmul;
pub mod gated_delta;
pub mod gated_delta_layer;
pub mod isa;
pub mod kv_element;
pub mod lora;
pub mod moe;
pub mod paged_attention;
pub mod pool;
pub mod quant_matmul;
#[cfg(target_arch = "x86_64")]
pub mod quant_matmul_amx;
#[cfg(target_arch = "x86_64")]
mod quant_matmul_avx2;
#[cfg(target_arch = "x86_64")]
mod quant_matmul_panel;
#[cfg(target_arch = "x86_64")]
mod quant_matmul_vnni;
pub mod quant_pack;
pub mod token_bitmask;

pub use activation::Gate;
pub use decoder_layer::{
    decoder_layer, quant_matmul_gated_kept, DecoderLayerStep, DecoderLayerWeights, DenseMlp,
    LayerLinear, LinearWeight,
};
pub use elementwise::{add_rms_norm, rotary_in_place, rotary_partial_in_place, RotaryHeads};
pub use f32_matmul::{f32_matmul, F32MatmulArgs};
pub use gated_delta::{gated_delta_decode, Bf16, GatedDeltaDecode, StateElement};
pub use gated_delta_layer::{gated_delta_layer, GatedDeltaLayerStep, GatedDeltaLayerWeights};
pub use kv_element::{f32_to_f16, KvElement, F16};
pub use lora::LoraLayer;
pub use moe::{moe_experts, route, ExpertWeights, MoeArgs, Router};
pub use paged_attention::{
    paged_attention, paged_attention_with_isa, PagedAttentionArgs, ShapeError,
};
pub use quant_matmul::{
    dequantize_rows, quant_matmul, quant_matmul_gated, quant_matmul_invariant, quant_matmul_with,
    QuantFormat, QuantKernel, QuantMatmulArgs, QuantShapeError,
};
pub use quant_pack::{pack_blocks, unpack_blocks, BlockLayout};
pub use token_bitmask::{apply_token_bitmask, BitmaskError};
