//! One Gated DeltaNet decoder layer (the linear-attention layers of the
//! Qwen3.5 / Qwen3-Next hybrids) for decode steps, one token a row, in a
//! single call: residual add + RMSNorm; the input projections (q/k/v, the
//! output gate z, the step sizes b, the decays a); the causal convolution's
//! step after the inputs the row's state slot holds, then SiLU; q and k
//! L2-normalised per head (q scaled by Dk^-1/2); the delta rule's step on
//! the state pool (`gated_delta::gated_delta_decode`); each value head's
//! RMSNorm times SiLU(z); the output projection; then the second half every
//! decoder layer shares (`decoder_layer::MlpTail`: add + norm, the MLP).
//!
//! The same arithmetic as the module path (python/ferrox/layers/gated_delta.py
//! and models/qwen3_5.py), which a decode step would otherwise spread over
//! some forty tensor operations per layer.

use crate::activation::{exp, silu_in_place, Gate};
use crate::decoder_layer::{linear, DenseMlp, LayerLinear, MlpTail};
use crate::elementwise::add_rms_norm;
use crate::gated_delta::{check_slots, gated_delta_decode, GatedDeltaDecode, StateElement};
use crate::paged_attention::ShapeError;

/// The layer's parameters and shapes.
pub struct GatedDeltaLayerWeights<'a> {
    pub input_norm: &'a [f32],          // [hidden]
    pub post_attention_norm: &'a [f32], // [hidden]: the MLP's input norm
    pub eps: f32,
    pub qkv: LayerLinear<'a>, // hidden -> C = 2 Hk Dk + Hv Dv (queries, keys, values)
    pub z: LayerLinear<'a>,   // hidden -> Hv Dv: the output gate
    pub b: LayerLinear<'a>,   // hidden -> Hv: step sizes (through a sigmoid)
    pub a: LayerLinear<'a>,   // hidden -> Hv: decays
    /// The depthwise convolution's weights, [C, K].
    pub conv: &'a [f32],
    pub dt_bias: &'a [f32], // [Hv]
    /// -exp(A_log), [Hv]: a head's log decay is this times softplus(a + dt_bias).
    pub decay_scale: &'a [f32],
    pub norm: &'a [f32],      // [Dv]: the output's RMSNorm (its weight as it is)
    pub out: LayerLinear<'a>, // Hv Dv -> hidden
    pub mlp: Option<DenseMlp<'a>>,
    pub activation: Gate,
    pub key_heads: usize,
    pub value_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    /// Value head h reads key head h % key_heads (llama.cpp's tiled order);
    /// else h / (value_heads / key_heads).
    pub tiled: bool,
}

/// One decode step's rows: each row's state slot (distinct) and whether it
/// starts from a zero state.
pub struct GatedDeltaLayerStep<'a> {
    pub slots: &'a [i64],
    pub fresh: &'a [bool],
    pub num_threads: usize,
}

/// Runs the layer. `residual` and `x` ([B, hidden]) as `decoder_layer`
/// takes and leaves them; `conv_states` ([S, C, K - 1]) and `states` ([S,
/// Hv, Dk, Dv]) are the state pool, read and written at the rows' slots.
pub fn gated_delta_layer<E: StateElement>(
    w: &GatedDeltaLayerWeights<'_>,
    step: &GatedDeltaLayerStep<'_>,
    residual: &mut [f32],
    x: &mut [f32],
    conv_states: &mut [f32],
    states: &mut [E],
) -> Result<(), ShapeError> {
    let hidden = w.input_norm.len();
    let (hk, hv, dk, dv) = (w.key_heads, w.value_heads, w.k_dim, w.v_dim);
    let (key_dim, value_dim) = (hk * dk, hv * dv);
    let channels = 2 * key_dim + value_dim;
    let rows = step.slots.len();
    let kernel = w.conv.len() / channels.max(1);
    let held = channels * kernel.saturating_sub(1); // a slot's convolution inputs
    let per_slot = hv * dk * dv;
    let num_slots = states.len() / per_slot.max(1);
    let checks = [
        (
            hk > 0 && dk > 0 && dv > 0 && hv.is_multiple_of(hk) && hv >= hk,
            "value heads must be a multiple of the key heads",
        ),
        (
            residual.len() == rows * hidden && x.len() == residual.len(),
            "residual and x must be [B, hidden]",
        ),
        (step.fresh.len() == rows, "fresh must have one flag per row"),
        (
            w.post_attention_norm.len() == hidden && w.norm.len() == dv,
            "the norms differ in size",
        ),
        (
            w.qkv.out_features == channels
                && w.z.out_features == value_dim
                && w.b.out_features == hv
                && w.a.out_features == hv
                && w.out.out_features == hidden,
            "a projection has the wrong number of outputs",
        ),
        (
            w.dt_bias.len() == hv && w.decay_scale.len() == hv,
            "dt_bias and the decay scales must have one value per value head",
        ),
        (
            kernel >= 2 && w.conv.len() == channels * kernel,
            "the convolution must be [C, K] with K >= 2",
        ),
        (
            w.mlp
                .as_ref()
                .is_none_or(|m| m.down.out_features == hidden && m.gate_up.out_features % 2 == 0),
            "down must output hidden, gate_up an even number",
        ),
        (
            states.len() == num_slots * per_slot && conv_states.len() == num_slots * held,
            "the state pools must be [S, C, K - 1] and [S, Hv, Dk, Dv] over the same slots",
        ),
    ];
    if let Some((_, what)) = checks.iter().find(|(ok, _)| !ok) {
        return Err(ShapeError(format!("gated delta layer: {what}")));
    }
    // (checked before any state changes: a refused call leaves the pool as it was)
    check_slots(step.slots, num_slots, "gated delta layer")?;
    let threads = step.num_threads;
    let mut normed = vec![0.0; residual.len()];
    add_rms_norm(residual, Some(x), w.input_norm, w.eps, &mut normed, threads)?;
    let mut qkv = linear(&w.qkv, &normed, hidden, threads)?;
    let mut z = linear(&w.z, &normed, hidden, threads)?;
    silu_in_place(&mut z);
    let b = linear(&w.b, &normed, hidden, threads)?;
    let a = linear(&w.a, &normed, hidden, threads)?;

    // Per row: the convolution's step and SiLU (in place on the q/k/v row),
    // q and k per value head, the values, the decay and step size.
    let (mut q, mut k) = (vec![0.0; rows * hv * dk], vec![0.0; rows * hv * dk]);
    let (mut g, mut beta) = (vec![0.0; rows * hv], vec![0.0; rows * hv]);
    let mut v = Vec::with_capacity(rows * value_dim);
    let q_scale = (dk as f32).powf(-0.5);
    for (r, row) in qkv.chunks_exact_mut(channels).enumerate() {
        let slot = step.slots[r] as usize;
        let history = &mut conv_states[slot * held..(slot + 1) * held];
        if step.fresh[r] {
            history.fill(0.0);
        }
        conv_step(row, history, w.conv, kernel);
        silu_in_place(row);
        let (queries, rest) = row.split_at_mut(key_dim);
        let (keys, values) = rest.split_at_mut(key_dim);
        for (qh, kh) in queries.chunks_exact_mut(dk).zip(keys.chunks_exact_mut(dk)) {
            l2_normalise(qh, q_scale);
            l2_normalise(kh, 1.0);
        }
        for head in 0..hv {
            let key_head = if w.tiled { head % hk } else { head / (hv / hk) };
            let at = (r * hv + head) * dk;
            q[at..at + dk].copy_from_slice(&queries[key_head * dk..(key_head + 1) * dk]);
            k[at..at + dk].copy_from_slice(&keys[key_head * dk..(key_head + 1) * dk]);
            let i = r * hv + head;
            g[i] = w.decay_scale[head] * softplus(a[i] + w.dt_bias[head]);
            beta[i] = sigmoid(b[i]);
        }
        v.extend_from_slice(values);
    }
    let args = GatedDeltaDecode {
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
        slots: step.slots,
        fresh: step.fresh,
        num_heads: hv,
        k_dim: dk,
        v_dim: dv,
    };
    let mut o = vec![0.0; rows * value_dim];
    gated_delta_decode(&args, states, &mut o, threads)?;
    for (head, gate) in o.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
        gated_norm(head, gate, w.norm, w.eps);
    }
    let mixed = linear(&w.out, &o, value_dim, threads)?;
    let tail = MlpTail {
        post_attention_norm: w.post_attention_norm,
        mlp: w.mlp.as_ref(),
        activation: w.activation,
        mlp_out_norm: None,
        eps: w.eps,
        // (`batch_invariant` refuses hybrid models)
        batch_invariant: false,
    };
    tail.run(residual, x, &mixed, &mut normed, threads)
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// log(1 + e^x), x itself above 20 (torch's softplus threshold).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The depthwise causal convolution's step over one row of channels: each
/// channel's output is its kernel over the K - 1 inputs `history` holds
/// ([C, K - 1]) and this one, written over the input; the history shifts
/// by one.
fn conv_step(row: &mut [f32], history: &mut [f32], conv: &[f32], kernel: usize) {
    // Qwen3.5's and Qwen3-Next's width, fixed at compile time: the history's
    // shift is then two moves a channel, where a width known only at run
    // time made it a call to copy memory for every channel.
    if kernel == 4 {
        conv_channels(row, history, conv, 4);
    } else {
        conv_channels(row, history, conv, kernel);
    }
}

#[inline(always)]
fn conv_channels(row: &mut [f32], history: &mut [f32], conv: &[f32], kernel: usize) {
    let keep = kernel - 1;
    for ((x, past), weights) in row
        .iter_mut()
        .zip(history.chunks_exact_mut(keep))
        .zip(conv.chunks_exact(kernel))
    {
        let input = *x;
        let mut acc = 0.0;
        for (p, wt) in past.iter().zip(weights) {
            acc += p * wt;
        }
        acc += input * weights[keep];
        for j in 1..keep {
            past[j - 1] = past[j];
        }
        past[keep - 1] = input;
        *x = acc;
    }
}

/// x / sqrt(|x|^2 + 1e-6) * scale, in place.
fn l2_normalise(x: &mut [f32], scale: f32) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let inv = scale / (sum + 1e-6).sqrt();
    for v in x {
        *v *= inv;
    }
}

/// One value head's output: RMSNorm (by `weight`) times `gate` (SiLU(z)).
fn gated_norm(o: &mut [f32], gate: &[f32], weight: &[f32], eps: f32) {
    let mean = o.iter().map(|v| v * v).sum::<f32>() / o.len() as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    for ((v, &z), &wt) in o.iter_mut().zip(gate).zip(weight) {
        *v = wt * (*v * inv) * z;
    }
}

#[cfg(test)]
#[path = "gated_delta_layer_tests.rs"]
mod tests;
