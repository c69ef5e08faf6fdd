//! One Llama-family decoder layer for rows of a few query tokens (decode
//! steps), over block-quantized or float32 weights, in a single call: residual add +
//! RMSNorm, the q/k/v projection, per-head q/k RMSNorm (Qwen3), rotary
//! embedding, the KV cache write, paged attention, the output projection, the
//! second add + RMSNorm, the gated MLP. A layer without a dense MLP (a
//! mixture of experts, run by `moe::moe_experts`) stops after the second
//! norm and hands back its output, the MLP's input.
//!
//! Each step is the same kernel the model runner calls one at a time
//! (`add_rms_norm`, `quant_matmul`, `rotary_in_place`, `paged_attention`;
//! float32 weights go through `f32_matmul`);
//! fused, a layer costs one call from Python instead of about twenty tensor
//! operations, which at one token per step cost more than the arithmetic.

use std::cell::RefCell;
use std::thread::LocalKey;

use crate::activation::{exp, gate_rows_threaded, Gate};
use crate::elementwise::{add_rms_norm, rotary_partial_in_place, RotaryHeads};
use crate::f32_matmul::{f32_matmul, F32MatmulArgs};
use crate::kv_element::KvElement;
use crate::paged_attention::{paged_attention, PagedAttentionArgs, ShapeError};
use crate::quant_matmul::{
    quant_matmul, quant_matmul_gated, quant_matmul_invariant, QuantFormat, QuantMatmulArgs,
    QuantShapeError,
};
use crate::quant_pack::BlockLayout;

/// A linear layer's weight: block-format bytes ([N, row bytes], in a
/// layout) or float32 ([N, K]).
pub enum LinearWeight<'a> {
    Blocks(&'a [u8], QuantFormat, BlockLayout),
    F32(&'a [f32]),
}

/// A linear layer's weight and optional bias.
pub struct LayerLinear<'a> {
    pub weight: LinearWeight<'a>,
    pub bias: Option<&'a [f32]>,
    pub out_features: usize,
}

/// A gated MLP's two projections.
pub struct DenseMlp<'a> {
    pub gate_up: LayerLinear<'a>, // hidden -> 2 I (gate, then up)
    pub down: LayerLinear<'a>,    // I -> hidden
}

/// The layer's parameters and shapes.
pub struct DecoderLayerWeights<'a> {
    pub input_norm: &'a [f32], // [hidden]
    /// The MLP's input norm, over the stream after attention (Llama's
    /// post-attention norm, Gemma's pre-feedforward norm). [hidden]
    pub post_attention_norm: &'a [f32],
    /// Gemma: norms of the attention output before it joins the stream, and
    /// of the MLP output. [hidden] each, or None.
    pub attention_out_norm: Option<&'a [f32]>,
    pub mlp_out_norm: Option<&'a [f32]>,
    pub activation: Gate,
    pub eps: f32,
    /// hidden -> (H + 2 Hkv) D; with `query_gate`, (2 H + 2 Hkv) D: each
    /// query head's D values followed by its gate's D values.
    pub qkv: LayerLinear<'a>,
    /// Qwen3.5's gated attention: the attention output is scaled by the
    /// sigmoid of each head's gate before the output projection.
    pub query_gate: bool,
    pub q_norm: Option<&'a [f32]>, // [D]: each query head's RMSNorm (with `k_norm`)
    pub k_norm: Option<&'a [f32]>, // [D]
    pub o: LayerLinear<'a>,        // H D -> hidden
    pub mlp: Option<DenseMlp<'a>>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The leading dimensions of each query and key head that rotate
    /// (`head_dim`: all of them).
    pub rotary_dim: usize,
    pub scale: f32,
    /// A sliding window (the step's tables are then the window pool's); 0: none.
    pub window: usize,
    /// Attention sinks, one logit per query head (gpt-oss), or None.
    pub sinks: Option<&'a [f32]>,
}

/// One step's tokens and the KV cache they read and write.
pub struct DecoderLayerStep<'a> {
    pub positions: &'a [i64],       // [T]
    pub cos: &'a [f32],             // [max position, D / 2]
    pub sin: &'a [f32],             // [max position, D / 2]
    pub slot_mapping: &'a [i64],    // [T]: cache slot of each token's K and V
    pub block_table: &'a [i32],     // [B, W]
    pub query_start_loc: &'a [i32], // [B + 1]
    pub seq_lens: &'a [i32],        // [B]
    pub block_size: usize,
    /// The paged attention's `batch_invariant`.
    pub batch_invariant: bool,
    pub num_threads: usize,
}

pub(crate) fn linear(
    layer: &LayerLinear<'_>,
    x: &[f32],
    k: usize,
    threads: usize,
) -> Result<Vec<f32>, ShapeError> {
    let mut out = vec![0.0; x.len() / k * layer.out_features];
    linear_into(layer, x, k, threads, false, out.as_mut_slice())?;
    Ok(out)
}

/// The block matmul's arguments for `x` ([M, k]) through `layer`, if its
/// weight is in a block format.
fn block_args<'a>(
    layer: &LayerLinear<'a>,
    x: &'a [f32],
    k: usize,
    threads: usize,
) -> Option<QuantMatmulArgs<'a>> {
    let LinearWeight::Blocks(w, fmt, layout) = layer.weight else {
        return None;
    };
    Some(QuantMatmulArgs {
        x,
        w,
        bias: layer.bias,
        m: x.len() / k,
        k,
        n: layer.out_features,
        fmt,
        layout,
        num_threads: threads,
    })
}

/// `x @ w^T (+ bias)` into `out` ([M, N]), every element written; block
/// weights on `quant_matmul_invariant` if `invariant` (a row's bits then do
/// not depend on the call's row count), else `quant_matmul`.
fn linear_into(
    layer: &LayerLinear<'_>,
    x: &[f32],
    k: usize,
    threads: usize,
    invariant: bool,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let (m, n) = (x.len() / k, layer.out_features);
    if out.len() != m * n {
        return Err(ShapeError("linear: the output is not [M, N]".into()));
    }
    let done = match layer.weight {
        LinearWeight::Blocks(..) => {
            let args = block_args(layer, x, k, threads).expect("a block-format layer");
            if invariant {
                quant_matmul_invariant(&args, out)
            } else {
                quant_matmul(&args, out)
            }
        }
        LinearWeight::F32(w) => {
            let args = F32MatmulArgs {
                x,
                w,
                bias: layer.bias,
                m,
                k,
                n,
                num_threads: threads,
            };
            f32_matmul(&args, out)
        }
    };
    done.map_err(|e| ShapeError(e.to_string()))
}

/// Buffers a layer call writes whole before it reads them, kept by the
/// calling thread from one call to the next. A new buffer comes zero-filled
/// (calloc writes every byte of a reused heap chunk): in a step of many
/// tokens that was tens of megabytes of writes a layer on the calling
/// thread while the pool's workers waited. A buffer grows to the largest
/// call's size and stays so, up to `KEEP_MAX_ELEMENTS` (a larger one, a
/// long prefill chunk's under `batch_invariant`, is given back after the
/// call).
#[derive(Default)]
struct AttentionBuffers {
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
}

/// The MLP's share of those buffers (`MlpTail`, which linear-attention
/// layers run too).
#[derive(Default)]
struct MlpBuffers {
    gate_up: Vec<f32>,
    act: Vec<f32>,
}

/// The largest buffer kept between calls, in floats (64 MiB).
const KEEP_MAX_ELEMENTS: usize = 1 << 24;

/// Kept buffers, each given back once it outgrows `KEEP_MAX_ELEMENTS`.
trait Kept: Default {
    fn trim(&mut self);
}

fn trim_each<const N: usize>(buffers: [&mut Vec<f32>; N]) {
    for buffer in buffers {
        if buffer.len() > KEEP_MAX_ELEMENTS {
            *buffer = Vec::new();
        }
    }
}

impl Kept for AttentionBuffers {
    fn trim(&mut self) {
        trim_each([&mut self.normed, &mut self.qkv, &mut self.attn, &mut self.o]);
    }
}

impl Kept for MlpBuffers {
    fn trim(&mut self) {
        trim_each([&mut self.gate_up, &mut self.act]);
    }
}

thread_local! {
    static ATTENTION_BUFFERS: RefCell<AttentionBuffers> = RefCell::default();
    static MLP_BUFFERS: RefCell<MlpBuffers> = RefCell::default();
}

/// `f` over this thread's kept buffers (taken out while it runs).
fn with_kept<B: Kept, R>(kept: &'static LocalKey<RefCell<B>>, f: impl FnOnce(&mut B) -> R) -> R {
    let mut buffers = kept.with(|b| std::mem::take(&mut *b.borrow_mut()));
    let result = f(&mut buffers);
    buffers.trim();
    kept.with(|b| *b.borrow_mut() = buffers);
    result
}

/// `quant_matmul_gated` with the calling thread's kept gate/up buffer (the
/// fused layers' own), for a gated MLP's gate/up outside a layer call (the
/// module path's `QuantLinear.gated`).
pub fn quant_matmul_gated_kept(
    args: &QuantMatmulArgs<'_>,
    gate: Gate,
    invariant: bool,
    out: &mut [f32],
) -> Result<(), QuantShapeError> {
    with_kept(&MLP_BUFFERS, |buffers| {
        quant_matmul_gated(args, gate, invariant, &mut buffers.gate_up, out)
    })
}

/// The first `len` values of `buffer`, grown where it is shorter; what they
/// hold is left from an earlier call (NaN in debug builds, so that a value
/// read before it is written shows).
fn sized(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    let part = &mut buffer[..len];
    if cfg!(debug_assertions) {
        part.fill(f32::NAN);
    }
    part
}

/// RMSNorm of each row of `x` by `weight`, in place.
fn rms_norm_rows(
    x: &mut [f32],
    weight: &[f32],
    eps: f32,
    threads: usize,
) -> Result<(), ShapeError> {
    let mut normed = vec![0.0; x.len()];
    add_rms_norm(x, None, weight, eps, &mut normed, threads)?;
    x.copy_from_slice(&normed);
    Ok(())
}

/// Runs the layer. `residual` ([T, hidden]) is the stream before the
/// previous layer's MLP output `x` ([T, hidden]); on return `residual` holds
/// the stream after attention and `x` this layer's MLP output (without a
/// dense MLP: its normed input), as the unfused layer returns them. The
/// tokens' keys and values are written into the caches ([N, BS, Hkv, D],
/// float32 or float16) before attention reads them.
pub fn decoder_layer<T: KvElement>(
    weights: &DecoderLayerWeights<'_>,
    step: &DecoderLayerStep<'_>,
    residual: &mut [f32],
    x: &mut [f32],
    k_cache: &mut [T],
    v_cache: &mut [T],
) -> Result<(), ShapeError> {
    let hidden = weights.input_norm.len();
    let (h, hkv, d) = (weights.num_heads, weights.num_kv_heads, weights.head_dim);
    let tokens = step.positions.len();
    let query_width = if weights.query_gate { 2 * h * d } else { h * d };
    let dense_ok = |m: &DenseMlp<'_>| {
        m.down.out_features == hidden && m.gate_up.out_features.is_multiple_of(2)
    };
    let checks = [
        (
            residual.len() == tokens * hidden && x.len() == residual.len(),
            "residual and x must be [T, hidden]",
        ),
        (
            step.slot_mapping.len() == tokens,
            "slot_mapping must have one slot per token",
        ),
        (
            weights.post_attention_norm.len() == hidden
                && weights.attention_out_norm.is_none_or(|n| n.len() == hidden)
                && weights.mlp_out_norm.is_none_or(|n| n.len() == hidden),
            "the norms differ in size",
        ),
        (
            weights.qkv.out_features == query_width + 2 * hkv * d,
            "qkv has the wrong number of outputs",
        ),
        (weights.o.out_features == hidden, "o must output hidden"),
        (
            weights.mlp.as_ref().is_none_or(dense_ok),
            "down must output hidden, gate_up an even number",
        ),
        (
            weights.q_norm.is_some() == weights.k_norm.is_some()
                && weights.q_norm.is_none_or(|n| n.len() == d)
                && weights.k_norm.is_none_or(|n| n.len() == d),
            "q_norm and k_norm must both be [head_dim] or both absent",
        ),
        (
            k_cache.len() == v_cache.len() && k_cache.len().is_multiple_of(hkv * d),
            "caches are not [N, BS, Hkv, D]",
        ),
    ];
    if let Some((_, what)) = checks.iter().find(|(ok, _)| !ok) {
        return Err(ShapeError(format!("decoder layer: {what}")));
    }
    let slots = k_cache.len() / (hkv * d);
    if let Some(&s) = step
        .slot_mapping
        .iter()
        .find(|&&s| s < 0 || s as usize >= slots)
    {
        return Err(ShapeError(format!(
            "decoder layer: slot {s} outside the cache"
        )));
    }
    with_kept(&ATTENTION_BUFFERS, |buffers| {
        let row_len = (h + 2 * hkv) * d;
        let threads = step.num_threads;
        let normed = sized(&mut buffers.normed, residual.len());
        add_rms_norm(
            residual,
            Some(x),
            weights.input_norm,
            weights.eps,
            normed,
            threads,
        )?;

        let qkv = sized(&mut buffers.qkv, tokens * weights.qkv.out_features);
        linear_into(
            &weights.qkv,
            normed,
            hidden,
            threads,
            step.batch_invariant,
            qkv,
        )?;
        let gates = weights
            .query_gate
            .then(|| split_query_gates(qkv, tokens, h, hkv, d));
        let qkv = &mut qkv[..tokens * row_len];
        if let (Some(q_norm), Some(k_norm)) = (weights.q_norm, weights.k_norm) {
            head_norms(qkv, row_len, h, hkv, d, q_norm, k_norm, weights.eps)?;
        }
        let heads = RotaryHeads {
            row_len,
            num_heads: h + hkv, // queries, then keys
            head_dim: d,
            rotary_dim: weights.rotary_dim,
        };
        rotary_partial_in_place(qkv, &heads, step.positions, step.cos, step.sin, threads)?;
        let kv_width = hkv * d;
        let mut q = Vec::with_capacity(tokens * h * d);
        for (row, &slot) in qkv.chunks_exact(row_len).zip(step.slot_mapping) {
            let at = slot as usize * kv_width;
            let (k, v) = (&row[h * d..(h + hkv) * d], &row[(h + hkv) * d..]);
            for (dst, &src) in k_cache[at..at + kv_width].iter_mut().zip(k) {
                *dst = T::from_f32(src);
            }
            for (dst, &src) in v_cache[at..at + kv_width].iter_mut().zip(v) {
                *dst = T::from_f32(src);
            }
            q.extend_from_slice(&row[..h * d]);
        }

        let rows: Vec<i32> = (0..step.seq_lens.len() as i32).collect();
        let attn = sized(&mut buffers.attn, q.len());
        let args = PagedAttentionArgs {
            q: &q,
            k_cache,
            v_cache,
            block_table: step.block_table,
            query_start_loc: step.query_start_loc,
            seq_lens: step.seq_lens,
            rows: &rows,
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
            block_size: step.block_size,
            scale: weights.scale,
            window: weights.window,
            sinks: weights.sinks,
            batch_invariant: step.batch_invariant,
            num_threads: threads,
        };
        paged_attention(&args, attn)?;
        if let Some(gates) = gates {
            for (a, &g) in attn.iter_mut().zip(&gates) {
                *a *= 1.0 / (1.0 + exp(-g));
            }
        }
        let o = sized(&mut buffers.o, tokens * hidden);
        linear_into(&weights.o, attn, h * d, threads, step.batch_invariant, o)?;
        if let Some(norm) = weights.attention_out_norm {
            rms_norm_rows(o, norm, weights.eps, threads)?;
        }
        let tail = MlpTail {
            post_attention_norm: weights.post_attention_norm,
            mlp: weights.mlp.as_ref(),
            activation: weights.activation,
            mlp_out_norm: weights.mlp_out_norm,
            eps: weights.eps,
            batch_invariant: step.batch_invariant,
        };
        tail.run(residual, x, o, normed, threads)
    })
}

/// A decoder layer's second half, the same whatever mixed the tokens
/// (attention, linear attention).
pub(crate) struct MlpTail<'a> {
    pub post_attention_norm: &'a [f32],
    pub mlp: Option<&'a DenseMlp<'a>>,
    pub activation: Gate,
    pub mlp_out_norm: Option<&'a [f32]>,
    pub eps: f32,
    /// The matmuls' `invariant` (`linear_into`).
    pub batch_invariant: bool,
}

impl MlpTail<'_> {
    /// `residual += mixed`, the MLP's input norm, then the MLP, whose output
    /// goes into `x` (without a dense MLP: its normed input). `normed` is
    /// scratch of the stream's size.
    pub(crate) fn run(
        &self,
        residual: &mut [f32],
        x: &mut [f32],
        mixed: &[f32],
        normed: &mut [f32],
        threads: usize,
    ) -> Result<(), ShapeError> {
        add_rms_norm(
            residual,
            Some(mixed),
            self.post_attention_norm,
            self.eps,
            normed,
            threads,
        )?;
        let Some(mlp) = self.mlp else {
            x.copy_from_slice(normed);
            return Ok(());
        };
        with_kept(&MLP_BUFFERS, |buffers| {
            self.mlp(mlp, normed, x, buffers, threads)
        })
    }

    /// The dense MLP of `normed` into `x`.
    fn mlp(
        &self,
        mlp: &DenseMlp<'_>,
        normed: &[f32],
        x: &mut [f32],
        buffers: &mut MlpBuffers,
        threads: usize,
    ) -> Result<(), ShapeError> {
        let hidden = self.post_attention_norm.len();
        let inter = mlp.gate_up.out_features / 2;
        let rows = normed.len() / hidden;
        let act = sized(&mut buffers.act, rows * inter);
        if let Some(args) = block_args(&mlp.gate_up, normed, hidden, threads) {
            // (on AMX tiles, the activation of the sums as they come out)
            let invariant = self.batch_invariant;
            quant_matmul_gated(&args, self.activation, invariant, &mut buffers.gate_up, act)
                .map_err(|e| ShapeError(e.to_string()))?;
        } else {
            let gate_up = sized(&mut buffers.gate_up, rows * 2 * inter);
            linear_into(
                &mlp.gate_up,
                normed,
                hidden,
                threads,
                self.batch_invariant,
                gate_up,
            )?;
            gate_rows_threaded(self.activation, gate_up, inter, threads, act);
        }
        linear_into(&mlp.down, act, inter, threads, self.batch_invariant, x)?;
        if let Some(norm) = self.mlp_out_norm {
            rms_norm_rows(x, norm, self.eps, threads)?;
        }
        Ok(())
    }
}

/// Gated attention's projection rows ([T, (2 H + 2 Hkv) D], each query
/// head followed by its gate) become the usual q/k/v rows ([T, (H + 2 Hkv)
/// D], in place: the first T (H + 2 Hkv) D values); the gates ([T, H D])
/// are returned.
fn split_query_gates(qkv: &mut [f32], tokens: usize, h: usize, hkv: usize, d: usize) -> Vec<f32> {
    let (wide, row_len) = ((2 * h + 2 * hkv) * d, (h + 2 * hkv) * d);
    let mut gates = Vec::with_capacity(tokens * h * d);
    for t in 0..tokens {
        let (src, dst) = (t * wide, t * row_len);
        for head in 0..h {
            let at = src + 2 * head * d;
            gates.extend_from_slice(&qkv[at + d..at + 2 * d]);
            qkv.copy_within(at..at + d, dst + head * d);
        }
        // (rows only move forward: a row's destination starts at or before
        // its source, and each copy reads what no earlier copy wrote)
        qkv.copy_within(src + 2 * h * d..src + wide, dst + h * d);
    }
    gates
}

/// RMSNorm over each query head (`q_norm`) and key head (`k_norm`) of the
/// q/k/v rows, in place; the values are left alone.
#[allow(clippy::too_many_arguments)]
fn head_norms(
    qkv: &mut [f32],
    row_len: usize,
    h: usize,
    hkv: usize,
    d: usize,
    q_norm: &[f32],
    k_norm: &[f32],
    eps: f32,
) -> Result<(), ShapeError> {
    for row in qkv.chunks_exact_mut(row_len) {
        let (queries, rest) = row.split_at_mut(h * d);
        for (heads, weight) in [(queries, q_norm), (&mut rest[..hkv * d], k_norm)] {
            let mut normed = vec![0.0; heads.len()];
            add_rms_norm(heads, None, weight, eps, &mut normed, 1)?;
            heads.copy_from_slice(&normed);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer with hidden 32, 2 heads of 16 (1 KV head), MLP 32, in Q8_0
    /// blocks of zeros: shapes only.
    fn run_with(slot: i64, qkv_outputs: usize) -> Result<(), ShapeError> {
        let (hidden, d, inter) = (32, 16, 32);
        let fmt = QuantFormat::Q8_0;
        let zeros = |rows: usize, k: usize| vec![0u8; rows * fmt.row_bytes(k)];
        let (wqkv, wo, wgu, wd) = (
            zeros(qkv_outputs, hidden),
            zeros(hidden, 2 * d),
            zeros(2 * inter, hidden),
            zeros(hidden, inter),
        );
        let linear = |w: &'static [u8], n| LayerLinear {
            weight: LinearWeight::Blocks(w, fmt, BlockLayout::Rows),
            bias: None,
            out_features: n,
        };
        let leak = |v: Vec<u8>| -> &'static [u8] { Box::leak(v.into_boxed_slice()) };
        let norm = vec![1.0; hidden];
        let weights = DecoderLayerWeights {
            input_norm: &norm,
            post_attention_norm: &norm,
            attention_out_norm: None,
            mlp_out_norm: None,
            activation: Gate::Silu,
            eps: 1e-6,
            qkv: linear(leak(wqkv), qkv_outputs),
            query_gate: false,
            q_norm: None,
            k_norm: None,
            o: linear(leak(wo), hidden),
            mlp: Some(DenseMlp {
                gate_up: linear(leak(wgu), 2 * inter),
                down: linear(leak(wd), hidden),
            }),
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: d,
            rotary_dim: d,
            scale: 0.25,
            window: 0,
            sinks: None,
        };
        let (cos, sin) = (vec![1.0; 8 * d / 2], vec![0.0; 8 * d / 2]);
        let step = DecoderLayerStep {
            positions: &[0],
            cos: &cos,
            sin: &sin,
            slot_mapping: &[slot],
            block_table: &[0],
            query_start_loc: &[0, 1],
            seq_lens: &[1],
            block_size: 4,
            batch_invariant: false,
            num_threads: 1,
        };
        let (mut residual, mut x) = (vec![1.0; hidden], vec![0.5; hidden]);
        let (mut k, mut v) = (vec![0.0; 4 * d], vec![0.0; 4 * d]);
        decoder_layer(&weights, &step, &mut residual, &mut x, &mut k, &mut v)?;
        // Zero weights: attention adds nothing, the MLP outputs zeros.
        assert!(residual.iter().all(|&r| r == 1.5) && x.iter().all(|&v| v == 0.0));
        Ok(())
    }

    #[test]
    fn kept_buffers_past_the_bound_are_given_back() {
        let mut kept = MlpBuffers {
            gate_up: vec![0.0; KEEP_MAX_ELEMENTS + 1],
            act: vec![0.0; KEEP_MAX_ELEMENTS],
        };
        kept.trim();
        assert_eq!(kept.gate_up.capacity(), 0);
        assert_eq!(kept.act.len(), KEEP_MAX_ELEMENTS);
    }

    #[test]
    fn runs_and_rejects_bad_shapes() {
        run_with(3, 4 * 16).unwrap();
        let err = run_with(4, 4 * 16).unwrap_err();
        assert!(err.0.contains("slot 4 outside the cache"), "{err:?}");
        let err = run_with(0, 3 * 16).unwrap_err();
        assert!(
            err.0.contains("qkv has the wrong number of outputs"),
            "{err:?}"
        );
    }
}
