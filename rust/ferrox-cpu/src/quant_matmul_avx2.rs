//! The AVX2 loops of the quantized matmul: two weight rows against up to
//! four activation rows at a time, so each unpacked weight block feeds up to
//! eight integer dot products.

use std::arch::x86_64::*;

use crate::paged_attention::avx2::hsum;
use crate::quant_matmul::{
    quantize_activations_impl, QuantFormat, QuantMatmulArgs, QuantizedActivations, BLOCK,
};

/// How many weight rows ahead of the current tile to prefetch.
const PREFETCH_ROWS: usize = 16;

/// A block's scale and offset (Q4_1) or scale (Q8_0), and its 32 weights as
/// bytes (unsigned nibbles for Q4_1, signed for Q8_0).
#[inline(always)]
unsafe fn unpack<const Q4: bool>(p: *const u8) -> (__m256i, f32, f32) {
    if Q4 {
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
        let packed = _mm_loadu_si128(p.add(4) as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(packed, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
        (
            _mm256_set_m128i(hi, lo),
            _mm_cvtss_f32(dm),
            _mm_cvtss_f32(_mm_shuffle_ps(dm, dm, 1)),
        )
    } else {
        let bits = std::ptr::read_unaligned(p as *const u16) as i32;
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
        (_mm256_loadu_si256(p.add(2) as *const __m256i), d, 0.0)
    }
}

/// The 32-term integer dot product of a weight block and an activation
/// block, as eight float partial sums.
#[inline(always)]
unsafe fn dot<const Q4: bool>(w: __m256i, x: __m256i) -> __m256 {
    let pairs = if Q4 {
        _mm256_maddubs_epi16(w, x) // nibbles are unsigned
    } else {
        // maddubs multiplies unsigned by signed bytes: move w's sign onto x
        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
    };
    _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const MR: usize, const Q4: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    col: usize,
    both: bool, // col + 1 is a real column too
    i0: usize,
    out: *mut f32,
) {
    let block_bytes = args.fmt.block_bytes();
    let row_bytes = args.fmt.row_bytes(args.k);
    let blocks = args.k / BLOCK;
    let w0 = args.w.as_ptr().add(col * row_bytes);
    let w1 = if both { w0.add(row_bytes) } else { w0 };
    let mut acc0 = [_mm256_setzero_ps(); MR];
    let mut acc1 = [_mm256_setzero_ps(); MR];
    let mut off0 = [0f32; MR];
    let mut off1 = [0f32; MR];
    // The weights stream from memory once per call: ask for the rows
    // PREFETCH_ROWS ahead while this tile computes (the hardware prefetcher
    // alone leaves the kernel waiting on memory). Prefetches never fault;
    // past the last row they are wasted, and the address is never read.
    let ahead = args
        .w
        .as_ptr()
        .wrapping_add((col + PREFETCH_ROWS) * row_bytes);
    for b in 0..blocks {
        if i0 == 0 {
            // (once per column pair, not again for each group of rows)
            let at = ahead.wrapping_add(b * block_bytes);
            _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(row_bytes) as *const i8);
        }
        let (wa, da, ma) = unpack::<Q4>(w0.add(b * block_bytes));
        let (wb, db, mb) = unpack::<Q4>(w1.add(b * block_bytes));
        for r in 0..MR {
            let xb = (i0 + r) * blocks + b;
            let x = _mm256_loadu_si256(acts.q.as_ptr().add(xb * BLOCK) as *const __m256i);
            let dx = *acts.d.get_unchecked(xb);
            acc0[r] = _mm256_fmadd_ps(dot::<Q4>(wa, x), _mm256_set1_ps(da * dx), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(dot::<Q4>(wb, x), _mm256_set1_ps(db * dx), acc1[r]);
            if Q4 {
                let s = *acts.s.get_unchecked(xb);
                off0[r] += ma * s;
                off1[r] += mb * s;
            }
        }
    }
    let bias0 = args.bias.map_or(0.0, |b| b[col]);
    let bias1 = if both {
        args.bias.map_or(0.0, |b| b[col + 1])
    } else {
        0.0
    };
    for r in 0..MR {
        let row = out.add((i0 + r) * args.n + col);
        *row = hsum(acc0[r]) + off0[r] + bias0;
        if both {
            *row.add(1) = hsum(acc1[r]) + off1[r] + bias1;
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn columns_of<const Q4: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    start: usize,
    end: usize,
    out: *mut f32,
) {
    let mut col = start;
    while col < end {
        let both = col + 1 < end;
        let mut i = 0;
        while i < args.m {
            let rows = (args.m - i).min(4);
            match rows {
                1 => tile::<1, Q4>(args, acts, col, both, i, out),
                2 => tile::<2, Q4>(args, acts, col, both, i, out),
                3 => tile::<3, Q4>(args, acts, col, both, i, out),
                _ => tile::<4, Q4>(args, acts, col, both, i, out),
            }
            i += rows;
        }
        col += 2;
    }
}

/// Columns `start..end` of the output.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `out` points to M * N floats; no other
/// thread writes these columns.
pub unsafe fn columns(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    start: usize,
    end: usize,
    out: *mut f32,
) {
    match args.fmt {
        QuantFormat::Q4_1 => columns_of::<true>(args, acts, start, end, out),
        QuantFormat::Q8_0 => columns_of::<false>(args, acts, start, end, out),
        // (the columns past a K-quant weight's last panel: few, in portable
        // code)
        QuantFormat::Q6_K | QuantFormat::Q4_K => {
            crate::quant_matmul::columns_portable(args, acts, start, end, out)
        }
    }
}

/// One weight row (K / 32 blocks of Q4_1 or Q8_0) as K floats.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `row` holds `out.len() / 32` blocks;
/// `fmt` has blocks of 32 (not a K-quant's super-blocks).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_row(row: &[u8], fmt: QuantFormat, out: &mut [f32]) {
    debug_assert_eq!(fmt.block_values(), BLOCK);
    let block_bytes = fmt.block_bytes();
    for b in 0..out.len() / BLOCK {
        let p = row.as_ptr().add(b * block_bytes);
        let o = out.as_mut_ptr().add(b * BLOCK);
        let (bytes, d, m) = match fmt {
            QuantFormat::Q4_1 => unpack::<true>(p),
            QuantFormat::Q8_0 | QuantFormat::Q6_K | QuantFormat::Q4_K => unpack::<false>(p),
        };
        let (dv, mv) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        let halves = [
            _mm256_castsi256_si128(bytes),
            _mm256_extracti128_si256(bytes, 1),
        ];
        for (h, half) in halves.into_iter().enumerate() {
            for e in 0..2 {
                let eight = if e == 0 {
                    half
                } else {
                    _mm_unpackhi_epi64(half, half)
                };
                let ints = match fmt {
                    QuantFormat::Q4_1 => _mm256_cvtepu8_epi32(eight),
                    QuantFormat::Q8_0 | QuantFormat::Q6_K | QuantFormat::Q4_K => {
                        _mm256_cvtepi8_epi32(eight)
                    }
                };
                let values = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), dv, mv);
                _mm256_storeu_ps(o.add(16 * h + 8 * e), values);
            }
        }
    }
}

/// `quant_matmul::quantize_activations` a block (four vectors) at a time:
/// the same scale, rounding (the conversion's round-to-nearest-even) and
/// sums, bit for bit.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_activations(x: &[f32], k: usize) -> QuantizedActivations {
    let blocks = x.len() / BLOCK;
    if blocks * BLOCK != x.len() {
        return quantize_activations_impl(x, k);
    }
    let mut out = QuantizedActivations {
        q: vec![0; x.len()],
        d: vec![0.0; blocks],
        s: vec![0.0; blocks],
        h: Vec::new(),
    };
    let sign = _mm256_set1_ps(-0.0);
    // (the two packs leave each lane's dwords as rows 0..4 of r0, r1, r2,
    // r3, then rows 4..8: back into order)
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..blocks {
        let p = x.as_ptr().add(b * BLOCK);
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let magnitude = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
        );
        let quad = _mm_max_ps(
            _mm256_castps256_ps128(magnitude),
            _mm256_extractf128_ps(magnitude, 1),
        );
        let pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
        let amax = _mm_cvtss_f32(_mm_max_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
        let d = amax / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let mut r = [_mm256_setzero_si256(); 4];
        for (r, v) in r.iter_mut().zip(v) {
            *r = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));
        }
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(r[0], r[1]),
            _mm256_packs_epi32(r[2], r[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, order);
        _mm256_storeu_si256(out.q.as_mut_ptr().add(b * BLOCK) as *mut __m256i, bytes);
        let sum = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        let sum = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256(sum, 1),
        );
        let sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b01_00_11_10));
        let sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b10_11_00_01));
        *out.d.get_unchecked_mut(b) = d;
        *out.s.get_unchecked_mut(b) = d * _mm_cvtsi128_si32(sum) as f32;
    }
    out
}
