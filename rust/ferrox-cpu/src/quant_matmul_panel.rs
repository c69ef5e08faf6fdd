//! The AVX2 quantized matmul for several activation rows: eight weight rows
//! (output columns) at a time, their blocks first interleaved into a panel
//! so that one 32-byte vector holds four consecutive weights of each of the
//! eight columns.
//!
//! Against that vector, four activation bytes broadcast to every lane give
//! in one `maddubs` + the block's sums eight columns' partial dot products
//! side by side: the block's scales then apply as vectors (eight weight
//! scales times one activation scale), the sums stay in the lanes of one
//! register per activation row, and the eight results leave in one store;
//! no horizontal sum, no scalar scale per block and column. The panel is
//! built once per eight columns and serves every row of the call (it stays
//! in L1: 320 bytes per block), so the interleaving costs little when
//! several rows share it; the pair kernel (`quant_matmul_avx2`) stays for
//! one or two Q4_1 rows and for the columns past the last whole panel.
//!
//! Q4_1 nibbles are unsigned, so `maddubs` takes them as they are, and the
//! 16-bit sums of a whole block cannot overflow (8 groups x 2 x 15 x 127 =
//! 30480): one `madd` per block. Q8_0 weights are signed: each group moves
//! the weight's sign onto the activation (`sign`) and widens at once (two
//! products of 127 x 127 already fill 16 bits).

use std::arch::x86_64::*;

use crate::quant_matmul::{QuantFormat, QuantMatmulArgs, QuantizedActivations, BLOCK, PANEL};

/// Activation rows per pass over a panel (two registers each).
const ROWS: usize = 4;
/// Vectors per block of a panel: 8 weight groups, then the scales and (Q4_1)
/// the offsets as eight floats each.
const PANEL_BLOCK: usize = 10;

/// Transposes four dwords of each of eight 16-byte rows: `out[g]` holds
/// dword `g` of rows 0..8 (row r in dword r).
#[inline(always)]
pub(crate) unsafe fn transpose(rows: &[__m128i; PANEL]) -> [__m256i; 4] {
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
pub(crate) unsafe fn load_rows(at: &[*const u8], offset: usize) -> [__m128i; PANEL] {
    let mut rows = [_mm_setzero_si128(); PANEL];
    for c in 0..PANEL {
        rows[c] = _mm_loadu_si128(at[c].add(offset) as *const __m128i);
    }
    rows
}

/// `N` float16 values, at `offset` past each pointer, as float bits.
#[inline(always)]
pub(crate) unsafe fn half_bits<const N: usize>(at: &[*const u8; N], offset: usize) -> [u16; N] {
    let mut bits = [0u16; N];
    for c in 0..N {
        bits[c] = std::ptr::read_unaligned(at[c].add(offset) as *const u16);
    }
    bits
}

/// The pointers to block `b` of `N` consecutive weight rows from `first`.
#[inline(always)]
pub(crate) unsafe fn block_pointers<const N: usize>(
    first: *const u8,
    row_bytes: usize,
    block_offset: usize,
) -> [*const u8; N] {
    let mut at = [std::ptr::null(); N];
    for (c, p) in at.iter_mut().enumerate() {
        *p = first.add(c * row_bytes + block_offset);
    }
    at
}

/// Eight float16 values, at `offset` past each pointer, as floats.
#[inline(always)]
unsafe fn halves(at: &[*const u8; PANEL], offset: usize) -> __m256 {
    let bits = half_bits(at, offset);
    _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i))
}

/// Interleaves columns `col..col + 8` of the weight into `panel`
/// (`PANEL_BLOCK` vectors per block).
#[inline(always)]
unsafe fn build_panel<const Q4: bool>(
    args: &QuantMatmulArgs<'_>,
    col: usize,
    panel: &mut [__m256i],
) {
    let block_bytes = args.fmt.block_bytes();
    let row_bytes = args.fmt.row_bytes(args.k);
    let first = args.w.as_ptr().add(col * row_bytes);
    let mask = _mm256_set1_epi8(0x0f);
    for b in 0..args.k / BLOCK {
        let at: [*const u8; PANEL] = block_pointers(first, row_bytes, b * block_bytes);
        // The next panel's block, while this one is rearranged.
        for p in at {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PANEL * row_bytes) as *const i8);
        }
        let out = &mut panel[b * PANEL_BLOCK..(b + 1) * PANEL_BLOCK];
        if Q4 {
            // weights 4g..4g+4 are the low nibbles of bytes 4g..4g+4, weights
            // 16+4g.. their high nibbles
            let nibbles = transpose(&load_rows(&at, 4));
            for g in 0..4 {
                out[g] = _mm256_and_si256(nibbles[g], mask);
                out[g + 4] = _mm256_and_si256(_mm256_srli_epi16(nibbles[g], 4), mask);
            }
            out[8] = _mm256_castps_si256(halves(&at, 0));
            out[9] = _mm256_castps_si256(halves(&at, 2));
        } else {
            for half in 0..2 {
                let bytes = transpose(&load_rows(&at, 2 + 16 * half));
                out[4 * half..4 * half + 4].copy_from_slice(&bytes);
            }
            out[8] = _mm256_castps_si256(halves(&at, 0));
        }
    }
}

/// Rows `i0..i0 + R` of the panel's eight columns.
#[inline(always)]
unsafe fn panel_rows<const R: usize, const Q4: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    panel: &[__m256i],
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    let blocks = args.k / BLOCK;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..blocks {
        let vectors = panel.as_ptr().add(b * PANEL_BLOCK);
        let mut sums = [_mm256_setzero_si256(); R];
        for g in 0..8 {
            let w = *vectors.add(g);
            let magnitude = if Q4 { w } else { _mm256_sign_epi8(w, w) };
            for (r, sum) in sums.iter_mut().enumerate() {
                let x = acts.q.as_ptr().add(((i0 + r) * blocks + b) * BLOCK + 4 * g);
                let x = _mm256_set1_epi32(std::ptr::read_unaligned(x as *const i32));
                if Q4 {
                    *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(w, x));
                } else {
                    let pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w));
                    *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        let d = _mm256_castsi256_ps(*vectors.add(8));
        for r in 0..R {
            let xb = (i0 + r) * blocks + b;
            let ints = if Q4 {
                _mm256_madd_epi16(sums[r], ones)
            } else {
                sums[r]
            };
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(*acts.d.get_unchecked(xb)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), scale, acc[r]);
            if Q4 {
                let m = _mm256_castsi256_ps(*vectors.add(9));
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(*acts.s.get_unchecked(xb)), acc[r]);
            }
        }
    }
    let bias = match args.bias {
        Some(bias) => _mm256_loadu_ps(bias.as_ptr().add(col)),
        None => _mm256_setzero_ps(),
    };
    for (r, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.add((i0 + r) * args.n + col), _mm256_add_ps(*acc, bias));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panels_of<const Q4: bool>(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    start: usize,
    end: usize,
    out: *mut f32,
) {
    let mut panel = vec![_mm256_setzero_si256(); args.k / BLOCK * PANEL_BLOCK];
    let mut col = start;
    while col < end {
        build_panel::<Q4>(args, col, &mut panel);
        let mut i = 0;
        while i < args.m {
            let rows = (args.m - i).min(ROWS);
            match rows {
                1 => panel_rows::<1, Q4>(args, acts, &panel, col, i, out),
                2 => panel_rows::<2, Q4>(args, acts, &panel, col, i, out),
                3 => panel_rows::<3, Q4>(args, acts, &panel, col, i, out),
                _ => panel_rows::<ROWS, Q4>(args, acts, &panel, col, i, out),
            }
            i += rows;
        }
        col += PANEL;
    }
}

/// Columns `start..end` of the output; `end - start` is a multiple of
/// `PANEL`.
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
    debug_assert_eq!((end - start) % PANEL, 0);
    match args.fmt {
        QuantFormat::Q4_1 => panels_of::<true>(args, acts, start, end, out),
        QuantFormat::Q8_0 => panels_of::<false>(args, acts, start, end, out),
    }
}
