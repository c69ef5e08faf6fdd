//! A mixture-of-experts block (a decode step's few tokens or a prefill
//! chunk's many), in one call over block-format experts: the router
//! (float32 logits, softmax, the top k, optionally renormalised, after an
//! optional bias: `route`), then each token's chosen experts' gated MLPs
//! (gate/up, SiLU * up or gpt-oss's clamped SwiGLU, down; biases where the
//! family has them), weighted and summed (`moe_experts`).
//!
//! Tokens are grouped by expert; all active experts' gate/up column ranges
//! are one job for the thread pool, then all their down column ranges
//! another: two dispatches a layer however many experts are active, where
//! one matmul call per projection costs two per expert. Each expert's
//! arithmetic is `quant_matmul`'s (its input rows quantized per 32-wide
//! block on the integer kernel, or, with 32 rows or more on a CPU with AMX,
//! rounded to bfloat16 on the tiles), so the result equals running the
//! experts one `quant_matmul` at a time up to the SiLU's rounding. On a
//! step of many routed tokens, gathering the experts' rows, the activation
//! and the weighted sum split over the threads too (the same bits).

use crate::activation::{gate_rows, Gate};
use crate::f32_matmul::{f32_matmul, F32MatmulArgs};
use crate::pool::run_parts_on;
use crate::quant_matmul::{
    check_k, OutPtr, QuantFormat, QuantKernel, QuantMatmulArgs, QuantShapeError, RowChunks,
};
use crate::quant_pack::{BlockLayout, PANEL};

/// One expert's weights, in block formats: gate and up stacked
/// ([2 I, row bytes of hidden]), down ([hidden, row bytes of I]), and their
/// biases ([2 I], [hidden]) if the family has them (gpt-oss). An expert no
/// token chose may be given empty slices.
#[derive(Clone, Copy)]
pub struct ExpertWeights<'a> {
    pub gate_up: &'a [u8],
    pub down: &'a [u8],
    pub gate_up_bias: Option<&'a [f32]>,
    pub down_bias: Option<&'a [f32]>,
}

pub struct MoeArgs<'a> {
    pub x: &'a [f32],              // [T, hidden]
    pub expert_ids: &'a [i64],     // [T, k]: each token's chosen experts
    pub expert_weights: &'a [f32], // [T, k]: their routing weights
    pub experts: &'a [ExpertWeights<'a>],
    pub gate_up_fmt: QuantFormat,
    pub down_fmt: QuantFormat,
    /// The layout of every expert's weights.
    pub layout: BlockLayout,
    pub hidden: usize,
    pub inter: usize,
    pub activation: Gate,
    pub num_threads: usize,
}

/// A softmax router over float32 weights ([experts, hidden]) and an
/// optional bias ([experts]).
pub struct Router<'a> {
    pub weight: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub top_k: usize,
    pub renormalize: bool,
}

/// Each token's `top_k` experts (largest softmax probability first, ties to
/// the lower index) and their weights (the probabilities, rescaled to sum
/// to one with `renormalize`): ([T, k] ids, [T, k] weights).
pub fn route(
    x: &[f32],
    hidden: usize,
    router: &Router<'_>,
    num_threads: usize,
) -> Result<(Vec<i64>, Vec<f32>), QuantShapeError> {
    let experts = router.weight.len() / hidden.max(1);
    if hidden == 0
        || router.weight.len() != experts * hidden
        || !x.len().is_multiple_of(hidden)
        || router.top_k == 0
        || router.top_k > experts
        || router.bias.is_some_and(|b| b.len() != experts)
    {
        return Err(QuantShapeError(format!(
            "router: {} weights for hidden {hidden}, {} of them a token",
            router.weight.len(),
            router.top_k
        )));
    }
    let tokens = x.len() / hidden;
    let mut logits = vec![0.0; tokens * experts];
    let args = F32MatmulArgs {
        x,
        w: router.weight,
        bias: router.bias,
        m: tokens,
        k: hidden,
        n: experts,
        num_threads,
    };
    f32_matmul(&args, &mut logits)?;
    let (mut ids, mut weights) = (Vec::with_capacity(tokens * router.top_k), Vec::new());
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for row in logits.chunks_exact(experts) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let exps: Vec<f32> = row.iter().map(|&v| (v - max).exp()).collect();
        let total: f32 = exps.iter().sum();
        order.clear();
        order.extend(0..experts);
        order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
        let chosen = &order[..router.top_k];
        let probs: Vec<f32> = chosen.iter().map(|&e| exps[e] / total).collect();
        let scale = if router.renormalize {
            1.0 / probs.iter().sum::<f32>()
        } else {
            1.0
        };
        ids.extend(chosen.iter().map(|&e| e as i64));
        weights.extend(probs.iter().map(|p| p * scale));
    }
    Ok((ids, weights))
}

/// An active expert's rows: the tokens that chose it and their weights.
struct Group {
    expert: usize,
    tokens: Vec<usize>,
    weights: Vec<f32>,
}

/// `out[t] = sum_j weight[t, j] * expert[ids[t, j]](x[t])` ([T, hidden]).
pub fn moe_experts(args: &MoeArgs<'_>, out: &mut [f32]) -> Result<(), QuantShapeError> {
    let (hidden, inter) = (args.hidden, args.inter);
    let gate_up_row = check_k(args.gate_up_fmt, hidden)?;
    let down_row = check_k(args.down_fmt, inter)?;
    let tokens = args.x.len() / hidden.max(1);
    let bad = |what: String| Err(QuantShapeError(format!("moe experts: {what}")));
    if args.x.len() != tokens * hidden || out.len() != args.x.len() {
        return bad(format!(
            "x ({}) and out ({}) must be [T, {hidden}]",
            args.x.len(),
            out.len()
        ));
    }
    let choices = args.expert_ids.len();
    if choices != args.expert_weights.len() || (tokens > 0 && !choices.is_multiple_of(tokens)) {
        return bad("expert ids and weights must both be [T, k]".into());
    }
    let top_k = choices.checked_div(tokens).unwrap_or(0);
    let mut by_expert: Vec<Option<Group>> = (0..args.experts.len()).map(|_| None).collect();
    for (i, (&id, &w)) in args.expert_ids.iter().zip(args.expert_weights).enumerate() {
        let Some(slot) = usize::try_from(id).ok().and_then(|e| by_expert.get_mut(e)) else {
            return bad(format!("expert {id} out of {} experts", args.experts.len()));
        };
        let group = slot.get_or_insert_with(|| Group {
            expert: id as usize,
            tokens: Vec::new(),
            weights: Vec::new(),
        });
        group.tokens.push(i / top_k);
        group.weights.push(w);
    }
    let groups: Vec<Group> = by_expert.into_iter().flatten().collect();
    for g in &groups {
        let e = &args.experts[g.expert];
        let biases_ok = e.gate_up_bias.is_none_or(|b| b.len() == 2 * inter)
            && e.down_bias.is_none_or(|b| b.len() == hidden);
        if e.gate_up.len() != 2 * inter * gate_up_row
            || e.down.len() != hidden * down_row
            || !biases_ok
        {
            return bad(format!(
                "expert {} has {} gate/up and {} down bytes, expected {} and {}",
                g.expert,
                e.gate_up.len(),
                e.down.len(),
                2 * inter * gate_up_row,
                hidden * down_row
            ));
        }
    }
    out.fill(0.0);
    if groups.is_empty() {
        return Ok(());
    }
    // The steps around the two matmuls split over the threads where a
    // step has enough values (a prefill chunk's), each value computed as
    // on one thread.
    let routed_values = choices * hidden.max(inter);
    let threads = if routed_values < PARALLEL_MIN_VALUES {
        1
    } else {
        args.num_threads
    };
    // gate/up for every active expert, then the gate's activation times up.
    let inputs = per_group(threads, groups.len(), |i| {
        let g = &groups[i];
        let mut rows = Vec::with_capacity(g.tokens.len() * hidden);
        for &t in &g.tokens {
            rows.extend_from_slice(&args.x[t * hidden..(t + 1) * hidden]);
        }
        rows
    });
    let gate_up = project(
        &groups,
        &inputs,
        |g| {
            let e = &args.experts[g.expert];
            (e.gate_up, e.gate_up_bias)
        },
        (args.gate_up_fmt, args.layout),
        hidden,
        2 * inter,
        args.num_threads,
    );
    let activated = per_group(threads, groups.len(), |i| {
        gate_rows(args.activation, &gate_up[i], inter)
    });
    let down = project(
        &groups,
        &activated,
        |g| {
            let e = &args.experts[g.expert];
            (e.down, e.down_bias)
        },
        (args.down_fmt, args.layout),
        inter,
        hidden,
        args.num_threads,
    );
    // The weighted sum, expert by expert in ascending order for each token
    // (the tokens split over the threads: a group's tokens ascend).
    let per = tokens.div_ceil(threads.max(1));
    let dst = OutPtr(out.as_mut_ptr());
    run_parts_on(threads, tokens.div_ceil(per.max(1)), &|part| {
        let (first, last) = (part * per, ((part + 1) * per).min(tokens));
        // SAFETY: each part writes the rows of its own tokens, in `out`.
        let out = unsafe {
            std::slice::from_raw_parts_mut(dst.get().add(first * hidden), (last - first) * hidden)
        };
        for (g, rows) in groups.iter().zip(&down) {
            let from = g.tokens.partition_point(|&t| t < first);
            let to = g.tokens.partition_point(|&t| t < last);
            for ((&t, &w), row) in g.tokens[from..to]
                .iter()
                .zip(&g.weights[from..to])
                .zip(rows[from * hidden..to * hidden].chunks_exact(hidden))
            {
                let at = (t - first) * hidden;
                for (o, &v) in out[at..at + hidden].iter_mut().zip(row) {
                    *o += v * w;
                }
            }
        }
    });
    Ok(())
}

/// Values (routed tokens times the hidden or intermediate size) below
/// which the steps around the experts' matmuls stay on the calling thread.
const PARALLEL_MIN_VALUES: usize = 1 << 15;

/// `make(0)`, ..., `make(n - 1)` in order, the groups shared out among up
/// to `threads` threads as they come free.
fn per_group<T: Send + Sync>(threads: usize, n: usize, make: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let made: Vec<std::sync::OnceLock<T>> = (0..n).map(|_| std::sync::OnceLock::new()).collect();
    run_parts_on(threads, n, &|i| {
        let _ = made[i].set(make(i));
    });
    made.into_iter()
        .map(|slot| slot.into_inner().expect("every group made"))
        .collect()
}

/// Each group's `inputs` ([rows, k]) times its weight (`weight(group)`:
/// [n, row bytes]), all groups' column ranges in one pool job: [rows, n]
/// per group.
#[allow(clippy::too_many_arguments)]
fn project<'a>(
    groups: &[Group],
    inputs: &[Vec<f32>],
    weight: impl Fn(&Group) -> (&'a [u8], Option<&'a [f32]>),
    (fmt, layout): (QuantFormat, BlockLayout),
    k: usize,
    n: usize,
    threads: usize,
) -> Vec<Vec<f32>> {
    let args: Vec<QuantMatmulArgs<'_>> = groups
        .iter()
        .zip(inputs)
        .map(|(g, x)| QuantMatmulArgs {
            x,
            w: weight(g).0,
            bias: weight(g).1,
            m: g.tokens.len(),
            k,
            n,
            fmt,
            layout,
            num_threads: 1,
        })
        .collect();
    // An expert with enough rows on a CPU with AMX takes the tiles (as
    // `quant_matmul` would take its call), the columns past its last panel
    // and every other expert the integer kernel.
    #[cfg(target_arch = "x86_64")]
    let tiles: Vec<Option<crate::quant_matmul_amx::TileRows>> = args
        .iter()
        .map(|a| {
            // SAFETY: `takes` checked the CPU and the format; the rows are
            // `inputs`' ([rows, k]).
            crate::quant_matmul_amx::takes(a)
                .then(|| unsafe { crate::quant_matmul_amx::TileRows::new(a) })
        })
        .collect();
    #[cfg(not(target_arch = "x86_64"))]
    let tiles: Vec<Option<()>> = args.iter().map(|_| None).collect();
    // (an expert on the tiles quantizes its rows only for columns past its
    // last panel)
    let chunks: Vec<RowChunks<'_>> = args
        .iter()
        .zip(&tiles)
        .map(|(a, t)| {
            let rows = if t.is_some() && n.is_multiple_of(PANEL) {
                0
            } else {
                a.m
            };
            let x: &[f32] = a.x;
            RowChunks::new(&QuantMatmulArgs {
                x: &x[..rows * k],
                m: rows,
                ..*a
            })
        })
        .collect();
    let mut outs: Vec<Vec<f32>> = groups
        .iter()
        .map(|g| vec![0.0; g.tokens.len() * n])
        .collect();
    let ptrs: Vec<OutPtr> = outs.iter_mut().map(|o| OutPtr(o.as_mut_ptr())).collect();
    // About four parts a thread (parts are claimed as threads free up), in
    // whole panels, never one spanning two experts.
    let total = groups.len() * n;
    let target = (4 * threads.max(1)).max(groups.len());
    let mut parts: Vec<(usize, usize, usize)> = Vec::new();
    // (the one kernel for every row count, on this CPU)
    let kernel = QuantKernel::best();
    let unit = kernel.column_unit();
    let per = total.div_ceil(target).div_ceil(unit).max(1) * unit;
    for i in 0..groups.len() {
        let mut start = 0;
        while start < n {
            let end = (start + per).min(n);
            parts.push((i, start, end));
            start = end;
        }
    }
    let job = |p: usize| {
        let (i, start, end) = parts[p];
        #[cfg(target_arch = "x86_64")]
        let start = match &tiles[i] {
            Some(rows) => {
                let whole = (n / PANEL * PANEL).clamp(start, end);
                // SAFETY: as below; `start` is a multiple of 16 (`unit`),
                // and so is `whole`.
                unsafe { rows.run_columns(&args[i], start, whole, ptrs[i]) };
                whole
            }
            None => start,
        };
        // SAFETY: part p writes columns start..end of group i's output
        // ([rows, n], allocated above), no other part the same; the kernel
        // runs on this CPU (`best`); the weight's size was checked.
        unsafe { chunks[i].run_columns(kernel, start, end, ptrs[i]) };
    };
    run_parts_on(threads, parts.len(), &job);
    outs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant_matmul::quant_matmul;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// Q8_0 blocks of random values in [-0.5, 0.5) (scale 1/254, so every
    /// byte is in range).
    fn q8_weight(rows: usize, k: usize, seed: &mut u64) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..rows * k / 32 {
            out.extend_from_slice(&0x1c08u16.to_le_bytes()); // f16 of ~1/254
            for _ in 0..32 {
                out.push((lcg(seed) * 254.0) as i8 as u8);
            }
        }
        out
    }

    /// Q6_K super-blocks of random 6-bit values and scales, d = 2^-12.
    fn q6_k_weight(rows: usize, k: usize, seed: &mut u64) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..rows * k / 256 {
            out.extend((0..208).map(|_| ((lcg(seed) + 0.5) * 256.0) as u8));
            out.extend_from_slice(&0x0c00u16.to_le_bytes());
        }
        out
    }

    /// Q4_K super-blocks of random scales, mins and nibbles, d = dmin = 2^-12.
    fn q4_k_weight(rows: usize, k: usize, seed: &mut u64) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..rows * k / 256 {
            out.extend_from_slice(&0x0c00u16.to_le_bytes());
            out.extend_from_slice(&0x0c00u16.to_le_bytes());
            out.extend((0..140).map(|_| ((lcg(seed) + 0.5) * 256.0) as u8));
        }
        out
    }

    fn weight(fmt: QuantFormat, rows: usize, k: usize, seed: &mut u64) -> Vec<u8> {
        match fmt {
            QuantFormat::Q6_K => q6_k_weight(rows, k, seed),
            QuantFormat::Q4_K => q4_k_weight(rows, k, seed),
            _ => q8_weight(rows, k, seed),
        }
    }

    fn matmul(
        x: &[f32],
        w: &[u8],
        bias: Option<&[f32]>,
        k: usize,
        n: usize,
        fmt: QuantFormat,
    ) -> Vec<f32> {
        let m = x.len() / k;
        let mut out = vec![0.0; m * n];
        let args = QuantMatmulArgs {
            x,
            w,
            bias,
            m,
            k,
            n,
            fmt,
            layout: BlockLayout::Rows,
            num_threads: 1,
        };
        quant_matmul(&args, &mut out).unwrap();
        out
    }

    /// The block against each expert run alone, one quant_matmul at a
    /// time; with biases and gpt-oss's clamped SwiGLU too, and with down
    /// projections in Q6_K and Q4_K (a Q4_K_M file's); with 7 tokens, and
    /// with 75 (experts of 32 rows or more, which take the AMX tiles on a
    /// CPU with them, as `quant_matmul` does); and with 240 (every format's
    /// gather, activation and weighted sum split over the threads, as the
    /// K-quant cases' are from 75).
    #[test]
    fn equals_the_experts_one_matmul_at_a_time() {
        let clamped = Gate::ClampedSwiGlu {
            alpha: 1.702,
            limit: 0.5,
        };
        for tokens in [7, 75, 240] {
            for (activation, with_bias) in [(Gate::Silu, false), (clamped, true)] {
                check_against_one_at_a_time(activation, with_bias, QuantFormat::Q8_0, tokens);
            }
            check_against_one_at_a_time(Gate::Silu, false, QuantFormat::Q6_K, tokens);
            check_against_one_at_a_time(Gate::Silu, false, QuantFormat::Q4_K, tokens);
        }
    }

    fn check_against_one_at_a_time(
        activation: Gate,
        with_bias: bool,
        down_fmt: QuantFormat,
        tokens: usize,
    ) {
        let inter = if down_fmt.block_values() == 256 {
            256
        } else {
            96
        };
        let (hidden, experts, top_k) = (64, 5, 2);
        let mut seed = 7;
        let weights: Vec<(Vec<u8>, Vec<u8>)> = (0..experts)
            .map(|_| {
                (
                    q8_weight(2 * inter, hidden, &mut seed),
                    weight(down_fmt, hidden, inter, &mut seed),
                )
            })
            .collect();
        let biases: Vec<(Vec<f32>, Vec<f32>)> = (0..experts)
            .map(|_| {
                (
                    (0..2 * inter).map(|_| lcg(&mut seed)).collect(),
                    (0..hidden).map(|_| lcg(&mut seed)).collect(),
                )
            })
            .collect();
        let x: Vec<f32> = (0..tokens * hidden).map(|_| lcg(&mut seed)).collect();
        let ids: Vec<i64> = (0..tokens * top_k)
            .map(|i| ((i * 3 + i / 2) % 4) as i64)
            .collect();
        let w: Vec<f32> = (0..tokens * top_k)
            .map(|i| 0.25 + i as f32 * 0.01)
            .collect();
        let bias = |e: usize| with_bias.then(|| (biases[e].0.as_slice(), biases[e].1.as_slice()));
        let views: Vec<ExpertWeights<'_>> = weights
            .iter()
            .enumerate()
            .map(|(e, (gu, d))| ExpertWeights {
                gate_up: gu,
                down: d,
                gate_up_bias: bias(e).map(|b| b.0),
                down_bias: bias(e).map(|b| b.1),
            })
            .collect();
        let args = MoeArgs {
            x: &x,
            expert_ids: &ids,
            expert_weights: &w,
            experts: &views,
            gate_up_fmt: QuantFormat::Q8_0,
            down_fmt,
            layout: BlockLayout::Rows,
            hidden,
            inter,
            activation,
            num_threads: 3,
        };
        let mut got = vec![f32::NAN; tokens * hidden];
        moe_experts(&args, &mut got).unwrap();
        // Expert 4 was chosen by no token; the reference runs each expert
        // on its tokens alone.
        let mut want = vec![0.0; tokens * hidden];
        for (e, (gu, d)) in weights.iter().enumerate() {
            let chosen: Vec<usize> = (0..tokens * top_k)
                .filter(|&i| ids[i] == e as i64)
                .collect();
            let rows: Vec<f32> = chosen
                .iter()
                .flat_map(|&i| x[i / top_k * hidden..(i / top_k + 1) * hidden].to_vec())
                .collect();
            if chosen.is_empty() {
                continue;
            }
            let h = matmul(
                &rows,
                gu,
                bias(e).map(|b| b.0),
                hidden,
                2 * inter,
                QuantFormat::Q8_0,
            );
            let act = gate_rows(activation, &h, inter);
            let y = matmul(&act, d, bias(e).map(|b| b.1), inter, hidden, down_fmt);
            for (row, &i) in y.chunks_exact(hidden).zip(&chosen) {
                let t = i / top_k;
                for (o, &v) in want[t * hidden..(t + 1) * hidden].iter_mut().zip(row) {
                    *o += v * w[i];
                }
            }
        }
        assert!(want.iter().all(|v| v.is_finite() && *v != 0.0));
        assert_eq!(
            got, want,
            "{activation:?}, biases {with_bias}, down {down_fmt:?}, {tokens} tokens"
        );
    }

    #[test]
    fn routes_by_softmax_top_k() {
        // two tokens, four experts; the router is the identity on 4 inputs
        // (hidden 4): the logits are the inputs
        let weight: Vec<f32> = (0..16)
            .map(|i| if i % 5 == 0 { 1.0 } else { 0.0 })
            .collect();
        let x = [0.0, 2.0, 1.0, -1.0, 5.0, 5.5, -3.0, 5.0];
        let plain = Router {
            weight: &weight,
            bias: None,
            top_k: 2,
            renormalize: false,
        };
        let (ids, w) = route(&x, 4, &plain, 1).unwrap();
        assert_eq!(ids, [1, 2, 1, 0]); // ties (experts 0 and 3 of token 2) to the lower index
        let row: Vec<f32> = x[..4].iter().map(|v| v.exp()).collect();
        let total: f32 = row.iter().sum();
        assert!((w[0] - row[1] / total).abs() < 1e-6 && (w[1] - row[2] / total).abs() < 1e-6);
        let renorm = Router {
            renormalize: true,
            ..plain
        };
        let (_, w) = route(&x, 4, &renorm, 1).unwrap();
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6 && (w[2] + w[3] - 1.0).abs() < 1e-6);
        let too_many = Router { top_k: 5, ..renorm };
        assert!(route(&x, 4, &too_many, 1).is_err());
        // A bias moves the choice: +4 on expert 3 makes it token 1's first.
        let bias = [0.0, 0.0, 0.0, 4.0];
        let biased = Router {
            bias: Some(&bias),
            ..plain
        };
        let (ids, _) = route(&x, 4, &biased, 1).unwrap();
        assert_eq!(ids[..2], [3, 1]);
    }

    #[test]
    fn rejects_bad_ids_and_sizes() {
        let gu = vec![0u8; 2 * 32 * 34];
        let d = vec![0u8; 32 * 34];
        let experts = [ExpertWeights {
            gate_up: &gu,
            down: &d,
            gate_up_bias: None,
            down_bias: None,
        }];
        let x = vec![0.0; 32];
        let run = |ids: &[i64], experts: &[ExpertWeights<'_>]| {
            let args = MoeArgs {
                x: &x,
                expert_ids: ids,
                expert_weights: &vec![1.0; ids.len()],
                experts,
                gate_up_fmt: QuantFormat::Q8_0,
                down_fmt: QuantFormat::Q8_0,
                layout: BlockLayout::Rows,
                hidden: 32,
                inter: 32,
                activation: Gate::Silu,
                num_threads: 1,
            };
            moe_experts(&args, &mut [0.0; 32])
        };
        run(&[0], &experts).unwrap();
        assert!(run(&[1], &experts)
            .unwrap_err()
            .0
            .contains("expert 1 out of 1"));
        assert!(run(&[-1], &experts).unwrap_err().0.contains("expert -1"));
        let short = [ExpertWeights {
            gate_up: &gu[..34],
            down: &d,
            gate_up_bias: None,
            down_bias: None,
        }];
        assert!(run(&[0], &short).unwrap_err().0.contains("gate/up"));
    }
}
