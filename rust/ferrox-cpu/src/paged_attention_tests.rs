use super::*;
use crate::kv_element::F16;
use proptest::prelude::*;

/// Plain softmax attention over gathered context, for comparison.
fn reference<T: KvElement>(args: &PagedAttentionArgs<'_, T>, num_tokens: usize) -> Vec<f32> {
    let (h, hkv, d, bs) = (
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        args.block_size,
    );
    let width = args.block_table.len() / args.seq_lens.len();
    let mut out = vec![0.0; num_tokens * h * d];
    for &row in args.rows {
        let r = row as usize;
        let qs = args.query_start_loc[r] as usize;
        let q_len = args.query_start_loc[r + 1] as usize - qs;
        let seq_len = args.seq_lens[r] as usize;
        for i in 0..q_len {
            let t = qs + i;
            let keys = seq_len - q_len + i + 1;
            let first_key = match args.window {
                0 => 0,
                w => keys.saturating_sub(w),
            };
            for head in 0..h {
                let kvh = head / (h / hkv);
                let q = &args.q[(t * h + head) * d..][..d];
                let slot = |j: usize| {
                    let b = args.block_table[r * width + j / bs] as usize;
                    ((b * bs + j % bs) * hkv + kvh) * d
                };
                let scores: Vec<f64> = (first_key..keys)
                    .map(|j| {
                        let k = &args.k_cache[slot(j)..][..d];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| (*a as f64) * (b.to_f32() as f64))
                            .sum::<f64>()
                            * args.scale as f64
                    })
                    .collect();
                let sink = args.sinks.map(|s| s[head] as f64);
                let m = scores
                    .iter()
                    .cloned()
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().chain(&sink).map(|x| (x - m).exp()).sum();
                for (j, sc) in (first_key..).zip(&scores) {
                    let p = (sc - m).exp() / z;
                    let v = &args.v_cache[slot(j)..][..d];
                    for c in 0..d {
                        out[(t * h + head) * d + c] += (p * v[c].to_f32() as f64) as f32;
                    }
                }
            }
        }
    }
    out
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Case {
    heads: (usize, usize),
    head_dim: usize,
    block_size: usize,
    rows: Vec<(usize, usize)>, // (q_len, seq_len)
    threads: usize,
    /// Leading blocks every row reads from the same physical blocks (a
    /// shared prefix), where the row has that many.
    shared_blocks: usize,
    /// Sliding window (0: none); table entries wholly behind every query's
    /// window point at a block of garbage (NaN), which must not be read.
    window: usize,
    /// Attention sinks (one logit per query head), or none.
    sinks: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![
            Just((1, 1)),
            Just((3, 1)),
            Just((4, 2)),
            Just((8, 1)),
            Just((6, 3)),
            Just((4, 1))
        ],
        prop_oneof![
            Just(8usize),
            Just(16),
            Just(32),
            Just(64),
            Just(80),
            Just(128),
            Just(256),
            Just(13)
        ],
        prop_oneof![Just(1usize), Just(4), Just(16)],
        prop::collection::vec(
            (prop_oneof![1usize..6, 6usize..21, 21usize..90], 0usize..40),
            1..6,
        ),
        1usize..4,
        0usize..4,
        prop_oneof![Just(0usize), 1usize..12],
        any::<bool>(),
    )
        .prop_map(
            |(heads, head_dim, block_size, rows, threads, shared_blocks, window, sinks)| Case {
                heads,
                head_dim,
                block_size,
                rows: rows.into_iter().map(|(q, ctx)| (q, q + ctx)).collect(),
                threads,
                shared_blocks,
                window,
                sinks,
            },
        )
}

fn run_case(c: &Case, seed: u64, half: bool) {
    let (h, hkv) = c.heads;
    let (d, bs) = (c.head_dim, c.block_size);
    let width = c.rows.iter().map(|r| r.1.div_ceil(bs)).max().unwrap();
    // The last block is garbage: windows point what they never read there.
    let num_blocks = c.rows.len() * width + 3;
    let garbage = num_blocks as i32 - 1;
    // Blocks are handed out in a scrambled order to exercise the table.
    let mut order: Vec<i32> = (0..garbage).collect();
    order.reverse();
    let mut table = vec![0i32; c.rows.len() * width];
    let mut next = 0;
    let mut qsl = vec![0i32];
    for (r, &(q_len, seq_len)) in c.rows.iter().enumerate() {
        for j in 0..seq_len.div_ceil(bs) {
            table[r * width + j] = if r > 0 && j < c.shared_blocks {
                table[j] // the first row's block
            } else {
                next += 1;
                order[next - 1]
            };
        }
        qsl.push(qsl[r] + q_len as i32);
    }
    for (r, &(q_len, seq_len)) in c.rows.iter().enumerate() {
        if c.window > 0 {
            // The first query reads from position seq_len - q_len + 1 - window.
            let first_read = (seq_len - q_len + 1).saturating_sub(c.window);
            for j in 0..first_read / bs {
                table[r * width + j] = garbage;
            }
        }
    }
    let num_tokens = *qsl.last().unwrap() as usize;
    let q = values(num_tokens * h * d, seed);
    let mut k = values(num_blocks * bs * hkv * d, seed + 1);
    let mut v = values(num_blocks * bs * hkv * d, seed + 2);
    let tail = (num_blocks - 1) * bs * hkv * d;
    k[tail..].fill(f32::NAN);
    v[tail..].fill(f32::NAN);
    if half {
        let to_half = |x: &[f32]| x.iter().map(|&x| F16::from_f32(x)).collect::<Vec<_>>();
        check_case(c, &q, &to_half(&k), &to_half(&v), &table, &qsl);
    } else {
        check_case(c, &q, &k, &v, &table, &qsl);
    }
}

fn check_case<T: KvElement>(c: &Case, q: &[f32], k: &[T], v: &[T], table: &[i32], qsl: &[i32]) {
    let (h, hkv) = c.heads;
    let (d, bs) = (c.head_dim, c.block_size);
    let num_tokens = *qsl.last().unwrap() as usize;
    let seq_lens: Vec<i32> = c.rows.iter().map(|r| r.1 as i32).collect();
    let rows: Vec<i32> = (0..c.rows.len() as i32).collect();
    // Sinks from well below to well above the scores (|score| < sqrt(d)).
    let sinks = c
        .sinks
        .then(|| values(h, 7).iter().map(|x| 4.0 * x).collect::<Vec<f32>>());
    let args = PagedAttentionArgs {
        q,
        k_cache: k,
        v_cache: v,
        block_table: table,
        query_start_loc: qsl,
        seq_lens: &seq_lens,
        rows: &rows,
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: bs,
        scale: 1.0 / (d as f32).sqrt(),
        window: c.window,
        sinks: sinks.as_deref(),
        batch_invariant: false,
        num_threads: c.threads,
    };
    let expected = reference(&args, num_tokens);
    // Every set of vector loops this CPU has, not only the widest; the
    // queries that share blocks taken together, then each as it is alone.
    for loops in Loops::supported() {
        // (the tiles' loops are the AVX-512 ones where the tiles do not fit,
        // and under `batch_invariant`)
        #[cfg(target_arch = "x86_64")]
        if loops == Loops::Amx {
            if amx::fits(&args) {
                tiles_match_bfloat16_reference(&args, num_tokens);
            }
            continue;
        }
        let mut out = vec![0.0; q.len()];
        paged_attention_on(&args, &mut out, loops).unwrap();
        for (i, (a, b)) in out.iter().zip(&expected).enumerate() {
            assert!(
                (a - b).abs() < 1e-5,
                "{loops:?}, together, element {i}: {a} vs {b}"
            );
        }
        let args = PagedAttentionArgs {
            batch_invariant: true,
            ..args
        };
        paged_attention_on(&args, &mut out, loops).unwrap();
        for (i, (a, b)) in out.iter().zip(&expected).enumerate() {
            assert!((a - b).abs() < 1e-5, "{loops:?}, element {i}: {a} vs {b}");
        }
        // Each query token alone (a row of one query over the same keys)
        // gives the same bits as among the call's other queries: its row's
        // and, in the same tiles, those of rows that share its blocks.
        let width = table.len() / c.rows.len();
        for (r, &(q_len, seq_len)) in c.rows.iter().enumerate() {
            for i in 0..q_len {
                let t = qsl[r] as usize + i;
                let token = &q[t * h * d..(t + 1) * h * d];
                let alone_len = [(seq_len - q_len + i + 1) as i32];
                let alone = PagedAttentionArgs {
                    q: token,
                    block_table: &table[r * width..(r + 1) * width],
                    query_start_loc: &[0, 1],
                    seq_lens: &alone_len,
                    rows: &[0],
                    num_threads: 1,
                    ..args
                };
                let mut one = vec![0.0; h * d];
                paged_attention_on(&alone, &mut one, loops).unwrap();
                let within = &out[t * h * d..(t + 1) * h * d];
                assert!(
                    one.iter()
                        .zip(within)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{loops:?}: row {r} query {i} alone differs from its row's call"
                );
            }
        }
    }
}

/// `x` rounded to bfloat16 (nearest even), as a float.
#[cfg(target_arch = "x86_64")]
fn bf16_value(x: f32) -> f32 {
    f32::from_bits((x.to_bits() + 0x7fff + ((x.to_bits() >> 16) & 1)) & 0xffff_0000)
}

/// The AMX tiles' attention (`Loops::Amx`) against the plain reference on
/// the values they compute with: queries times the scale, keys and values
/// rounded to bfloat16. What is left is the probabilities' rounding to
/// bfloat16 in the weighted sum (each within 2^-9 of its value relatively;
/// their sum is taken before the rounding) and their exponential's
/// polynomial (4e-5): the result within about 2^-8 (values in [-1, 1];
/// measured up to 1.3e-3).
#[cfg(target_arch = "x86_64")]
fn tiles_match_bfloat16_reference<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    num_tokens: usize,
) {
    let round = |x: &[T]| {
        x.iter()
            .map(|v| bf16_value(v.to_f32()))
            .collect::<Vec<f32>>()
    };
    let q: Vec<f32> = args.q.iter().map(|&x| bf16_value(x * args.scale)).collect();
    let (k, v) = (round(args.k_cache), round(args.v_cache));
    let rounded = PagedAttentionArgs {
        q: &q,
        k_cache: &k,
        v_cache: &v,
        block_table: args.block_table,
        query_start_loc: args.query_start_loc,
        seq_lens: args.seq_lens,
        rows: args.rows,
        num_heads: args.num_heads,
        num_kv_heads: args.num_kv_heads,
        head_dim: args.head_dim,
        block_size: args.block_size,
        scale: 1.0,
        window: args.window,
        sinks: args.sinks,
        batch_invariant: false,
        num_threads: args.num_threads,
    };
    let expected = reference(&rounded, num_tokens);
    let mut out = vec![0.0; args.q.len()];
    paged_attention_on(args, &mut out, Loops::Amx).unwrap();
    for (i, (a, b)) in out.iter().zip(&expected).enumerate() {
        assert!((a - b).abs() < 4e-3, "Amx, element {i}: {a} vs {b}");
    }
}

/// The tiles take a prompt's tile and prompt ends behind a shared prefix,
/// not decode rows (behind a shared prefix or over blocks of their own),
/// nor a float32 cache or a `batch_invariant` call.
#[cfg(target_arch = "x86_64")]
#[test]
fn tiles_take_tiles_whose_lanes_share_their_keys() {
    // (rows, queries a row, tokens a row, leading blocks shared)
    let case = |rows: usize, q: usize, seq: usize, shared: usize| {
        let width = seq.div_ceil(16);
        let mut table = Vec::new();
        for r in 0..rows {
            table.extend((0..width).map(|j| if j < shared { j } else { shared + r * width + j } as i32));
        }
        let qsl: Vec<i32> = (0..=rows).map(|r| (r * q) as i32).collect();
        (
            table,
            qsl,
            vec![seq as i32; rows],
            (rows * width + shared) * 16 * 3 * 64,
        )
    };
    for (rows, q, seq, shared, half, invariant, want) in [
        (1, 16, 1012, 0, true, false, true), // a prompt's tile of 16 queries
        (16, 1, 1001, 62, true, false, false), // decode behind a shared prefix
        (16, 1, 829, 44, true, false, false), // 124 tokens of their own each
        (2, 8, 1009, 62, true, false, true), // two rows' prompt ends behind a prefix
        (1, 16, 1012, 0, false, false, false), // a float32 cache
        (1, 16, 1012, 0, true, true, false), // batch_invariant
    ] {
        let (table, qsl, seq_lens, cache) = case(rows, q, seq, shared);
        let rows_all: Vec<i32> = (0..rows as i32).collect();
        let qs = vec![0.0f32; rows * q * 9 * 64];
        let (k16, k32) = (vec![F16::from_f32(0.0); cache], vec![0.0f32; cache]);
        macro_rules! decide {
            ($k:expr) => {{
                let args = PagedAttentionArgs {
                    q: &qs,
                    k_cache: $k,
                    v_cache: $k,
                    block_table: &table,
                    query_start_loc: &qsl,
                    seq_lens: &seq_lens,
                    rows: &rows_all,
                    num_heads: 9,
                    num_kv_heads: 3,
                    head_dim: 64,
                    block_size: 16,
                    scale: 0.125,
                    window: 0,
                    sinks: None,
                    batch_invariant: invariant,
                    num_threads: 1,
                };
                let all: Vec<usize> = (0..rows).collect();
                let queries = tile_queries(&args, &tiles(&args, &all)[..16]);
                amx::fits(&args) && amx::takes(&args, &queries)
            }};
        }
        let got = if half { decide!(&k16) } else { decide!(&k32) };
        if amx::supported() {
            assert_eq!(
                got, want,
                "rows {rows}, q {q}, seq {seq}, shared {shared}, half {half}"
            );
        } else {
            assert!(!got);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn matches_reference(c in case(), seed in any::<u64>(), half in any::<bool>()) {
        run_case(&c, seed, half);
    }
}

#[test]
fn out_of_range_blocks_are_rejected() {
    let q = vec![0.0; 4];
    let kv = vec![0.0; 4 * 2];
    let mut out = vec![0.0; 4];
    let args = PagedAttentionArgs {
        q: &q,
        k_cache: &kv,
        v_cache: &kv,
        block_table: &[5],
        query_start_loc: &[0, 1],
        seq_lens: &[1],
        rows: &[0],
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 4,
        block_size: 2,
        scale: 1.0,
        window: 0,
        sinks: None,
        batch_invariant: false,
        num_threads: 1,
    };
    assert!(paged_attention(&args, &mut out).is_err());
    let args = PagedAttentionArgs {
        seq_lens: &[3],
        block_table: &[0],
        ..args
    };
    assert!(
        paged_attention(&args, &mut out).is_err(),
        "seq_len past the table"
    );
}

#[test]
fn fast_exp_is_accurate() {
    let mut x = -90.0f32;
    while x <= 0.0 {
        let (got, want) = (fast_exp(x), x.exp());
        // Below -87 the result is clamped to about 1.6e-38: zero for a softmax.
        // x log2(e) is rounded to f32: the relative error grows with |x|.
        let tolerance = if x > -10.0 {
            1e-6 * want
        } else {
            1e-5 * want + 1e-37
        };
        assert!((got - want).abs() <= tolerance, "exp({x}): {got} vs {want}");
        x += 0.013;
    }
    assert_eq!(fast_exp(f32::NEG_INFINITY), fast_exp(-87.0));
}

/// The vector loops that take the query heads of a KV head together (AVX2:
/// threes and twos; AVX-512: up to four, the queries in registers or read
/// from memory for the larger heads; the values a few registers of a head
/// at a time) give each head the bits of its own loops, for every group
/// size up to eight, the head sizes they cover (and one they do not), and
/// key counts around the four-key chains.
#[cfg(target_arch = "x86_64")]
#[test]
fn grouped_heads_equal_head_by_head() {
    if crate::isa::avx2() {
        // SAFETY: the CPU has the features.
        unsafe { grouped_heads_on_avx2::<f32>() };
        unsafe { grouped_heads_on_avx2::<crate::kv_element::F16>() };
    }
    if crate::isa::avx512() {
        // SAFETY: the CPU has the features.
        unsafe { grouped_heads_on_avx512::<f32>() };
        unsafe { grouped_heads_on_avx512::<crate::kv_element::F16>() };
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn grouped_heads_on_avx2<T: KvElement>() {
    grouped_equal_by_head::<super::avx2::Avx2, T>(&[32, 64, 96, 128, 48]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn grouped_heads_on_avx512<T: KvElement>() {
    grouped_equal_by_head::<super::avx512::Avx512, T>(&[16, 32, 64, 80, 96, 128, 256, 48]);
}

#[inline(always)]
fn grouped_equal_by_head<V: VectorOps, T: KvElement>(dims: &[usize]) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for &d in dims {
        for heads in 1..=8 {
            for n in [1, 3, 4, 7, 16, 17] {
                let (stride, bs, base) = (2 * d, n + 3, d / 2);
                let q = values(heads * d, (d + heads + n) as u64);
                let cache = |seed| -> Vec<T> {
                    values(base + n * stride, seed)
                        .iter()
                        .map(|&x| T::from_f32(x))
                        .collect()
                };
                let (keys, vals) = (cache(3), cache(5));
                let shape = (d, bs, n);
                let (mut grouped, mut alone) = (vec![0.0; heads * bs], vec![0.0; heads * bs]);
                let (mut max_g, mut max_a) = (vec![0.0; heads], vec![0.0; heads]);
                V::scores_group(
                    &q,
                    &keys,
                    base,
                    stride,
                    0.3,
                    &mut grouped,
                    shape,
                    &mut max_g,
                );
                scores_by_head::<V, T>(&q, &keys, base, stride, 0.3, &mut alone, shape, &mut max_a);
                let case = format!("d={d} heads={heads} n={n}");
                assert_eq!(bits(&grouped), bits(&alone), "scores {case}");
                assert_eq!(bits(&max_g), bits(&max_a), "maxes {case}");
                // the scores as probabilities; each head's accumulator and
                // correction its own
                let probs: Vec<f32> = grouped.iter().map(|s| s.abs() * 0.1).collect();
                let corrections: Vec<f32> = (0..heads).map(|g| 0.5 + 0.1 * g as f32).collect();
                let start = values(heads * d, 11);
                let (mut acc_g, mut acc_a) = (start.clone(), start);
                V::accumulate_group(&mut acc_g, &corrections, &probs, &vals, base, stride, shape);
                accumulate_by_head::<V, T>(
                    &mut acc_a,
                    &corrections,
                    &probs,
                    &vals,
                    base,
                    stride,
                    shape,
                );
                assert_eq!(bits(&acc_g), bits(&acc_a), "accumulators {case}");
            }
        }
    }
}

/// The tile loops at sixteen lanes a vector (AVX-512) give every query the
/// bits of the eight-lane ones (AVX2), where every block a query reads goes
/// through them (fresh prompts and chunks whose tiles share all their
/// blocks), for groups of 1, 3, 4 and 8 query heads a KV head, head sizes
/// with and without a remainder, blocks smaller and larger than a tile,
/// and both caches.
#[cfg(target_arch = "x86_64")]
#[test]
fn tile_loops_agree_across_widths() {
    if !crate::isa::avx512() {
        return;
    }
    // (heads, KV heads, head size, block size, queries, cached, threads)
    let cases: [(usize, usize, usize, usize, usize, usize, usize); 6] = [
        (9, 3, 64, 16, 64, 0, 1),
        (9, 3, 64, 16, 48, 32, 2),
        (8, 8, 80, 4, 32, 16, 3),
        (32, 8, 13, 32, 48, 0, 2),
        (8, 1, 128, 16, 32, 64, 1),
        (4, 4, 64, 32, 64, 0, 2),
    ];
    for (h, hkv, d, bs, q_len, ctx, threads) in cases {
        let seq = ctx + q_len;
        let blocks = seq.div_ceil(bs);
        let table: Vec<i32> = (0..blocks as i32).rev().collect();
        let seed = (h + d + bs + q_len) as u64;
        let q = values(q_len * h * d, seed);
        let k = values(blocks * bs * hkv * d, seed + 1);
        let v = values(blocks * bs * hkv * d, seed + 2);
        let half = |x: &[f32]| x.iter().map(|&x| F16::from_f32(x)).collect::<Vec<_>>();
        let case = format!("heads {h}/{hkv}, d {d}, bs {bs}, q {q_len}, ctx {ctx}");
        let (qsl, seq_lens) = ([0, q_len as i32], [seq as i32]);
        let shape = (
            &q[..],
            &table[..],
            &qsl[..],
            &seq_lens[..],
            (h, hkv, d, bs),
            threads,
        );
        widths_agree(shape, &k, &v, &case);
        widths_agree(shape, &half(&k), &half(&v), &format!("{case}, float16"));
    }
}

type Shape<'a> = (
    &'a [f32],
    &'a [i32],
    &'a [i32],
    &'a [i32],
    (usize, usize, usize, usize),
    usize,
);

#[cfg(target_arch = "x86_64")]
fn widths_agree<T: KvElement>(shape: Shape<'_>, k: &[T], v: &[T], case: &str) {
    let (q, table, qsl, seq_lens, (h, hkv, d, bs), threads) = shape;
    let args = PagedAttentionArgs {
        q,
        k_cache: k,
        v_cache: v,
        block_table: table,
        query_start_loc: qsl,
        seq_lens,
        rows: &[0],
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: bs,
        scale: 1.0 / (d as f32).sqrt(),
        window: 0,
        sinks: None,
        batch_invariant: false,
        num_threads: threads,
    };
    let (mut narrow, mut wide) = (vec![0.0; q.len()], vec![0.0; q.len()]);
    paged_attention_on(&args, &mut narrow, Loops::Avx2).unwrap();
    paged_attention_on(&args, &mut wide, Loops::Avx512).unwrap();
    for (i, (a, b)) in narrow.iter().zip(&wide).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{case}: element {i}: {a} vs {b}");
    }
}
