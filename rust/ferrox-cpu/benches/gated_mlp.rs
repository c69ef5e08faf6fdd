//! A gated MLP's first half on SmolLM2-135M's gate/up projection (576 ->
//! 2 x 1536, Q4_1, packed): the block matmul alone, the matmul then the
//! activation over its [M, 2 I] sums (`gate_rows_threaded`), and
//! `quant_matmul_gated`, which on a CPU with AMX tiles activates the sums
//! as they leave the tiles (elsewhere it is the matmul then the
//! activation); alternating in one process, on the engine's kernel
//! threads. Prints, per row count, the median microseconds per call
//! (min-max over the repeats) and the gated call's speed-up over the two
//! steps; first, the activation alone (SiLU(gate) * up) in nanoseconds a
//! value on one thread.
//!
//! cargo bench -p ferrox-cpu --bench gated_mlp [-- --threads 2 --repeats 7]
//!     [--rows 32,256,1024]

use std::time::Instant;

#[path = "common/blocks.rs"]
mod blocks;
#[path = "common/shared.rs"]
mod shared;
use blocks::weights;
use shared::{arg, median_min_max, option};

use ferrox_cpu::activation::gate_rows_threaded;
use ferrox_cpu::{
    pack_blocks, quant_matmul, quant_matmul_gated, BlockLayout, Gate, QuantFormat, QuantMatmulArgs,
};

const K: usize = 576;
const INTER: usize = 1536;

/// Microseconds per call of `f`, median (min-max) of `repeats` samples of
/// `calls` calls.
fn time(repeats: usize, calls: usize, mut f: impl FnMut()) -> Vec<f64> {
    (0..repeats)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..calls {
                f();
            }
            start.elapsed().as_secs_f64() * 1e6 / calls as f64
        })
        .collect()
}

fn show((median, min, max): (f64, f64, f64)) -> String {
    format!("{median:.1} ({min:.1}-{max:.1})")
}

fn main() {
    let threads = arg(
        "--threads",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let repeats = arg("--repeats", 7);
    let rows: Vec<usize> = option("--rows").map_or(vec![32, 64, 256, 1024], |list| {
        list.split(',')
            .map(|v| v.parse().expect("a number"))
            .collect()
    });
    let values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 100.0)
            .collect()
    };
    // the activation alone, one thread, 64 rows
    let sums = values(64 * 2 * INTER);
    let mut act = vec![0.0; 64 * INTER];
    let each = time(repeats, 50, || {
        gate_rows_threaded(Gate::Silu, &sums, INTER, 1, &mut act)
    });
    let (median, min, max) = median_min_max(each);
    let per = 1e3 / (64 * INTER) as f64;
    println!(
        "activation alone: {:.3} ns a value ({:.3}-{:.3}), one thread",
        median * per,
        min * per,
        max * per
    );

    let n = 2 * INTER;
    let w = weights(QuantFormat::Q4_1, n, K);
    let mut packed = vec![0; w.len()];
    pack_blocks(&w, QuantFormat::Q4_1, K, &mut packed).unwrap();
    println!("{threads} threads, {repeats} repeats; microseconds per call, median (min-max)");
    println!(
        "{:>5}{:>24}{:>24}{:>24}{:>9}",
        "rows", "matmul", "matmul + activation", "gated", "speedup"
    );
    for m in rows {
        let x = values(m * K);
        let args = QuantMatmulArgs {
            x: &x,
            w: &packed,
            bias: None,
            m,
            k: K,
            n,
            fmt: QuantFormat::Q4_1,
            layout: BlockLayout::Panels,
            num_threads: threads,
        };
        let mut sums = vec![0.0; m * n];
        let mut act = vec![0.0; m * INTER];
        let mut scratch = Vec::new();
        let calls = (2e8 / (m * K * n) as f64).ceil() as usize;
        let (mut alone, mut two, mut gated) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..repeats {
            alone.extend(time(1, calls, || quant_matmul(&args, &mut sums).unwrap()));
            two.extend(time(1, calls, || {
                quant_matmul(&args, &mut sums).unwrap();
                gate_rows_threaded(Gate::Silu, &sums, INTER, threads, &mut act);
            }));
            gated.extend(time(1, calls, || {
                quant_matmul_gated(&args, Gate::Silu, false, &mut scratch, &mut act).unwrap()
            }));
        }
        let (two, gated) = (median_min_max(two), median_min_max(gated));
        println!(
            "{m:>5}{:>24}{:>24}{:>24}{:>8.2}x",
            show(median_min_max(alone)),
            show(two),
            show(gated),
            two.0 / gated.0
        );
    }
}
