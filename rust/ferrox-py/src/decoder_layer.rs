//! `CpuDecoderLayer`: a decoder layer's block-format weights, held once, and
//! its fused decode-step forward (`ferrox_cpu::decoder_layer`).

use ferrox_cpu::{decoder_layer, BlockLinear, DecoderLayerStep, DecoderLayerWeights, QuantFormat};
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2,
    PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::invalid_argument;
use crate::kernels::{contiguous, quant_format};

type LinearArrays<'py> = (
    PyReadonlyArray2<'py, u8>,
    Option<PyReadonlyArray1<'py, f32>>,
);
type LinearSpec<'py> = (
    Bound<'py, PyArray2<u8>>,
    Option<Bound<'py, PyArray1<f32>>>,
    String,
);

struct Linear {
    w: Py<PyArray2<u8>>,
    bias: Option<Py<PyArray1<f32>>>,
    fmt: QuantFormat,
    out_features: usize,
}

impl Linear {
    fn new(spec: LinearSpec<'_>) -> PyResult<Self> {
        let (w, bias, fmt) = spec;
        let out_features = w.shape()[0];
        if bias.as_ref().is_some_and(|b| b.len() != out_features) {
            return Err(invalid_argument(
                "a bias must have one value per output".into(),
            ));
        }
        Ok(Self {
            w: w.unbind(),
            bias: bias.map(Bound::unbind),
            fmt: quant_format(&fmt)?,
            out_features,
        })
    }

    /// Read views of the weight and bias for one call.
    fn borrow<'py>(&self, py: Python<'py>) -> LinearArrays<'py> {
        (
            self.w.bind(py).readonly(),
            self.bias.as_ref().map(|b| b.bind(py).readonly()),
        )
    }

    fn view<'a>(&self, arrays: &'a LinearArrays<'_>) -> PyResult<BlockLinear<'a>> {
        let (w, bias) = arrays;
        Ok(BlockLinear {
            w: contiguous(w.as_slice())?,
            bias: bias
                .as_ref()
                .map(|b| contiguous(b.as_slice()))
                .transpose()?,
            fmt: self.fmt,
            out_features: self.out_features,
        })
    }
}

/// A Llama-family decoder layer over block-format weights (q/k/v, o,
/// gate/up, down), run whole for decode steps.
#[pyclass(module = "ferrox._native", frozen)]
pub struct CpuDecoderLayer {
    input_norm: Py<PyArray1<f32>>,
    post_attention_norm: Py<PyArray1<f32>>,
    eps: f32,
    qkv: Linear,
    o: Linear,
    gate_up: Linear,
    down: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
}

#[pymethods]
impl CpuDecoderLayer {
    /// Each linear layer is (weight uint8 [N, row bytes], bias or None, format).
    #[new]
    #[pyo3(signature = (input_norm, post_attention_norm, eps, qkv, o, gate_up, down, num_heads, num_kv_heads, head_dim, scale))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        input_norm: Bound<'_, PyArray1<f32>>,
        post_attention_norm: Bound<'_, PyArray1<f32>>,
        eps: f32,
        qkv: LinearSpec<'_>,
        o: LinearSpec<'_>,
        gate_up: LinearSpec<'_>,
        down: LinearSpec<'_>,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> PyResult<Self> {
        if num_heads == 0 || num_kv_heads == 0 || head_dim == 0 || num_heads % num_kv_heads != 0 {
            return Err(invalid_argument(format!(
                "bad attention shape: {num_heads} heads, {num_kv_heads} KV heads, head_dim {head_dim}"
            )));
        }
        Ok(Self {
            input_norm: input_norm.unbind(),
            post_attention_norm: post_attention_norm.unbind(),
            eps,
            qkv: Linear::new(qkv)?,
            o: Linear::new(o)?,
            gate_up: Linear::new(gate_up)?,
            down: Linear::new(down)?,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        })
    }

    /// The layer on a step of short rows: `residual` and `x` ([T, hidden])
    /// are updated in place (the stream after attention, the MLP output);
    /// the tokens' K and V go into the caches ([N, BS, Hkv, D]) at
    /// `slot_mapping`.
    #[pyo3(signature = (residual, x, k_cache, v_cache, positions, cos, sin, slot_mapping, block_table, query_start_loc, seq_lens, num_threads))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        mut residual: PyReadwriteArray2<'_, f32>,
        mut x: PyReadwriteArray2<'_, f32>,
        mut k_cache: PyReadwriteArrayDyn<'_, f32>,
        mut v_cache: PyReadwriteArrayDyn<'_, f32>,
        positions: PyReadonlyArray1<'_, i64>,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        slot_mapping: PyReadonlyArray1<'_, i64>,
        block_table: PyReadonlyArray2<'_, i32>,
        query_start_loc: PyReadonlyArray1<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        num_threads: usize,
    ) -> PyResult<()> {
        let kv_shape = k_cache.shape().to_vec();
        if kv_shape.len() != 4
            || v_cache.shape() != kv_shape.as_slice()
            || kv_shape[2] != self.num_kv_heads
            || kv_shape[3] != self.head_dim
        {
            return Err(invalid_argument(format!(
                "the caches must both be [N, BS, {}, {}], got {kv_shape:?}",
                self.num_kv_heads, self.head_dim
            )));
        }
        let (input_norm, post_attention_norm) = (
            self.input_norm.bind(py).readonly(),
            self.post_attention_norm.bind(py).readonly(),
        );
        let [qkv, o, gate_up, down] =
            [&self.qkv, &self.o, &self.gate_up, &self.down].map(|l| l.borrow(py));
        let layer = DecoderLayerWeights {
            input_norm: contiguous(input_norm.as_slice())?,
            post_attention_norm: contiguous(post_attention_norm.as_slice())?,
            eps: self.eps,
            qkv: self.qkv.view(&qkv)?,
            o: self.o.view(&o)?,
            gate_up: self.gate_up.view(&gate_up)?,
            down: self.down.view(&down)?,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            scale: self.scale,
        };
        let step = DecoderLayerStep {
            positions: contiguous(positions.as_slice())?,
            cos: contiguous(cos.as_slice())?,
            sin: contiguous(sin.as_slice())?,
            slot_mapping: contiguous(slot_mapping.as_slice())?,
            block_table: contiguous(block_table.as_slice())?,
            query_start_loc: contiguous(query_start_loc.as_slice())?,
            seq_lens: contiguous(seq_lens.as_slice())?,
            block_size: kv_shape[1],
            num_threads,
        };
        let mutable = |what: &str| invalid_argument(format!("{what} must be C-contiguous"));
        let residual = residual.as_slice_mut().map_err(|_| mutable("residual"))?;
        let x = x.as_slice_mut().map_err(|_| mutable("x"))?;
        let k_cache = k_cache.as_slice_mut().map_err(|_| mutable("k_cache"))?;
        let v_cache = v_cache.as_slice_mut().map_err(|_| mutable("v_cache"))?;
        py.detach(|| decoder_layer(&layer, &step, residual, x, k_cache, v_cache))
            .map_err(|e| invalid_argument(e.to_string()))
    }
}
