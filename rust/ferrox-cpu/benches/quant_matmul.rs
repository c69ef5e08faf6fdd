//! The block-quantized matmul's kernels side by side (`QuantKernel`): the
//! AVX2 pair kernel (two weight rows against up to four activation rows),
//! the AVX2 panel kernel (eight weight rows interleaved once, then every
//! activation row), the same with AVX-VNNI's dot products, and the AVX-512
//! VNNI one (sixteen), those this CPU has (under its `FERROX_CPU_ISA` cap),
//! at SmolLM2-135M's shapes, for 1 to 64 activation rows, on the engine's
//! kernel threads. Alternates them in one process and prints, per shape and
//! row count, the median microseconds per call of each (min-max over the
//! repeats), the best one's speed-up over the pair kernel and the GMAC/s it
//! reaches; `QuantKernel::best` was chosen by these figures. On a CPU with
//! AMX tiles, the column `AmxTiles packed` is the default `quant_matmul`,
//! which takes the tiles from `quant_matmul_amx::min_rows` rows on (below,
//! the widest integer kernel's figures again); `MIN_ROWS` and
//! `MIN_ROWS_K_QUANTS` were chosen by it.
//!
//! cargo bench -p ferrox-cpu --bench quant_matmul [-- --threads 2 --repeats 7]
//!     [--rows 1,16,256] [--only gate_up]

use std::time::Instant;

#[path = "common/blocks.rs"]
mod blocks;
#[path = "common/shared.rs"]
mod shared;
use blocks::weights;
use shared::{arg, median_min_max, option};

use ferrox_cpu::{
    pack_blocks, quant_matmul, quant_matmul_with, BlockLayout, QuantFormat, QuantKernel,
    QuantMatmulArgs,
};

/// SmolLM2-135M's layers in its GGUF formats (the LM head is the Q8_0
/// embedding), then a K-quant file's (hidden size 1024) Q4_K attention
/// projection and Q6_K LM head: name, K, N, format.
const SHAPES: [(&str, usize, usize, QuantFormat); 7] = [
    ("qkv 576->960 q4_1", 576, 960, QuantFormat::Q4_1),
    ("o 576->576 q4_1", 576, 576, QuantFormat::Q4_1),
    ("gate_up 576->3072 q4_1", 576, 3072, QuantFormat::Q4_1),
    ("down 1536->576 q4_1", 1536, 576, QuantFormat::Q4_1),
    ("lm_head 576->49152 q8_0", 576, 49152, QuantFormat::Q8_0),
    ("q/k 1024->2560 q4_k", 1024, 2560, QuantFormat::Q4_K),
    ("lm_head 1024->49152 q6_k", 1024, 49152, QuantFormat::Q6_K),
];
const ROWS: [usize; 8] = [1, 2, 3, 4, 8, 16, 32, 64];

fn main() {
    let threads = arg(
        "--threads",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let repeats = arg("--repeats", 7);
    // Each kernel on the rows layout (a panel kernel then packs per call),
    // and each panel kernel on weights packed ahead.
    // (None: the default `quant_matmul`, listed where the CPU has AMX tiles)
    let mut kernels: Vec<(Option<QuantKernel>, BlockLayout)> = QuantKernel::ALL
        .into_iter()
        .filter(|k| k.supported())
        .flat_map(|k| {
            let packed = (k.layout() == BlockLayout::Panels).then_some((k, BlockLayout::Panels));
            std::iter::once((k, BlockLayout::Rows)).chain(packed)
        })
        .map(|(k, layout)| (Some(k), layout))
        .collect();
    if ferrox_cpu::quant_matmul_amx::supported() {
        kernels.push((None, BlockLayout::Panels));
    }
    println!("{threads} threads, {repeats} repeats; microseconds per call, median (min-max)");
    print!("{:<26}{:>5}", "shape", "rows");
    for (kernel, layout) in &kernels {
        let kernel = kernel.map_or("AmxTiles".to_string(), |k| format!("{k:?}"));
        let name = match layout {
            BlockLayout::Rows => kernel,
            BlockLayout::Panels => format!("{kernel} packed"),
        };
        print!("{name:>26}");
    }
    println!("{:>9}{:>10}", "speedup", "GMAC/s");
    let rows: Vec<usize> = option("--rows").map_or(ROWS.to_vec(), |list| {
        list.split(',')
            .map(|v| v.parse().expect("a number"))
            .collect()
    });
    let only = option("--only").unwrap_or_default();
    for (name, k, n, fmt) in SHAPES {
        if !name.contains(&only) {
            continue;
        }
        let w = weights(fmt, n, k);
        let mut packed = vec![0; w.len()];
        pack_blocks(&w, fmt, k, &mut packed).unwrap();
        for &m in &rows {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0)
                .collect();
            let mut out = vec![0.0; m * n];
            let args = |layout| QuantMatmulArgs {
                x: &x,
                w: if layout == BlockLayout::Panels {
                    &packed
                } else {
                    &w
                },
                bias: None,
                m,
                k,
                n,
                fmt,
                layout,
                num_threads: threads,
            };
            // Calls per sample: 2e8 multiply-adds (about 1-3 ms), at least one.
            let calls = (2e8 / (m * k * n) as f64).ceil() as usize;
            let mut times = vec![Vec::new(); kernels.len()];
            for _ in 0..repeats {
                for (which, &(kernel, layout)) in kernels.iter().enumerate() {
                    let args = args(layout);
                    let call = |out: &mut [f32]| match kernel {
                        Some(kernel) => quant_matmul_with(&args, out, kernel).unwrap(),
                        None => quant_matmul(&args, out).unwrap(),
                    };
                    call(&mut out);
                    let start = Instant::now();
                    for _ in 0..calls {
                        call(&mut out);
                    }
                    times[which].push(start.elapsed().as_secs_f64() * 1e6 / calls as f64);
                }
            }
            let stats: Vec<(f64, f64, f64)> = times.into_iter().map(median_min_max).collect();
            print!("{name:<26}{m:>5}");
            for (median, min, max) in &stats {
                print!("{:>26}", format!("{median:.1} ({min:.1}-{max:.1})"));
            }
            let best = stats.iter().map(|s| s.0).fold(f64::INFINITY, f64::min);
            println!(
                "{:>8.2}x{:>10.1}",
                stats[0].0 / best,
                (m * k * n) as f64 / best / 1e3
            );
        }
    }
}
