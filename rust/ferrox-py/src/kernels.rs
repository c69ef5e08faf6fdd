//! CPU kernels over numpy views of torch tensors.

use ferrox_cpu::activation::gate_rows_threaded;
use ferrox_cpu::{
    add_rms_norm, apply_token_bitmask, dequantize_rows, gated_delta_decode, pack_blocks,
    paged_attention, quant_matmul, quant_matmul_gated_kept, quant_matmul_invariant,
    rotary_in_place, BlockLayout, GatedDeltaDecode, KvElement, PagedAttentionArgs, QuantFormat,
    QuantKernel, QuantMatmulArgs, QuantShapeError, F16,
};
use numpy::ndarray::Dimension;
use numpy::{
    Element, PyArrayDyn, PyArrayMethods, PyReadonlyArray, PyReadonlyArray1, PyReadonlyArray2,
    PyReadonlyArrayDyn, PyReadwriteArray, PyReadwriteArray2, PyReadwriteArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::invalid_argument;

fn dims<const N: usize>(shape: &[usize], what: &str) -> PyResult<[usize; N]> {
    shape.try_into().map_err(|_| {
        invalid_argument(format!(
            "{what} must have {N} dimensions, got {}",
            shape.len()
        ))
    })
}

/// An array's elements as one slice in row-major (C) order. numpy's
/// `as_slice` also hands out a Fortran-ordered array (a transposed view) in
/// its memory order, which a kernel would read as other rows: refused.
pub(crate) fn contiguous<'a, T: Element, D: Dimension>(
    array: &'a PyReadonlyArray<'_, T, D>,
) -> PyResult<&'a [T]> {
    match array.as_slice() {
        Ok(slice) if array.is_c_contiguous() => Ok(slice),
        _ => Err(invalid_argument("arrays must be C-contiguous".into())),
    }
}

/// An array the kernel writes, as `contiguous`; `name` is the argument the
/// error names.
pub(crate) fn contiguous_mut<'a, T: Element, D: Dimension>(
    array: &'a mut PyReadwriteArray<'_, T, D>,
    name: &str,
) -> PyResult<&'a mut [T]> {
    let c_order = array.is_c_contiguous();
    match array.as_slice_mut() {
        Ok(slice) if c_order => Ok(slice),
        _ => Err(invalid_argument(format!("{name} must be C-contiguous"))),
    }
}

/// A KV cache array: float32, or float16 as its bits (a torch float16
/// tensor's `.view(torch.int16)`: numpy has no float16 the bindings read).
/// Callers borrow it read-only or read-write (`borrowed`).
pub(crate) enum CacheArray<'py> {
    F32(Bound<'py, PyArrayDyn<f32>>),
    F16(Bound<'py, PyArrayDyn<i16>>),
}

impl<'py> CacheArray<'py> {
    pub(crate) fn extract(array: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if let Ok(a) = array.cast::<PyArrayDyn<f32>>() {
            return Ok(Self::F32(a.clone()));
        }
        if let Ok(a) = array.cast::<PyArrayDyn<i16>>() {
            return Ok(Self::F16(a.clone()));
        }
        Err(invalid_argument(format!(
            "{what} must be a float32 array or a float16 one viewed as int16"
        )))
    }

    pub(crate) fn shape(&self) -> Vec<usize> {
        match self {
            Self::F32(a) => a.shape().to_vec(),
            Self::F16(a) => a.shape().to_vec(),
        }
    }
}

/// A recurrent-state pool array: float32, or bfloat16 as its bits (a torch
/// bfloat16 tensor's `.view(torch.int16)`).
pub(crate) enum StateArray<'py> {
    F32(Bound<'py, PyArrayDyn<f32>>),
    Bf16(Bound<'py, PyArrayDyn<i16>>),
}

impl<'py> StateArray<'py> {
    pub(crate) fn extract(array: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(a) = array.cast::<PyArrayDyn<f32>>() {
            return Ok(Self::F32(a.clone()));
        }
        if let Ok(a) = array.cast::<PyArrayDyn<i16>>() {
            return Ok(Self::Bf16(a.clone()));
        }
        Err(invalid_argument(
            "states must be a float32 array or a bfloat16 one viewed as int16".into(),
        ))
    }

    pub(crate) fn shape(&self) -> Vec<usize> {
        match self {
            Self::F32(a) => a.shape().to_vec(),
            Self::Bf16(a) => a.shape().to_vec(),
        }
    }
}

/// Evaluates `$body` with `$s` bound to a `StateArray`'s elements, borrowed
/// read-write: `&mut [f32]` or `&mut [Bf16]`.
macro_rules! with_states {
    ($states:expr, $s:ident => $body:expr) => {{
        match $states {
            $crate::kernels::StateArray::F32(a) => {
                let mut rw = a
                    .try_readwrite()
                    .map_err($crate::kernels::borrowed("states"))?;
                let $s = $crate::kernels::contiguous_mut(&mut rw, "states")?;
                $body
            }
            $crate::kernels::StateArray::Bf16(a) => {
                let mut rw = a
                    .try_readwrite()
                    .map_err($crate::kernels::borrowed("states"))?;
                let bits = $crate::kernels::contiguous_mut(&mut rw, "states")?;
                // SAFETY: Bf16 is a transparent u16, of i16's size and
                // alignment; the borrow is handed on whole.
                let $s = unsafe {
                    std::slice::from_raw_parts_mut(
                        bits.as_mut_ptr().cast::<ferrox_cpu::Bf16>(),
                        bits.len(),
                    )
                };
                $body
            }
        }
    }};
}
pub(crate) use with_states;

/// The error of an array borrowed elsewhere (the same array as K and V).
pub(crate) fn borrowed<E>(what: &str) -> impl FnOnce(E) -> PyErr + '_ {
    move |_| invalid_argument(format!("{what} is already in use (the same array twice?)"))
}

/// float16 bits as the kernels' element type.
pub(crate) fn half_slice(bits: &[i16]) -> &[F16] {
    // SAFETY: F16 is a transparent u16, of i16's size and alignment.
    unsafe { std::slice::from_raw_parts(bits.as_ptr().cast::<F16>(), bits.len()) }
}

/// float16 bits as the kernels' element type, writable.
pub(crate) fn half_slice_mut(bits: &mut [i16]) -> &mut [F16] {
    // SAFETY: as in half_slice; the borrow is handed on whole.
    unsafe { std::slice::from_raw_parts_mut(bits.as_mut_ptr().cast::<F16>(), bits.len()) }
}

/// Paged attention: writes `out[t]` ([T, H, D], float32) for the tokens of
/// `rows`, reading keys and values ([N, BS, Hkv, D]; float32, or float16 as
/// int16 bits) through `block_table`. `window`: a sliding window (each query
/// sees the last `window` keys up to itself; 0: all keys). `sinks`: one
/// logit per query head (float32) that joins each softmax's denominator.
/// `batch_invariant`: each query computed as it is alone (its result the
/// same bits whatever else the call holds), not together with the queries
/// that share its blocks.
#[pyfunction]
#[pyo3(signature = (out, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, rows, scale, num_threads, window = 0, sinks = None, batch_invariant = false))]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_cpu(
    py: Python<'_>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    q: PyReadonlyArrayDyn<'_, f32>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_table: PyReadonlyArray2<'_, i32>,
    query_start_loc: PyReadonlyArray1<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    rows: PyReadonlyArray1<'_, i32>,
    scale: f32,
    num_threads: usize,
    window: usize,
    sinks: Option<PyReadonlyArray1<'_, f32>>,
    batch_invariant: bool,
) -> PyResult<()> {
    let (k_cache, v_cache) = (
        CacheArray::extract(k_cache, "k_cache")?,
        CacheArray::extract(v_cache, "v_cache")?,
    );
    let [_, num_heads, head_dim] = dims::<3>(q.shape(), "q")?;
    let [_, block_size, num_kv_heads, kv_dim] = dims::<4>(&k_cache.shape(), "k_cache")?;
    if kv_dim != head_dim || v_cache.shape() != k_cache.shape() || out.shape() != q.shape() {
        return Err(invalid_argument(
            "q, out and the caches disagree in shape".into(),
        ));
    }
    let out = contiguous_mut(&mut out, "out")?;
    let sinks = sinks.as_ref().map(|s| contiguous(s)).transpose()?;
    let shape = AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        window,
        sinks,
        batch_invariant,
        num_threads,
    };
    let step = (
        contiguous(&q)?,
        contiguous(&block_table)?,
        contiguous(&query_start_loc)?,
        contiguous(&seq_lens)?,
        contiguous(&rows)?,
    );
    match (&k_cache, &v_cache) {
        (CacheArray::F32(k), CacheArray::F32(v)) => {
            let k = k.try_readonly().map_err(borrowed("k_cache"))?;
            let v = v.try_readonly().map_err(borrowed("v_cache"))?;
            let (k, v) = (contiguous(&k)?, contiguous(&v)?);
            attend(py, &shape, step, k, v, out)
        }
        (CacheArray::F16(k), CacheArray::F16(v)) => {
            let k = k.try_readonly().map_err(borrowed("k_cache"))?;
            let v = v.try_readonly().map_err(borrowed("v_cache"))?;
            let (k, v) = (contiguous(&k)?, contiguous(&v)?);
            attend(py, &shape, step, half_slice(k), half_slice(v), out)
        }
        _ => Err(invalid_argument(
            "k_cache and v_cache must have one dtype".into(),
        )),
    }
}

struct AttentionShape<'a> {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    scale: f32,
    window: usize,
    sinks: Option<&'a [f32]>,
    batch_invariant: bool,
    num_threads: usize,
}

type StepArrays<'a> = (&'a [f32], &'a [i32], &'a [i32], &'a [i32], &'a [i32]);

fn attend<T: KvElement>(
    py: Python<'_>,
    shape: &AttentionShape<'_>,
    (q, block_table, query_start_loc, seq_lens, rows): StepArrays<'_>,
    k_cache: &[T],
    v_cache: &[T],
    out: &mut [f32],
) -> PyResult<()> {
    let args = PagedAttentionArgs {
        q,
        k_cache,
        v_cache,
        block_table,
        query_start_loc,
        seq_lens,
        rows,
        num_heads: shape.num_heads,
        num_kv_heads: shape.num_kv_heads,
        head_dim: shape.head_dim,
        block_size: shape.block_size,
        scale: shape.scale,
        window: shape.window,
        sinks: shape.sinks,
        batch_invariant: shape.batch_invariant,
        num_threads: shape.num_threads,
    };
    py.detach(|| paged_attention(&args, out))
        .map_err(|e| invalid_argument(e.to_string()))
}

/// Rotary embedding in place on the first `num_heads` heads of `x`
/// ([T, heads, D], float32), with cos/sin tables [max_position, D/2].
#[pyfunction]
#[pyo3(signature = (x, num_heads, positions, cos, sin, num_threads))]
pub fn rotary_in_place_cpu(
    py: Python<'_>,
    mut x: PyReadwriteArrayDyn<'_, f32>,
    num_heads: usize,
    positions: PyReadonlyArray1<'_, i64>,
    cos: PyReadonlyArray2<'_, f32>,
    sin: PyReadonlyArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let [_, heads, head_dim] = dims::<3>(x.shape(), "x")?;
    let positions = contiguous(&positions)?;
    let cos = contiguous(&cos)?;
    let sin = contiguous(&sin)?;
    let x = contiguous_mut(&mut x, "x")?;
    py.detach(|| {
        rotary_in_place(
            x,
            heads * head_dim,
            num_heads,
            head_dim,
            positions,
            cos,
            sin,
            num_threads,
        )
    })
    .map_err(|e| invalid_argument(e.to_string()))
}

/// `residual += delta` (if given), then `out = rms_norm(residual) * weight`,
/// row by row over the last dimension (float32).
#[pyfunction]
#[pyo3(signature = (residual, delta, weight, eps, out, num_threads))]
pub fn add_rms_norm_cpu(
    py: Python<'_>,
    mut residual: PyReadwriteArrayDyn<'_, f32>,
    delta: Option<PyReadonlyArrayDyn<'_, f32>>,
    weight: PyReadonlyArray1<'_, f32>,
    eps: f32,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let delta = match &delta {
        Some(d) => Some(contiguous(d)?),
        None => None,
    };
    let weight = contiguous(&weight)?;
    let residual = contiguous_mut(&mut residual, "residual")?;
    let out = contiguous_mut(&mut out, "out")?;
    py.detach(|| add_rms_norm(residual, delta, weight, eps, out, num_threads))
        .map_err(|e| invalid_argument(e.to_string()))
}

/// Structured outputs: `logits[rows[g], t] = -inf` for every token `t` whose
/// bit is 0 in `bitmask[g]` (logits [R, V] float32, bitmask [G, W] int32).
#[pyfunction]
pub fn apply_token_bitmask_cpu(
    py: Python<'_>,
    mut logits: PyReadwriteArray2<'_, f32>,
    rows: PyReadonlyArray1<'_, i64>,
    bitmask: PyReadonlyArray2<'_, i32>,
) -> PyResult<()> {
    let vocab = logits.shape()[1];
    let words = bitmask.shape()[1];
    let rows = contiguous(&rows)?;
    let bitmask = contiguous(&bitmask)?;
    let logits = contiguous_mut(&mut logits, "logits")?;
    py.detach(|| apply_token_bitmask(logits, vocab, rows, bitmask, words))
        .map_err(|e| invalid_argument(e.to_string()))
}

pub(crate) fn quant_format(name: &str) -> PyResult<QuantFormat> {
    match name {
        "q4_1" => Ok(QuantFormat::Q4_1),
        "q8_0" => Ok(QuantFormat::Q8_0),
        "q6_k" => Ok(QuantFormat::Q6_K),
        "q4_k" => Ok(QuantFormat::Q4_K),
        other => Err(invalid_argument(format!(
            "unknown block format {other:?}; expected 'q4_1', 'q8_0', 'q6_k' or 'q4_k'"
        ))),
    }
}

/// The block layout `packed` names: the kernels' panels (`pack_blocks_cpu`)
/// or llama.cpp's rows.
pub(crate) fn block_layout(packed: bool) -> BlockLayout {
    if packed {
        BlockLayout::Panels
    } else {
        BlockLayout::Rows
    }
}

/// `out[M, N] = x[M, K] @ W^T (+ bias)` for a weight `W` kept in a block
/// format (`w`: [N, K / 32 * block bytes] uint8, in llama.cpp's rows or,
/// with `packed`, as `pack_blocks_cpu` wrote it; see
/// ferrox_cpu::quant_matmul). `batch_invariant`: the same kernel for every
/// row count (`quant_matmul_invariant`; otherwise a CPU with AMX tiles takes
/// calls of many rows to them).
#[pyfunction]
#[pyo3(signature = (out, x, w, bias, fmt, num_threads, packed=false, batch_invariant=false))]
#[allow(clippy::too_many_arguments)]
pub fn quant_matmul_cpu(
    py: Python<'_>,
    out: PyReadwriteArray2<'_, f32>,
    x: PyReadonlyArray2<'_, f32>,
    w: PyReadonlyArray2<'_, u8>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    fmt: &str,
    num_threads: usize,
    packed: bool,
    batch_invariant: bool,
) -> PyResult<()> {
    block_matmul(
        py,
        out,
        x,
        w,
        bias,
        fmt,
        num_threads,
        packed,
        |args, out| {
            if batch_invariant {
                quant_matmul_invariant(args, out)
            } else {
                quant_matmul(args, out)
            }
        },
    )
}

/// A gated MLP's first half: `out[M, I] = act(gate) * up`, where `[gate |
/// up] = x @ W^T (+ bias)` and `W` (as for `quant_matmul_cpu`) holds the
/// gate's I rows, then up's. `activation`: "silu" or "gelu_tanh". On AMX
/// tiles the sums are activated as they come out of the tiles (never
/// written); otherwise the matmul, then the activation
/// (ferrox_cpu::quant_matmul_gated).
#[pyfunction]
#[pyo3(signature = (out, x, w, bias, fmt, activation, num_threads, packed=false, batch_invariant=false))]
#[allow(clippy::too_many_arguments)]
pub fn quant_gated_matmul_cpu(
    py: Python<'_>,
    out: PyReadwriteArray2<'_, f32>,
    x: PyReadonlyArray2<'_, f32>,
    w: PyReadonlyArray2<'_, u8>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    fmt: &str,
    activation: &str,
    num_threads: usize,
    packed: bool,
    batch_invariant: bool,
) -> PyResult<()> {
    let gate = crate::decoder_layer::gate_of(activation)?;
    block_matmul(
        py,
        out,
        x,
        w,
        bias,
        fmt,
        num_threads,
        packed,
        |args, out| quant_matmul_gated_kept(args, gate, batch_invariant, out),
    )
}

/// A gated MLP's activation of a [T, 2 I] gate/up output (the gate's I
/// columns, then up's) into `out` ([T, I]): act(gate) * up, the rows split
/// over up to `num_threads` threads on large calls (ferrox_cpu::activation,
/// `gate_rows_threaded`). `activation`: "silu" or "gelu_tanh".
#[pyfunction]
pub fn gate_rows_cpu(
    py: Python<'_>,
    mut out: PyReadwriteArray2<'_, f32>,
    gate_up: PyReadonlyArray2<'_, f32>,
    activation: &str,
    num_threads: usize,
) -> PyResult<()> {
    let gate = crate::decoder_layer::gate_of(activation)?;
    let [rows, width] = dims::<2>(gate_up.shape(), "gate_up")?;
    if !width.is_multiple_of(2) || out.shape() != [rows, width / 2] {
        return Err(invalid_argument(format!(
            "gate_up must be [T, 2 I] and out [T, I]; got {:?} and {:?}",
            gate_up.shape(),
            out.shape()
        )));
    }
    let gate_up = contiguous(&gate_up)?;
    let out = contiguous_mut(&mut out, "out")?;
    py.detach(|| gate_rows_threaded(gate, gate_up, width / 2, num_threads, out));
    Ok(())
}

/// The block matmuls' arguments from their numpy views; `run` (without the
/// GIL) fills `out`.
#[allow(clippy::too_many_arguments)]
fn block_matmul(
    py: Python<'_>,
    mut out: PyReadwriteArray2<'_, f32>,
    x: PyReadonlyArray2<'_, f32>,
    w: PyReadonlyArray2<'_, u8>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    fmt: &str,
    num_threads: usize,
    packed: bool,
    run: impl FnOnce(&QuantMatmulArgs<'_>, &mut [f32]) -> Result<(), QuantShapeError> + Send,
) -> PyResult<()> {
    let fmt = quant_format(fmt)?;
    let [m, k] = dims::<2>(x.shape(), "x")?;
    let n = w.shape()[0];
    let bias = match &bias {
        Some(b) => Some(contiguous(b)?),
        None => None,
    };
    let x = contiguous(&x)?;
    let w = contiguous(&w)?;
    let out = contiguous_mut(&mut out, "out")?;
    let args = QuantMatmulArgs {
        x,
        w,
        bias,
        m,
        k,
        n,
        fmt,
        layout: block_layout(packed),
        num_threads,
    };
    py.detach(|| run(&args, out))
        .map_err(|e| invalid_argument(e.to_string()))
}

/// `out` = the block-format weight `w` ([N, row bytes] uint8, llama.cpp's
/// rows) in the panels the kernels read (ferrox_cpu::quant_pack): the same
/// bytes rearranged, for `packed=True` calls.
#[pyfunction]
pub fn pack_blocks_cpu(
    py: Python<'_>,
    mut out: PyReadwriteArray2<'_, u8>,
    w: PyReadonlyArray2<'_, u8>,
    fmt: &str,
) -> PyResult<()> {
    let fmt = quant_format(fmt)?;
    let row_bytes = w.shape()[1];
    if out.shape() != w.shape() || !row_bytes.is_multiple_of(fmt.block_bytes()) {
        return Err(invalid_argument(format!(
            "out must have the weight's shape {:?}, whole {fmt:?} blocks a row",
            w.shape()
        )));
    }
    let k = row_bytes / fmt.block_bytes() * fmt.block_values();
    let w = contiguous(&w)?;
    let out = contiguous_mut(&mut out, "out")?;
    py.detach(|| pack_blocks(w, fmt, k, out))
        .map_err(|e| invalid_argument(e.to_string()))
}

/// Whether block weights should be packed at load (`pack_blocks_cpu`): the
/// kernel this CPU runs reads panels ("panels"), or rows as they are
/// ("rows").
#[pyfunction]
pub fn quant_layout_cpu() -> &'static str {
    match QuantKernel::best().layout() {
        BlockLayout::Rows => "rows",
        BlockLayout::Panels => "panels",
    }
}

/// Which kernel `quant_matmul_cpu` runs on this CPU (for every row count):
/// "pairs", "panels" (AVX2), "vnni_panels" (AVX2 with AVX-VNNI) or
/// "wide_panels" (AVX-512 VNNI).
#[pyfunction]
pub fn quant_matmul_kernel_cpu() -> &'static str {
    match QuantKernel::best() {
        QuantKernel::Pairs => "pairs",
        QuantKernel::Panels => "panels",
        QuantKernel::VnniPanels => "vnni_panels",
        QuantKernel::WidePanels => "wide_panels",
    }
}

/// The widest instruction-set level ferrox's CPU kernels use here: what the
/// CPU has, capped by `FERROX_CPU_ISA` ("portable", "avx2", "avxvnni",
/// "avx512" or "amx").
#[pyfunction]
pub fn cpu_isa() -> &'static str {
    match ferrox_cpu::isa::effective() {
        ferrox_cpu::isa::Isa::Portable => "portable",
        ferrox_cpu::isa::Isa::Avx2 => "avx2",
        ferrox_cpu::isa::Isa::AvxVnni => "avxvnni",
        ferrox_cpu::isa::Isa::Avx512 => "avx512",
        ferrox_cpu::isa::Isa::Amx => "amx",
    }
}

/// Rows `rows` of a block-format weight (`w`: [N, row bytes] uint8, packed
/// or not) as float32 into `out` ([len(rows), K]).
#[pyfunction]
#[pyo3(signature = (out, w, fmt, rows, num_threads, packed=false))]
pub fn dequantize_rows_cpu(
    py: Python<'_>,
    mut out: PyReadwriteArray2<'_, f32>,
    w: PyReadonlyArray2<'_, u8>,
    fmt: &str,
    rows: PyReadonlyArray1<'_, i64>,
    num_threads: usize,
    packed: bool,
) -> PyResult<()> {
    let fmt = quant_format(fmt)?;
    let k = out.shape()[1];
    let rows: Vec<usize> = rows
        .as_array()
        .iter()
        .map(|&r| usize::try_from(r).map_err(|_| invalid_argument(format!("row {r} is negative"))))
        .collect::<PyResult<_>>()?;
    let w = contiguous(&w)?;
    let out = contiguous_mut(&mut out, "out")?;
    let layout = block_layout(packed);
    py.detach(|| dequantize_rows(w, fmt, layout, k, &rows, out, num_threads))
        .map_err(|e| invalid_argument(e.to_string()))
}

/// The gated delta rule's decode step for every row, in place on the state
/// pool `states` ([S, H, Dk, Dv]; float32, or bfloat16 as int16 bits): row b (one token) continues the
/// state of slot `slots[b]` (zero where `fresh[b]`); q, k [B, H, Dk], v and
/// out [B, H, Dv], g (log decay) and beta [B, H].
#[pyfunction]
#[pyo3(signature = (states, slots, fresh, q, k, v, g, beta, out, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_decode_cpu(
    py: Python<'_>,
    states: Bound<'_, PyAny>,
    slots: PyReadonlyArray1<'_, i64>,
    fresh: PyReadonlyArray1<'_, bool>,
    q: PyReadonlyArrayDyn<'_, f32>,
    k: PyReadonlyArrayDyn<'_, f32>,
    v: PyReadonlyArrayDyn<'_, f32>,
    g: PyReadonlyArrayDyn<'_, f32>,
    beta: PyReadonlyArrayDyn<'_, f32>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let states = StateArray::extract(&states)?;
    let [_, num_heads, k_dim, v_dim] = dims::<4>(&states.shape(), "states")?;
    let args = GatedDeltaDecode {
        q: contiguous(&q)?,
        k: contiguous(&k)?,
        v: contiguous(&v)?,
        g: contiguous(&g)?,
        beta: contiguous(&beta)?,
        slots: contiguous(&slots)?,
        fresh: contiguous(&fresh)?,
        num_heads,
        k_dim,
        v_dim,
    };
    let out = contiguous_mut(&mut out, "out")?;
    with_states!(states, s => py.detach(|| gated_delta_decode(&args, s, out, num_threads)))
        .map_err(|e| invalid_argument(e.to_string()))
}
