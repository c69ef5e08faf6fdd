//! The AVX2 quantized matmul for several activation rows over packed panels
//! (`quant_pack`): sixteen weight rows (output columns) per panel, taken as
//! two halves of eight, one 32-byte vector holding four consecutive weights
//! of each of a half's eight columns.
//!
//! Against that vector, four activation bytes broadcast to every lane give
//! in one `maddubs` + the block's sums eight columns' partial dot products
//! side by side: the block's scales then apply as vectors (eight weight
//! scales times one activation scale), the sums stay in the lanes of one
//! register per activation row, and the eight results leave in one store;
//! no horizontal sum, no scalar scale per block and column.
//!
//! Q4_1 nibbles are unsigned, so `maddubs` takes them as they are (the low
//! nibbles masked, the high ones shifted down), and the 16-bit sums of a
//! whole block cannot overflow (8 groups x 2 x 15 x 127 = 30480, in any
//! order): one `madd` per block. Q8_0 weights are signed: each group moves
//! the weight's sign onto the activation (`sign`) and widens at once (two
//! products of 127 x 127 already fill 16 bits).
//!
//! A weight in the rows layout is packed here a panel at a time, per call
//! (`pack_panel`), into the same layout: the loop and its results are the
//! same for both layouts.
//!
//! With AVX-VNNI (`panel_vnni`), one `vpdpbusd` takes the place of each
//! `maddubs` and the adds and `madd` that widen its sums: four products a
//! 32-bit lane, summed in 32 bits. The integer sums are exact either way
//! (the 16-bit ones never overflow, as above), so the two give the same
//! bits.

use std::arch::x86_64::*;

use crate::quant_matmul::{QuantFormat, QuantMatmulArgs, QuantizedActivations, BLOCK, SUPER_BLOCK};
use crate::quant_pack::PANEL;

/// Activation rows per pass over a half panel (two registers each).
const ROWS: usize = 4;
/// Q4_1's rows per pass with `maddubs` (no AVX-VNNI): its loop keeps the
/// nibble mask and both unpacked halves in registers besides the rows'
/// sums and accumulators, and at four rows the compiler spills them
/// (`benches/kernel_ab.py` on an AVX2-only AMD EPYC: 1.07-1.12x at 256
/// rows, 0.98-1.09x at 16; docs/performance.md, "Three Q4_1 rows a pass").
/// The other formats measured alike at three and four, and stay at four.
const Q4_1_ROWS_MADDUBS: usize = 3;
/// Columns of a half panel.
const HALF: usize = PANEL / 2;

/// Transposes four dwords of each of eight 16-byte rows: `out[g]` holds
/// dword `g` of rows 0..8 (row r in dword r).
#[inline(always)]
unsafe fn transpose(rows: &[__m128i; HALF]) -> [__m256i; 4] {
    // (plain loops, no closures, in these helpers: a closure is not
    // compiled with the caller's target features, and its intrinsics would
    // not be inlined)
    let mut a = [_mm256_setzero_si256(); 4];
    for c in 0..4 {
        a[c] = _mm256_set_m128i(rows[c + 4], rows[c]);
    }
    let t0 = _mm256_unpacklo_epi32(a[0], a[1]);
    let t1 = _mm256_unpacklo_epi32(a[2], a[3]);
    let t2 = _mm256_unpackhi_epi32(a[0], a[1]);
    let t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    [
        _mm256_unpacklo_epi64(t0, t1),
        _mm256_unpackhi_epi64(t0, t1),
        _mm256_unpacklo_epi64(t2, t3),
        _mm256_unpackhi_epi64(t2, t3),
    ]
}

/// Sixteen bytes at `offset` past each of eight pointers.
#[inline(always)]
unsafe fn load_rows(at: &[*const u8], offset: usize) -> [__m128i; HALF] {
    let mut rows = [_mm_setzero_si128(); HALF];
    for c in 0..HALF {
        rows[c] = _mm_loadu_si128(at[c].add(offset) as *const __m128i);
    }
    rows
}

/// Columns `col..col + 16` of a rows-layout weight, packed into `panel`
/// (`K / 32` panel blocks, the layout `quant_pack::pack_blocks` writes).
///
/// # Safety
/// The CPU has AVX2; the weight holds columns `col..col + 16`; `panel` has
/// `K / 32 * fmt.panel_block_bytes()` bytes.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn pack_panel(args: &QuantMatmulArgs<'_>, col: usize, panel: &mut [u8]) {
    let fmt = args.fmt;
    let (quants_at, halves) = match fmt {
        QuantFormat::Q4_1 => (4, 1), // 16 nibble bytes: one transpose a half
        QuantFormat::Q8_0 => (2, 2), // 32 bytes: two
        QuantFormat::Q6_K | QuantFormat::Q4_K => {
            return crate::quant_pack::pack_panel_portable(args.w, fmt, args.k, col, panel);
        }
    };
    let (block_bytes, row_bytes) = (fmt.block_bytes(), fmt.row_bytes(args.k));
    let (panel_block, scales) = (fmt.panel_block_bytes(), fmt.panel_scales_at());
    let first = args.w.as_ptr().add(col * row_bytes);
    for b in 0..args.k / BLOCK {
        let mut at = [std::ptr::null(); PANEL];
        for (c, p) in at.iter_mut().enumerate() {
            *p = first.add(c * row_bytes + b * block_bytes);
        }
        // The next panel's block, while this one is rearranged.
        for p in at {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PANEL * row_bytes) as *const i8);
        }
        let dst = panel.as_mut_ptr().add(b * panel_block);
        for part in 0..halves {
            for h in 0..2 {
                let groups = transpose(&load_rows(&at[HALF * h..], quants_at + 16 * part));
                for (g, v) in groups.iter().enumerate() {
                    let to = dst.add((4 * part + g) * 4 * PANEL + 32 * h);
                    _mm256_storeu_si256(to as *mut __m256i, *v);
                }
            }
        }
        // the float16 scales (and Q4_1's offsets), sixteen in a row
        let heads = if fmt == QuantFormat::Q4_1 { 2 } else { 1 };
        for h in 0..heads {
            for (c, p) in at.iter().enumerate() {
                let bits = std::ptr::read_unaligned(p.add(2 * h) as *const u16);
                std::ptr::write_unaligned(
                    dst.add(scales + 2 * PANEL * h + 2 * c) as *mut u16,
                    bits,
                );
            }
        }
    }
}

/// `sum` plus the products of `w`'s unsigned bytes and `a`'s signed ones:
/// with `V` (AVX-VNNI) four a 32-bit lane, summed in 32 bits; else two a
/// 16-bit lane (`maddubs`), summed in 16 bits, which the caller keeps from
/// overflowing, and read out by `lanes`.
#[inline(always)]
unsafe fn dot<const V: bool>(sum: __m256i, w: __m256i, a: __m256i) -> __m256i {
    if V {
        _mm256_dpbusd_avx_epi32(sum, w, a)
    } else {
        _mm256_add_epi16(sum, _mm256_maddubs_epi16(w, a))
    }
}

/// `dot`'s sums as one 32-bit sum a lane (a column).
#[inline(always)]
unsafe fn lanes<const V: bool>(sum: __m256i) -> __m256i {
    if V {
        sum
    } else {
        _mm256_madd_epi16(sum, _mm256_set1_epi16(1))
    }
}

/// `sum` (32-bit lanes) plus the products of `w`'s unsigned bytes and `a`'s
/// signed ones, four a lane, where their 16-bit sums need widening at once.
#[inline(always)]
unsafe fn dot32<const V: bool>(sum: __m256i, w: __m256i, a: __m256i) -> __m256i {
    if V {
        _mm256_dpbusd_avx_epi32(sum, w, a)
    } else {
        _mm256_add_epi32(sum, lanes::<false>(_mm256_maddubs_epi16(w, a)))
    }
}

/// Four activation bytes at `q + at`, in every lane.
#[inline(always)]
unsafe fn broadcast(q: *const i8, at: usize) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(q.add(at) as *const i32))
}

/// Rows `i0..i0 + R` of a half panel's eight columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn half_rows<const R: usize, const Q4: bool, const V: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    half: usize,
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let blocks = args.k / BLOCK;
    let (panel_block, scales) = (args.fmt.panel_block_bytes(), args.fmt.panel_scales_at());
    let mask = _mm256_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..blocks {
        let p = panel.add(b * panel_block + 32 * half);
        let q = acts.q.as_ptr().add((i0 * blocks + b) * BLOCK);
        let mut sums = [_mm256_setzero_si256(); R];
        if Q4 {
            for g in 0..4 {
                let v = _mm256_loadu_si256(p.add(g * 4 * PANEL) as *const __m256i);
                let lo = _mm256_and_si256(v, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                for (r, sum) in sums.iter_mut().enumerate() {
                    *sum = dot::<V>(*sum, lo, broadcast(q, r * blocks * BLOCK + 4 * g));
                    *sum = dot::<V>(*sum, hi, broadcast(q, r * blocks * BLOCK + 16 + 4 * g));
                }
            }
        } else {
            for g in 0..8 {
                let w = _mm256_loadu_si256(p.add(g * 4 * PANEL) as *const __m256i);
                let magnitude = _mm256_sign_epi8(w, w);
                for (r, sum) in sums.iter_mut().enumerate() {
                    let signed = _mm256_sign_epi8(broadcast(q, r * blocks * BLOCK + 4 * g), w);
                    *sum = dot32::<V>(*sum, magnitude, signed);
                }
            }
        }
        let heads = panel.add(b * panel_block + scales + 16 * half);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(heads as *const __m128i));
        for r in 0..R {
            let xb = (i0 + r) * blocks + b;
            let ints = if Q4 { lanes::<V>(sums[r]) } else { sums[r] };
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(*acts.d.get_unchecked(xb)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), scale, acc[r]);
            if Q4 {
                let m = _mm256_cvtph_ps(_mm_loadu_si128(heads.add(2 * PANEL) as *const __m128i));
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(*acts.s.get_unchecked(xb)), acc[r]);
            }
        }
    }
    store_half(args, &acc, col + HALF * half, i0, out);
}

/// Half `half` (32 bytes: eight columns) of a panel block's 64-byte group
/// `g`. (A helper function, not a closure: a closure is not compiled with
/// the caller's target features, and its intrinsics would not be inlined.)
#[inline(always)]
unsafe fn half_group(p: *const u8, g: usize, half: usize) -> __m256i {
    _mm256_loadu_si256(p.add(g * 4 * PANEL + 32 * half) as *const __m256i)
}

/// Q6_K's 6-bit weights of 32-value block `J` (of four in a half
/// super-block) from a group of its `ql` bytes (`a`: those of blocks 0 and
/// 2, `b`: of 1 and 3) and of its `qh` bytes.
#[inline(always)]
unsafe fn q6_k_weights<const J: usize>(a: __m256i, b: __m256i, bits: __m256i) -> __m256i {
    let low = _mm256_set1_epi8(0x0f);
    let high = _mm256_set1_epi8(0x30);
    let (nibbles, top) = match J {
        0 => (a, _mm256_slli_epi16(bits, 4)),
        1 => (b, _mm256_slli_epi16(bits, 2)),
        2 => (_mm256_srli_epi16(a, 4), bits),
        _ => (_mm256_srli_epi16(b, 4), _mm256_srli_epi16(bits, 2)),
    };
    _mm256_or_si256(_mm256_and_si256(nibbles, low), _mm256_and_si256(top, high))
}

/// Block `J` (of four, in half super-block `n`) of a Q6_K half panel, for
/// rows `i0..i0 + R`: each half of 16 values as an integer sum that starts
/// at -32 times the activations' sum (the weights' offset), times its own
/// scale.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q6_k_block<const R: usize, const J: usize, const V: bool>(
    acts: &QuantizedActivations,
    p: *const u8, // the panel block
    half: usize,
    d: __m256,
    n: usize,
    first: usize, // this block's index among the activations' blocks, row i0
    stride: usize,
    acc: &mut [__m256; R],
) {
    let group = 4 * PANEL;
    let scales = p.add(48 * group + HALF * half);
    for h in 0..2 {
        let mut sums = [_mm256_setzero_si256(); R];
        for (r, sum) in sums.iter_mut().enumerate() {
            *sum = _mm256_set1_epi32(*acts.h.get_unchecked(2 * (first + r * stride) + h));
        }
        // two groups' products at a time: 2 x 2 x 63 x 127 fits 16 bits
        for g in (4 * h..4 * h + 4).step_by(2) {
            let mut w = [_mm256_setzero_si256(); 2];
            for (e, w) in w.iter_mut().enumerate() {
                // (the three groups side by side: `quant_pack::q6_k_slot`)
                let first = 3 * (8 * n + g + e);
                *w = q6_k_weights::<J>(
                    half_group(p, first, half),
                    half_group(p, first + 1, half),
                    half_group(p, first + 2, half),
                );
            }
            for (r, sum) in sums.iter_mut().enumerate() {
                let q = acts.q.as_ptr().add((first + r * stride) * BLOCK);
                let (a0, a1) = (broadcast(q, 4 * g), broadcast(q, 4 * g + 4));
                *sum = if V {
                    dot::<true>(dot::<true>(*sum, w[0], a0), w[1], a1)
                } else {
                    let pairs = dot::<false>(_mm256_maddubs_epi16(w[0], a0), w[1], a1);
                    _mm256_add_epi32(*sum, lanes::<false>(pairs))
                };
            }
        }
        let bytes = _mm_loadl_epi64(scales.add(16 * (2 * (4 * n + J) + h)) as *const __m128i);
        let scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let dx = _mm256_set1_ps(*acts.d.get_unchecked(first + r * stride));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(scale, dx), *acc);
        }
    }
}

/// Rows `i0..i0 + R` of a Q6_K half panel's eight columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q6_k_half_rows<const R: usize, const V: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    half: usize,
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let (blocks, supers) = (args.k / BLOCK, args.k / SUPER_BLOCK);
    let (panel_block, heads) = (args.fmt.panel_block_bytes(), args.fmt.panel_scales_at());
    let mut acc = [_mm256_setzero_ps(); R];
    for sb in 0..supers {
        let p = panel.add(sb * panel_block);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(
            p.add(heads + 2 * HALF * half) as *const __m128i
        ));
        for n in 0..2 {
            let first = i0 * blocks + 8 * sb + 4 * n;
            q6_k_block::<R, 0, V>(acts, p, half, d, n, first, blocks, &mut acc);
            q6_k_block::<R, 1, V>(acts, p, half, d, n, first + 1, blocks, &mut acc);
            q6_k_block::<R, 2, V>(acts, p, half, d, n, first + 2, blocks, &mut acc);
            q6_k_block::<R, 3, V>(acts, p, half, d, n, first + 3, blocks, &mut acc);
        }
    }
    store_half(args, &acc, col + HALF * half, i0, out);
}

/// `acc` (rows `i0..`, columns `col..col + 8`) plus the bias into `out`.
#[inline(always)]
unsafe fn store_half<const R: usize>(
    args: &QuantMatmulArgs<'_>,
    acc: &[__m256; R],
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let bias = match args.bias {
        Some(bias) => _mm256_loadu_ps(bias.as_ptr().add(col)),
        None => _mm256_setzero_ps(),
    };
    for (r, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.add((i0 + r) * args.n + col), _mm256_add_ps(*acc, bias));
    }
}

/// The six-bit scales (or mins) of blocks 0..4 and 4..8 of a half panel's
/// eight columns, a byte each in each column's lane, from the three groups
/// of its scale bytes (`quant_matmul::q4_k_scale_min`'s arrangement: `a`
/// holds bytes 0..4 of each column, `b` bytes 4..8, `c` bytes 8..12):
/// for the scales a, b, c; for the mins b, c >> 4, ... (`MINS`).
#[inline(always)]
unsafe fn q4_k_six_bits<const MINS: bool>(a: __m256i, b: __m256i, c: __m256i) -> [__m256i; 2] {
    let (six, low, top) = (
        _mm256_set1_epi8(0x3f),
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(0x30),
    );
    let (first, nibbles) = if MINS {
        (b, _mm256_srli_epi16(c, 4))
    } else {
        (a, c)
    };
    // blocks 4..8: the nibble, with the top two bits of blocks 0..4's byte
    let high = _mm256_and_si256(_mm256_srli_epi16(first, 2), top);
    [
        _mm256_and_si256(first, six),
        _mm256_or_si256(_mm256_and_si256(nibbles, low), high),
    ]
}

/// Byte `j % 4` of each lane of `bytes[j / 4]`, as float32, times `d`.
#[inline(always)]
unsafe fn q4_k_lane_scale(bytes: &[__m256i; 2], j: usize, d: __m256) -> __m256 {
    let shifted = _mm256_srl_epi32(bytes[j / 4], _mm_cvtsi32_si128(8 * (j % 4) as i32));
    let ints = _mm256_and_si256(shifted, _mm256_set1_epi32(0xff));
    _mm256_mul_ps(d, _mm256_cvtepi32_ps(ints))
}

/// Rows `i0..i0 + R` of a Q4_K half panel's eight columns: each 32-value
/// block's nibbles (the low ones of its 64 values' bytes, or the high) as
/// one integer sum a row, times d * scale * dx, less dmin * min * sx.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_k_half_rows<const R: usize, const V: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    half: usize,
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let (blocks, supers) = (args.k / BLOCK, args.k / SUPER_BLOCK);
    let (panel_block, heads) = (args.fmt.panel_block_bytes(), args.fmt.panel_scales_at());
    let mask = _mm256_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); R];
    for sb in 0..supers {
        let p = panel.add(sb * panel_block);
        // (the next super-block's scales, d and dmin: `quant_matmul_vnni`)
        let next = p.wrapping_add(panel_block);
        for at in [0, 64, 128, heads] {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(at) as *const i8);
        }
        let (a, b, c) = (
            half_group(p, 0, half),
            half_group(p, 1, half),
            half_group(p, 2, half),
        );
        let (scales, mins) = (
            q4_k_six_bits::<false>(a, b, c),
            q4_k_six_bits::<true>(a, b, c),
        );
        let at = p.add(heads + 2 * HALF * half);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(at.add(2 * PANEL) as *const __m128i));
        for j in 0..8 {
            let first = i0 * blocks + 8 * sb + j;
            let mut sums = [_mm256_setzero_si256(); R];
            let mut rows = [std::ptr::null::<i8>(); R];
            for (r, row) in rows.iter_mut().enumerate() {
                *row = acts.q.as_ptr().add((first + r * blocks) * BLOCK);
            }
            // 8 groups x 2 x 15 x 127 fits 16 bits
            for g in 0..8 {
                let v = half_group(p, 3 + 8 * (j / 2) + g, half);
                let w = if j % 2 == 0 {
                    _mm256_and_si256(v, mask)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16(v, 4), mask)
                };
                for (r, sum) in sums.iter_mut().enumerate() {
                    *sum = dot::<V>(*sum, w, broadcast(rows[r], 4 * g));
                }
            }
            let (scale, min) = (
                q4_k_lane_scale(&scales, j, d),
                q4_k_lane_scale(&mins, j, dmin),
            );
            for (r, acc) in acc.iter_mut().enumerate() {
                let xb = first + r * blocks;
                let ints = _mm256_cvtepi32_ps(lanes::<V>(sums[r]));
                let dx = _mm256_set1_ps(*acts.d.get_unchecked(xb));
                *acc = _mm256_fmadd_ps(ints, _mm256_mul_ps(scale, dx), *acc);
                *acc = _mm256_fnmadd_ps(min, _mm256_set1_ps(*acts.s.get_unchecked(xb)), *acc);
            }
        }
    }
    store_half(args, &acc, col + HALF * half, i0, out);
}

/// The panel formats' loops (`rows_of`).
const Q4_1: u8 = 0;
const Q8_0: u8 = 1;
const Q6_K: u8 = 2;
const Q4_K: u8 = 3;

/// Rows `i0..i0 + R` of a half panel, in the format `FMT` (one of the
/// constants above), with AVX-VNNI's dot products if `V`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_of<const R: usize, const FMT: u8, const V: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    half: usize,
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    match FMT {
        Q6_K => q6_k_half_rows::<R, V>(args, acts, panel, half, col, i0, out),
        Q4_K => q4_k_half_rows::<R, V>(args, acts, panel, half, col, i0, out),
        Q4_1 => half_rows::<R, true, V>(args, acts, panel, half, col, i0, out),
        _ => half_rows::<R, false, V>(args, acts, panel, half, col, i0, out),
    }
}

/// Every row of a panel's sixteen columns, `ROWS` rows a pass
/// (`Q4_1_ROWS_MADDUBS` for Q4_1 without AVX-VNNI). A row's sums are the
/// same whichever pass holds it.
#[inline(always)]
unsafe fn panel_rows<const FMT: u8, const V: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    out: *mut f32,
) {
    if FMT == Q4_1 && !V {
        passes::<Q4_1_ROWS_MADDUBS, FMT, V>(args, acts, panel, col, out)
    } else {
        passes::<ROWS, FMT, V>(args, acts, panel, col, out)
    }
}

/// `panel_rows` at up to `P` (3 or 4) rows a pass; four rows left at
/// three a pass go as two and two.
#[inline(always)]
unsafe fn passes<const P: usize, const FMT: u8, const V: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    out: *mut f32,
) {
    for half in 0..2 {
        let mut i = 0;
        while i < args.m {
            let left = args.m - i;
            let rows = if left == P + 1 && P < 4 {
                2
            } else {
                left.min(P)
            };
            match rows {
                1 => rows_of::<1, FMT, V>(args, acts, panel, half, col, i, out),
                2 => rows_of::<2, FMT, V>(args, acts, panel, half, col, i, out),
                3 => rows_of::<3, FMT, V>(args, acts, panel, half, col, i, out),
                _ => rows_of::<P, FMT, V>(args, acts, panel, half, col, i, out),
            }
            i += rows;
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_of<const FMT: u8>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    out: *mut f32,
) {
    panel_rows::<FMT, false>(args, acts, panel, col, out)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn panel_of_vnni<const FMT: u8>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    out: *mut f32,
) {
    panel_rows::<FMT, true>(args, acts, panel, col, out)
}

/// A panel's loops, as `panel` takes them.
type Loops = unsafe fn(&QuantMatmulArgs<'_>, &QuantizedActivations, *const u8, usize, *mut f32);

/// The loops for `fmt`, with AVX-VNNI's dot products if `vnni`.
fn loops(fmt: QuantFormat, vnni: bool) -> Loops {
    macro_rules! of {
        ($fmt:ident) => {
            if vnni {
                panel_of_vnni::<$fmt> as Loops
            } else {
                panel_of::<$fmt>
            }
        };
    }
    match fmt {
        QuantFormat::Q4_1 => of!(Q4_1),
        QuantFormat::Q8_0 => of!(Q8_0),
        QuantFormat::Q6_K => of!(Q6_K),
        QuantFormat::Q4_K => of!(Q4_K),
    }
}

/// Every row of columns `col..col + 16` of the output, from their packed
/// panel.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `panel` holds the columns' `K / 32`
/// panel blocks; `out` points to M * N floats; no other thread writes these
/// columns.
pub unsafe fn panel(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    out: *mut f32,
) {
    loops(args.fmt, false)(args, acts, panel, col, out)
}

/// `panel` with AVX-VNNI's dot products: the same bits.
///
/// # Safety
/// As `panel`, and the CPU has AVX-VNNI.
pub unsafe fn panel_vnni(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    out: *mut f32,
) {
    loops(args.fmt, true)(args, acts, panel, col, out)
}
