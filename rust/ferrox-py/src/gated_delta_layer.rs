//! `CpuGatedDeltaLayer`: a hybrid model's linear-attention decoder layer
//! (Gated DeltaNet, then the MLP), its weights held once, and its fused
//! decode-step forward (`ferrox_cpu::gated_delta_layer`).

use ferrox_cpu::{gated_delta_layer, GatedDeltaLayerStep, GatedDeltaLayerWeights};
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray2, PyReadwriteArray3,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::decoder_layer::{borrow_mlp, dense_mlp, gate_of, view_mlp, Linear, LinearSpec};
use crate::errors::invalid_argument;
use crate::kernels::{contiguous, contiguous_mut, with_states, StateArray};

/// A Gated DeltaNet layer over block-format or float32 projections, run
/// whole for decode steps (one token a row); its state lives in the pool
/// the caller passes.
#[pyclass(module = "ferrox._native", frozen)]
pub struct CpuGatedDeltaLayer {
    input_norm: Py<PyArray1<f32>>,
    post_attention_norm: Py<PyArray1<f32>>,
    eps: f32,
    /// q/k/v, the output gate z, the step sizes b, the decays a, the output.
    projections: [Linear; 5],
    conv: Py<PyArray2<f32>>,
    dt_bias: Py<PyArray1<f32>>,
    decay_scale: Py<PyArray1<f32>>,
    norm: Py<PyArray1<f32>>,
    mlp: Option<(Linear, Linear)>,
    activation: ferrox_cpu::Gate,
    key_heads: usize,
    value_heads: usize,
    k_dim: usize,
    v_dim: usize,
    tiled: bool,
}

#[pymethods]
impl CpuGatedDeltaLayer {
    /// Linear layers as `CpuDecoderLayer` takes them. `conv`: the depthwise
    /// convolution [C, K]; `dt_bias` and `decay_scale` (-exp(A_log)) [Hv];
    /// `norm`: the gated output norm's weight [Dv]; `gate_up` and `down` both
    /// None: no dense MLP (a mixture of experts follows). `tiled`: value head
    /// h reads key head h % key_heads (else h / (value_heads / key_heads)).
    #[new]
    #[pyo3(signature = (input_norm, post_attention_norm, eps, qkv, z, b, a, conv, dt_bias, decay_scale, norm, out, gate_up, down, key_heads, value_heads, k_dim, v_dim, tiled, activation="silu"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        input_norm: Bound<'_, PyArray1<f32>>,
        post_attention_norm: Bound<'_, PyArray1<f32>>,
        eps: f32,
        qkv: LinearSpec<'_>,
        z: LinearSpec<'_>,
        b: LinearSpec<'_>,
        a: LinearSpec<'_>,
        conv: Bound<'_, PyArray2<f32>>,
        dt_bias: Bound<'_, PyArray1<f32>>,
        decay_scale: Bound<'_, PyArray1<f32>>,
        norm: Bound<'_, PyArray1<f32>>,
        out: LinearSpec<'_>,
        gate_up: Option<LinearSpec<'_>>,
        down: Option<LinearSpec<'_>>,
        key_heads: usize,
        value_heads: usize,
        k_dim: usize,
        v_dim: usize,
        tiled: bool,
        activation: &str,
    ) -> PyResult<Self> {
        if key_heads == 0 || k_dim == 0 || v_dim == 0 || !value_heads.is_multiple_of(key_heads) {
            return Err(invalid_argument(format!(
                "bad linear-attention shape: {key_heads} key heads, {value_heads} value heads, \
                 dims {k_dim} and {v_dim}"
            )));
        }
        Ok(Self {
            input_norm: input_norm.unbind(),
            post_attention_norm: post_attention_norm.unbind(),
            eps,
            projections: [
                Linear::new(qkv)?,
                Linear::new(z)?,
                Linear::new(b)?,
                Linear::new(a)?,
                Linear::new(out)?,
            ],
            conv: conv.unbind(),
            dt_bias: dt_bias.unbind(),
            decay_scale: decay_scale.unbind(),
            norm: norm.unbind(),
            mlp: dense_mlp(gate_up, down)?,
            activation: gate_of(activation)?,
            key_heads,
            value_heads,
            k_dim,
            v_dim,
            tiled,
        })
    }

    /// The layer on a step of decode rows: `residual` and `x` ([B, hidden])
    /// as `CpuDecoderLayer.forward` updates them; `conv_states` [S, C, K - 1]
    /// (float32) and `states` [S, Hv, Dk, Dv] (float32, or bfloat16 as int16
    /// bits) are read and written at
    /// `slots` ([B], distinct); rows with `fresh` start from zero.
    #[pyo3(signature = (residual, x, conv_states, states, slots, fresh, num_threads))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        mut residual: PyReadwriteArray2<'_, f32>,
        mut x: PyReadwriteArray2<'_, f32>,
        mut conv_states: PyReadwriteArray3<'_, f32>,
        states: Bound<'_, PyAny>,
        slots: PyReadonlyArray1<'_, i64>,
        fresh: PyReadonlyArray1<'_, bool>,
        num_threads: usize,
    ) -> PyResult<()> {
        let conv = self.conv.bind(py).readonly();
        let (channels, kernel) = (conv.shape()[0], conv.shape()[1]);
        let states = StateArray::extract(&states)?;
        let states_shape = states.shape();
        if states_shape.len() != 4 {
            return Err(invalid_argument(format!(
                "states must be [S, Hv, Dk, Dv], got {states_shape:?}"
            )));
        }
        let (slots_shape, conv_shape) = (states_shape[0], conv_states.shape());
        let want = [self.value_heads, self.k_dim, self.v_dim];
        if conv_shape != [slots_shape, channels, kernel.saturating_sub(1)]
            || states_shape[1..] != want
        {
            return Err(invalid_argument(format!(
                "the state pools must be [S, {channels}, {}] and [S, {}, {}, {}], got {conv_shape:?} \
                 and {:?}",
                kernel.saturating_sub(1),
                want[0],
                want[1],
                want[2],
                states_shape
            )));
        }
        let [input_norm, post_attention_norm, dt_bias, decay_scale, norm] = [
            &self.input_norm,
            &self.post_attention_norm,
            &self.dt_bias,
            &self.decay_scale,
            &self.norm,
        ]
        .map(|v| v.bind(py).readonly());
        let arrays = self.projections.each_ref().map(|l| l.borrow(py));
        let [qkv, z, b, a, out] = [0, 1, 2, 3, 4].map(|i| self.projections[i].view(&arrays[i]));
        let mlp_arrays = borrow_mlp(py, &self.mlp);
        let weights = GatedDeltaLayerWeights {
            input_norm: contiguous(&input_norm)?,
            post_attention_norm: contiguous(&post_attention_norm)?,
            eps: self.eps,
            qkv: qkv?,
            z: z?,
            b: b?,
            a: a?,
            conv: contiguous(&conv)?,
            dt_bias: contiguous(&dt_bias)?,
            decay_scale: contiguous(&decay_scale)?,
            norm: contiguous(&norm)?,
            out: out?,
            mlp: view_mlp(&self.mlp, &mlp_arrays)?,
            activation: self.activation,
            key_heads: self.key_heads,
            value_heads: self.value_heads,
            k_dim: self.k_dim,
            v_dim: self.v_dim,
            tiled: self.tiled,
        };
        let step = GatedDeltaLayerStep {
            slots: contiguous(&slots)?,
            fresh: contiguous(&fresh)?,
            num_threads,
        };
        let residual = contiguous_mut(&mut residual, "residual")?;
        let x = contiguous_mut(&mut x, "x")?;
        let conv_states = contiguous_mut(&mut conv_states, "conv_states")?;
        with_states!(states, s => py.detach(|| {
            gated_delta_layer(&weights, &step, residual, x, conv_states, s)
        }))
        .map_err(|e| invalid_argument(e.to_string()))
    }
}
