//! Python bindings of ferrox-core: argument extraction, GIL release around
//! every core call, and error mapping. No scheduling logic lives here.

mod allocator;
mod convert;
mod decoder_layer;
mod errors;
mod gated_delta_layer;
mod kernels;
mod lora;
mod moe;
mod radix;
mod scheduler;

use ferrox_core::FinishReason;
use pyo3::prelude::*;

#[pymodule(gil_used = false)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<allocator::PyBlockAllocator>()?;
    m.add_class::<decoder_layer::CpuDecoderLayer>()?;
    m.add_class::<gated_delta_layer::CpuGatedDeltaLayer>()?;
    m.add_class::<moe::CpuMoeExperts>()?;
    m.add_class::<lora::CpuLoraLayer>()?;
    m.add_class::<radix::PyRadixCache>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<scheduler::PyBatchPlan>()?;
    m.add_class::<scheduler::PyStepEvents>()?;
    m.add_class::<scheduler::PySchedulerStats>()?;
    // Finish-reason codes of `StepEvents.finish_reasons` (0: still running).
    m.add("FINISH_STOP", FinishReason::Stop as u8)?;
    m.add("FINISH_LENGTH", FinishReason::Length as u8)?;
    m.add("FINISH_ABORT", FinishReason::Abort as u8)?;
    m.add_function(wrap_pyfunction!(kernels::paged_attention_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::rotary_in_place_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gated_delta_decode_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::add_rms_norm_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::apply_token_bitmask_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::quant_matmul_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::quant_gated_matmul_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gate_rows_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::dequantize_rows_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::quant_matmul_kernel_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::pack_blocks_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::quant_layout_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::cpu_isa, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
