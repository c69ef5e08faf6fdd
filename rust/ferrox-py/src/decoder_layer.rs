//! `CpuDecoderLayer`: a decoder layer's block-format or float32 weights,
//! held once, and its fused decode-step forward (`ferrox_cpu::decoder_layer`).

use ferrox_cpu::{
    decoder_layer, BlockLayout, DecoderLayerStep, DecoderLayerWeights, DenseMlp, Gate, KvElement,
    LayerLinear, LinearWeight, QuantFormat,
};
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::invalid_argument;
use crate::kernels::{
    block_layout, borrowed, contiguous, contiguous_mut, half_slice_mut, quant_format, CacheArray,
};

pub(crate) type LinearArrays<'py> = (
    PyReadonlyArray2<'py, u8>,
    Option<PyReadonlyArray1<'py, f32>>,
);
/// A per-head norm pair: the query heads' and the key heads' weights.
type HeadNorms<T> = (T, T);
/// (weight bytes, bias, format: "q4_1" / "q8_0" / "q6_k" / "q4_k" / "f32", packed: block
/// weights in the kernels' panels)
pub(crate) type LinearSpec<'py> = (
    Bound<'py, PyArray2<u8>>,
    Option<Bound<'py, PyArray1<f32>>>,
    String,
    bool,
);

pub(crate) struct Linear {
    w: Py<PyArray2<u8>>,
    bias: Option<Py<PyArray1<f32>>>,
    fmt: Option<(QuantFormat, BlockLayout)>, // None: the bytes are float32 [N, K]
    out_features: usize,
}

impl Linear {
    pub(crate) fn new(spec: LinearSpec<'_>) -> PyResult<Self> {
        let (w, bias, fmt, packed) = spec;
        let out_features = w.shape()[0];
        if bias.as_ref().is_some_and(|b| b.len() != out_features) {
            return Err(invalid_argument(
                "a bias must have one value per output".into(),
            ));
        }
        let fmt = if fmt == "f32" {
            if w.shape()[1] % 4 != 0 {
                return Err(invalid_argument(
                    "f32 weight bytes must be a float32 [N, K] array viewed as uint8".into(),
                ));
            }
            None
        } else {
            Some((quant_format(&fmt)?, block_layout(packed)))
        };
        Ok(Self {
            w: w.unbind(),
            bias: bias.map(Bound::unbind),
            fmt,
            out_features,
        })
    }

    /// Read views of the weight and bias for one call.
    pub(crate) fn borrow<'py>(&self, py: Python<'py>) -> LinearArrays<'py> {
        (
            self.w.bind(py).readonly(),
            self.bias.as_ref().map(|b| b.bind(py).readonly()),
        )
    }

    pub(crate) fn view<'a>(&self, arrays: &'a LinearArrays<'_>) -> PyResult<LayerLinear<'a>> {
        let (w, bias) = arrays;
        let bytes = contiguous(w)?;
        let weight = match self.fmt {
            Some((fmt, layout)) => LinearWeight::Blocks(bytes, fmt, layout),
            None => LinearWeight::F32(float_view(bytes)?),
        };
        Ok(LayerLinear {
            weight,
            bias: bias.as_ref().map(|b| contiguous(b)).transpose()?,
            out_features: self.out_features,
        })
    }
}

/// A dense MLP's activation by name: "silu" or "gelu_tanh".
pub(crate) fn gate_of(activation: &str) -> PyResult<Gate> {
    match activation {
        "silu" => Ok(Gate::Silu),
        "gelu_tanh" => Ok(Gate::GeluTanh),
        other => Err(invalid_argument(format!(
            "activation must be 'silu' or 'gelu_tanh', got {other:?}"
        ))),
    }
}

/// A gated MLP's two projections, both given or both None.
pub(crate) fn dense_mlp(
    gate_up: Option<LinearSpec<'_>>,
    down: Option<LinearSpec<'_>>,
) -> PyResult<Option<(Linear, Linear)>> {
    match (gate_up, down) {
        (Some(gate_up), Some(down)) => Ok(Some((Linear::new(gate_up)?, Linear::new(down)?))),
        (None, None) => Ok(None),
        _ => Err(invalid_argument(
            "gate_up and down must both be given or both be None".into(),
        )),
    }
}

/// Read views of a dense MLP's weights for one call.
pub(crate) type MlpArrays<'py> = Option<(LinearArrays<'py>, LinearArrays<'py>)>;

pub(crate) fn borrow_mlp<'py>(py: Python<'py>, mlp: &Option<(Linear, Linear)>) -> MlpArrays<'py> {
    mlp.as_ref()
        .map(|(gate_up, down)| (gate_up.borrow(py), down.borrow(py)))
}

pub(crate) fn view_mlp<'a>(
    mlp: &Option<(Linear, Linear)>,
    arrays: &'a MlpArrays<'_>,
) -> PyResult<Option<DenseMlp<'a>>> {
    Ok(match (mlp, arrays) {
        (Some((gate_up, down)), Some((gate_up_arrays, down_arrays))) => Some(DenseMlp {
            gate_up: gate_up.view(gate_up_arrays)?,
            down: down.view(down_arrays)?,
        }),
        _ => None,
    })
}

/// Bytes that hold float32 values (a numpy float32 array's `.view(uint8)`).
fn float_view(bytes: &[u8]) -> PyResult<&[f32]> {
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>())
        || !bytes.len().is_multiple_of(4)
    {
        return Err(invalid_argument(
            "f32 weight bytes must be an aligned float32 array".into(),
        ));
    }
    // SAFETY: aligned and a whole number of floats (checked above); every bit
    // pattern is a valid f32; the view lives no longer than `bytes`.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), bytes.len() / 4) })
}

/// A Llama-family decoder layer over block-format or float32 weights
/// (q/k/v, o, gate/up, down; q/k norms where the family has them), run
/// whole for decode steps. Without gate/up and down (a mixture-of-experts
/// layer) it stops at the MLP's normed input.
#[pyclass(module = "ferrox._native", frozen)]
pub struct CpuDecoderLayer {
    input_norm: Py<PyArray1<f32>>,
    post_attention_norm: Py<PyArray1<f32>>,
    eps: f32,
    qkv: Linear,
    head_norms: Option<HeadNorms<Py<PyArray1<f32>>>>,
    o: Linear,
    mlp: Option<(Linear, Linear)>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    window: usize,
    /// Gemma: the norms of the attention output and of the MLP output.
    output_norms: Option<HeadNorms<Py<PyArray1<f32>>>>,
    activation: Gate,
    sinks: Option<Vec<f32>>,
    query_gate: bool,
    rotary_dim: usize,
}

#[pymethods]
impl CpuDecoderLayer {
    /// Each linear layer is (weight uint8 [N, row bytes], bias or None,
    /// format): format "q8_0" / "q4_1" / "q6_k" / "q4_k" for blocks, "f32" for a float32
    /// [N, K] weight viewed as uint8 [N, 4 K]. `head_norms`: the q and k
    /// norms' weights ([head_dim] each), or None; `gate_up` and `down` both
    /// None: no dense MLP. `window`: the layer's sliding window (its steps
    /// then pass the window pool's slots and tables); 0: full attention.
    /// `output_norms` (Gemma): the norms ([hidden] each) of the attention
    /// output before it joins the stream and of the MLP output; then
    /// `post_attention_norm` is the MLP's input norm. `activation`: "silu"
    /// or "gelu_tanh", of the MLP's gate. `sinks`: attention sinks, one
    /// logit per query head (gpt-oss). `query_gate` (Qwen3.5): q/k/v's
    /// query rows hold each head's query then its gate, and the attention
    /// output is scaled by the gate's sigmoid. `rotary_dim`: the leading
    /// dimensions of each head that rotate (None: all).
    #[new]
    #[pyo3(signature = (input_norm, post_attention_norm, eps, qkv, o, gate_up, down, num_heads, num_kv_heads, head_dim, scale, head_norms=None, window=0, output_norms=None, activation="silu", sinks=None, query_gate=false, rotary_dim=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        input_norm: Bound<'_, PyArray1<f32>>,
        post_attention_norm: Bound<'_, PyArray1<f32>>,
        eps: f32,
        qkv: LinearSpec<'_>,
        o: LinearSpec<'_>,
        gate_up: Option<LinearSpec<'_>>,
        down: Option<LinearSpec<'_>>,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        head_norms: Option<HeadNorms<Bound<'_, PyArray1<f32>>>>,
        window: usize,
        output_norms: Option<HeadNorms<Bound<'_, PyArray1<f32>>>>,
        activation: &str,
        sinks: Option<Vec<f32>>,
        query_gate: bool,
        rotary_dim: Option<usize>,
    ) -> PyResult<Self> {
        let rotary_dim = rotary_dim.unwrap_or(head_dim);
        if rotary_dim == 0 || rotary_dim > head_dim || !rotary_dim.is_multiple_of(2) {
            return Err(invalid_argument(format!(
                "rotary_dim must be even, in (0, head_dim = {head_dim}], got {rotary_dim}"
            )));
        }
        if sinks.as_ref().is_some_and(|s| s.len() != num_heads) {
            return Err(invalid_argument(format!(
                "sinks must have one logit per query head ({num_heads})"
            )));
        }
        let activation = gate_of(activation)?;
        let hidden = input_norm.len();
        if output_norms
            .as_ref()
            .is_some_and(|(a, m)| a.len() != hidden || m.len() != hidden)
        {
            return Err(invalid_argument(format!(
                "the output norms must have hidden ({hidden}) weights"
            )));
        }
        if num_heads == 0
            || num_kv_heads == 0
            || head_dim == 0
            || !num_heads.is_multiple_of(num_kv_heads)
        {
            return Err(invalid_argument(format!(
                "bad attention shape: {num_heads} heads, {num_kv_heads} KV heads, head_dim {head_dim}"
            )));
        }
        let mlp = dense_mlp(gate_up, down)?;
        if head_norms
            .as_ref()
            .is_some_and(|(q, k)| q.len() != head_dim || k.len() != head_dim)
        {
            return Err(invalid_argument(format!(
                "the q and k norms must have head_dim ({head_dim}) weights"
            )));
        }
        Ok(Self {
            input_norm: input_norm.unbind(),
            post_attention_norm: post_attention_norm.unbind(),
            eps,
            qkv: Linear::new(qkv)?,
            head_norms: head_norms.map(|(q, k)| (q.unbind(), k.unbind())),
            o: Linear::new(o)?,
            mlp,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            window,
            output_norms: output_norms.map(|(a, m)| (a.unbind(), m.unbind())),
            activation,
            sinks,
            query_gate,
            rotary_dim,
        })
    }

    /// The layer on a step of short rows: `residual` and `x` ([T, hidden])
    /// are updated in place (the stream after attention, the MLP output);
    /// the tokens' K and V go into the caches ([N, BS, Hkv, D]; float32, or
    /// float16 viewed as int16) at `slot_mapping`. `batch_invariant`: the
    /// paged attention's (`paged_attention_cpu`).
    #[pyo3(signature = (residual, x, k_cache, v_cache, positions, cos, sin, slot_mapping, block_table, query_start_loc, seq_lens, num_threads, batch_invariant = false))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        mut residual: PyReadwriteArray2<'_, f32>,
        mut x: PyReadwriteArray2<'_, f32>,
        k_cache: &Bound<'_, PyAny>,
        v_cache: &Bound<'_, PyAny>,
        positions: PyReadonlyArray1<'_, i64>,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        slot_mapping: PyReadonlyArray1<'_, i64>,
        block_table: PyReadonlyArray2<'_, i32>,
        query_start_loc: PyReadonlyArray1<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        num_threads: usize,
        batch_invariant: bool,
    ) -> PyResult<()> {
        let k_cache = CacheArray::extract(k_cache, "k_cache")?;
        let v_cache = CacheArray::extract(v_cache, "v_cache")?;
        let kv_shape = k_cache.shape();
        if kv_shape.len() != 4
            || v_cache.shape() != kv_shape
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
        let [qkv, o] = [&self.qkv, &self.o].map(|l| l.borrow(py));
        let mlp_arrays = borrow_mlp(py, &self.mlp);
        let mlp = view_mlp(&self.mlp, &mlp_arrays)?;
        let norm_arrays = self
            .head_norms
            .as_ref()
            .map(|(q, k)| (q.bind(py).readonly(), k.bind(py).readonly()));
        let (q_norm, k_norm) = match &norm_arrays {
            Some((q, k)) => (Some(contiguous(q)?), Some(contiguous(k)?)),
            None => (None, None),
        };
        let output_arrays = self
            .output_norms
            .as_ref()
            .map(|(a, m)| (a.bind(py).readonly(), m.bind(py).readonly()));
        let (attention_out_norm, mlp_out_norm) = match &output_arrays {
            Some((a, m)) => (Some(contiguous(a)?), Some(contiguous(m)?)),
            None => (None, None),
        };
        let layer = DecoderLayerWeights {
            input_norm: contiguous(&input_norm)?,
            post_attention_norm: contiguous(&post_attention_norm)?,
            attention_out_norm,
            mlp_out_norm,
            activation: self.activation,
            eps: self.eps,
            qkv: self.qkv.view(&qkv)?,
            query_gate: self.query_gate,
            q_norm,
            k_norm,
            o: self.o.view(&o)?,
            mlp,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim,
            scale: self.scale,
            window: self.window,
            sinks: self.sinks.as_deref(),
        };
        let step = DecoderLayerStep {
            positions: contiguous(&positions)?,
            cos: contiguous(&cos)?,
            sin: contiguous(&sin)?,
            slot_mapping: contiguous(&slot_mapping)?,
            block_table: contiguous(&block_table)?,
            query_start_loc: contiguous(&query_start_loc)?,
            seq_lens: contiguous(&seq_lens)?,
            block_size: kv_shape[1],
            batch_invariant,
            num_threads,
        };
        let residual = contiguous_mut(&mut residual, "residual")?;
        let x = contiguous_mut(&mut x, "x")?;
        match (&k_cache, &v_cache) {
            (CacheArray::F32(k), CacheArray::F32(v)) => {
                let mut k = k.try_readwrite().map_err(borrowed("k_cache"))?;
                let mut v = v.try_readwrite().map_err(borrowed("v_cache"))?;
                let k = contiguous_mut(&mut k, "k_cache")?;
                let v = contiguous_mut(&mut v, "v_cache")?;
                run(py, &layer, &step, residual, x, k, v)
            }
            (CacheArray::F16(k), CacheArray::F16(v)) => {
                let mut k = k.try_readwrite().map_err(borrowed("k_cache"))?;
                let mut v = v.try_readwrite().map_err(borrowed("v_cache"))?;
                let k = half_slice_mut(contiguous_mut(&mut k, "k_cache")?);
                let v = half_slice_mut(contiguous_mut(&mut v, "v_cache")?);
                run(py, &layer, &step, residual, x, k, v)
            }
            _ => Err(invalid_argument(
                "k_cache and v_cache must have one dtype".into(),
            )),
        }
    }
}

fn run<T: KvElement>(
    py: Python<'_>,
    layer: &DecoderLayerWeights<'_>,
    step: &DecoderLayerStep<'_>,
    residual: &mut [f32],
    x: &mut [f32],
    k_cache: &mut [T],
    v_cache: &mut [T],
) -> PyResult<()> {
    py.detach(|| decoder_layer(layer, step, residual, x, k_cache, v_cache))
        .map_err(|e| invalid_argument(e.to_string()))
}
