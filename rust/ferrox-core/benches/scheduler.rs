//! Criterion benches of one scheduler step (`schedule()` + `update()`).
//!
//! cargo bench -p ferrox-core --bench scheduler

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use ferrox_core::{RequestParams, Scheduler, SchedulerConfig};

const BLOCK_SIZE: usize = 16;
/// Steps between rebuilds, so that contexts stay within 512-2,048 + this.
const STEPS_PER_BUILD: u64 = 512;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo) as u64) as usize
    }
}

fn step(sched: &mut Scheduler) -> usize {
    let plan = sched.schedule().unwrap();
    let sampled = vec![7u32; plan.sample_rows.len()];
    let events = sched.update(&plan, &sampled, &[], None).unwrap();
    events.len()
}

/// `num_running` requests with 512-2,048-token contexts, all decoding; the
/// step budget leaves `prefill_budget` tokens beyond the decodes.
fn build(num_running: usize, prefill_budget: usize) -> Scheduler {
    let prefill_budget = prefill_budget.max(1);
    let cfg = SchedulerConfig {
        block_size: BLOCK_SIZE,
        num_blocks: num_running * (2_048 + STEPS_PER_BUILD as usize + 64) / BLOCK_SIZE + 2_048,
        max_num_seqs: num_running + 1,
        max_num_batched_tokens: num_running + prefill_budget,
        max_model_len: 8_192,
        vocab_size: 49_152,
        ..SchedulerConfig::default()
    };
    let mut sched = Scheduler::new(cfg).unwrap();
    let mut rng = Rng(0x5EED);
    let params = RequestParams {
        max_tokens: 100_000,
        ignore_eos: true,
        ..RequestParams::default()
    };
    for id in 0..num_running as u64 {
        let len = rng.range(512, 2_049);
        let prompt: Vec<u32> = (0..len).map(|_| (rng.next() % 49_152) as u32).collect();
        sched.add_request(id, &prompt, params.clone()).unwrap();
    }
    while sched.stats().num_waiting > 0
        || (0..num_running as u64).any(|id| {
            let r = sched.request(id).unwrap();
            r.num_computed_tokens + 1 < r.num_tokens()
        })
    {
        step(&mut sched);
    }
    sched
}

fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("scheduler_step");
    group.measurement_time(Duration::from_secs(4));
    for num_running in [256usize, 1_024] {
        group.bench_with_input(
            BenchmarkId::new("decode", num_running),
            &num_running,
            |b, &n| {
                let mut sched = build(n, 8_192);
                let mut steps = 0;
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        if steps == STEPS_PER_BUILD {
                            sched = build(n, 8_192);
                            steps = 0;
                        }
                        let start = Instant::now();
                        black_box(step(&mut sched));
                        total += start.elapsed();
                        steps += 1;
                    }
                    total
                })
            },
        );
    }
    // 256 decodes plus a 2,048-token chunk of a new 4,096-token prompt that
    // shares a 1,024-token prefix with the previous one.
    group.bench_function("mixed_256_decodes_plus_2048_chunk", |b| {
        let mut sched = build(256, 2_048);
        let mut rng = Rng(99);
        let shared: Vec<u32> = (0..1_024).map(|_| (rng.next() % 49_152) as u32).collect();
        let mut next_id = 1_000_000u64;
        let mut steps = 0;
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                if steps == STEPS_PER_BUILD {
                    sched = build(256, 2_048);
                    steps = 0;
                }
                if sched.stats().num_running == 256 {
                    let mut prompt = shared.clone();
                    prompt.extend((0..3_072).map(|_| (rng.next() % 49_152) as u32));
                    let params = RequestParams {
                        max_tokens: 1,
                        ..RequestParams::default()
                    };
                    sched.add_request(next_id, &prompt, params).unwrap();
                    next_id += 1;
                }
                let start = Instant::now();
                black_box(step(&mut sched));
                total += start.elapsed();
                steps += 1;
            }
            total
        })
    });
    group.finish();
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
