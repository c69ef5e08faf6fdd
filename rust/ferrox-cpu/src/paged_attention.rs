//! Attention of a step's queries over the paged KV cache, in float32, reading
//! every cached key and value once per tile of queries (up to eight query
//! tokens, sixteen with AVX-512, of one request, or of requests whose block
//! tables share the block: a shared prefix is read once for several
//! requests). On a CPU with AMX, a tile of a prompt's queries over a
//! float16 cache is computed in bfloat16 on the tiles instead
//! (`paged_attention_amx`).
//!
//! ```text
//!  row r:  | cached context ........ | this step's queries (q_len) |
//!          <---------------- seq_len[r] -------------------------->
//!  query i of row r sees keys [0, seq_len - q_len + i]
//!  (with a sliding window w: only the last w of them)
//! ```
//!
//! Keys are visited a block at a time with an online softmax (running max and
//! sum), so no score matrix is materialised. The query heads that share a KV
//! head (grouped-query attention) are served together. The cache holds
//! float32 or float16 (`KvElement`); queries and outputs are float32.

use std::fmt;
use std::ops::Range;
use std::sync::OnceLock;

use crate::kv_element::KvElement;
use crate::pool::run_parts;
use crate::quant_matmul::OutPtr;

/// Shapes and data of one call. Layouts are row-major:
/// `q`, `out`: [T, H, D]; caches: [N, BS, Hkv, D]; `block_table`: [B, W].
pub struct PagedAttentionArgs<'a, T: KvElement = f32> {
    pub q: &'a [f32],
    pub k_cache: &'a [T],
    pub v_cache: &'a [T],
    pub block_table: &'a [i32],
    pub query_start_loc: &'a [i32],
    pub seq_lens: &'a [i32],
    /// The rows (requests) to compute; others are left untouched in `out`.
    pub rows: &'a [i32],
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
    /// A query sees only the last `window` keys up to itself (0: all).
    /// Keys before the window are never read, so their blocks may be gone
    /// (their table entries point anywhere inside the cache).
    pub window: usize,
    /// Attention sinks (gpt-oss): per query head, a logit that joins each
    /// softmax's denominator with no value of its own. None: no sinks.
    pub sinks: Option<&'a [f32]>,
    /// Every query computed in the order it has alone (the per-query loops):
    /// its result is the same bits whatever else the call holds. Otherwise
    /// the queries of a tile that read one block take it together (the
    /// tile loops, `paged_attention_tile`), rounded differently.
    pub batch_invariant: bool,
    pub num_threads: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "paged attention: {}", self.0)
    }
}

impl std::error::Error for ShapeError {}

macro_rules! check {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(ShapeError(format!($($arg)+)));
        }
    };
}

impl<T: KvElement> PagedAttentionArgs<'_, T> {
    fn num_blocks(&self) -> usize {
        self.k_cache.len() / (self.block_size * self.num_kv_heads * self.head_dim)
    }

    /// Every index the kernel will follow stays inside its slice.
    fn validate(&self, out_len: usize) -> Result<(), ShapeError> {
        let (h, hkv, d, bs) = (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        );
        check!(h > 0 && hkv > 0 && d > 0 && bs > 0, "empty dimensions");
        check!(
            h % hkv == 0,
            "{h} heads are not a multiple of {hkv} KV heads"
        );
        check!(self.q.len().is_multiple_of(h * d), "q is not [T, {h}, {d}]");
        check!(out_len == self.q.len(), "out and q differ in size");
        check!(
            self.sinks.is_none_or(|s| s.len() == h),
            "sinks must have one entry per query head ({h})"
        );
        check!(
            self.k_cache.len() == self.v_cache.len()
                && self.k_cache.len().is_multiple_of(bs * hkv * d),
            "caches are not [N, {bs}, {hkv}, {d}]"
        );
        let num_tokens = self.q.len() / (h * d);
        let num_reqs = self.seq_lens.len();
        check!(
            self.query_start_loc.len() == num_reqs + 1,
            "query_start_loc must have B + 1 entries"
        );
        check!(
            num_reqs == 0 || self.block_table.len().is_multiple_of(num_reqs),
            "block_table is not [B, W]"
        );
        let width = self.block_table.len().checked_div(num_reqs).unwrap_or(0);
        let num_blocks = self.num_blocks() as i64;
        for &row in self.rows {
            check!(
                row >= 0 && (row as usize) < num_reqs,
                "row {row} out of range"
            );
            let r = row as usize;
            let (qs, qe) = (self.query_start_loc[r], self.query_start_loc[r + 1]);
            let seq_len = self.seq_lens[r];
            check!(
                0 <= qs && qs <= qe && qe as usize <= num_tokens,
                "row {r}: bad query range"
            );
            check!(
                seq_len >= qe - qs && (seq_len as usize) <= width * bs,
                "row {r}: seq_len {seq_len} does not fit its queries or block table"
            );
            let used = (seq_len as usize).div_ceil(bs);
            for &b in &self.block_table[r * width..r * width + used] {
                check!(
                    0 <= b && (b as i64) < num_blocks,
                    "row {r}: block {b} is outside the cache"
                );
            }
        }
        Ok(())
    }
}

/// Computes `out[t]` for the tokens of `args.rows`.
pub fn paged_attention<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    paged_attention_on(args, out, Loops::best())
}

/// `paged_attention` on the widest vector loops this CPU has at or below
/// `isa` (the kernel bench compares them in one process).
pub fn paged_attention_with_isa<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    out: &mut [f32],
    isa: crate::isa::Isa,
) -> Result<(), ShapeError> {
    let level = |loops: &Loops| match loops {
        Loops::Portable => crate::isa::Isa::Portable,
        #[cfg(target_arch = "x86_64")]
        Loops::Avx2 => crate::isa::Isa::Avx2,
        #[cfg(target_arch = "x86_64")]
        Loops::Avx512 => crate::isa::Isa::Avx512,
        #[cfg(target_arch = "x86_64")]
        Loops::Amx => crate::isa::Isa::Amx,
    };
    let loops = Loops::supported()
        .into_iter()
        .rfind(|l| level(l) <= isa)
        .unwrap_or(Loops::Portable);
    paged_attention_on(args, out, loops)
}

/// The vector loops a call runs: the widest the CPU has, or (tests, the
/// kernel bench) a narrower one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loops {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// The AVX-512 loops, and the AMX tiles for the tiles they take
    /// (`paged_attention_amx`).
    #[cfg(target_arch = "x86_64")]
    Amx,
}

impl Loops {
    /// Those this CPU runs, narrowest first.
    fn supported() -> Vec<Loops> {
        #[allow(unused_mut)]
        let mut all = vec![Loops::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if crate::isa::avx2() {
                all.push(Loops::Avx2);
                if avx512::supported() {
                    all.push(Loops::Avx512);
                    if amx::supported() {
                        all.push(Loops::Amx);
                    }
                }
            }
        }
        all
    }

    /// The widest, found once (every call asks).
    fn best() -> Loops {
        static BEST: OnceLock<Loops> = OnceLock::new();
        *BEST.get_or_init(|| *Self::supported().last().expect("the portable loops"))
    }
}

fn paged_attention_on<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    out: &mut [f32],
    loops: Loops,
) -> Result<(), ShapeError> {
    args.validate(out.len())?;
    let mut rows: Vec<usize> = args.rows.iter().map(|&r| r as usize).collect();
    rows.sort_unstable();
    rows.dedup();
    let cost = |r: usize| {
        let q_len = (args.query_start_loc[r + 1] - args.query_start_loc[r]) as usize;
        (q_len * args.seq_lens[r] as usize).max(1)
    };
    // Contiguous runs of rows of about equal cost, one per thread.
    let parts = args.num_threads.clamp(1, rows.len().max(1));
    let total: usize = rows.iter().map(|&r| cost(r)).sum();
    let share = total.div_ceil(parts);
    let mut runs: Vec<Vec<usize>> = vec![Vec::new()];
    let mut acc = 0;
    for &r in &rows {
        if acc >= share * runs.len() && runs.len() < parts {
            runs.push(Vec::new());
        }
        acc += cost(r);
        runs.last_mut().expect("a run").push(r);
    }
    // With fewer runs than threads (a decode step of one or a few rows, a
    // prefill chunk), each run's tiles are split between threads (every
    // `tile_parts`-th tile: later ones see more keys), and where a run has
    // too few its KV heads: a query's result does not depend on which
    // thread computes it.
    let runs: Vec<Vec<usize>> = runs.into_iter().filter(|r| !r.is_empty()).collect();
    let spare = (args.num_threads / runs.len().max(1)).max(1);
    let pieces: Vec<Piece<'_>> = runs
        .iter()
        .flat_map(|run| {
            let queries: usize = run
                .iter()
                .map(|&r| (args.query_start_loc[r + 1] - args.query_start_loc[r]) as usize)
                .sum();
            let size = loops.query_tile(queries, spare);
            let tile_parts = spare.min(queries.div_ceil(size)).max(1);
            let head_parts = (spare / tile_parts).clamp(1, args.num_kv_heads.max(1));
            (0..tile_parts).flat_map(move |t| {
                (0..head_parts).map(move |p| {
                    let heads = p * args.num_kv_heads / head_parts
                        ..(p + 1) * args.num_kv_heads / head_parts;
                    (run.as_slice(), heads, (t, tile_parts), size)
                })
            })
        })
        .collect();
    let token_width = args.num_heads * args.head_dim;
    let out = OutPtr(out.as_mut_ptr());
    run_parts(pieces.len(), &|part| {
        let (run, ref kv_heads, (tile_part, tile_parts), size) = pieces[part];
        let queries = tiles(args, run);
        let mut scratch = Scratch::new(args, queries.len().min(size));
        let mut emit = |t: usize, h: usize, v: &[f32]| {
            // SAFETY: `out` holds T * H * D floats (`validate`); each
            // (token, head) is written by the one piece whose run holds the
            // token's row, whose tiles its query and whose KV heads the head.
            unsafe {
                let at = out.get().add(t * token_width + h * args.head_dim);
                std::ptr::copy_nonoverlapping(v.as_ptr(), at, args.head_dim);
            }
        };
        #[cfg(target_arch = "x86_64")]
        let (tiles_fit, mut staged) = (
            loops == Loops::Amx && amx::fits(args),
            amx::Staged::default(),
        );
        let mine = queries.chunks(size).skip(tile_part).step_by(tile_parts);
        for tile in mine {
            let queries = tile_queries(args, tile);
            #[cfg(target_arch = "x86_64")]
            if tiles_fit {
                // SAFETY: `fits`; the arguments were validated.
                if unsafe {
                    amx::run_tile(args, &queries, kv_heads.clone(), &mut staged, &mut emit)
                } {
                    continue;
                }
            }
            run_tile(
                args,
                &queries,
                kv_heads.clone(),
                loops,
                &mut scratch,
                &mut emit,
            );
        }
    });
    Ok(())
}

/// Query tokens that visit their blocks together: a block is read (and a
/// float16 one widened) once for every query of the tile that reads it, the
/// queries of one row and those of rows whose tables share the block (a
/// shared prefix: an agent's fan-out, a common system prompt), while every
/// query still meets its keys in the same chunks and order as alone, so its
/// result is the same bits whatever the tile.
const QUERY_TILE: usize = 8;

/// The AVX-512 loops' tiles: sixteen query tokens, a whole number of their
/// vectors whatever the group of query heads a KV head serves (eight
/// queries of SmolLM2's groups of three fill 24 of 32 lanes), each block
/// widened once for twice the queries. The AVX2 loops measured no faster
/// with them on a fresh prompt, and keep eight.
const WIDE_QUERY_TILE: usize = 16;

impl Loops {
    /// The tile size for a run of `queries` query tokens that `threads`
    /// threads share: sixteen for the AVX-512 loops unless the run's tiles
    /// are split between threads and sixteen would leave too few to share
    /// the work evenly (a prompt of a few dozen tokens).
    fn query_tile(self, queries: usize, threads: usize) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Loops::Avx512 | Loops::Amx
                if threads == 1 || queries >= 4 * WIDE_QUERY_TILE * threads =>
            {
                WIDE_QUERY_TILE
            }
            _ => QUERY_TILE,
        }
    }
}

/// A thread's share of the call: a run of rows, its KV heads, which of the
/// run's tiles (every `parts`-th from `part`: `(part, parts)`), the tile
/// size.
type Piece<'a> = (&'a [usize], Range<usize>, (usize, usize), usize);

/// One query token: its row and its index among the row's queries.
type Query = (usize, usize);

/// A run's query tokens in tile order: rows sorted by their block tables
/// (rows that share leading blocks become neighbours, so their queries
/// share tiles), each row's queries in order.
fn tiles<T: KvElement>(args: &PagedAttentionArgs<'_, T>, run: &[usize]) -> Vec<Query> {
    let width = args.block_table.len() / args.seq_lens.len();
    let used = |r: usize| {
        let blocks = (args.seq_lens[r] as usize).div_ceil(args.block_size);
        &args.block_table[r * width..r * width + blocks]
    };
    let mut rows = run.to_vec();
    rows.sort_by(|&a, &b| used(a).cmp(used(b)).then(a.cmp(&b)));
    let q_len = |r: usize| (args.query_start_loc[r + 1] - args.query_start_loc[r]) as usize;
    rows.iter()
        .flat_map(|&r| (0..q_len(r)).map(move |i| (r, i)))
        .collect()
}

/// One query token's online-softmax state, per head.
struct QueryState {
    acc: Vec<f32>, // [H, D]
    max: Vec<f32>, // [H]
    sum: Vec<f32>, // [H]
    /// This block's largest score and the running sums' correction.
    block_max: Vec<f32>,
    correction: Vec<f32>,
}

struct Scratch {
    scores: Vec<f32>, // [H, BS]
    states: Vec<QueryState>,
    /// A float16 cache's block widened once for every query head (and
    /// query token) that reads it: [BS, Hkv, D] keys, then values (sized
    /// when a block is first widened: a float32 cache, or a decode's one
    /// query read by the vector loops, never needs them).
    keys: Vec<f32>,
    values: Vec<f32>,
    /// The blocks the tile's queries take together (`tile`).
    tile: TileState,
}

impl Scratch {
    /// Scratch for tiles of up to `queries` query tokens.
    fn new<T: KvElement>(args: &PagedAttentionArgs<'_, T>, queries: usize) -> Self {
        let h = args.num_heads;
        let state = || QueryState {
            acc: vec![0.0; h * args.head_dim],
            max: vec![0.0; h],
            sum: vec![0.0; h],
            block_max: vec![0.0; h],
            correction: vec![0.0; h],
        };
        Self {
            scores: vec![0.0; h * args.block_size],
            states: (0..queries).map(|_| state()).collect(),
            keys: Vec::new(),
            values: Vec::new(),
            tile: TileState::default(),
        }
    }
}

fn run_tile<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    tile: &[TileQuery<'_>],
    kv_heads: Range<usize>,
    loops: Loops,
    scratch: &mut Scratch,
    emit: &mut dyn FnMut(usize, usize, &[f32]),
) {
    // SAFETY: `loops` is one of `Loops::supported()`: the CPU has the
    // features each function is built for.
    match loops {
        Loops::Portable => run_tile_impl::<Portable, T>(args, tile, kv_heads, scratch, emit),
        #[cfg(target_arch = "x86_64")]
        Loops::Avx2 => unsafe { run_tile_avx2(args, tile, kv_heads, scratch, emit) },
        #[cfg(target_arch = "x86_64")]
        Loops::Avx512 | Loops::Amx => unsafe {
            run_tile_avx512(args, tile, kv_heads, scratch, emit)
        },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_tile_avx2<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    tile: &[TileQuery<'_>],
    kv_heads: Range<usize>,
    scratch: &mut Scratch,
    emit: &mut dyn FnMut(usize, usize, &[f32]),
) {
    run_tile_impl::<avx2::Avx2, T>(args, tile, kv_heads, scratch, emit)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn run_tile_avx512<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    tile: &[TileQuery<'_>],
    kv_heads: Range<usize>,
    scratch: &mut Scratch,
    emit: &mut dyn FnMut(usize, usize, &[f32]),
) {
    run_tile_impl::<avx512::Avx512, T>(args, tile, kv_heads, scratch, emit)
}

/// The vector loops of the kernel over one block of keys: a portable
/// version the compiler may vectorise, an AVX2/FMA one and an AVX-512 one.
trait VectorOps: Sized {
    /// scores[j] = scale * q . k_j for the block's keys (k_j at `base + j *
    /// stride`); returns the largest score.
    fn scores<T: KvElement>(
        q: &[f32],
        keys: &[T],
        base: usize,
        stride: usize,
        scale: f32,
        scores: &mut [f32],
    ) -> f32;
    /// acc = acc * correction + sum_j probs[j] * v_j
    fn accumulate<T: KvElement>(
        acc: &mut [f32],
        correction: f32,
        probs: &[f32],
        values: &[T],
        base: usize,
        stride: usize,
    );
    /// dst = src as float32.
    fn widen<T: KvElement>(src: &[T], dst: &mut [f32]);

    /// Whether `scores` and `accumulate` have vector loops for heads of `d`
    /// floats (the others fall back to plain code, which widens float16
    /// elements one at a time: such blocks are widened before they are read).
    fn has_loop(_d: usize) -> bool {
        false
    }

    /// Lanes a vector of the tile loops holds (a tile's (query, head) pairs
    /// of one KV head are rounded up to a whole number of them), or 0: no
    /// tile loops. With them, the queries of a tile that read one block
    /// take it together (unless `batch_invariant`).
    const TILE_WIDTH: usize = 0;

    /// `tile::block`: keys `range.0..range.0 + range.1` of a float32 block
    /// (rows `stride` apart from `at`) for the lanes of `vectors` of the
    /// tile's KV head `local`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn tile_block(
        tile: &mut TileState,
        local: usize,
        keys: &[f32],
        values: &[f32],
        at: usize,
        stride: usize,
        range: (usize, usize),
        vectors: Range<usize>,
    ) {
        // SAFETY: the loops with a tile width (AVX2 at eight lanes, AVX-512
        // at sixteen) run inside `run_tile_avx2` / `run_tile_avx512`, where
        // their features are enabled; the caller passes a tile started
        // with TILE_WIDTH lanes a vector, its lanes, and rows inside the
        // block.
        #[cfg(target_arch = "x86_64")]
        match Self::TILE_WIDTH {
            16 => unsafe {
                return tile::block::<tile::Lanes16>(
                    tile, local, keys, values, at, stride, range, vectors,
                );
            },
            8 => unsafe {
                return tile::block::<tile::Lanes8>(
                    tile, local, keys, values, at, stride, range, vectors,
                );
            },
            _ => {}
        }
        let _ = (tile, local, keys, values, at, stride, range, vectors);
        unreachable!("these vector loops have no tile loops")
    }

    /// `scores` for the query heads that share one KV head (`maxes.len()`
    /// of them, queries `d` apart in `q`, scores `bs` apart in `scores`, `n`
    /// keys), each head's largest score into `maxes`. Vector loops may read
    /// each key once for all of them.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn scores_group<T: KvElement>(
        q: &[f32],
        keys: &[T],
        base: usize,
        stride: usize,
        scale: f32,
        scores: &mut [f32],
        shape: (usize, usize, usize),
        maxes: &mut [f32],
    ) {
        scores_by_head::<Self, T>(q, keys, base, stride, scale, scores, shape, maxes)
    }

    /// `accumulate` for the query heads that share one KV head (one
    /// correction each, accumulators `d` apart, probabilities `bs` apart).
    #[inline(always)]
    fn accumulate_group<T: KvElement>(
        acc: &mut [f32],
        corrections: &[f32],
        probs: &[f32],
        values: &[T],
        base: usize,
        stride: usize,
        shape: (usize, usize, usize),
    ) {
        accumulate_by_head::<Self, T>(acc, corrections, probs, values, base, stride, shape)
    }
}

/// `VectorOps::scores_group` one head at a time.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scores_by_head<V: VectorOps, T: KvElement>(
    q: &[f32],
    keys: &[T],
    base: usize,
    stride: usize,
    scale: f32,
    scores: &mut [f32],
    (d, bs, n): (usize, usize, usize),
    maxes: &mut [f32],
) {
    for (g, max) in maxes.iter_mut().enumerate() {
        let q = &q[g * d..(g + 1) * d];
        *max = V::scores(
            q,
            keys,
            base,
            stride,
            scale,
            &mut scores[g * bs..g * bs + n],
        );
    }
}

/// `VectorOps::accumulate_group` one head at a time.
#[inline(always)]
fn accumulate_by_head<V: VectorOps, T: KvElement>(
    acc: &mut [f32],
    corrections: &[f32],
    probs: &[f32],
    values: &[T],
    base: usize,
    stride: usize,
    (d, bs, n): (usize, usize, usize),
) {
    for (g, &c) in corrections.iter().enumerate() {
        let probs = &probs[g * bs..g * bs + n];
        V::accumulate(&mut acc[g * d..(g + 1) * d], c, probs, values, base, stride);
    }
}

struct Portable;

impl VectorOps for Portable {
    #[inline(always)]
    fn scores<T: KvElement>(
        q: &[f32],
        keys: &[T],
        base: usize,
        stride: usize,
        scale: f32,
        scores: &mut [f32],
    ) -> f32 {
        let d = q.len();
        let mut max = f32::NEG_INFINITY;
        for (j, score) in scores.iter_mut().enumerate() {
            let k = &keys[base + j * stride..][..d];
            let mut acc = [0.0f32; 8];
            let (cq, ck) = (q.chunks_exact(8), k.chunks_exact(8));
            let tail: f32 = cq
                .remainder()
                .iter()
                .zip(ck.remainder())
                .map(|(x, y)| x * y.to_f32())
                .sum();
            for (x, y) in cq.zip(ck) {
                for l in 0..8 {
                    acc[l] += x[l] * y[l].to_f32();
                }
            }
            *score = (acc.iter().sum::<f32>() + tail) * scale;
            max = max.max(*score);
        }
        max
    }

    #[inline(always)]
    fn accumulate<T: KvElement>(
        acc: &mut [f32],
        correction: f32,
        probs: &[f32],
        values: &[T],
        base: usize,
        stride: usize,
    ) {
        let d = acc.len();
        if correction != 1.0 {
            acc.iter_mut().for_each(|a| *a *= correction);
        }
        for (j, &p) in probs.iter().enumerate() {
            let v = &values[base + j * stride..][..d];
            for (a, x) in acc.iter_mut().zip(v) {
                *a += p * x.to_f32();
            }
        }
    }

    #[inline(always)]
    fn widen<T: KvElement>(src: &[T], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[path = "paged_attention_avx2.rs"]
pub(crate) mod avx2;

#[cfg(target_arch = "x86_64")]
#[path = "paged_attention_avx512.rs"]
mod avx512;

#[cfg(target_arch = "x86_64")]
#[path = "paged_attention_amx.rs"]
mod amx;

#[path = "paged_attention_tile.rs"]
pub(crate) mod tile;
use tile::{attend_together, shares_a_block, TileState};

#[inline(always)]
fn sum(values: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// The Taylor coefficients of 2^f = e^(f ln 2), degree 6 down to 0
/// (Horner's order): `fast_exp`'s polynomial, and the tile loops'.
pub(crate) const EXP2_TAYLOR: [f32; 7] = [
    0.000_154_035_3,
    0.001_333_355_8,
    0.009_618_129,
    0.055_504_11,
    0.240_226_5,
    std::f32::consts::LN_2,
    1.0,
];

/// e^x for x <= 0 (a softmax weight), within about 2e-7 relative error:
/// 2^(x log2 e) split into 2^n (built in the exponent bits) times a degree-6
/// polynomial of 2^f with |f| <= 1/2. Written so the compiler vectorises it.
#[inline(always)]
fn fast_exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    let t = x.max(-87.0) * LOG2_E;
    let n = t.round();
    let f = t - n;
    let mut p = EXP2_TAYLOR[0];
    for c in &EXP2_TAYLOR[1..] {
        p = c + f * p;
    }
    // SAFETY: n lies in [-126, 0] after the clamp, so it fits an i32.
    let n = unsafe { n.to_int_unchecked::<i32>() };
    p * f32::from_bits(((n + 127) << 23) as u32)
}

/// One tile of query tokens, every head. Block positions are visited in
/// order; at each, every query whose keys reach into it takes its chunk from
/// its own row's block, all KV heads of a block together, so memory is read
/// sequentially; query heads sharing a KV head reuse its keys from cache, and
/// the tile's queries that read the same physical block read it once.
#[inline(always)]
fn run_tile_impl<V: VectorOps, T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    queries: &[TileQuery<'_>],
    kv_heads: Range<usize>,
    s: &mut Scratch,
    emit: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let (h, hkv, d, bs) = (
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        args.block_size,
    );
    let group = h / hkv;
    for state in &mut s.states[..queries.len()] {
        match args.sinks {
            // A sink is a key of score `sink` whose value is zero.
            Some(sinks) => {
                state.max.copy_from_slice(sinks);
                state.sum.fill(1.0);
            }
            None => {
                state.max.fill(f32::NEG_INFINITY);
                state.sum.fill(0.0);
            }
        }
        state.acc.fill(0.0);
    }
    let chunk = |query: &TileQuery<'_>, block: usize| chunk(query, block, bs);
    // Blocks several queries read taken together (the tile loops; their
    // state is set up at the first such block).
    let together = V::TILE_WIDTH > 0 && !args.batch_invariant && shares_a_block(queries, bs);
    s.tile.started = false;
    let first_block = queries.iter().map(|q| q.2 / bs).min().unwrap_or(0);
    let blocks = queries.iter().map(|q| q.3.div_ceil(bs)).max().unwrap_or(0);
    let token = hkv * d;
    for block in first_block..blocks {
        // The next block of each query's table is asked for just before
        // the query takes this one (once, where consecutive queries share
        // it), so the requests spread over the block's work instead of
        // queueing all at once behind the core's few outstanding misses.
        let mut asked = None;
        let mut ask_next = |&(_, table, _, end): &TileQuery<'_>| {
            // (a query that reads block + 1 has it in its table)
            if (block + 1) * bs < end && asked != Some(table[block + 1]) {
                prefetch_block(args, table[block + 1] as usize, &kv_heads);
                asked = Some(table[block + 1]);
            }
        };
        let served = match together {
            true => attend_together::<V, T>(args, queries, block, &kv_heads, s),
            false => 0,
        };
        // The float16 keys and values in `s.keys` / `s.values`: the
        // physical block and the offsets widened.
        let mut widened: Option<(i32, usize, usize)> = None;
        for (e, query) in queries.iter().enumerate() {
            ask_next(query);
            let Some((lo, hi)) = chunk(query, block) else {
                continue;
            };
            if served & (1 << e) != 0 {
                continue;
            }
            let (t, table, _, _) = *query;
            let physical = table[block];
            let at = physical as usize * bs * token;
            let mut from_widened =
                widened.is_some_and(|(p, a, b)| p == physical && a <= lo && hi <= b);
            if T::HALF && !from_widened {
                // Widened once for every later query of the tile that
                // reads this physical block; a block no other query of the
                // tile reads is read as float16 where it lies, by the
                // vector loops (a widened copy would cost a pass over it
                // and save nothing; the values are the same, so are the
                // results).
                let (mut a, mut b) = (lo, hi);
                let mut shared = false;
                for other in &queries[e + 1..] {
                    if let Some((olo, ohi)) = chunk(other, block) {
                        if other.1[block] == physical {
                            (a, b) = (a.min(olo), b.max(ohi));
                            shared = true;
                        }
                    }
                }
                if shared || !V::has_loop(d) {
                    widen_rows::<V, T>(args, at, a..b, s);
                    widened = Some((physical, a, b));
                    from_widened = true;
                }
            }
            let (n, offset) = (hi - lo, lo * token);
            let q_row = &args.q[t * h * d..(t + 1) * h * d];
            let state = &mut s.states[e];
            if from_widened {
                let (keys, values) = (&s.keys[..], &s.values[..]);
                attend_block::<V, f32>(
                    keys,
                    values,
                    offset,
                    n,
                    q_row,
                    kv_heads.clone(),
                    args,
                    &mut s.scores,
                    state,
                );
            } else {
                let (keys, values) = (args.k_cache, args.v_cache);
                attend_block::<V, T>(
                    keys,
                    values,
                    at + offset,
                    n,
                    q_row,
                    kv_heads.clone(),
                    args,
                    &mut s.scores,
                    state,
                );
            }
        }
    }
    for (e, (&(t, _, _, _), state)) in queries.iter().zip(&mut s.states).enumerate() {
        for head in kv_heads.start * group..kv_heads.end * group {
            let acc = &mut state.acc[head * d..(head + 1) * d];
            if s.tile.started {
                let (local, g) = (head / group - kv_heads.start, head % group);
                let (max, sum) = (&mut state.max[head], &mut state.sum[head]);
                s.tile.merge_into(local, e, g, max, sum, acc);
            }
            let inv = 1.0 / state.sum[head];
            acc.iter_mut().for_each(|a| *a *= inv);
            emit(t, head, acc);
        }
    }
}

/// A tile's query: its token, its row's block table, and the keys it sees,
/// [first, end).
type TileQuery<'a> = (usize, &'a [i32], usize, usize);

/// Per query of `tile`: its token, its row's table, and the keys it sees,
/// [first, end): up to itself, within the window if there is one.
fn tile_queries<'a, T: KvElement>(
    args: &PagedAttentionArgs<'a, T>,
    tile: &[Query],
) -> Vec<TileQuery<'a>> {
    let width = args.block_table.len() / args.seq_lens.len();
    tile.iter()
        .map(|&(row, i)| {
            let q_start = args.query_start_loc[row] as usize;
            let q_len = args.query_start_loc[row + 1] as usize - q_start;
            let end = args.seq_lens[row] as usize - q_len + i + 1;
            let first = match args.window {
                0 => 0,
                w => end.saturating_sub(w),
            };
            let table = &args.block_table[row * width..(row + 1) * width];
            (q_start + i, table, first, end)
        })
        .collect()
}

/// A query's chunk of block position `block`, as offsets in the block.
#[inline(always)]
fn chunk(&(_, _, first, end): &TileQuery<'_>, block: usize, bs: usize) -> Option<(usize, usize)> {
    let lo = (block * bs).max(first);
    let hi = ((block + 1) * bs).min(end);
    (lo < hi).then(|| (lo - block * bs, hi - block * bs))
}

/// Rows `rows` of the block at `at` widened into `s.keys` / `s.values`.
#[inline(always)]
fn widen_rows<V: VectorOps, T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    at: usize,
    rows: Range<usize>,
    s: &mut Scratch,
) {
    let token = args.num_kv_heads * args.head_dim;
    if s.keys.is_empty() {
        s.keys.resize(args.block_size * token, 0.0);
        s.values.resize(args.block_size * token, 0.0);
    }
    let span = rows.start * token..rows.end * token;
    V::widen(
        &args.k_cache[at + span.start..at + span.end],
        &mut s.keys[span.clone()],
    );
    V::widen(
        &args.v_cache[at + span.start..at + span.end],
        &mut s.values[span],
    );
}

/// Asks the second-level cache for the keys and values of `kv_heads` in
/// block `physical` (into the first level measured no better: its few
/// outstanding misses fill up). A block's rows of one KV head lie `Hkv * D`
/// elements apart and the next block anywhere in the pool, which the
/// hardware prefetcher does not follow: a decode step's attention otherwise
/// waits on memory at every key row. A hint only (nothing is read; an
/// address past the cache is never touched).
#[inline(always)]
fn prefetch_block<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    physical: usize,
    kv_heads: &Range<usize>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let (d, bs) = (args.head_dim, args.block_size);
        let token = args.num_kv_heads * d;
        let row_bytes = d * std::mem::size_of::<T>();
        for j in 0..bs {
            for head in kv_heads.clone() {
                let at = (physical * bs + j) * token + head * d;
                for cache in [args.k_cache, args.v_cache] {
                    let row = cache.as_ptr().wrapping_add(at) as *const i8;
                    for line in (0..row_bytes).step_by(64) {
                        // SAFETY: a prefetch never faults and reads nothing.
                        unsafe { _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(line)) };
                    }
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (args, physical, kv_heads);
}

/// One block of `n` keys (at `first` in `keys` / `values`, laid out
/// [BS, Hkv, D]) for the query heads of `kv_heads`: the online softmax's
/// update.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend_block<V: VectorOps, E: KvElement>(
    keys: &[E],
    values: &[E],
    first: usize,
    n: usize,
    q_row: &[f32],
    kv_heads: Range<usize>,
    args: &PagedAttentionArgs<'_, impl KvElement>,
    scores: &mut [f32],
    s: &mut QueryState,
) {
    let (hkv, d, bs) = (args.num_kv_heads, args.head_dim, args.block_size);
    let group = args.num_heads / hkv;
    for kv_head in kv_heads {
        let base = first + kv_head * d;
        let heads = kv_head * group..(kv_head + 1) * group;
        let scores = &mut scores[heads.start * bs..heads.end * bs];
        let q = &q_row[heads.start * d..heads.end * d];
        let block_max = &mut s.block_max[heads.clone()];
        V::scores_group(
            q,
            keys,
            base,
            hkv * d,
            args.scale,
            scores,
            (d, bs, n),
            block_max,
        );
        for (g, head) in heads.clone().enumerate() {
            let new_max = s.max[head].max(s.block_max[head]);
            let correction = fast_exp(s.max[head] - new_max);
            s.max[head] = new_max;
            let scores = &mut scores[g * bs..g * bs + n];
            for score in scores.iter_mut() {
                *score = fast_exp(*score - new_max);
            }
            s.sum[head] = s.sum[head] * correction + sum(scores);
            s.correction[head] = correction;
        }
        let acc = &mut s.acc[heads.start * d..heads.end * d];
        let corrections = &s.correction[heads];
        V::accumulate_group(acc, corrections, scores, values, base, hkv * d, (d, bs, n));
    }
}

#[cfg(test)]
#[path = "paged_attention_tests.rs"]
mod tests;
