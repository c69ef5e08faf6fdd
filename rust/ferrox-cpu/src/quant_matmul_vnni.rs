//! The AVX-512 VNNI quantized matmul over packed panels (`quant_pack`):
//! the panel kernel of `quant_matmul_panel` at its full width (one 64-byte
//! vector holding four consecutive weights of each of sixteen columns) with
//! `vpdpbusd`, which multiplies unsigned by signed bytes and adds each four
//! products into a 32-bit lane in one instruction: no 16-bit step to
//! overflow, no widening.
//!
//! Both formats enter the loop as unsigned weights plus a per-block offset:
//! Q4_1 as its nibbles and `m`; Q8_0 as `w + 128` (its bytes with the sign
//! bit flipped) and `-128 d`, since d * sum(w x) equals
//! d * sum((w + 128) x) - 128 d * sum(x), and d_x * sum(x) is the
//! activation block's `s`.

use std::arch::x86_64::*;

use crate::quant_matmul::quantize_activations_impl;
use crate::quant_matmul::{QuantFormat, QuantMatmulArgs, QuantizedActivations, BLOCK, SUPER_BLOCK};
use crate::quant_pack::PANEL;

/// Activation rows per pass over a panel (two registers each: a block's
/// sums and the result).
const ROWS: usize = 8;
/// The same for Q6_K (three registers each: two halves' sums and the result).
const Q6_K_ROWS: usize = 4;

/// Four activation bytes at `q + at`, in every lane.
#[inline(always)]
unsafe fn broadcast(q: *const i8, at: usize) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(q.add(at) as *const i32))
}

/// Rows `i0..i0 + R` of the panel's sixteen columns.
#[inline(always)]
unsafe fn panel_rows<const R: usize, const Q4: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let blocks = args.k / BLOCK;
    let (panel_block, scales) = (args.fmt.panel_block_bytes(), args.fmt.panel_scales_at());
    let mask = _mm512_set1_epi8(0x0f);
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..blocks {
        let p = panel.add(b * panel_block);
        let q = acts.q.as_ptr().add((i0 * blocks + b) * BLOCK);
        let stride = blocks * BLOCK;
        let mut sums = [_mm512_setzero_si512(); R];
        if Q4 {
            for g in 0..4 {
                let v = _mm512_loadu_si512(p.add(g * 4 * PANEL) as *const __m512i);
                let lo = _mm512_and_si512(v, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
                for (r, sum) in sums.iter_mut().enumerate() {
                    *sum = _mm512_dpbusd_epi32(*sum, lo, broadcast(q, r * stride + 4 * g));
                    *sum = _mm512_dpbusd_epi32(*sum, hi, broadcast(q, r * stride + 16 + 4 * g));
                }
            }
        } else {
            for g in 0..8 {
                let v = _mm512_loadu_si512(p.add(g * 4 * PANEL) as *const __m512i);
                let w = _mm512_xor_si512(v, flip);
                for (r, sum) in sums.iter_mut().enumerate() {
                    *sum = _mm512_dpbusd_epi32(*sum, w, broadcast(q, r * stride + 4 * g));
                }
            }
        }
        let heads = p.add(scales);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(heads as *const __m256i));
        let m = if Q4 {
            _mm512_cvtph_ps(_mm256_loadu_si256(heads.add(2 * PANEL) as *const __m256i))
        } else {
            _mm512_mul_ps(d, _mm512_set1_ps(-128.0))
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            let xb = (i0 + r) * blocks + b;
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(*acts.d.get_unchecked(xb)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, *acc);
            *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(*acts.s.get_unchecked(xb)), *acc);
        }
    }
    store_rows(args, &acc, col, i0, out);
}

/// Q6_K's 6-bit weights of 32-value block `j` (of four in a half
/// super-block) from the three groups at `at` (`quant_pack::q6_k_slot`):
/// the `ql` bytes of blocks 0 and 2, of blocks 1 and 3, and the `qh` bytes.
#[inline(always)]
unsafe fn q6_k_weights(at: *const u8, j: usize) -> __m512i {
    let low = _mm512_set1_epi8(0x0f);
    let high = _mm512_set1_epi8(0x30);
    let group = 4 * PANEL;
    let ql = _mm512_loadu_si512(at.add(group * (j & 1)) as *const __m512i);
    let bits = _mm512_loadu_si512(at.add(2 * group) as *const __m512i);
    let (nibbles, top) = match j {
        0 => (ql, _mm512_slli_epi16::<4>(bits)),
        1 => (ql, _mm512_slli_epi16::<2>(bits)),
        2 => (_mm512_srli_epi16::<4>(ql), bits),
        _ => (_mm512_srli_epi16::<4>(ql), _mm512_srli_epi16::<2>(bits)),
    };
    _mm512_or_si512(_mm512_and_si512(nibbles, low), _mm512_and_si512(top, high))
}

/// Sixteen signed byte scales at `at`, as float32 times `d`. (A helper
/// function, not a closure: a closure is not compiled with the caller's
/// target features.)
#[inline(always)]
unsafe fn byte_scales(at: *const u8, d: __m512) -> __m512 {
    let bytes = _mm_loadu_si128(at as *const __m128i);
    _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)))
}

/// Rows `i0..i0 + R` of a Q6_K panel's sixteen columns, a 32-value block
/// at a time: each half of 16 values has its own sum, which starts at -32
/// times the activations' sum there (the weights' offset, `acts.h`), and
/// its own scale; the block's activation scale then applies once.
#[inline(always)]
unsafe fn q6_k_rows<const R: usize>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let (blocks, supers) = (args.k / BLOCK, args.k / SUPER_BLOCK);
    let (panel_block, heads) = (args.fmt.panel_block_bytes(), args.fmt.panel_scales_at());
    let group = 4 * PANEL;
    let mut acc = [_mm512_setzero_ps(); R];
    for sb in 0..supers {
        let p = panel.add(sb * panel_block);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(heads) as *const __m256i));
        for block in 0..8 {
            let (n, j) = (block / 4, block % 4);
            let mut sums = [[_mm512_setzero_si512(); R]; 2];
            for (h, sums) in sums.iter_mut().enumerate() {
                for (r, sum) in sums.iter_mut().enumerate() {
                    let xb = (i0 + r) * blocks + 8 * sb + block;
                    *sum = _mm512_set1_epi32(*acts.h.get_unchecked(2 * xb + h));
                }
            }
            for g in 0..8 {
                let w = q6_k_weights(p.add(3 * (8 * n + g) * group), j);
                for (r, sum) in sums[g / 4].iter_mut().enumerate() {
                    let at = ((i0 + r) * blocks + 8 * sb + block) * BLOCK + 4 * g;
                    *sum = _mm512_dpbusd_epi32(*sum, w, broadcast(acts.q.as_ptr(), at));
                }
            }
            // the sixteen columns' byte scales of each half (before the `d`s)
            let scales = p.add(heads - 16 * PANEL + 2 * PANEL * block);
            let (first, second) = (byte_scales(scales, d), byte_scales(scales.add(PANEL), d));
            for (r, acc) in acc.iter_mut().enumerate() {
                let xb = (i0 + r) * blocks + 8 * sb + block;
                let both = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(sums[1][r]),
                    second,
                    _mm512_mul_ps(_mm512_cvtepi32_ps(sums[0][r]), first),
                );
                *acc = _mm512_fmadd_ps(both, _mm512_set1_ps(*acts.d.get_unchecked(xb)), *acc);
            }
        }
    }
    store_rows(args, &acc, col, i0, out);
}

/// The six-bit scales (or mins, `MINS`) of blocks 0..4 and 4..8 of a
/// Q4_K panel's sixteen columns, a byte each in each column's lane, from
/// the three groups of its scale bytes (`a` bytes 0..4 of each column, `b`
/// 4..8, `c` 8..12; `quant_matmul::q4_k_scale_min`).
#[inline(always)]
unsafe fn q4_k_six_bits<const MINS: bool>(a: __m512i, b: __m512i, c: __m512i) -> [__m512i; 2] {
    let (six, low, top) = (
        _mm512_set1_epi8(0x3f),
        _mm512_set1_epi8(0x0f),
        _mm512_set1_epi8(0x30),
    );
    let (first, nibbles) = if MINS {
        (b, _mm512_srli_epi16::<4>(c))
    } else {
        (a, c)
    };
    // blocks 4..8: the nibble, with the top two bits of blocks 0..4's byte
    let high = _mm512_and_si512(_mm512_srli_epi16::<2>(first), top);
    [
        _mm512_and_si512(first, six),
        _mm512_or_si512(_mm512_and_si512(nibbles, low), high),
    ]
}

/// The 64-byte group `g` of a panel block. (A helper function, not a
/// closure: see `byte_scales`.)
#[inline(always)]
unsafe fn load_group(p: *const u8, g: usize) -> __m512i {
    _mm512_loadu_si512(p.add(g * 4 * PANEL) as *const __m512i)
}

/// Byte `j % 4` of each lane of `bytes[j / 4]`, as float32, times `d`.
#[inline(always)]
unsafe fn q4_k_lane_scale(bytes: &[__m512i; 2], j: usize, d: __m512) -> __m512 {
    let shifted = _mm512_srl_epi32(bytes[j / 4], _mm_cvtsi32_si128(8 * (j % 4) as i32));
    let ints = _mm512_and_si512(shifted, _mm512_set1_epi32(0xff));
    _mm512_mul_ps(d, _mm512_cvtepi32_ps(ints))
}

/// Blocks `2C` and `2C + 1` of a Q4_K panel's super-block at `p` (the low
/// and the high nibbles of the same 64 values' bytes) for rows `first..`,
/// `stride` blocks apart: each block's integer sum a row, times
/// d * scale * dx, less dmin * min * sx, onto `acc`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_k_pair<const R: usize, const C: usize>(
    acts: &QuantizedActivations,
    p: *const u8,
    scales: &[[__m512; 2]; 8], // each block's d * scale and dmin * min
    first: usize,              // block 2C's index among row i0's activation blocks
    stride: usize,
    acc: &mut [__m512; R],
) {
    let mask = _mm512_set1_epi8(0x0f);
    // each row's activation bytes of block 2C (then 2C + 1 at BLOCK past)
    let mut rows = [std::ptr::null::<i8>(); R];
    for (r, row) in rows.iter_mut().enumerate() {
        *row = acts.q.as_ptr().add((first + r * stride) * BLOCK);
    }
    // (one block at a time: both blocks' sums at once hold more vectors
    // than the registers have room for at four rows)
    for h in 0..2 {
        let mut sums = [_mm512_setzero_si512(); R];
        for g in 0..8 {
            let v = load_group(p, 3 + 8 * C + g);
            let nibbles = if h == 0 {
                _mm512_and_si512(v, mask)
            } else {
                _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask)
            };
            for (r, sum) in sums.iter_mut().enumerate() {
                let at = BLOCK * h + 4 * g;
                *sum = _mm512_dpbusd_epi32(*sum, nibbles, broadcast(rows[r], at));
            }
        }
        let [scale, min] = scales[2 * C + h];
        for (r, acc) in acc.iter_mut().enumerate() {
            let xb = first + h + r * stride;
            let dx = _mm512_set1_ps(*acts.d.get_unchecked(xb));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(scale, dx), *acc);
            *acc = _mm512_fnmadd_ps(min, _mm512_set1_ps(*acts.s.get_unchecked(xb)), *acc);
        }
    }
}

/// Rows `i0..i0 + R` of a Q4_K panel's sixteen columns.
#[inline(always)]
unsafe fn q4_k_rows<const R: usize>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let (blocks, supers) = (args.k / BLOCK, args.k / SUPER_BLOCK);
    let (panel_block, heads) = (args.fmt.panel_block_bytes(), args.fmt.panel_scales_at());
    let mut acc = [_mm512_setzero_ps(); R];
    for sb in 0..supers {
        let p = panel.add(sb * panel_block);
        // The next super-block's scales and its d and dmin, at both ends of
        // it, which its first blocks wait for.
        let next = p.wrapping_add(panel_block);
        for at in [0, 64, 128, heads] {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(at) as *const i8);
        }
        let (a, b, c) = (load_group(p, 0), load_group(p, 1), load_group(p, 2));
        let (scales, mins) = (
            q4_k_six_bits::<false>(a, b, c),
            q4_k_six_bits::<true>(a, b, c),
        );
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(heads) as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(
            p.add(heads + 2 * PANEL) as *const __m256i
        ));
        let mut each = [[_mm512_setzero_ps(); 2]; 8];
        for (j, each) in each.iter_mut().enumerate() {
            *each = [
                q4_k_lane_scale(&scales, j, d),
                q4_k_lane_scale(&mins, j, dmin),
            ];
        }
        let first = i0 * blocks + 8 * sb;
        q4_k_pair::<R, 0>(acts, p, &each, first, blocks, &mut acc);
        q4_k_pair::<R, 1>(acts, p, &each, first + 2, blocks, &mut acc);
        q4_k_pair::<R, 2>(acts, p, &each, first + 4, blocks, &mut acc);
        q4_k_pair::<R, 3>(acts, p, &each, first + 6, blocks, &mut acc);
    }
    store_rows(args, &acc, col, i0, out);
}

/// `acc` (rows `i0..`, columns `col..col + 16`) plus the bias into `out`.
#[inline(always)]
unsafe fn store_rows<const R: usize>(
    args: &QuantMatmulArgs<'_>,
    acc: &[__m512; R],
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let bias = match args.bias {
        Some(bias) => _mm512_loadu_ps(bias.as_ptr().add(col)),
        None => _mm512_setzero_ps(),
    };
    for (r, acc) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add((i0 + r) * args.n + col), _mm512_add_ps(*acc, bias));
    }
}

/// Rows `i0..i0 + R` of a Q6_K panel's super-block `sb` from its weights
/// unpacked (`unpacked[8 * block + g]`: group g of each 32-value block),
/// onto their sums in `acc`: the arithmetic of `q6_k_rows`, in its order,
/// so that a row's bits do not depend on which of the two runs it. (One
/// shared block loop fed eight unpacked groups would serve both, but the
/// streamed one-row pass then ran 0.8-0.9x as fast: it builds each group's
/// weights where it uses them.)
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q6_k_unpacked_rows<const R: usize>(
    acts: &QuantizedActivations,
    unpacked: &[__m512i; 64],
    scales: *const u8, // the super-block's byte scales
    d: __m512,
    first: usize, // block 0 of the super-block among row i0's activation blocks
    stride: usize,
    acc: &mut [__m512],
) {
    let mut rows = [_mm512_setzero_ps(); R];
    rows.copy_from_slice(&acc[..R]);
    for block in 0..8 {
        let mut sums = [[_mm512_setzero_si512(); R]; 2];
        for (h, sums) in sums.iter_mut().enumerate() {
            for (r, sum) in sums.iter_mut().enumerate() {
                let xb = first + r * stride + block;
                *sum = _mm512_set1_epi32(*acts.h.get_unchecked(2 * xb + h));
            }
            for g in 4 * h..4 * h + 4 {
                let w = unpacked[8 * block + g];
                for (r, sum) in sums.iter_mut().enumerate() {
                    let at = (first + r * stride + block) * BLOCK + 4 * g;
                    *sum = _mm512_dpbusd_epi32(*sum, w, broadcast(acts.q.as_ptr(), at));
                }
            }
        }
        let at = scales.add(2 * PANEL * block);
        let (first_scale, second_scale) = (byte_scales(at, d), byte_scales(at.add(PANEL), d));
        for (r, row) in rows.iter_mut().enumerate() {
            let both = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(sums[1][r]),
                second_scale,
                _mm512_mul_ps(_mm512_cvtepi32_ps(sums[0][r]), first_scale),
            );
            let dx = _mm512_set1_ps(*acts.d.get_unchecked(first + r * stride + block));
            *row = _mm512_fmadd_ps(both, dx, *row);
        }
    }
    acc[..R].copy_from_slice(&rows);
}

/// Every row of a Q6_K panel. One pass of rows streams the panel
/// (`q6_k_rows`), and so do rows over a single super-block (an expert's
/// down projection); more rows share each super-block's weights unpacked
/// once, where every pass would unpack them again (by
/// `benches/q6_k_blocks.py`: a 1024 -> 49152 LM head at 16 rows, 0.77x
/// Q8_0's speed this way, 0.65x streaming; at 4 rows streaming is ahead).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
unsafe fn q6_k_panel(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    out: *mut f32,
) {
    let (blocks, supers) = (args.k / BLOCK, args.k / SUPER_BLOCK);
    if args.m <= Q6_K_ROWS || supers == 1 {
        let mut i = 0;
        while i < args.m {
            let rows = (args.m - i).min(Q6_K_ROWS);
            match rows {
                1 => q6_k_rows::<1>(args, acts, panel, col, i, out),
                2 => q6_k_rows::<2>(args, acts, panel, col, i, out),
                3 => q6_k_rows::<3>(args, acts, panel, col, i, out),
                _ => q6_k_rows::<Q6_K_ROWS>(args, acts, panel, col, i, out),
            }
            i += rows;
        }
        return;
    }
    let (panel_block, heads) = (args.fmt.panel_block_bytes(), args.fmt.panel_scales_at());
    let mut acc = vec![_mm512_setzero_ps(); args.m];
    let mut unpacked = [_mm512_setzero_si512(); 64];
    for sb in 0..supers {
        let p = panel.add(sb * panel_block);
        for n in 0..2 {
            for g in 0..8 {
                let at = p.add(3 * (8 * n + g) * 4 * PANEL);
                for j in 0..4 {
                    unpacked[8 * (4 * n + j) + g] = q6_k_weights(at, j);
                }
            }
        }
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(heads) as *const __m256i));
        let scales = p.add(heads - 16 * PANEL);
        let mut i = 0;
        while i < args.m {
            let rows = (args.m - i).min(ROWS);
            let (first, rest) = (i * blocks + 8 * sb, &mut acc[i..]);
            let u = &unpacked;
            match rows {
                1 => q6_k_unpacked_rows::<1>(acts, u, scales, d, first, blocks, rest),
                2 => q6_k_unpacked_rows::<2>(acts, u, scales, d, first, blocks, rest),
                3 => q6_k_unpacked_rows::<3>(acts, u, scales, d, first, blocks, rest),
                4 => q6_k_unpacked_rows::<4>(acts, u, scales, d, first, blocks, rest),
                5 => q6_k_unpacked_rows::<5>(acts, u, scales, d, first, blocks, rest),
                6 => q6_k_unpacked_rows::<6>(acts, u, scales, d, first, blocks, rest),
                7 => q6_k_unpacked_rows::<7>(acts, u, scales, d, first, blocks, rest),
                _ => q6_k_unpacked_rows::<ROWS>(acts, u, scales, d, first, blocks, rest),
            }
            i += rows;
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        store_rows(args, &[*acc], col, i, out);
    }
}

/// The formats' loops over a pass of rows (`rows_of`).
const Q4_1: u8 = 0;
const Q8_0: u8 = 1;
const Q4_K: u8 = 2;

/// Rows `i0..i0 + R` of a panel in the format `FMT` (one of the constants
/// above).
#[inline(always)]
unsafe fn rows_of<const R: usize, const FMT: u8>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    match FMT {
        Q4_K => q4_k_rows::<R>(args, acts, panel, col, i0, out),
        Q4_1 => panel_rows::<R, true>(args, acts, panel, col, i0, out),
        _ => panel_rows::<R, false>(args, acts, panel, col, i0, out),
    }
}

/// The rows of a Q4_K call's next pass over a panel (of `m`, `left` to
/// go), by `benches/k_quant_blocks.py`: passes of four and five rows ran
/// 0.69-0.83x Q4_1's speed where two and three rows ran 1.05-1.16x, so a
/// call of up to eight rows goes three rows at a time (four as two and
/// two), and a longer one eight at a time with a last four or five split.
/// (Each row's arithmetic is the same in any pass: the split moves no
/// bits.)
fn q4_k_pass(m: usize, left: usize) -> usize {
    match left {
        4 => 2,
        5 => 3,
        _ if m <= ROWS => left.min(3),
        _ => left.min(ROWS),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
unsafe fn panel_of<const FMT: u8>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    out: *mut f32,
) {
    let mut i = 0;
    while i < args.m {
        let rows = if FMT == Q4_K {
            q4_k_pass(args.m, args.m - i)
        } else {
            (args.m - i).min(ROWS)
        };
        match rows {
            1 => rows_of::<1, FMT>(args, acts, panel, col, i, out),
            2 => rows_of::<2, FMT>(args, acts, panel, col, i, out),
            3 => rows_of::<3, FMT>(args, acts, panel, col, i, out),
            4 => rows_of::<4, FMT>(args, acts, panel, col, i, out),
            5 => rows_of::<5, FMT>(args, acts, panel, col, i, out),
            6 => rows_of::<6, FMT>(args, acts, panel, col, i, out),
            7 => rows_of::<7, FMT>(args, acts, panel, col, i, out),
            _ => rows_of::<ROWS, FMT>(args, acts, panel, col, i, out),
        }
        i += rows;
    }
}

/// Every row of columns `col..col + 16` of the output, from their packed
/// panel.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `panel` holds the columns' `K / 32`
/// panel blocks; `out` points to M * N floats; no other thread writes these
/// columns.
pub unsafe fn panel(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: *const u8,
    col: usize,
    out: *mut f32,
) {
    match args.fmt {
        QuantFormat::Q4_1 => panel_of::<Q4_1>(args, acts, panel, col, out),
        QuantFormat::Q8_0 => panel_of::<Q8_0>(args, acts, panel, col, out),
        QuantFormat::Q6_K => q6_k_panel(args, acts, panel, col, out),
        QuantFormat::Q4_K => panel_of::<Q4_K>(args, acts, panel, col, out),
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
        h: Vec::new(),
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
