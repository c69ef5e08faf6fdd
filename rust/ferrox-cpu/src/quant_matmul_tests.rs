use super::*;
use crate::quant_pack::pack_blocks;
use proptest::prelude::*;

const LAYOUTS: [BlockLayout; 2] = [BlockLayout::Rows, BlockLayout::Panels];

/// A rows-layout weight in `layout`.
fn laid_out(w: &[u8], fmt: QuantFormat, k: usize, layout: BlockLayout) -> Vec<u8> {
    match layout {
        BlockLayout::Rows => w.to_vec(),
        BlockLayout::Panels => {
            let mut packed = vec![0; w.len()];
            pack_blocks(w, fmt, k, &mut packed).unwrap();
            packed
        }
    }
}

/// float16 bits of a positive normal value with a random mantissa and an
/// exponent in 2^-6 .. 2^-2, with the given sign.
fn half_bits(exp: u16, frac: u16, negative: bool) -> [u8; 2] {
    let bits = (u16::from(negative) << 15) | ((exp % 5 + 9) << 10) | (frac & 0x3ff);
    bits.to_le_bytes()
}

fn weight_bytes(fmt: QuantFormat, n: usize, k: usize, seed: &[u16]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(n * fmt.row_bytes(k));
    let mut at = 0;
    let mut next = || {
        at += 1;
        seed[at % seed.len()]
            .wrapping_mul(40503)
            .wrapping_add((at as u16).wrapping_mul(7919))
    };
    if fmt == QuantFormat::Q6_K {
        for _ in 0..n * (k / SUPER_BLOCK) {
            // any 6-bit values and signed scales; d of either sign
            bytes.extend((0..Q6_K_D).map(|_| next() as u8));
            let (e, f, s) = (next(), next(), next());
            bytes.extend(half_bits(e, f, s % 2 == 0));
        }
        return bytes;
    }
    if fmt == QuantFormat::Q4_K {
        for _ in 0..n * (k / SUPER_BLOCK) {
            // d and dmin of either sign, any scales, mins and nibbles
            for _ in 0..2 {
                let (e, f, s) = (next(), next(), next());
                bytes.extend(half_bits(e, f, s % 2 == 0));
            }
            bytes.extend((0..140).map(|_| next() as u8));
        }
        return bytes;
    }
    for _ in 0..n * (k / BLOCK) {
        let (e, f) = (next(), next());
        bytes.extend(half_bits(e, f, false));
        match fmt {
            QuantFormat::Q4_1 => {
                let (e, f, s) = (next(), next(), next());
                bytes.extend(half_bits(e, f, s % 2 == 0));
                bytes.extend((0..16).map(|_| next() as u8));
            }
            QuantFormat::Q8_0 => {
                // -127..=127, as llama.cpp writes them
                bytes.extend((0..BLOCK).map(|_| ((next() % 255) as i16 - 127) as i8 as u8));
            }
            QuantFormat::Q6_K | QuantFormat::Q4_K => unreachable!(),
        }
    }
    bytes
}

fn dense(fmt: QuantFormat, w: &[u8], n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0; n * k];
    let rows: Vec<usize> = (0..n).collect();
    dequantize_rows(w, fmt, BlockLayout::Rows, k, &rows, &mut out, 1).unwrap();
    out
}

/// The default `quant_matmul`'s output for `args`, from a NaN-filled buffer
/// (every element must be written).
fn run(args: &QuantMatmulArgs) -> Vec<f32> {
    let mut out = vec![f32::NAN; args.m * args.n];
    quant_matmul(args, &mut out).unwrap();
    out
}

/// float32 to bfloat16 and back, rounding to nearest even (finite values).
fn bf16_round(v: f32) -> f32 {
    let bits = v.to_bits();
    f32::from_bits((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
}

/// A rows-layout weight as the tiles take it: each value `d * q (+ m)` in
/// float32 (one rounding: Q4_1's as a fused multiply-add; the K-quants' as
/// `dequantize_block` computes them), then to bfloat16.
fn bf16_weights(fmt: QuantFormat, w: &[u8], n: usize, k: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * k);
    let blocks = n * k / fmt.block_values();
    for block in w.chunks_exact(fmt.block_bytes()).take(blocks) {
        let d = half(block, 0);
        match fmt {
            QuantFormat::Q4_1 => {
                let m = half(block, 2);
                let q = |j: usize| (block[4 + j % 16] >> (4 * (j / 16)) & 0x0f) as f32;
                out.extend((0..BLOCK).map(|j| bf16_round(q(j).mul_add(d, m))));
            }
            QuantFormat::Q8_0 => {
                out.extend((0..BLOCK).map(|j| bf16_round(block[2 + j] as i8 as f32 * d)));
            }
            QuantFormat::Q6_K | QuantFormat::Q4_K => {
                let mut values = [0f32; SUPER_BLOCK];
                dequantize_block(block, fmt, 0, &mut values);
                out.extend(values.iter().map(|&v| bf16_round(v)));
            }
        }
    }
    out
}

/// `len` pseudo-random activations in -4..4 (a xorshift from `seed`).
fn inputs(len: usize, seed: u32) -> Vec<f32> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state % 20001) as f32 / 2500.0 - 4.0
        })
        .collect()
}

fn case() -> impl Strategy<Value = (usize, usize, usize, Vec<f32>, Vec<u16>, bool, usize)> {
    (
        // a few rows, or more than `ROW_CHUNK` (whole chunks, then a part)
        prop_oneof![8 => 1usize..11, 1 => ROW_CHUNK + 1..2 * ROW_CHUNK + 8],
        1usize..11,
        1usize..40,
        prop::collection::vec(any::<u16>(), 1..64),
        any::<bool>(),
        1usize..4,
    )
        .prop_flat_map(|(m, kb, n, seed, bias, threads)| {
            let k = kb * BLOCK;
            (
                Just(m),
                Just(k),
                Just(n),
                prop::collection::vec(-4.0f32..4.0, m * k),
                Just(seed),
                Just(bias),
                Just(threads),
            )
        })
}

/// Each format with the case's K and activations, but the K-quants
/// (super-blocks of 256) with K = 256 or 512 and the activations repeated
/// to fill it.
fn formats(m: usize, k: usize, x: &[f32]) -> Vec<(QuantFormat, usize, Vec<f32>)> {
    let k6 = SUPER_BLOCK * (1 + k / BLOCK % 2);
    let x6 = x
        .iter()
        .cycle()
        .take(m * k6)
        .enumerate()
        .map(|(i, v)| v * (1.0 + (i % 7) as f32 / 8.0));
    vec![
        (QuantFormat::Q4_1, k, x.to_vec()),
        (QuantFormat::Q8_0, k, x.to_vec()),
        (QuantFormat::Q6_K, k6, x6.clone().collect()),
        (QuantFormat::Q4_K, k6, x6.collect()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Against float64 matmuls of the dequantized weights: exact (up to
    /// float rounding) over the quantized activations, and within the bound
    /// that quantizing the activations allows over the float activations.
    #[test]
    fn quant_matmul_matches_dequantized_reference((m, k, n, x, seed, with_bias, threads) in case()) {
        for (fmt, k, x) in formats(m, k, &x) {
            let w = weight_bytes(fmt, n, k, &seed);
            let wf = dense(fmt, &w, n, k);
            let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
            let bias = with_bias.then_some(bias.as_slice());
            // (in the layout a loader packs into for this CPU's kernel)
            let layout = QuantKernel::best().layout();
            let packed = laid_out(&w, fmt, k, layout);
            let args = QuantMatmulArgs { x: &x, w: &packed, bias, m, k, n, fmt, layout, num_threads: threads };
            let mut got = vec![f32::NAN; m * n];
            quant_matmul_invariant(&args, &mut got).unwrap();
            let acts = quantize_activations(&x, k);
            for i in 0..m {
                for j in 0..n {
                    let (mut on_quantized, mut on_float, mut bound, mut magnitude) = (0f64, 0f64, 0f64, 0f64);
                    for c in 0..k {
                        let wv = wf[j * k + c] as f64;
                        let b = (i * k + c) / BLOCK;
                        on_quantized += wv * acts.q[i * k + c] as f64 * acts.d[b] as f64;
                        on_float += wv * x[i * k + c] as f64;
                        bound += wv.abs() * acts.d[b] as f64 / 2.0;
                        magnitude += (wv * x[i * k + c] as f64).abs();
                    }
                    let b = bias.map_or(0.0, |b| b[j] as f64);
                    let y = got[i * n + j] as f64;
                    let tol = 1e-5 * (magnitude + bound + b.abs() + 1.0);
                    prop_assert!((y - on_quantized - b).abs() <= tol,
                        "{fmt:?} m={m} k={k} n={n} ({i},{j}): {y} vs {}", on_quantized + b);
                    prop_assert!((y - on_float - b).abs() <= bound + tol,
                        "{fmt:?} ({i},{j}): {y} vs float {} beyond bound {bound}", on_float + b);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every kernel this CPU has, whatever the rows (the default choice
    /// depends on them), columns (whole panels and the rest) and threads,
    /// writes every element and agrees with the portable kernel; with a bias.
    #[test]
    fn every_kernel_matches_portable((m, k, n, x, seed, with_bias, threads) in case()) {
        for (fmt, k, x) in formats(m, k, &x) {
            let w = weight_bytes(fmt, n, k, &seed);
            let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let bias = with_bias.then_some(bias.as_slice());
            let args = QuantMatmulArgs {
                x: &x, w: &w, bias, m, k, n, fmt, layout: BlockLayout::Rows, num_threads: threads,
            };
            let acts = quantize_activations(&x, k).for_format(fmt);
            let mut want = vec![0.0; m * n];
            unsafe { columns_portable(&args, &acts, 0, n, want.as_mut_ptr()) };
            let wf = dense(fmt, &w, n, k);
            let packed = laid_out(&w, fmt, k, BlockLayout::Panels);
            let supported = QuantKernel::ALL.into_iter().filter(|k| k.supported());
            for (kernel, layout) in supported.flat_map(|k| LAYOUTS.map(|l| (k, l))) {
                let w = if layout == BlockLayout::Panels { &packed } else { &w };
                let args = QuantMatmulArgs { w, layout, ..args };
                let mut got = vec![f32::NAN; m * n];
                quant_matmul_with(&args, &mut got, kernel).unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let (a, b) = (got[i * n + j], want[i * n + j]);
                        let magnitude: f32 = (0..k)
                            .map(|c| (wf[j * k + c] * acts.q[i * k + c] as f32 * acts.d[(i * k + c) / BLOCK]).abs())
                            .sum();
                        let b_abs = bias.map_or(0.0, |b| b[j].abs());
                        prop_assert!((a - b).abs() <= 1e-5 * (1.0 + magnitude + b_abs),
                            "{kernel:?} {layout:?} {fmt:?} m={m} k={k} n={n} ({i},{j}): {a} vs {b}");
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Batch invariance: every row of an M-row call equals, bit for bit,
    /// that row computed alone and computed among other rows in another
    /// order, under each kernel this CPU has and `quant_matmul_invariant`,
    /// whatever the threads; and
    /// a weight packed ahead gives the panel kernels the bits of the same
    /// weight in rows.
    #[test]
    fn a_row_is_the_same_in_any_batch((m, k, n, x, seed, with_bias, threads) in case()) {
        for (fmt, k, x) in formats(m, k, &x) {
            let w = weight_bytes(fmt, n, k, &seed);
            let packed = laid_out(&w, fmt, k, BlockLayout::Panels);
            let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
            let bias = with_bias.then_some(bias.as_slice());
            let rows_args = QuantMatmulArgs {
                x: &x, w: &w, bias, m, k, n, fmt, layout: BlockLayout::Rows, num_threads: threads,
            };
            let packed_args = QuantMatmulArgs { w: &packed, layout: BlockLayout::Panels, ..rows_args };
            let reversed: Vec<f32> = (0..m).rev().flat_map(|i| x[i * k..(i + 1) * k].to_vec()).collect();
            let kernels: Vec<Option<QuantKernel>> = std::iter::once(None)
                .chain(QuantKernel::ALL.into_iter().filter(|k| k.supported()).map(Some))
                .collect();
            for (kernel, args) in kernels.into_iter().flat_map(|k| [(k, rows_args), (k, packed_args)]) {
                let call = |args: &QuantMatmulArgs| {
                    let mut out = vec![f32::NAN; args.m * args.n];
                    match kernel {
                        Some(kernel) => quant_matmul_with(args, &mut out, kernel).unwrap(),
                        None => quant_matmul_invariant(args, &mut out).unwrap(),
                    }
                    out
                };
                let batch = call(&args);
                let flipped = call(&QuantMatmulArgs { x: &reversed, ..args });
                for i in 0..m {
                    let alone = call(&QuantMatmulArgs { x: &x[i * k..(i + 1) * k], m: 1, ..args });
                    let row = &batch[i * n..(i + 1) * n];
                    let other = &flipped[(m - 1 - i) * n..(m - i) * n];
                    prop_assert!(row.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{kernel:?} {fmt:?} m={m} k={k} n={n} row {i}: batch {row:?} alone {alone:?}");
                    prop_assert!(row.iter().zip(other).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{kernel:?} {fmt:?} m={m} k={k} n={n} row {i}: order changed it");
                }
                // (the pair kernel reads packed panels through the portable
                // loop, and rows through its AVX2 one where the CPU has it)
                if kernel == Some(QuantKernel::Pairs) {
                    continue;
                }
                let in_rows = call(&rows_args);
                prop_assert!(batch.iter().zip(&in_rows).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{kernel:?} {fmt:?} m={m} k={k} n={n}: {:?} differs from the rows layout", args.layout);
            }
        }
    }

    /// The AVX-VNNI panels give the AVX2 panels' bits: their integer sums
    /// are exact either way (random weight bytes, Q8_0's -128 included;
    /// every activation block reaches +-127).
    #[test]
    fn vnni_panels_give_the_avx2_bits((m, k, n, x, seed, with_bias, threads) in case()) {
        if !QuantKernel::VnniPanels.supported() {
            return Ok(());
        }
        for (fmt, k, x) in formats(m, k, &x) {
            let w = weight_bytes(fmt, n, k, &seed);
            let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
            let args = QuantMatmulArgs {
                x: &x, w: &w, bias: with_bias.then_some(bias.as_slice()), m, k, n, fmt,
                layout: BlockLayout::Rows, num_threads: threads,
            };
            let mut avx2 = vec![f32::NAN; m * n];
            let mut vnni = vec![f32::NAN; m * n];
            quant_matmul_with(&args, &mut avx2, QuantKernel::Panels).unwrap();
            quant_matmul_with(&args, &mut vnni, QuantKernel::VnniPanels).unwrap();
            let differs = avx2.iter().zip(&vnni).position(|(a, b)| a.to_bits() != b.to_bits());
            prop_assert!(differs.is_none(), "{fmt:?} m={m} k={k} n={n}: element {differs:?} differs");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// On a CPU with AMX tiles, the default `quant_matmul` of `min_rows`
    /// rows or more (every block format; whole row tiles and a partial one,
    /// panel pairs and a lone panel, the columns past the last panel, a bias
    /// or none, either layout, any threads) writes every element and equals float64 sums
    /// of the bfloat16 weights and activations up to float32 summing; and
    /// a row's bits do not depend on the other rows' order. (Without the
    /// tiles, the call takes `quant_matmul_invariant`, tested above.)
    #[test]
    fn amx_tiles_match_bfloat16_reference(
        m in crate::quant_matmul_amx::MIN_ROWS..160, kb in 1usize..12, n in 1usize..80,
        seed in prop::collection::vec(any::<u16>(), 1..64), with_bias in any::<bool>(),
        threads in 1usize..4, x_seed in any::<u32>(),
    ) {
        #[cfg(target_arch = "x86_64")]
        if !crate::quant_matmul_amx::supported() {
            return Ok(());
        }
        #[cfg(not(target_arch = "x86_64"))]
        return Ok(());
        let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
        let bias = with_bias.then_some(bias.as_slice());
        // (the K-quants' super-blocks: 256 to 768 inputs)
        let formats = [QuantFormat::Q4_1, QuantFormat::Q8_0, QuantFormat::Q4_K, QuantFormat::Q6_K];
        for fmt in formats {
            if m < crate::quant_matmul_amx::min_rows(fmt) {
                continue; // (the integer kernels, tested above)
            }
            let k = if fmt.block_values() == BLOCK { kb * BLOCK } else { (kb % 3 + 1) * SUPER_BLOCK };
            let x = inputs(m * k, x_seed);
            let reversed: Vec<f32> = (0..m).rev().flat_map(|i| x[i * k..(i + 1) * k].to_vec()).collect();
            let w = weight_bytes(fmt, n, k, &seed);
            let wf = bf16_weights(fmt, &w, n, k);
            for layout in LAYOUTS {
                let packed = laid_out(&w, fmt, k, layout);
                let args = QuantMatmulArgs { x: &x, w: &packed, bias, m, k, n, fmt, layout, num_threads: threads };
                let got = run(&args);
                let flipped = run(&QuantMatmulArgs { x: &reversed, ..args });
                let whole = n / PANEL * PANEL;
                for i in 0..m {
                    for j in 0..n {
                        let y = got[i * n + j];
                        prop_assert_eq!(y.to_bits(), flipped[(m - 1 - i) * n + j].to_bits(),
                            "{:?} {:?} m={} k={} n={} ({},{}): order changed it", fmt, layout, m, k, n, i, j);
                        if j >= whole {
                            continue; // (the integer kernel's columns, tested above)
                        }
                        let (mut want, mut magnitude) = (0f64, 0f64);
                        for c in 0..k {
                            let term = wf[j * k + c] as f64 * bf16_round(x[i * k + c]) as f64;
                            want += term;
                            magnitude += term.abs();
                        }
                        let b = bias.map_or(0.0, |b| b[j] as f64);
                        prop_assert!((y as f64 - want - b).abs() <= 4e-5 * (magnitude + b.abs()) + 1e-6,
                            "{fmt:?} {layout:?} m={m} k={k} n={n} ({i},{j}): {y} vs {}", want + b);
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// `quant_matmul_gated` is, bit for bit, the matmul it names (the
    /// default or the invariant one) and then `gate_row` on each row's gate
    /// and up halves: on AMX tiles, where a call of `min_rows` rows or more
    /// with I a multiple of 16 activates the sums as they leave the tiles
    /// (gate and up panels paired, any row tile partial), and on every
    /// other path; every output written, whatever was in the buffers.
    #[test]
    fn gated_is_the_matmul_then_the_activation(
        m in prop_oneof![1usize..8, 30usize..100], kb in 1usize..8, k_quant in any::<bool>(),
        inter in prop_oneof![1usize..40, (1usize..5).prop_map(|p| 16 * p)],
        seed in prop::collection::vec(any::<u16>(), 1..64), with_bias in any::<bool>(),
        threads in 1usize..4, invariant in any::<bool>(), x_seed in any::<u32>(),
    ) {
        // the 32-value formats, or the K-quants (K of 256 or 512)
        let (k, formats) = match k_quant {
            false => (kb * BLOCK, [QuantFormat::Q4_1, QuantFormat::Q8_0]),
            true => ((kb % 2 + 1) * SUPER_BLOCK, [QuantFormat::Q4_K, QuantFormat::Q6_K]),
        };
        let n = 2 * inter;
        let x = inputs(m * k, x_seed);
        let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
        let bias = with_bias.then_some(bias.as_slice());
        let gates = [Gate::Silu, Gate::GeluTanh, Gate::ClampedSwiGlu { alpha: 1.702, limit: 7.0 }];
        for fmt in formats {
            let w = weight_bytes(fmt, n, k, &seed);
            for layout in LAYOUTS {
                let packed = laid_out(&w, fmt, k, layout);
                let args = QuantMatmulArgs { x: &x, w: &packed, bias, m, k, n, fmt, layout, num_threads: threads };
                let mut sums = vec![f32::NAN; m * n];
                if invariant {
                    quant_matmul_invariant(&args, &mut sums).unwrap();
                } else {
                    quant_matmul(&args, &mut sums).unwrap();
                }
                for gate in gates {
                    let mut want = vec![0.0; m * inter];
                    for (row, dst) in sums.chunks_exact(n).zip(want.chunks_exact_mut(inter)) {
                        crate::activation::gate_row(gate, &row[..inter], &row[inter..], dst);
                    }
                    let mut got = vec![f32::NAN; m * inter];
                    let mut scratch = vec![f32::NAN; 3];
                    quant_matmul_gated(&args, gate, invariant, &mut scratch, &mut got).unwrap();
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        prop_assert_eq!(g.to_bits(), w.to_bits(),
                            "{:?} {:?} {:?} m={} k={} I={} invariant={} at {}: {} vs {}",
                            fmt, layout, gate, m, k, inter, invariant, i, g, w);
                    }
                }
            }
        }
    }
}

#[test]
fn gated_shapes_are_errors() {
    let (m, k, inter) = (2, BLOCK, 16);
    let w = weight_bytes(QuantFormat::Q8_0, 2 * inter, k, &[7]);
    let x = vec![0.5; m * k];
    let args = QuantMatmulArgs {
        x: &x,
        w: &w,
        bias: None,
        m,
        k,
        n: 2 * inter,
        fmt: QuantFormat::Q8_0,
        layout: BlockLayout::Rows,
        num_threads: 1,
    };
    let mut scratch = Vec::new();
    // out of [M, 2 I] (the matmul's shape) rather than [M, I]
    let mut wrong = vec![0.0; m * 2 * inter];
    assert!(quant_matmul_gated(&args, Gate::Silu, false, &mut scratch, &mut wrong).is_err());
    // an odd N: no gate / up halves
    let odd = QuantMatmulArgs {
        n: 2 * inter - 1,
        w: &w[..(2 * inter - 1) * 34],
        ..args
    };
    let mut out = vec![0.0; m * inter];
    assert!(quant_matmul_gated(&odd, Gate::Silu, false, &mut scratch, &mut out).is_err());
    // a weight of the wrong size
    let short = QuantMatmulArgs {
        w: &w[..w.len() - 34],
        ..args
    };
    assert!(quant_matmul_gated(&short, Gate::Silu, false, &mut scratch, &mut out).is_err());
    quant_matmul_gated(&args, Gate::Silu, false, &mut scratch, &mut out).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// The vector dequantizer gives the portable one's values, for any rows
    /// (repeats, any order) and threads.
    #[test]
    fn dequantize_rows_matches_block_by_block(
        kb in 1usize..20, n in 1usize..30, seed in prop::collection::vec(any::<u16>(), 1..64),
        picks in prop::collection::vec(any::<prop::sample::Index>(), 0..40), threads in 1usize..4,
    ) {
        for fmt in [QuantFormat::Q4_1, QuantFormat::Q8_0, QuantFormat::Q6_K, QuantFormat::Q4_K] {
            let kb = if fmt.block_values() == SUPER_BLOCK { 1 + kb % 3 } else { kb };
            let k = kb * fmt.block_values();
            let values = fmt.block_values();
            let w = weight_bytes(fmt, n, k, &seed);
            let rows: Vec<usize> = picks.iter().map(|i| i.index(n)).collect();
            for layout in LAYOUTS {
            let mut got = vec![f32::NAN; rows.len() * k];
            dequantize_rows(&laid_out(&w, fmt, k, layout), fmt, layout, k, &rows, &mut got, threads).unwrap();
            for (i, &r) in rows.iter().enumerate() {
                let row = &w[r * fmt.row_bytes(k)..(r + 1) * fmt.row_bytes(k)];
                let mut want = vec![0.0; k];
                for b in 0..kb {
                    dequantize_block(row, fmt, b, &mut want[b * values..(b + 1) * values]);
                }
                // fma rounds once where the portable code rounds twice
                for (a, b) in got[i * k..(i + 1) * k].iter().zip(&want) {
                    prop_assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{fmt:?} {layout:?}: {a} vs {b}");
                }
            }
            }
        }
    }
}

#[test]
fn f16_conversion_covers_every_class() {
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0xc000), -2.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert!(f16_to_f32(0x7c00).is_infinite());
    assert!(f16_to_f32(0x7e00).is_nan());
}

#[test]
fn bad_shapes_are_errors() {
    let w = vec![0u8; 20];
    let x = vec![0.0; 32];
    let mut out = vec![0.0; 1];
    let ok = QuantMatmulArgs {
        x: &x,
        w: &w,
        bias: None,
        m: 1,
        k: 32,
        n: 1,
        fmt: QuantFormat::Q4_1,
        layout: BlockLayout::Rows,
        num_threads: 1,
    };
    assert!(quant_matmul(&ok, &mut out).is_ok());
    let odd_k = QuantMatmulArgs {
        k: 30,
        x: &x[..30],
        ..ok
    };
    assert!(quant_matmul(&odd_k, &mut out).is_err());
    let short_w = QuantMatmulArgs { w: &w[..19], ..ok };
    assert!(quant_matmul(&short_w, &mut out).is_err());
    let mut rows_out = vec![0.0; 32];
    assert!(dequantize_rows(
        &w,
        QuantFormat::Q4_1,
        BlockLayout::Rows,
        32,
        &[1],
        &mut rows_out,
        1
    )
    .is_err());
}

#[test]
fn vector_quantization_matches_plain() {
    // Blocks of zeros, of ties (x.5 steps after scaling), of one large
    // value, and random ones.
    let mut x: Vec<f32> = vec![0.0; 32];
    x.extend((0..32).map(|i| if i == 0 { 127.0 } else { i as f32 - 16.5 })); // scale 1

    x.extend((0..32).map(|i| if i == 7 { 1e6 } else { i as f32 * 1e-3 }));
    let mut seed = 12345u32;
    x.extend((0..32 * 40).map(|_| {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (seed >> 8) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0
    }));
    let want = quantize_activations_impl(&x, 32);
    let mut versions = vec![quantize_activations(&x, 32)];
    #[cfg(target_arch = "x86_64")]
    if crate::isa::avx2() {
        // (the AVX2 version too where the dispatch picks AVX-512's)
        versions.push(unsafe { crate::quant_matmul_avx2::quantize_activations(&x, 32) });
    }
    for got in versions {
        assert_eq!(got.q, want.q);
        assert_eq!(got.d, want.d);
        assert_eq!(got.s, want.s);
    }
}

#[test]
fn small_rounding_matches_round_ties_even() {
    // Every quarter from -130 to 130 (ties included), and values near ties.
    for i in -520..=520 {
        let x = i as f32 / 4.0;
        for v in [x, x + 1e-5, x - 1e-5, x + 0.4999, x - 0.4999] {
            assert_eq!(round_small(v), v.round_ties_even() as i32, "{v}");
        }
    }
}

#[test]
fn isa_levels_parse_and_cap_the_kernels() {
    use crate::isa::{self, Isa};
    assert_eq!(Isa::parse("AVX2"), Some(Isa::Avx2));
    assert_eq!(Isa::parse(" portable "), Some(Isa::Portable));
    assert_eq!(Isa::parse("native"), Some(Isa::Amx));
    assert_eq!(Isa::parse("avx512"), Some(Isa::Avx512));
    assert_eq!(Isa::parse("AvxVnni"), Some(Isa::AvxVnni));
    assert_eq!(Isa::parse("sse9"), None);
    assert!(Isa::Avx2 < Isa::AvxVnni && Isa::AvxVnni < Isa::Avx512);
    // Whatever the cap this process runs under, no kernel above it runs.
    let level = isa::effective();
    assert!(level <= isa::cap());
    assert_eq!(QuantKernel::Panels.supported(), level >= Isa::Avx2);
    if isa::cap() < Isa::AvxVnni {
        assert!(!QuantKernel::VnniPanels.supported());
    }
    if level < Isa::Avx512 {
        assert!(!QuantKernel::WidePanels.supported());
    }
    #[cfg(target_arch = "x86_64")]
    assert_eq!(crate::quant_matmul_amx::supported(), level == Isa::Amx);
}
