//! The paged-attention kernel's loops side by side: the AVX2 loops (eight
//! lanes a vector), the AVX-512 ones (sixteen) and the AMX tiles
//! (`paged_attention_amx`), those this CPU has, alternating in one process,
//! on SmolLM2-135M's heads (9 query and 3 KV heads of 64) over a float16
//! cache of 16-token blocks:
//!
//! - `fresh`: one prompt of `--prompt` tokens (1012) with nothing cached,
//!   the tile loops' case of a long prefill;
//! - `tails`: 31 rows of 9 queries behind one shared 1,000-token prefix
//!   (an agent's fan-out: the requests that waited for the first one's
//!   prefix, their own prompts' ends);
//! - `fan-out`: 32 decode rows behind one shared 1,000-token prefix, each
//!   with a block of its own (the same fan-out's decode steps);
//! - `chat`: 16 decode rows behind a shared 704-token system prompt and 124
//!   tokens of their own each.
//!
//! Each case runs over 30 layers' caches in turn (as a model's step finds
//! them: in memory, not in the core's caches). Prints per case and loops
//! the median milliseconds of one call (min-max over `--repeats`), GFLOP/s
//! (a multiply-add counted as two), and each loops' speed over the
//! narrower ones' per repeat.
//!
//! cargo bench -p ferrox-cpu --bench paged_attention [-- --threads 2 --repeats 15 --prompt 1012]

use std::time::Instant;

#[path = "common/shared.rs"]
mod shared;
use shared::{arg, median_min_max};

use ferrox_cpu::isa::Isa;
use ferrox_cpu::{paged_attention_with_isa, KvElement, PagedAttentionArgs, F16};

const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const DIM: usize = 64;
const BLOCK: usize = 16;
const LAYERS: usize = 30;

/// One case: each row's queries and tokens in all (the last `q` of them
/// its queries), and the leading blocks every row's table shares.
struct Case {
    name: &'static str,
    rows: usize,
    q: usize,
    seq: usize,
    shared: usize,
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Milliseconds per call (one call per layer, the layers in turn) with the
/// loops of `isa`.
fn run(case: &Case, threads: usize, isa: Isa, data: &Data) -> f64 {
    let seq_lens = vec![case.seq as i32; case.rows];
    let qsl: Vec<i32> = (0..=case.rows).map(|r| (r * case.q) as i32).collect();
    let rows: Vec<i32> = (0..case.rows as i32).collect();
    let mut out = vec![0.0; data.q.len()];
    let start = Instant::now();
    for layer in 0..LAYERS {
        let args = PagedAttentionArgs {
            q: &data.q,
            k_cache: &data.k[layer],
            v_cache: &data.v[layer],
            block_table: &data.table,
            query_start_loc: &qsl,
            seq_lens: &seq_lens,
            rows: &rows,
            num_heads: HEADS,
            num_kv_heads: KV_HEADS,
            head_dim: DIM,
            block_size: BLOCK,
            scale: 1.0 / (DIM as f32).sqrt(),
            window: 0,
            sinks: None,
            batch_invariant: false,
            num_threads: threads,
        };
        paged_attention_with_isa(&args, &mut out, isa).expect("valid shapes");
    }
    start.elapsed().as_secs_f64() * 1e3 / LAYERS as f64
}

struct Data {
    q: Vec<f32>,
    k: Vec<Vec<F16>>,
    v: Vec<Vec<F16>>,
    table: Vec<i32>,
}

fn data(case: &Case) -> Data {
    let width = case.seq.div_ceil(BLOCK);
    let own = width - case.shared;
    let blocks = case.shared + case.rows * own;
    let mut table = Vec::with_capacity(case.rows * width);
    for r in 0..case.rows {
        table.extend(0..case.shared as i32);
        table.extend((0..own).map(|j| (case.shared + r * own + j) as i32));
    }
    let cache = |seed| {
        values(blocks * BLOCK * KV_HEADS * DIM, seed)
            .iter()
            .map(|&x| F16::from_f32(x))
            .collect::<Vec<_>>()
    };
    Data {
        q: values(case.rows * case.q * HEADS * DIM, 1),
        k: (0..LAYERS as u32).map(|l| cache(2 * l + 2)).collect(),
        v: (0..LAYERS as u32).map(|l| cache(2 * l + 3)).collect(),
        table,
    }
}

/// Multiply-adds of one call: each query head's scores and weighted sum
/// over the keys it sees.
fn macs(case: &Case) -> f64 {
    let context = case.seq - case.q;
    let keys: usize = (1..=case.q).map(|i| context + i).sum();
    (case.rows * keys * HEADS * DIM * 2) as f64
}

fn main() {
    let threads = arg("--threads", 2);
    let repeats = arg("--repeats", 15);
    let prompt = arg("--prompt", 1012);
    if !ferrox_cpu::isa::avx512() {
        println!("this CPU (or FERROX_CPU_ISA) allows no AVX-512 loops: nothing to compare");
        return;
    }
    let cases = [
        Case {
            name: "fresh",
            rows: 1,
            q: prompt,
            seq: prompt,
            shared: 0,
        },
        Case {
            name: "tails",
            rows: 31,
            q: 9,
            seq: 1009,
            shared: 1000 / BLOCK,
        },
        Case {
            name: "fan-out",
            rows: 32,
            q: 1,
            seq: 1001,
            shared: 1000 / BLOCK,
        },
        Case {
            name: "chat",
            rows: 16,
            q: 1,
            seq: 829,
            shared: 704 / BLOCK,
        },
    ];
    let mut loops = vec![("AVX2", Isa::Avx2), ("AVX-512", Isa::Avx512)];
    if ferrox_cpu::quant_matmul_amx::supported() {
        loops.push(("AMX", Isa::Amx));
    }
    println!("{threads} threads, {repeats} repeats; ms a call, median (min-max); GFLOP/s");
    for case in &cases {
        let data = data(case);
        let mut times = vec![vec![]; loops.len()];
        for repeat in 0..repeats + 1 {
            // Each repeat starts at another of the loops: none goes first
            // every time.
            for i in 0..loops.len() {
                let which = (i + repeat) % loops.len();
                let ms = run(case, threads, loops[which].1, &data);
                if repeat > 0 {
                    times[which].push(ms);
                }
            }
        }
        let flops = 2.0 * macs(case);
        for ((name, _), times) in loops.iter().zip(&times) {
            let (m, lo, hi) = median_min_max(times.clone());
            println!(
                "{:8} {:8} {m:8.3} ({lo:.3}-{hi:.3})  {:6.1}",
                case.name,
                name,
                flops / m / 1e6
            );
        }
        for pair in 1..loops.len() {
            let ratios: Vec<f64> = times[pair - 1]
                .iter()
                .zip(&times[pair])
                .map(|(a, b)| a / b)
                .collect();
            let (m, lo, hi) = median_min_max(ratios);
            println!(
                "{:8} {} / {} speed: {m:.2}x ({lo:.2}-{hi:.2})",
                case.name,
                loops[pair].0,
                loops[pair - 1].0
            );
        }
    }
}
