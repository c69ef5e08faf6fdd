//! The AVX-512 vector loops of the CPU paged-attention kernel: the AVX2
//! loops at twice the width (a head of 64 floats in four registers), for
//! head sizes that are multiples of 16; others take the AVX2 loops.

use std::arch::x86_64::*;

use super::avx2::Avx2;
use super::{accumulate_by_head, scores_by_head, VectorOps};
use crate::kv_element::KvElement;

pub struct Avx512;

/// Sixteen cache elements from `p` as floats (float16 widened).
#[inline(always)]
unsafe fn load16<T: KvElement>(p: *const T) -> __m512 {
    if T::HALF {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    } else {
        _mm512_loadu_ps(p as *const f32)
    }
}

/// The sixteen lanes added pairwise into eight.
#[inline(always)]
unsafe fn fold(v: __m512) -> __m256 {
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    _mm256_add_ps(_mm512_castps512_ps256(v), high)
}

/// `R` registers hold a head of `16 * R` floats for the whole block; four
/// keys at once, as in the AVX2 loop.
#[inline(always)]
unsafe fn scores_regs<const R: usize, T: KvElement>(
    q: &[f32],
    keys: &[T],
    base: usize,
    stride: usize,
    scale: f32,
    scores: &mut [f32],
) -> f32 {
    // (loops, not closures: a closure would not get the caller's target
    // features, and its intrinsics would become calls)
    let mut qv = [_mm512_setzero_ps(); R];
    for (r, v) in qv.iter_mut().enumerate() {
        *v = _mm512_loadu_ps(q.as_ptr().add(16 * r));
    }
    let n = scores.len();
    let scale4 = _mm_set1_ps(scale);
    let mut max4 = _mm_set1_ps(f32::NEG_INFINITY);
    let mut j = 0;
    while j + 4 <= n {
        let k = keys.as_ptr().add(base + j * stride);
        let mut a = [_mm512_setzero_ps(); 4];
        for (r, v) in qv.iter().enumerate() {
            for (key, acc) in a.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps(*v, load16(k.add(key * stride + 16 * r)), *acc);
            }
        }
        let (a0, a1, a2, a3) = (fold(a[0]), fold(a[1]), fold(a[2]), fold(a[3]));
        // as in the AVX2 loop: per 128-bit half, the four keys' partial sums
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
        let mut acc = _mm512_setzero_ps();
        for (r, v) in qv.iter().enumerate() {
            acc = _mm512_fmadd_ps(*v, load16(k.add(16 * r)), acc);
        }
        *score = _mm512_reduce_add_ps(acc) * scale;
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
    let c = _mm512_set1_ps(correction);
    let mut av = [_mm512_setzero_ps(); R];
    for (r, v) in av.iter_mut().enumerate() {
        *v = _mm512_mul_ps(_mm512_loadu_ps(acc.as_ptr().add(16 * r)), c);
    }
    for (j, &p) in probs.iter().enumerate() {
        let x = values.as_ptr().add(base + j * stride);
        let pv = _mm512_set1_ps(p);
        for (r, v) in av.iter_mut().enumerate() {
            *v = _mm512_fmadd_ps(pv, load16(x.add(16 * r)), *v);
        }
    }
    for (r, v) in av.iter().enumerate() {
        _mm512_storeu_ps(acc.as_mut_ptr().add(16 * r), *v);
    }
}

/// Four keys' sixteen-lane partial sums, summed: the four scores.
#[inline(always)]
unsafe fn sum4(a: &[__m512; 4]) -> __m128 {
    let (a0, a1, a2, a3) = (fold(a[0]), fold(a[1]), fold(a[2]), fold(a[3]));
    let s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1))
}

/// `scores_group` for `G` query heads of `16 * R` floats: each key is
/// loaded once and multiplied by every head's query. With `HELD` the
/// queries stay in registers beside the partial sums of four keys for every
/// head (`G * (R + 4)` registers); without, for heads too large for that,
/// they are read from memory (the first level of cache) as the products
/// need them. Per head the same four-key chains, sums and maximum as
/// `scores_regs`.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // register tiles
unsafe fn scores_group_regs<const R: usize, const G: usize, const HELD: bool, T: KvElement>(
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
    let d = 16 * R;
    let q = q.as_ptr();
    let mut held = [[_mm512_setzero_ps(); R]; G];
    if HELD {
        for (g, head) in held.iter_mut().enumerate() {
            for (r, v) in head.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(q.add(g * d + 16 * r));
            }
        }
    }
    // (a plain expression, not a closure: see `scores_regs`)
    macro_rules! query {
        ($g:expr, $r:expr) => {
            if HELD {
                held[$g][$r]
            } else {
                _mm512_loadu_ps(q.add($g * d + 16 * $r))
            }
        };
    }
    let scale4 = _mm_set1_ps(scale);
    let mut max4 = [_mm_set1_ps(f32::NEG_INFINITY); G];
    let mut j = 0;
    while j + 4 <= n {
        let k = keys.as_ptr().add(base + j * stride);
        let mut a = [[_mm512_setzero_ps(); 4]; G];
        for r in 0..R {
            for key in 0..4 {
                let kv = load16(k.add(key * stride + 16 * r));
                for g in 0..G {
                    a[g][key] = _mm512_fmadd_ps(query!(g, r), kv, a[g][key]);
                }
            }
        }
        for g in 0..G {
            let s = _mm_mul_ps(sum4(&a[g]), scale4);
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
        let mut acc = [_mm512_setzero_ps(); G];
        for r in 0..R {
            let kv = load16(k.add(16 * r));
            for g in 0..G {
                acc[g] = _mm512_fmadd_ps(query!(g, r), kv, acc[g]);
            }
        }
        for g in 0..G {
            let score = _mm512_reduce_add_ps(acc[g]) * scale;
            scores[g * bs + i] = score;
            maxes[g] = maxes[g].max(score);
        }
    }
}

/// `accumulate_group` for `G` query heads of `16 * R` floats: each value
/// row is loaded once for every head. The head is taken `C` registers at a
/// time (one pass over the block's values each), so that `G * C` partial
/// sums, the `G` probabilities and a value fit the 32 registers; each lane
/// still sums its products in the order `accumulate_regs` does.
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
    let d = 16 * R;
    for part in (0..R).step_by(C) {
        let mut av = [[_mm512_setzero_ps(); C]; G];
        for (g, head) in av.iter_mut().enumerate() {
            let c = _mm512_set1_ps(corrections[g]);
            for (r, v) in head.iter_mut().enumerate() {
                let at = acc.as_ptr().add(g * d + 16 * (part + r));
                *v = _mm512_mul_ps(_mm512_loadu_ps(at), c);
            }
        }
        for j in 0..n {
            let x = values.as_ptr().add(base + j * stride + 16 * part);
            let mut p = [_mm512_setzero_ps(); G];
            for (g, p) in p.iter_mut().enumerate() {
                *p = _mm512_set1_ps(*probs.get_unchecked(g * bs + j));
            }
            for r in 0..C {
                let v = load16(x.add(16 * r));
                for g in 0..G {
                    av[g][r] = _mm512_fmadd_ps(p[g], v, av[g][r]);
                }
            }
        }
        for (g, head) in av.iter().enumerate() {
            for (r, v) in head.iter().enumerate() {
                _mm512_storeu_ps(acc.as_mut_ptr().add(g * d + 16 * (part + r)), *v);
            }
        }
    }
}

/// `scores_group` for `G` heads of `d = 16 R` floats: the queries in
/// registers where they fit beside the partial sums and a key (at most 31
/// of `G * (R + 4)` registers), read from memory for the larger heads, else
/// `$fallback` (head by head).
macro_rules! grouped_scores {
    ($d:expr, $g:expr, ($($arg:expr),* $(,)?), $fallback:expr) => {
        match ($d, $g) {
            // SAFETY (each arm): as for every method below.
            (16, 2) => unsafe { scores_group_regs::<1, 2, true, T>($($arg),*) },
            (16, 3) => unsafe { scores_group_regs::<1, 3, true, T>($($arg),*) },
            (16, 4) => unsafe { scores_group_regs::<1, 4, true, T>($($arg),*) },
            (32, 2) => unsafe { scores_group_regs::<2, 2, true, T>($($arg),*) },
            (32, 3) => unsafe { scores_group_regs::<2, 3, true, T>($($arg),*) },
            (32, 4) => unsafe { scores_group_regs::<2, 4, true, T>($($arg),*) },
            (64, 2) => unsafe { scores_group_regs::<4, 2, true, T>($($arg),*) },
            (64, 3) => unsafe { scores_group_regs::<4, 3, true, T>($($arg),*) },
            (64, 4) => unsafe { scores_group_regs::<4, 4, false, T>($($arg),*) },
            (80, 2) => unsafe { scores_group_regs::<5, 2, true, T>($($arg),*) },
            (80, 3) => unsafe { scores_group_regs::<5, 3, true, T>($($arg),*) },
            (80, 4) => unsafe { scores_group_regs::<5, 4, false, T>($($arg),*) },
            (96, 2) => unsafe { scores_group_regs::<6, 2, true, T>($($arg),*) },
            (96, 3) => unsafe { scores_group_regs::<6, 3, true, T>($($arg),*) },
            (96, 4) => unsafe { scores_group_regs::<6, 4, false, T>($($arg),*) },
            (128, 2) => unsafe { scores_group_regs::<8, 2, true, T>($($arg),*) },
            (128, 3) => unsafe { scores_group_regs::<8, 3, false, T>($($arg),*) },
            (128, 4) => unsafe { scores_group_regs::<8, 4, false, T>($($arg),*) },
            (256, 2) => unsafe { scores_group_regs::<16, 2, false, T>($($arg),*) },
            (256, 3) => unsafe { scores_group_regs::<16, 3, false, T>($($arg),*) },
            (256, 4) => unsafe { scores_group_regs::<16, 4, false, T>($($arg),*) },
            _ => $fallback,
        }
    };
}

/// `accumulate_group` for `G` heads of `d = 16 R` floats, `C` registers
/// of each at a time (`G * C + G + 1` registers, at most 32), else
/// `$fallback` (head by head).
macro_rules! grouped_accumulate {
    ($d:expr, $g:expr, ($($arg:expr),* $(,)?), $fallback:expr) => {
        match ($d, $g) {
            // SAFETY (each arm): as for every method below.
            (16, 2) => unsafe { accumulate_group_regs::<1, 1, 2, T>($($arg),*) },
            (16, 3) => unsafe { accumulate_group_regs::<1, 1, 3, T>($($arg),*) },
            (16, 4) => unsafe { accumulate_group_regs::<1, 1, 4, T>($($arg),*) },
            (32, 2) => unsafe { accumulate_group_regs::<2, 2, 2, T>($($arg),*) },
            (32, 3) => unsafe { accumulate_group_regs::<2, 2, 3, T>($($arg),*) },
            (32, 4) => unsafe { accumulate_group_regs::<2, 2, 4, T>($($arg),*) },
            (64, 2) => unsafe { accumulate_group_regs::<4, 4, 2, T>($($arg),*) },
            (64, 3) => unsafe { accumulate_group_regs::<4, 4, 3, T>($($arg),*) },
            (64, 4) => unsafe { accumulate_group_regs::<4, 4, 4, T>($($arg),*) },
            (80, 2) => unsafe { accumulate_group_regs::<5, 5, 2, T>($($arg),*) },
            (80, 3) => unsafe { accumulate_group_regs::<5, 5, 3, T>($($arg),*) },
            (80, 4) => unsafe { accumulate_group_regs::<5, 5, 4, T>($($arg),*) },
            (96, 2) => unsafe { accumulate_group_regs::<6, 6, 2, T>($($arg),*) },
            (96, 3) => unsafe { accumulate_group_regs::<6, 6, 3, T>($($arg),*) },
            (96, 4) => unsafe { accumulate_group_regs::<6, 6, 4, T>($($arg),*) },
            (128, 2) => unsafe { accumulate_group_regs::<8, 8, 2, T>($($arg),*) },
            (128, 3) => unsafe { accumulate_group_regs::<8, 8, 3, T>($($arg),*) },
            (128, 4) => unsafe { accumulate_group_regs::<8, 4, 4, T>($($arg),*) },
            (256, 2) => unsafe { accumulate_group_regs::<16, 8, 2, T>($($arg),*) },
            (256, 3) => unsafe { accumulate_group_regs::<16, 8, 3, T>($($arg),*) },
            (256, 4) => unsafe { accumulate_group_regs::<16, 4, 4, T>($($arg),*) },
            _ => $fallback,
        }
    };
}

/// The sizes `heads` query heads are taken in by the grouped loops: as few
/// groups of at most four as cover them, as even as can be (8: 4 + 4, 7:
/// 4 + 3, 6: 3 + 3, 5: 3 + 2).
fn head_groups(heads: usize) -> impl Iterator<Item = usize> {
    let groups = heads.div_ceil(4).max(1);
    let (size, larger) = (heads / groups, heads % groups);
    (0..groups).map(move |i| size + usize::from(i < larger))
}

// SAFETY (every method): only reached from `run_tile_avx512`, where AVX-512 F
// (and AVX2, FMA, F16C) are enabled; `validate` has checked that every key
// and value row `base + j * stride .. + d` lies inside the cache, and
// `d == 16 * R`.
impl VectorOps for Avx512 {
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
                16 => scores_regs::<1, T>(q, keys, base, stride, scale, scores),
                32 => scores_regs::<2, T>(q, keys, base, stride, scale, scores),
                64 => scores_regs::<4, T>(q, keys, base, stride, scale, scores),
                80 => scores_regs::<5, T>(q, keys, base, stride, scale, scores),
                96 => scores_regs::<6, T>(q, keys, base, stride, scale, scores),
                128 => scores_regs::<8, T>(q, keys, base, stride, scale, scores),
                256 => scores_regs::<16, T>(q, keys, base, stride, scale, scores),
                _ => Avx2::scores(q, keys, base, stride, scale, scores),
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
                16 => accumulate_regs::<1, T>(acc, correction, probs, values, base, stride),
                32 => accumulate_regs::<2, T>(acc, correction, probs, values, base, stride),
                64 => accumulate_regs::<4, T>(acc, correction, probs, values, base, stride),
                80 => accumulate_regs::<5, T>(acc, correction, probs, values, base, stride),
                96 => accumulate_regs::<6, T>(acc, correction, probs, values, base, stride),
                128 => accumulate_regs::<8, T>(acc, correction, probs, values, base, stride),
                256 => accumulate_regs::<16, T>(acc, correction, probs, values, base, stride),
                _ => Avx2::accumulate(acc, correction, probs, values, base, stride),
            }
        }
    }

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
            grouped_scores!(
                d,
                size,
                (q, keys, base, stride, scale, scores, bs, n, maxes),
                scores_by_head::<Self, T>(q, keys, base, stride, scale, scores, shape, maxes)
            );
            first += size;
        }
    }

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

    const TILE_WIDTH: usize = 16;

    fn has_loop(d: usize) -> bool {
        matches!(d, 16 | 32 | 64 | 80 | 96 | 128 | 256) || Avx2::has_loop(d)
    }

    #[inline(always)]
    fn widen<T: KvElement>(src: &[T], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        unsafe {
            while i + 16 <= n {
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), load16(src.as_ptr().add(i)));
                i += 16;
            }
        }
        Avx2::widen(&src[i..n], &mut dst[i..n]);
    }
}

/// Whether the CPU runs these loops (with the AVX2 ones they fall back to).
pub fn supported() -> bool {
    crate::isa::avx512()
}
