//! out[M, N] = x[M, K] @ w[N, K]^T (+ bias) over float32 weights, for the
//! few rows of a decode step: the fused decoder layer's linear layers when a
//! model is held in float32 (`decoder_layer`). Four weight rows at a time
//! against each activation row, so the four rows stay in L1 across the M
//! activation rows; with AVX-512 and many rows, sixteen weight rows
//! transposed once per call into a panel, so that each activation element,
//! broadcast, multiplies sixteen weights in one instruction and no dot
//! product needs a horizontal sum.

use crate::pool::run_parts;
use crate::quant_matmul::{OutPtr, QuantShapeError};

pub struct F32MatmulArgs<'a> {
    pub x: &'a [f32],            // [M, K]
    pub w: &'a [f32],            // [N, K]
    pub bias: Option<&'a [f32]>, // [N]
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub num_threads: usize,
}

/// Multiply-adds below which one more thread costs more than it saves.
const WORK_PER_THREAD: usize = 1 << 14;

pub fn f32_matmul(args: &F32MatmulArgs<'_>, out: &mut [f32]) -> Result<(), QuantShapeError> {
    if args.x.len() != args.m * args.k
        || args.w.len() != args.n * args.k
        || out.len() != args.m * args.n
        || args.bias.is_some_and(|b| b.len() != args.n)
    {
        return Err(QuantShapeError(format!(
            "shapes disagree: x {} (M={} K={}), w {} (N={}), out {}",
            args.x.len(),
            args.m,
            args.k,
            args.w.len(),
            args.n,
            out.len()
        )));
    }
    if args.m == 0 || args.n == 0 {
        return Ok(());
    }
    let work = (args.m * args.n * args.k).div_ceil(WORK_PER_THREAD);
    let threads = args.num_threads.min(work).min(args.n.div_ceil(4)).max(1);
    let (kernel, unit) = select_kernel(args.m);
    // Column ranges in whole groups (panels) of the kernel's width.
    let per = args.n.div_ceil(unit).div_ceil(threads) * unit;
    let ptr = OutPtr(out.as_mut_ptr());
    run_parts(threads, &|part| {
        let start = part * per;
        let end = ((part + 1) * per).min(args.n);
        if start < end {
            // SAFETY: each part writes only columns start..end of `out`,
            // which has M * N elements (checked above).
            unsafe { kernel(args, start, end, ptr.get()) };
        }
    });
    Ok(())
}

type Kernel = unsafe fn(&F32MatmulArgs<'_>, usize, usize, *mut f32);

/// Rows from which the AVX-512 panel kernel runs: below, transposing its
/// panels costs more than it saves.
const PANEL_MIN_ROWS: usize = 8;
const PANEL: usize = 16;

/// The kernel for `m` rows and the column width its ranges come in.
fn select_kernel(m: usize) -> (Kernel, usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::avx2() {
        if m >= PANEL_MIN_ROWS && crate::isa::avx512() {
            return (columns_avx512, PANEL);
        }
        return (columns_avx2, 4);
    }
    let _ = m;
    (columns_portable, 4)
}

/// Columns `start..end` of the output.
///
/// # Safety
/// `out` points to M * N floats; no other thread writes these columns.
unsafe fn columns_portable(args: &F32MatmulArgs<'_>, start: usize, end: usize, out: *mut f32) {
    let k = args.k;
    for col in start..end {
        let w = &args.w[col * k..(col + 1) * k];
        let bias = args.bias.map_or(0.0, |b| b[col]);
        for i in 0..args.m {
            let x = &args.x[i * k..(i + 1) * k];
            let mut acc = [0f32; 8];
            let (cx, cw) = (x.chunks_exact(8), w.chunks_exact(8));
            let tail: f32 = cx
                .remainder()
                .iter()
                .zip(cw.remainder())
                .map(|(a, b)| a * b)
                .sum();
            for (a, b) in cx.zip(cw) {
                for l in 0..8 {
                    acc[l] += a[l] * b[l];
                }
            }
            *out.add(i * args.n + col) = acc.iter().sum::<f32>() + tail + bias;
        }
    }
}

/// # Safety
/// The CPU has AVX2 and FMA; `out` points to M * N floats; no other thread
/// writes these columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn columns_avx2(args: &F32MatmulArgs<'_>, start: usize, end: usize, out: *mut f32) {
    use std::arch::x86_64::*;

    use crate::paged_attention::avx2::hsum;

    let (k, n) = (args.k, args.n);
    let k8 = k / 8 * 8;
    let bias = |c: usize| args.bias.map_or(0.0, |b| b[c]);
    let mut col = start;
    while col + 4 <= end {
        let w = args.w.as_ptr().add(col * k);
        let rows = [w, w.add(k), w.add(2 * k), w.add(3 * k)];
        for i in 0..args.m {
            let x = args.x.as_ptr().add(i * k);
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut j = 0;
            while j < k8 {
                let xv = _mm256_loadu_ps(x.add(j));
                for (a, r) in acc.iter_mut().zip(rows) {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(r.add(j)), xv, *a);
                }
                j += 8;
            }
            for (c, (a, r)) in acc.iter().zip(rows).enumerate() {
                let mut s = hsum(*a);
                for t in k8..k {
                    s += *r.add(t) * *x.add(t);
                }
                *out.add(i * n + col + c) = s + bias(col + c);
            }
        }
        col += 4;
    }
    if col < end {
        columns_portable(args, col, end, out);
    }
}

/// Rows `i0..i0 + R` of one panel's sixteen columns: acc[r] += x[i0 + r][t]
/// (broadcast) * panel[t] for every t.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn panel_rows<const R: usize>(
    args: &F32MatmulArgs<'_>,
    panel: &[f32],
    col: usize,
    i0: usize,
    out: *mut f32,
) {
    use std::arch::x86_64::*;

    let k = args.k;
    let mut acc = [_mm512_setzero_ps(); R];
    for t in 0..k {
        let w = _mm512_loadu_ps(panel.as_ptr().add(t * PANEL));
        for (r, a) in acc.iter_mut().enumerate() {
            let x = _mm512_set1_ps(*args.x.get_unchecked((i0 + r) * k + t));
            *a = _mm512_fmadd_ps(x, w, *a);
        }
    }
    let bias = match args.bias {
        Some(b) => _mm512_loadu_ps(b.as_ptr().add(col)),
        None => _mm512_setzero_ps(),
    };
    for (r, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add((i0 + r) * args.n + col), _mm512_add_ps(*a, bias));
    }
}

/// # Safety
/// The CPU has AVX-512 F, AVX2 and FMA; `out` points to M * N floats; no
/// other thread writes these columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn columns_avx512(args: &F32MatmulArgs<'_>, start: usize, end: usize, out: *mut f32) {
    const ROWS: usize = 8;
    let k = args.k;
    let mut panel = vec![0f32; k * PANEL];
    let mut col = start;
    while col + PANEL <= end {
        // panel[t][c] = w[col + c][t]
        for c in 0..PANEL {
            let row = &args.w[(col + c) * k..(col + c + 1) * k];
            for (t, &v) in row.iter().enumerate() {
                *panel.get_unchecked_mut(t * PANEL + c) = v;
            }
        }
        let mut i = 0;
        while i < args.m {
            let rows = (args.m - i).min(ROWS);
            match rows {
                1 => panel_rows::<1>(args, &panel, col, i, out),
                2 => panel_rows::<2>(args, &panel, col, i, out),
                3 => panel_rows::<3>(args, &panel, col, i, out),
                4 => panel_rows::<4>(args, &panel, col, i, out),
                5 => panel_rows::<5>(args, &panel, col, i, out),
                6 => panel_rows::<6>(args, &panel, col, i, out),
                7 => panel_rows::<7>(args, &panel, col, i, out),
                _ => panel_rows::<ROWS>(args, &panel, col, i, out),
            }
            i += rows;
        }
        col += PANEL;
    }
    if col < end {
        columns_avx2(args, col, end, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    proptest! {
        #[test]
        fn matches_reference(
            m in 1usize..20, // the panel kernel from PANEL_MIN_ROWS rows
            k in 1usize..70,
            n in 1usize..40, // whole panels of 16 and the columns past them
            threads in 1usize..4,
            with_bias in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let (x, w) = (values(m * k, seed), values(n * k, seed.wrapping_add(1)));
            let b = values(n, seed.wrapping_add(2));
            let bias = with_bias.then_some(b.as_slice());
            let mut out = vec![f32::NAN; m * n];
            let args = F32MatmulArgs { x: &x, w: &w, bias, m, k, n, num_threads: threads };
            f32_matmul(&args, &mut out).unwrap();
            for i in 0..m {
                for c in 0..n {
                    let expect: f64 = (0..k)
                        .map(|t| x[i * k + t] as f64 * w[c * k + t] as f64)
                        .sum::<f64>()
                        + bias.map_or(0.0, |b| b[c] as f64);
                    let got = out[i * n + c] as f64;
                    prop_assert!((got - expect).abs() < 1e-4 * (1.0 + k as f64), "{got} vs {expect}");
                }
            }
        }
    }

    #[test]
    fn large_products_split_across_threads() {
        // Enough work for several threads: every column must still be written.
        let (m, k, n) = (3, 512, 300);
        let (x, w) = (values(m * k, 7), values(n * k, 8));
        let mut one = vec![0.0; m * n];
        let mut many = vec![f32::NAN; m * n];
        let args = |t| F32MatmulArgs {
            x: &x,
            w: &w,
            bias: None,
            m,
            k,
            n,
            num_threads: t,
        };
        f32_matmul(&args(1), &mut one).unwrap();
        f32_matmul(&args(4), &mut many).unwrap();
        assert_eq!(one, many);
    }

    #[test]
    fn bad_shapes_are_rejected() {
        let x = vec![0.0; 6];
        let w = vec![0.0; 8];
        let mut out = vec![0.0; 4];
        let args = F32MatmulArgs {
            x: &x,
            w: &w,
            bias: None,
            m: 2,
            k: 3,
            n: 2,
            num_threads: 1,
        };
        assert!(f32_matmul(&args, &mut out).is_err());
    }
}
