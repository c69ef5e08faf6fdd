//! The AVX2/FMA vector loops of the CPU paged-attention kernel.
//!
//! The scores of the query heads that share a KV head are taken together
//! where their partial sums fit the sixteen registers: each key is then
//! loaded (and widened from float16) once for all of them, and each head's
//! arithmetic is the one it has alone, so the results are the same bits.
//! For heads of 96 and 128 the values are taken together the same way,
//! four registers of each head's output at a time (one pass over the
//! block's values per four registers): eight or twelve independent
//! accumulator chains, enough to cover the FMA latency, and each value
//! widened once per pass, not once per head.

use std::arch::x86_64::*;

use super::{accumulate_by_head, scores_by_head, Portable, VectorOps};
use crate::kv_element::KvElement;

pub struct Avx2;

/// Eight cache elements from `p` as floats (float16 widened by F16C).
#[inline(always)]
unsafe fn load8<T: KvElement>(p: *const T) -> __m256 {
    if T::HALF {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// Horizontal sum of the eight lanes.
#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
}

/// `R` registers hold a head of `8 * R` floats for the whole block. Four
/// keys go at once: four independent FMA chains instead of one hide the
/// FMA latency, and one shuffle tree sums all four.
#[inline(always)]
unsafe fn scores_regs<const R: usize, T: KvElement>(
    q: &[f32],
    keys: &[T],
    base: usize,
    stride: usize,
    scale: f32,
    scores: &mut [f32],
) -> f32 {
    let mut qv = [_mm256_setzero_ps(); R];
    for (r, v) in qv.iter_mut().enumerate() {
        *v = _mm256_loadu_ps(q.as_ptr().add(8 * r));
    }
    let n = scores.len();
    let scale4 = _mm_set1_ps(scale);
    let mut max4 = _mm_set1_ps(f32::NEG_INFINITY);
    let mut j = 0;
    while j + 4 <= n {
        let k = keys.as_ptr().add(base + j * stride);
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        for (r, v) in qv.iter().enumerate() {
            a0 = _mm256_fmadd_ps(*v, load8(k.add(8 * r)), a0);
            a1 = _mm256_fmadd_ps(*v, load8(k.add(stride + 8 * r)), a1);
            a2 = _mm256_fmadd_ps(*v, load8(k.add(2 * stride + 8 * r)), a2);
            a3 = _mm256_fmadd_ps(*v, load8(k.add(3 * stride + 8 * r)), a3);
        }
        // hadd(hadd(a0, a1), hadd(a2, a3)) holds, per 128-bit half, the
        // four keys' partial sums in order; adding the halves finishes them.
        let s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        let s = _mm_mul_ps(
            _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)),
            scale4,
        );
        _mm_storeu_ps(scores.as_mut_ptr().add(j), s);
        max4 = _mm_max_ps(max4, s);
        j += 4;
    }
    let pair = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
    let mut max = _mm_cvtss_f32(_mm_max_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
    for (i, score) in scores.iter_mut().enumerate().skip(j) {
        let k = keys.as_ptr().add(base + i * stride);
        let mut acc = _mm256_setzero_ps();
        for (r, v) in qv.iter().enumerate() {
            acc = _mm256_fmadd_ps(*v, load8(k.add(8 * r)), acc);
        }
        *score = hsum(acc) * scale;
        max = max.max(*score);
    }
    max
}

#[inline(always)]
unsafe fn accumulate_regs<const R: usize, T: KvElement>(
    acc: &mut [f32],
    correction: f32,
    probs: &[f32],
    values: &[T],
    base: usize,
    stride: usize,
) {
    let c = _mm256_set1_ps(correction);
    let mut av = [_mm256_setzero_ps(); R];
    for (r, v) in av.iter_mut().enumerate() {
        *v = _mm256_mul_ps(_mm256_loadu_ps(acc.as_ptr().add(8 * r)), c);
    }
    for (j, &p) in probs.iter().enumerate() {
        let x = values.as_ptr().add(base + j * stride);
        let pv = _mm256_set1_ps(p);
        for (r, v) in av.iter_mut().enumerate() {
            *v = _mm256_fmadd_ps(pv, load8(x.add(8 * r)), *v);
        }
    }
    for (r, v) in av.iter().enumerate() {
        _mm256_storeu_ps(acc.as_mut_ptr().add(8 * r), *v);
    }
}

/// `accumulate` for `G` query heads of `8 * R` floats (accumulators `8 R`
/// apart, probabilities `bs` apart), `C` registers of each head at a time:
/// each value is loaded once per pass for every head, and each lane sums
/// its products in the order `accumulate_regs` does.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // register tiles
unsafe fn accumulate_group_regs<const R: usize, const C: usize, const G: usize, T: KvElement>(
    acc: &mut [f32],
    corrections: &[f32],
    probs: &[f32],
    values: &[T],
    base: usize,
    stride: usize,
    bs: usize,
    n: usize,
) {
    let d = 8 * R;
    for part in (0..R).step_by(C) {
        let mut av = [[_mm256_setzero_ps(); C]; G];
        for (g, head) in av.iter_mut().enumerate() {
            let c = _mm256_set1_ps(corrections[g]);
            for (r, v) in head.iter_mut().enumerate() {
                let at = acc.as_ptr().add(g * d + 8 * (part + r));
                *v = _mm256_mul_ps(_mm256_loadu_ps(at), c);
            }
        }
        for j in 0..n {
            let x = values.as_ptr().add(base + j * stride + 8 * part);
            let mut p = [_mm256_setzero_ps(); G];
            for (g, p) in p.iter_mut().enumerate() {
                *p = _mm256_set1_ps(*probs.get_unchecked(g * bs + j));
            }
            for r in 0..C {
                let v = load8(x.add(8 * r));
                for g in 0..G {
                    av[g][r] = _mm256_fmadd_ps(p[g], v, av[g][r]);
                }
            }
        }
        for (g, head) in av.iter().enumerate() {
            for (r, v) in head.iter().enumerate() {
                _mm256_storeu_ps(acc.as_mut_ptr().add(g * d + 8 * (part + r)), *v);
            }
        }
    }
}

/// `scores` for `G` query heads of `8 * R` floats (queries `8 R` apart in
/// `q`, scores `bs` apart): each key is loaded once for every head; per
/// head the same four-key chains, sums and maximum as `scores_regs`.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // register tiles
unsafe fn scores_group_regs<const R: usize, const G: usize, T: KvElement>(
    q: &[f32],
    keys: &[T],
    base: usize,
    stride: usize,
    scale: f32,
    scores: &mut [f32],
    bs: usize,
    n: usize,
    maxes: &mut [f32],
) {
    let d = 8 * R;
    let q = q.as_ptr();
    let scale4 = _mm_set1_ps(scale);
    let mut max4 = [_mm_set1_ps(f32::NEG_INFINITY); G];
    let mut j = 0;
    while j + 4 <= n {
        let k = keys.as_ptr().add(base + j * stride);
        let mut a = [[_mm256_setzero_ps(); 4]; G];
        for r in 0..R {
            for key in 0..4 {
                let kv = load8(k.add(key * stride + 8 * r));
                for g in 0..G {
                    let qv = _mm256_loadu_ps(q.add(g * d + 8 * r));
                    a[g][key] = _mm256_fmadd_ps(qv, kv, a[g][key]);
                }
            }
        }
        for g in 0..G {
            let [a0, a1, a2, a3] = a[g];
            let s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            let s = _mm_mul_ps(
                _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)),
                scale4,
            );
            _mm_storeu_ps(scores.as_mut_ptr().add(g * bs + j), s);
            max4[g] = _mm_max_ps(max4[g], s);
        }
        j += 4;
    }
    for g in 0..G {
        let pair = _mm_max_ps(max4[g], _mm_movehl_ps(max4[g], max4[g]));
        maxes[g] = _mm_cvtss_f32(_mm_max_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
    }
    for i in j..n {
        let k = keys.as_ptr().add(base + i * stride);
        let mut acc = [_mm256_setzero_ps(); G];
        for r in 0..R {
            let kv = load8(k.add(8 * r));
            for g in 0..G {
                let qv = _mm256_loadu_ps(q.add(g * d + 8 * r));
                acc[g] = _mm256_fmadd_ps(qv, kv, acc[g]);
            }
        }
        for g in 0..G {
            let score = hsum(acc[g]) * scale;
            scores[g * bs + i] = score;
            maxes[g] = maxes[g].max(score);
        }
    }
}

/// `$f::<R, G, T>(args)` for the head sizes (8 R) of 32, 64 and 128 and
/// `G` of 2 or 3 (four-key chains of three heads fill twelve registers),
/// else `$fallback` (head by head).
/// `accumulate_group_regs::<R, 4, G, T>(args)` for the head sizes (8 R)
/// of 96 and 128 and `G` of 2 or 3 (4 G accumulators, the value and the
/// probabilities within sixteen registers), else `$fallback`. Heads of 64
/// and less stay head by head: there a head's accumulators are one pass of
/// eight registers or fewer, and grouping measured no faster (SmolLM2's
/// three heads of 64 a KV head).
macro_rules! grouped_accumulate {
    ($d:expr, $g:expr, ($($arg:expr),* $(,)?), $fallback:expr) => {
        match ($d, $g) {
            // SAFETY (each arm): as for every method below.
            (96, 2) => unsafe { accumulate_group_regs::<12, 4, 2, T>($($arg),*) },
            (96, 3) => unsafe { accumulate_group_regs::<12, 4, 3, T>($($arg),*) },
            (128, 2) => unsafe { accumulate_group_regs::<16, 4, 2, T>($($arg),*) },
            (128, 3) => unsafe { accumulate_group_regs::<16, 4, 3, T>($($arg),*) },
            _ => $fallback,
        }
    };
}

macro_rules! grouped {
    ($d:expr, $g:expr, $f:ident($($arg:expr),* $(,)?), $fallback:expr) => {
        match ($d, $g) {
            // SAFETY (each arm): as for every method below.
            (32, 2) => unsafe { $f::<4, 2, T>($($arg),*) },
            (32, 3) => unsafe { $f::<4, 3, T>($($arg),*) },
            (64, 2) => unsafe { $f::<8, 2, T>($($arg),*) },
            (64, 3) => unsafe { $f::<8, 3, T>($($arg),*) },
            (128, 2) => unsafe { $f::<16, 2, T>($($arg),*) },
            (128, 3) => unsafe { $f::<16, 3, T>($($arg),*) },
            _ => $fallback,
        }
    };
}

// SAFETY (every method): only reached from `run_tile_avx2`, where AVX2,
// FMA and F16C are enabled; `validate` has checked that every key and value
// row `base + j * stride .. + d` lies inside the cache, and `d == 8 * R`.
impl VectorOps for Avx2 {
    #[inline(always)]
    fn scores<T: KvElement>(
        q: &[f32],
        keys: &[T],
        base: usize,
        stride: usize,
        scale: f32,
        scores: &mut [f32],
    ) -> f32 {
        unsafe {
            match q.len() {
                8 => scores_regs::<1, T>(q, keys, base, stride, scale, scores),
                16 => scores_regs::<2, T>(q, keys, base, stride, scale, scores),
                32 => scores_regs::<4, T>(q, keys, base, stride, scale, scores),
                64 => scores_regs::<8, T>(q, keys, base, stride, scale, scores),
                80 => scores_regs::<10, T>(q, keys, base, stride, scale, scores),
                96 => scores_regs::<12, T>(q, keys, base, stride, scale, scores),
                128 => scores_regs::<16, T>(q, keys, base, stride, scale, scores),
                _ => Portable::scores(q, keys, base, stride, scale, scores),
            }
        }
    }

    #[inline(always)]
    fn accumulate<T: KvElement>(
        acc: &mut [f32],
        correction: f32,
        probs: &[f32],
        values: &[T],
        base: usize,
        stride: usize,
    ) {
        unsafe {
            match acc.len() {
                8 => accumulate_regs::<1, T>(acc, correction, probs, values, base, stride),
                16 => accumulate_regs::<2, T>(acc, correction, probs, values, base, stride),
                32 => accumulate_regs::<4, T>(acc, correction, probs, values, base, stride),
                64 => accumulate_regs::<8, T>(acc, correction, probs, values, base, stride),
                80 => accumulate_regs::<10, T>(acc, correction, probs, values, base, stride),
                96 => accumulate_regs::<12, T>(acc, correction, probs, values, base, stride),
                128 => accumulate_regs::<16, T>(acc, correction, probs, values, base, stride),
                _ => Portable::accumulate(acc, correction, probs, values, base, stride),
            }
        }
    }

    /// Heads in groups of up to three (four: two and two).
    #[inline(always)]
    fn scores_group<T: KvElement>(
        q: &[f32],
        keys: &[T],
        base: usize,
        stride: usize,
        scale: f32,
        scores: &mut [f32],
        shape: (usize, usize, usize),
        maxes: &mut [f32],
    ) {
        let (d, bs, n) = shape;
        let mut first = 0;
        for size in head_groups(maxes.len()) {
            let (q, scores) = (&q[first * d..], &mut scores[first * bs..]);
            let maxes = &mut maxes[first..first + size];
            grouped!(
                d,
                size,
                scores_group_regs(q, keys, base, stride, scale, scores, bs, n, maxes),
                scores_by_head::<Self, T>(q, keys, base, stride, scale, scores, shape, maxes)
            );
            first += size;
        }
    }

    /// Heads in the groups `scores_group` takes.
    #[inline(always)]
    fn accumulate_group<T: KvElement>(
        acc: &mut [f32],
        corrections: &[f32],
        probs: &[f32],
        values: &[T],
        base: usize,
        stride: usize,
        shape: (usize, usize, usize),
    ) {
        let (d, bs, n) = shape;
        let mut first = 0;
        for size in head_groups(corrections.len()) {
            let (acc, probs) = (&mut acc[first * d..], &probs[first * bs..]);
            let corrections = &corrections[first..first + size];
            grouped_accumulate!(
                d,
                size,
                (acc, corrections, probs, values, base, stride, bs, n),
                accumulate_by_head::<Self, T>(acc, corrections, probs, values, base, stride, shape)
            );
            first += size;
        }
    }

    const TILE_WIDTH: usize = 8;

    fn has_loop(d: usize) -> bool {
        matches!(d, 8 | 16 | 32 | 64 | 80 | 96 | 128)
    }

    #[inline(always)]
    fn widen<T: KvElement>(src: &[T], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        unsafe {
            while i + 8 <= n {
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8(src.as_ptr().add(i)));
                i += 8;
            }
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }
}

/// The sizes `heads` query heads are taken in: threes, a four as two twos
/// (one head alone takes the per-head loops, which read each key again).
fn head_groups(heads: usize) -> impl Iterator<Item = usize> {
    let threes = match heads % 3 {
        1 if heads >= 4 => (heads - 4) / 3,
        _ => heads / 3,
    };
    let rest = heads - 3 * threes;
    let tail: &[usize] = match rest {
        0 => &[],
        1 => &[1],
        2 => &[2],
        _ => &[2, 2],
    };
    std::iter::repeat_n(3, threes).chain(tail.iter().copied())
}
