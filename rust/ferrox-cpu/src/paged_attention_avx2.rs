//! The AVX2/FMA vector loops of the CPU paged-attention kernel.

use std::arch::x86_64::*;

use super::{Portable, VectorOps};
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

// SAFETY (every method): only reached from `run_row_avx2`, where AVX2,
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
