//! The AVX-512 VNNI quantized matmul: the panel kernel of
//! `quant_matmul_panel` at twice the width (sixteen weight rows per panel,
//! one 64-byte vector holding four consecutive weights of each) with
//! `vpdpbusd`, which multiplies unsigned by signed bytes and adds each four
//! products into a 32-bit lane in one instruction: no 16-bit step to
//! overflow, no widening.
//!
//! Both formats enter the loop as unsigned weights plus a per-block offset:
//! Q4_1 as its nibbles and `m`; Q8_0 as `w + 128` (its bytes with the sign
//! bit flipped) and `-128 d`, since d * sum(w x) equals
//! d * sum((w + 128) x) - 128 d * sum(x), and d_x * sum(x) is the
//! activation block's `s`. One loop then serves both.

use std::arch::x86_64::*;

use crate::quant_matmul::quantize_activations_impl;
use crate::quant_matmul::{QuantFormat, QuantMatmulArgs, QuantizedActivations, BLOCK};
use crate::quant_matmul_panel::{block_pointers, half_bits, load_rows, transpose};

/// Output columns per panel.
pub const WIDE_PANEL: usize = 16;
/// Activation rows per pass over a panel (two registers each).
const ROWS: usize = 8;
/// Vectors per block of a panel: 8 weight groups, the scales, the offsets.
const PANEL_BLOCK: usize = 10;

/// Four dwords of each of sixteen rows (16 bytes at `at[c] + offset`),
/// transposed: `out[g]` holds dword `g` of every row, row c in dword c.
#[inline(always)]
unsafe fn transpose16(at: &[*const u8; WIDE_PANEL], offset: usize) -> [__m512i; 4] {
    let lo = transpose(&load_rows(&at[..8], offset));
    let hi = transpose(&load_rows(&at[8..], offset));
    let mut out = [_mm512_setzero_si512(); 4];
    for g in 0..4 {
        out[g] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo[g]), hi[g]);
    }
    out
}

/// Sixteen float16 values, at `offset` past each pointer, as floats.
#[inline(always)]
unsafe fn halves(at: &[*const u8; WIDE_PANEL], offset: usize) -> __m512 {
    let bits = half_bits(at, offset);
    _mm512_cvtph_ps(_mm256_loadu_si256(bits.as_ptr() as *const __m256i))
}

/// Interleaves columns `col..col + 16` of the weight into `panel`
/// (`PANEL_BLOCK` vectors per block): unsigned weights, scales, offsets.
#[inline(always)]
unsafe fn build_panel(args: &QuantMatmulArgs<'_>, col: usize, panel: &mut [__m512i]) {
    let block_bytes = args.fmt.block_bytes();
    let row_bytes = args.fmt.row_bytes(args.k);
    let first = args.w.as_ptr().add(col * row_bytes);
    for b in 0..args.k / BLOCK {
        let at: [*const u8; WIDE_PANEL] = block_pointers(first, row_bytes, b * block_bytes);
        // The next panel's block, while this one is rearranged.
        for p in at {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(WIDE_PANEL * row_bytes) as *const i8);
        }
        let out = &mut panel[b * PANEL_BLOCK..(b + 1) * PANEL_BLOCK];
        let d = halves(&at, 0);
        match args.fmt {
            QuantFormat::Q4_1 => {
                // weights 4g..4g+4: the low nibbles of bytes 4g..4g+4;
                // weights 16+4g..: their high nibbles
                let mask = _mm512_set1_epi8(0x0f);
                let nibbles = transpose16(&at, 4);
                for g in 0..4 {
                    out[g] = _mm512_and_si512(nibbles[g], mask);
                    out[g + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(nibbles[g]), mask);
                }
                out[9] = _mm512_castps_si512(halves(&at, 2));
            }
            QuantFormat::Q8_0 => {
                let flip = _mm512_set1_epi8(-128);
                for half in 0..2 {
                    let bytes = transpose16(&at, 2 + 16 * half);
                    for g in 0..4 {
                        out[4 * half + g] = _mm512_xor_si512(bytes[g], flip);
                    }
                }
                out[9] = _mm512_castps_si512(_mm512_mul_ps(d, _mm512_set1_ps(-128.0)));
            }
        }
        out[8] = _mm512_castps_si512(d);
    }
}

/// Rows `i0..i0 + R` of the panel's sixteen columns.
#[inline(always)]
unsafe fn panel_rows<const R: usize>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: &[__m512i],
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let blocks = args.k / BLOCK;
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..blocks {
        let vectors = panel.as_ptr().add(b * PANEL_BLOCK);
        let mut sums = [_mm512_setzero_si512(); R];
        for g in 0..8 {
            let w = *vectors.add(g);
            for (r, sum) in sums.iter_mut().enumerate() {
                let x = acts.q.as_ptr().add(((i0 + r) * blocks + b) * BLOCK + 4 * g);
                let x = _mm512_set1_epi32(std::ptr::read_unaligned(x as *const i32));
                *sum = _mm512_dpbusd_epi32(*sum, w, x);
            }
        }
        let d = _mm512_castsi512_ps(*vectors.add(8));
        let m = _mm512_castsi512_ps(*vectors.add(9));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xb = (i0 + r) * blocks + b;
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(*acts.d.get_unchecked(xb)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, *acc);
            *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(*acts.s.get_unchecked(xb)), *acc);
        }
    }
    let bias = match args.bias {
        Some(bias) => _mm512_loadu_ps(bias.as_ptr().add(col)),
        None => _mm512_setzero_ps(),
    };
    for (r, acc) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add((i0 + r) * args.n + col), _mm512_add_ps(*acc, bias));
    }
}

/// Columns `start..end` of the output; `end - start` is a multiple of
/// `WIDE_PANEL`.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `out` points to M * N floats; no
/// other thread writes these columns.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub unsafe fn columns(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    start: usize,
    end: usize,
    out: *mut f32,
) {
    debug_assert_eq!((end - start) % WIDE_PANEL, 0);
    let mut panel = vec![_mm512_setzero_si512(); args.k / BLOCK * PANEL_BLOCK];
    let mut col = start;
    while col < end {
        build_panel(args, col, &mut panel);
        let mut i = 0;
        while i < args.m {
            let rows = (args.m - i).min(ROWS);
            match rows {
                1 => panel_rows::<1>(args, acts, &panel, col, i, out),
                2 => panel_rows::<2>(args, acts, &panel, col, i, out),
                3 => panel_rows::<3>(args, acts, &panel, col, i, out),
                4 => panel_rows::<4>(args, acts, &panel, col, i, out),
                5 => panel_rows::<5>(args, acts, &panel, col, i, out),
                6 => panel_rows::<6>(args, acts, &panel, col, i, out),
                7 => panel_rows::<7>(args, acts, &panel, col, i, out),
                _ => panel_rows::<ROWS>(args, acts, &panel, col, i, out),
            }
            i += rows;
        }
        col += WIDE_PANEL;
    }
}

/// Whether the CPU runs this kernel.
pub fn supported() -> bool {
    crate::isa::avx512_vnni()
}

/// Whether the CPU runs `quantize_activations`.
pub fn quantize_supported() -> bool {
    crate::isa::avx512()
}

/// `quant_matmul::quantize_activations` a block (two vectors) at a time:
/// the same scale, rounding (the conversion's round-to-nearest-even) and
/// sums, bit for bit.
///
/// # Safety
/// The CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
pub unsafe fn quantize_activations(x: &[f32], k: usize) -> QuantizedActivations {
    let blocks = x.len() / BLOCK;
    if blocks * BLOCK != x.len() {
        return quantize_activations_impl(x, k);
    }
    let mut out = QuantizedActivations {
        q: vec![0; x.len()],
        d: vec![0.0; blocks],
        s: vec![0.0; blocks],
    };
    let sign = _mm512_set1_ps(-0.0);
    for b in 0..blocks {
        let v0 = _mm512_loadu_ps(x.as_ptr().add(b * BLOCK));
        let v1 = _mm512_loadu_ps(x.as_ptr().add(b * BLOCK + 16));
        let magnitude = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1));
        let d = _mm512_reduce_max_ps(magnitude) / 127.0;
        let inv = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let r0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
        let r1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        let q = out.q.as_mut_ptr().add(b * BLOCK);
        _mm_storeu_si128(q as *mut __m128i, _mm512_cvtsepi32_epi8(r0));
        _mm_storeu_si128(q.add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(r1));
        *out.d.get_unchecked_mut(b) = d;
        *out.s.get_unchecked_mut(b) = d * _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1)) as f32;
    }
    out
}
