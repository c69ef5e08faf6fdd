//! How many float32 multiply-adds a second the machine's cores retire, on one
//! thread and on several at once, sampled again and again: the ceiling the
//! kernels' GMAC/s figures are read against, and whether it holds still.
//!
//! Each thread runs twelve independent chains of 8-lane fused multiply-adds
//! (AVX2 + FMA; a CPU without them runs plain `mul_add` chains, which say
//! little), enough to keep a core's FMA units full. One thread and then
//! `--threads` threads, alternating, `--samples` times, each sample a fixed
//! amount of work per thread (about a tenth of a second on one core).
//! Prints each sample, then per thread count the median (min-max) and, per
//! pair of samples, how much more the threads together retired than one.
//! On a virtual machine this shows whether its vCPUs are cores of their own
//! or share one core's vector units (or are shared with other tenants), and
//! whether that changes from second to second.
//!
//! cargo bench -p ferrox-cpu --bench vector_rate [-- --threads 2 --samples 30]

use std::time::Instant;

#[path = "common/shared.rs"]
mod shared;
use shared::{arg, median_min_max};

/// Rounds of twelve fused multiply-adds per thread and sample.
const ROUNDS: usize = 30_000_000;
const CHAINS: usize = 12;

/// `ROUNDS` rounds of `CHAINS` 8-lane multiply-adds; returns a value that
/// depends on every chain (so none is optimised away).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chains_avx2(seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); CHAINS];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = _mm256_set1_ps(seed + i as f32 * 1e-3);
    }
    let (x, y) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-4));
    for _ in 0..ROUNDS {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, x, y);
        }
    }
    let mut total = _mm256_setzero_ps();
    for a in acc {
        total = _mm256_add_ps(total, a);
    }
    _mm256_cvtss_f32(total)
}

/// The same count of multiply-adds as plain scalar chains.
fn chains_portable(seed: f32) -> f32 {
    let mut acc = [0.0f32; CHAINS * 8];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = seed + i as f32 * 1e-3;
    }
    for _ in 0..ROUNDS {
        for a in acc.iter_mut() {
            *a = a.mul_add(0.999_9, 1e-4);
        }
    }
    acc.iter().sum()
}

fn one_thread(seed: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { chains_avx2(seed) };
    }
    chains_portable(seed)
}

/// Giga multiply-adds a second (lanes counted) of `threads` threads at once.
fn sample(threads: usize) -> f64 {
    let start = Instant::now();
    let sums: Vec<f32> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || one_thread(t as f32)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a chain thread"))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    assert!(sums.iter().all(|v| v.is_finite()));
    (threads * ROUNDS * CHAINS * 8) as f64 / seconds / 1e9
}

/// median (min-max), `digits` after the point.
fn median_spread(values: &[f64], digits: usize) -> String {
    let (mid, low, high) = median_min_max(values.to_vec());
    format!("{mid:.digits$} ({low:.digits$}-{high:.digits$})")
}

fn main() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = arg("--threads", cores).max(1);
    let samples = arg("--samples", 20).max(1);
    println!(
        "{} chains of 8-lane float32 multiply-adds per thread; 1 thread and {threads} threads, \
         alternating, {samples} samples each",
        CHAINS
    );
    let (mut alone, mut together) = (Vec::new(), Vec::new());
    for i in 0..samples {
        let a = sample(1);
        let b = sample(threads);
        println!(
            "sample {i:3}: 1 thread {a:7.1} GFMA/s, {threads} threads {b:7.1} GFMA/s ({:.2}x)",
            b / a
        );
        alone.push(a);
        together.push(b);
    }
    let ratios: Vec<f64> = alone.iter().zip(&together).map(|(a, b)| b / a).collect();
    println!("1 thread:  {} GFMA/s", median_spread(&alone, 1));
    println!("{threads} threads: {} GFMA/s", median_spread(&together, 1));
    println!(
        "{threads} threads against 1: {}x",
        median_spread(&ratios, 2)
    );
}
