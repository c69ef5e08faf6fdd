//! The gated MLP's activations over a row of gate and up values, written
//! so the compiler vectorises them (and built once more with AVX2 / FMA,
//! picked where the CPU has them): SiLU(gate) * up, tanh-GELU(gate) * up
//! and gpt-oss's clamped SwiGLU.
//!
//! Each is the gate times a sigmoid, and the sigmoid's e^x is computed
//! here (`exp`, within about 3e-7 relative error over the whole float
//! range) instead of one call into the C library per value: for Gemma's
//! 6912-wide MLP a token's tanh calls alone cost more than a layer's
//! element-wise work should.

use crate::pool::run_parts;
use crate::quant_matmul::OutPtr;

/// e^x within about 3e-7 relative error (x clamped to [-87, 88]; e^-87 is
/// 1.6e-38, e^88 1.7e38): x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two
/// parts, so that n ln 2 loses no bits), e^r by its degree-6 Taylor
/// polynomial, 2^n built in the exponent bits.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_145_75; // ln 2's leading bits (n * LN2_HI is exact)
    const LN2_LO: f32 = 1.428_606_8e-6; // the rest of ln 2
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + SHIFT;
    let n = shifted - SHIFT;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // n lies in [-126, 127], so 2^n is a normal float. Its exponent bits
    // from `shifted`'s low bits (which hold n: it lies in SHIFT's binade),
    // in integer arithmetic that vectorises, where `n as i32` (a saturating
    // conversion) made the compiler convert one value at a time.
    let biased = shifted
        .to_bits()
        .wrapping_sub(SHIFT.to_bits())
        .wrapping_add(127);
    p * f32::from_bits(biased << 23)
}

/// The gated MLP's activation of its gate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Gate {
    /// SwiGLU: silu(gate) * up (Llama).
    Silu,
    /// GeGLU with tanh's GELU: gelu_tanh(gate) * up (Gemma).
    GeluTanh,
    /// gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g),
    /// g = min(gate, limit).
    ClampedSwiGlu { alpha: f32, limit: f32 },
}

#[inline(always)]
fn one(gate: Gate, g: f32, u: f32) -> f32 {
    // sqrt(2 / pi), for tanh's GELU: 0.5 g (1 + tanh(c z)) = g sigmoid(2 c z)
    const C: f32 = 0.797_884_6;
    match gate {
        Gate::Silu => g / (1.0 + exp(-g)) * u,
        Gate::GeluTanh => g / (1.0 + exp(-2.0 * C * (g + 0.044_715 * g * g * g))) * u,
        Gate::ClampedSwiGlu { alpha, limit } => {
            let g = g.min(limit);
            (u.clamp(-limit, limit) + 1.0) * g / (1.0 + exp(-alpha * g))
        }
    }
}

#[inline(always)]
fn gate_row_impl(gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) {
    // (one loop per kind, so each vectorises without a branch inside)
    match gate {
        Gate::Silu => {
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                *o = one(Gate::Silu, g, u);
            }
        }
        Gate::GeluTanh => {
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                *o = one(Gate::GeluTanh, g, u);
            }
        }
        clamped => {
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                *o = one(clamped, g, u);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gate_row_avx2(gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) {
    gate_row_impl(gate, g, u, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn gate_row_avx512(gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) {
    gate_row_impl(gate, g, u, out)
}

/// `out[i] = act(g[i]) * u[i]` (the three slices of one length).
pub fn gate_row(gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::avx512() {
        // SAFETY: the CPU has AVX-512 F, AVX2 and FMA.
        return unsafe { gate_row_avx512(gate, g, u, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::isa::avx2() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { gate_row_avx2(gate, g, u, out) };
    }
    gate_row_impl(gate, g, u, out)
}

#[inline(always)]
fn silu_impl(x: &mut [f32]) {
    for v in x {
        *v /= 1.0 + exp(-*v);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_avx2(x: &mut [f32]) {
    silu_impl(x)
}

/// SiLU (x sigmoid(x)) of each value, in place.
pub fn silu_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::avx2() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { silu_avx2(x) };
    }
    silu_impl(x)
}

/// Each row of `gate_up` ([rows, 2 inter]: the gate, then up) activated:
/// [rows, inter].
pub fn gate_rows(gate: Gate, gate_up: &[f32], inter: usize) -> Vec<f32> {
    let mut out = vec![0.0; gate_up.len() / 2];
    gate_rows_into(gate, gate_up, inter, &mut out);
    out
}

fn gate_rows_into(gate: Gate, gate_up: &[f32], inter: usize, out: &mut [f32]) {
    for (row, dst) in gate_up
        .chunks_exact(2 * inter)
        .zip(out.chunks_exact_mut(inter))
    {
        let (g, u) = row.split_at(inter);
        gate_row(gate, g, u, dst);
    }
}

/// Outputs below which `gate_rows_threaded` stays on the calling thread.
const PARALLEL_MIN_OUTPUTS: usize = 1 << 15;

/// `gate_rows` into `out` ([rows, inter]), the rows split between up to
/// `num_threads` threads of the pool where there are enough of them (a
/// prefill chunk's MLP): the same values, each computed alone.
pub fn gate_rows_threaded(
    gate: Gate,
    gate_up: &[f32],
    inter: usize,
    num_threads: usize,
    out: &mut [f32],
) {
    let rows = out.len() / inter.max(1);
    assert_eq!(
        gate_up.len(),
        2 * out.len(),
        "gate_up must be [rows, 2 inter]"
    );
    let parts = num_threads.min(rows).max(1);
    if parts == 1 || rows * inter < PARALLEL_MIN_OUTPUTS {
        return gate_rows_into(gate, gate_up, inter, out);
    }
    let per = rows.div_ceil(parts);
    let dst = OutPtr(out.as_mut_ptr());
    run_parts(parts, &|part| {
        let (first, last) = (part * per, ((part + 1) * per).min(rows));
        if first >= last {
            return;
        }
        // SAFETY: each part writes its own rows of `out`, which outlives the call.
        let mine = unsafe {
            std::slice::from_raw_parts_mut(dst.get().add(first * inter), (last - first) * inter)
        };
        gate_rows_into(
            gate,
            &gate_up[first * 2 * inter..last * 2 * inter],
            inter,
            mine,
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_over_the_range() {
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            assert!(((got - want) / want).abs() < 4e-7, "e^{x}: {got} vs {want}");
            x += 0.013;
        }
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1e-37);
        assert!(exp(1000.0).is_finite() && exp(1000.0) > 1e38);
    }

    #[test]
    fn activations_match_their_definitions() {
        let g: Vec<f32> = (0..301).map(|i| (i as f32 - 150.0) * 0.07).collect();
        let u: Vec<f32> = (0..301).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        type Reference = fn(f64, f64) -> f64;
        let kinds: [(Gate, Reference); 3] = [
            (Gate::Silu, |g, u| g / (1.0 + (-g).exp()) * u),
            (Gate::GeluTanh, |g, u| {
                let c = (2.0f64 / std::f64::consts::PI).sqrt();
                0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u
            }),
            (
                Gate::ClampedSwiGlu {
                    alpha: 1.702,
                    limit: 7.0,
                },
                |g, u| {
                    let g = g.min(7.0);
                    (u.clamp(-7.0, 7.0) + 1.0) * g / (1.0 + (-1.702 * g).exp())
                },
            ),
        ];
        for (gate, reference) in kinds {
            for version in 0..2 {
                let mut out = vec![f32::NAN; g.len()];
                if version == 0 {
                    gate_row_impl(gate, &g, &u, &mut out);
                } else {
                    gate_row(gate, &g, &u, &mut out);
                }
                for i in 0..g.len() {
                    let want = reference(g[i] as f64, u[i] as f64);
                    let got = out[i] as f64;
                    assert!(
                        (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                        "{gate:?} at {}: {got} vs {want}",
                        g[i]
                    );
                }
            }
        }
    }

    #[test]
    fn threaded_rows_are_the_rows_alone() {
        // Row counts below, at and above the threshold, odd ones included.
        for (rows, inter) in [(1, 24), (7, 4097), (64, 512), (33, 1536), (101, 1000)] {
            let gate_up: Vec<f32> = (0..rows * 2 * inter)
                .map(|i| ((i * 7919) % 1000) as f32 / 125.0 - 4.0)
                .collect();
            for gate in [Gate::Silu, Gate::GeluTanh] {
                let alone = gate_rows(gate, &gate_up, inter);
                for threads in 1..4 {
                    let mut split = vec![f32::NAN; rows * inter];
                    gate_rows_threaded(gate, &gate_up, inter, threads, &mut split);
                    assert!(
                        split
                            .iter()
                            .zip(&alone)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{gate:?}, {rows} rows of {inter}, {threads} threads"
                    );
                }
            }
        }
    }
}
