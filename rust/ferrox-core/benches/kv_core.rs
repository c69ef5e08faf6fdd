//! Criterion benches of the KV core: radix-cache match / insert / evict on a
//! large tree, and block allocation.
//!
//! cargo bench -p ferrox-core --bench kv_core

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use ferrox_core::{BlockAllocator, RadixCache};

const BLOCK_SIZE: usize = 16;
const NUM_SEQUENCES: usize = 10_000;
const NUM_SYSTEM_PROMPTS: usize = 200;

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
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 49_152) as u32).collect()
    }
}

/// 10,000 sequences of 512-4,096 tokens, each a shared system prompt
/// (256-1,024 tokens, one of 200) followed by its own text.
fn build_tree() -> (BlockAllocator, RadixCache, Vec<Vec<u32>>) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let system: Vec<Vec<u32>> = (0..NUM_SYSTEM_PROMPTS)
        .map(|_| {
            let n = rng.range(256, 1025);
            rng.tokens(n)
        })
        .collect();
    let sequences: Vec<Vec<u32>> = (0..NUM_SEQUENCES)
        .map(|i| {
            let mut seq = system[i % NUM_SYSTEM_PROMPTS].clone();
            let total = rng.range(512.max(seq.len() + 16), 4097);
            let tail = rng.tokens(total - seq.len());
            seq.extend(tail);
            seq
        })
        .collect();
    let num_blocks: usize = sequences
        .iter()
        .map(|s| s.len() / BLOCK_SIZE)
        .sum::<usize>()
        + 4096;
    let mut alloc = BlockAllocator::new(num_blocks, BLOCK_SIZE).unwrap();
    let mut cache = RadixCache::new(BLOCK_SIZE, num_blocks).unwrap();
    for seq in &sequences {
        let blocks = alloc.allocate(seq.len() / BLOCK_SIZE).unwrap();
        cache.insert(0, seq, &blocks, &mut alloc).unwrap();
    }
    (alloc, cache, sequences)
}

fn bench_radix(c: &mut Criterion) {
    let (mut alloc, mut cache, sequences) = build_tree();
    let mut rng = Rng(7);
    // A 4,096-token prompt: a cached sequence's first 3,000 tokens, then new text.
    let long = sequences.iter().find(|s| s.len() >= 3_200).unwrap();
    let mut prompt = long[..3_000].to_vec();
    prompt.extend(rng.tokens(4_096 - prompt.len()));
    let mut group = c.benchmark_group("radix_cache");
    group.measurement_time(Duration::from_secs(3));
    group.bench_function("match_prefix_4096_in_10k_tree", |b| {
        b.iter(|| black_box(cache.split_and_touch_prefix(0, black_box(&prompt))))
    });

    // Insert a new 4,096-token sequence sharing a system prompt (its shared
    // blocks are released as duplicates); evicted again outside the timing.
    group.bench_function("insert_4096_in_10k_tree", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                let mut seq = sequences[i as usize % NUM_SEQUENCES].clone();
                seq.truncate(1_024.min(seq.len()));
                let tail = rng.tokens(4_096 - seq.len());
                seq.extend(tail);
                let blocks = alloc.allocate(seq.len() / BLOCK_SIZE).unwrap();
                let start = Instant::now();
                let out = cache.insert(0, &seq, &blocks, &mut alloc).unwrap();
                total += start.elapsed();
                black_box(out);
                cache.evict(out.num_new_blocks, &mut alloc).unwrap();
            }
            total
        })
    });

    group.bench_function("evict_1000_blocks", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let seq = rng.tokens(1_000 * BLOCK_SIZE);
                let blocks = alloc.allocate(1_000).unwrap();
                cache.insert(0, &seq, &blocks, &mut alloc).unwrap();
                let start = Instant::now();
                let freed = cache.evict(1_000, &mut alloc).unwrap();
                total += start.elapsed();
                assert_eq!(freed, 1_000);
            }
            total
        })
    });
    group.finish();
}

fn bench_allocator(c: &mut Criterion) {
    let mut alloc = BlockAllocator::new(1 << 16, BLOCK_SIZE).unwrap();
    let held = alloc.allocate(1 << 15).unwrap();
    c.bench_function("allocator/alloc_free_one_block", |b| {
        b.iter(|| {
            let block = alloc.allocate_one().unwrap();
            alloc.release_one(black_box(block)).unwrap();
        })
    });
    black_box(held);
}

criterion_group!(benches, bench_radix, bench_allocator);
criterion_main!(benches);
