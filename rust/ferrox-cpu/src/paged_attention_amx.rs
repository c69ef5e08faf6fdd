//! Attention of a tile of queries on AMX tiles (Intel Xeon from Sapphire
//! Rapids on), in bfloat16 with float32 sums: a prompt's queries, and
//! queries of several requests over their shared prefix.
//!
//! A tile's (query, head) pairs of one KV head are its *lanes*, sixteen to
//! a lane group (a tile's columns); its keys are taken sixteen at a time,
//! *units* (a tile's rows), each unit one physical block's keys at one
//! position of the queries' tables. Per lane group:
//!
//! ```text
//!  scores  S^T[16 keys, 16 lanes] = K[16 keys, D] . Q^T[D, 16 lanes]      (tdpbf16ps, D/32 steps)
//!  probs   P^T = exp(S^T - max), masked; max over every key a lane sees  (AVX-512, two passes)
//!  values  O^T[D, 16 lanes] += V^T[D, 16 keys] . P^T[16 keys, 16 lanes]   (tdpbf16ps, per unit)
//! ```
//!
//! With the keys as the tiles' rows and the lanes as their columns, a
//! lane's maximum and sum are vertical operations on whole vectors, and the
//! keys go into the tiles as the cache stores them (rows of D). The values
//! go transposed: each unit's V^T and its keys in bfloat16 are made once a
//! call per thread (`Staged`) and serve every tile that reads the block,
//! the queries of a long prompt as the requests of a shared prefix. The
//! maximum is found before any exponential (the scores of a lane group are
//! kept), so the value sums stay in the tiles with no rescaling.
//!
//! Numerics: queries (times the scale), keys, values and probabilities are
//! rounded to bfloat16 (8 significant bits), every product summed in
//! float32. A tile takes this path when the KV cache is float16 (the cache
//! of block-format models; a float32 cache keeps float32 attention), the
//! call is not `batch_invariant`, most of the lanes it would compute do
//! work (`MIN_BUSY`) and its rows have more than one query each
//! (`MIN_QUERIES_A_ROW`): decode steps stay on the vector loops. A query's
//! result then depends on whether its tile took this path.

use std::arch::asm;
use std::arch::x86_64::*;
use std::collections::HashMap;
use std::ops::Range;

use super::tile::{Lanes, Lanes16};
use super::{PagedAttentionArgs, TileQuery};
use crate::kv_element::KvElement;
use crate::quant_matmul_amx::{self, TileConfig};

/// Keys of a unit; lanes of a lane group.
const KEYS: usize = 16;
const LANES: usize = 16;

/// A tile takes the tiles when at least this share of the lanes it would
/// compute (a lane group's sixteen, for each unit any of them reads) do
/// work, and its rows have two queries each on average or more; by
/// `benches/paged_attention.rs` on SmolLM2's groups of three query heads: a
/// prompt's tile of sixteen queries keeps 48 of 48 lanes busy (2.0-2.5x the
/// AVX-512 loops), prompt ends of 9 queries behind a shared prefix about
/// as many (1.7-2.2x); 16 decode rows behind a shared prompt with 124
/// tokens of their own each 60 % (0.6x: a row's own blocks are staged for
/// three lanes each, and used once), and decode rows behind a shared prefix
/// with a block of their own 46 of 48 but 1.0-1.2x on one thread and about
/// 1.0x on two (a decode step stages the prefix's blocks for one use).
const MIN_BUSY: (usize, usize) = (3, 4);
/// Decode rows (one query each) keep the vector loops (see `MIN_BUSY`).
const MIN_QUERIES_A_ROW: usize = 2;

/// Whether a call's tiles may take this path: its shapes fit the tiles (a
/// head of a multiple of 32, blocks of a multiple of 16 keys), its cache is
/// float16, and the CPU has the tiles.
pub(super) fn fits<T: KvElement>(args: &PagedAttentionArgs<'_, T>) -> bool {
    T::HALF
        && !args.batch_invariant
        && args.head_dim.is_multiple_of(32)
        && args.block_size.is_multiple_of(KEYS)
        && quant_matmul_amx::supported()
}

/// Whether the CPU has the tiles (the loops a test or the kernel bench may
/// ask for).
pub(super) fn supported() -> bool {
    quant_matmul_amx::supported()
}

/// Sixteen keys of one physical block at one position of the tables.
struct Unit {
    /// The first key's position.
    pos: usize,
    /// The block and which sixteen of its keys.
    physical: i32,
    sub: usize,
    /// The block's keys the tile's queries read up to (its staged part).
    need: usize,
    /// Where its lane groups' masks start in `Staged::masks`.
    masks: usize,
}

/// A thread's state over one call: the blocks it has converted (per
/// physical block and KV head: each unit's keys [16, D] then values
/// transposed [D, 16], bfloat16) and a tile's buffers.
#[derive(Default)]
pub(super) struct Staged {
    /// (physical block, KV head) -> (offset in `data`, keys staged).
    index: HashMap<(i32, usize), (usize, usize)>,
    data: Vec<u16>,
    units: Vec<Unit>,
    /// Per unit, per lane group: the lanes that read the unit.
    masks: Vec<u16>,
    /// Per lane group: D/32 tiles of the queries as pairs [16, 16 lanes x 2].
    q: Vec<u16>,
    /// A lane group's scores, [unit][16 keys][16 lanes].
    s: Vec<f32>,
    /// Each lane group's probabilities as pairs, [group][unit][8][16 lanes x 2].
    p: Vec<u16>,
    /// A lane group's weighted values, [D][16 lanes].
    o: Vec<f32>,
    /// A lane's result, [D].
    out: Vec<f32>,
    /// A unit's keys or values as float32, [16, D] (staging).
    widened: Vec<f32>,
}

/// Runs the tile of `queries` for `kv_heads` and returns true, or returns
/// false (nothing computed) if too few of its lanes would work or its rows
/// are decode rows (`MIN_BUSY`, `MIN_QUERIES_A_ROW`).
///
/// # Safety
/// `fits(args)`; `args` validated; `queries` from `tile_queries`.
pub(super) unsafe fn run_tile<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    queries: &[TileQuery<'_>],
    kv_heads: Range<usize>,
    st: &mut Staged,
    emit: &mut dyn FnMut(usize, usize, &[f32]),
) -> bool {
    if !find_units(args, queries, st) {
        return false;
    }
    let (group, groups) = lane_groups(args, queries);
    let d = args.head_dim;
    st.s.resize(st.units.len() * KEYS * LANES, 0.0);
    st.p.resize(groups * st.units.len() * KEYS * LANES, 0);
    st.o.resize(d * LANES, 0.0);
    st.out.resize(d, 0.0);
    st.q.resize(groups * (d / 32) * KEYS * 2 * LANES, 0);
    for kv_head in kv_heads {
        stage_units(args, kv_head, st);
        queries_as_pairs(args, queries, kv_head, group, st);
        kv_head_of_tile(args, queries, kv_head, group, st, emit);
    }
    asm!("tilerelease", options(nostack, nomem));
    true
}

/// Whether `run_tile` would take this tile (`MIN_BUSY`).
#[cfg(test)]
pub(super) fn takes<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    queries: &[TileQuery<'_>],
) -> bool {
    find_units(args, queries, &mut Staged::default())
}

/// Query heads a KV head serves, and the tile's lane groups.
fn lane_groups<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    queries: &[TileQuery<'_>],
) -> (usize, usize) {
    let group = args.num_heads / args.num_kv_heads;
    (group, (queries.len() * group).div_ceil(LANES))
}

/// The tile's units in position order (and, at a position, by block) with
/// their lanes; false if the tile holds decode rows or its units would
/// leave too many lanes idle.
fn find_units<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    queries: &[TileQuery<'_>],
    st: &mut Staged,
) -> bool {
    let bs = args.block_size;
    let (group, groups) = lane_groups(args, queries);
    let mut rows: Vec<*const i32> = queries.iter().map(|q| q.1.as_ptr()).collect();
    rows.dedup();
    if queries.len() < MIN_QUERIES_A_ROW * rows.len() {
        return false;
    }
    st.units.clear();
    st.masks.clear();
    let first = queries.iter().map(|q| q.2).min().unwrap_or(0) / KEYS * KEYS;
    let end = queries.iter().map(|q| q.3).max().unwrap_or(0);
    let (mut busy, mut computed) = (0usize, 0usize);
    for pos in (first..end).step_by(KEYS) {
        let block = pos / bs;
        let at = st.units.len();
        for (e, &(_, table, lo, hi)) in queries.iter().enumerate() {
            if hi <= pos || pos + KEYS <= lo {
                continue;
            }
            let physical = table[block];
            let u = match st.units[at..].iter().position(|u| u.physical == physical) {
                Some(i) => at + i,
                None => {
                    st.units.push(Unit {
                        pos,
                        physical,
                        sub: (pos % bs) / KEYS,
                        need: 0,
                        masks: st.masks.len(),
                    });
                    st.masks.resize(st.masks.len() + groups, 0);
                    st.units.len() - 1
                }
            };
            let unit = &mut st.units[u];
            unit.need = unit.need.max((hi - block * bs).min(bs));
            for lane in e * group..(e + 1) * group {
                st.masks[unit.masks + lane / LANES] |= 1 << (lane % LANES);
            }
        }
        for unit in &st.units[at..] {
            for &m in &st.masks[unit.masks..unit.masks + groups] {
                busy += m.count_ones() as usize;
                computed += if m != 0 { LANES } else { 0 };
            }
        }
    }
    busy * MIN_BUSY.1 >= computed * MIN_BUSY.0
}

/// Every unit's block, for `kv_head`, in `st.data` (converted where this
/// thread has not yet, or has fewer of its keys than a unit needs).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,f16c")]
unsafe fn stage_units<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    kv_head: usize,
    st: &mut Staged,
) {
    let (d, bs) = (args.head_dim, args.block_size);
    let block_len = bs * 2 * d; // u16s of a block's units
    st.widened.resize(KEYS * d, 0.0);
    for u in 0..st.units.len() {
        let (physical, need) = (st.units[u].physical, st.units[u].need);
        let len = st.data.len();
        let entry = st.index.entry((physical, kv_head)).or_insert((len, 0));
        if entry.1 >= need {
            continue;
        }
        if entry.0 == len {
            st.data.resize(len + block_len, 0);
        }
        entry.1 = need;
        let at = entry.0;
        for sub in 0..bs / KEYS {
            let unit = &mut st.data[at + sub * 2 * KEYS * d..][..2 * KEYS * d];
            let (keys, values_t) = unit.split_at_mut(KEYS * d);
            let valid = need.saturating_sub(sub * KEYS).min(KEYS);
            let row = |r: usize| {
                (physical as usize * bs + sub * KEYS + r) * args.num_kv_heads * d + kv_head * d
            };
            widen(args.k_cache, valid, d, &row, &mut st.widened);
            for (dst, src) in keys.chunks_exact_mut(32).zip(st.widened.chunks_exact(32)) {
                bf16_32(src, dst);
            }
            widen(args.v_cache, valid, d, &row, &mut st.widened);
            // V^T[i][r] = v_r[i]: dim i's sixteen keys in one row
            let index = strides(d as i32);
            for i in 0..d {
                let column = _mm512_i32gather_ps::<4>(index, st.widened.as_ptr().add(i));
                let bf: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(column));
                _mm256_storeu_si256(values_t.as_mut_ptr().add(i * KEYS) as *mut __m256i, bf);
            }
        }
    }
}

/// Keys `0..valid` of a unit (`row(r)`: key r's first element in `cache`)
/// widened to float32 at `out` ([16, D]), the rest zero (never written, so
/// never read: a unit's keys past its queries may be garbage, even NaN,
/// whose products with a probability of zero would not be zero).
#[inline(always)]
unsafe fn widen<T: KvElement>(
    cache: &[T],
    valid: usize,
    d: usize,
    row: &dyn Fn(usize) -> usize,
    out: &mut [f32],
) {
    for r in 0..KEYS {
        let dst = &mut out[r * d..(r + 1) * d];
        if r >= valid {
            dst.fill(0.0);
            continue;
        }
        let src = &cache[row(r)..row(r) + d];
        if T::HALF {
            let src = src.as_ptr() as *const __m256i;
            for (j, chunk) in dst.chunks_exact_mut(16).enumerate() {
                _mm512_storeu_ps(
                    chunk.as_mut_ptr(),
                    _mm512_cvtph_ps(_mm256_loadu_si256(src.add(j))),
                );
            }
        } else {
            for (x, y) in dst.iter_mut().zip(src) {
                *x = y.to_f32();
            }
        }
    }
}

/// 32 floats as bfloat16, in order.
#[inline(always)]
unsafe fn bf16_32(src: &[f32], dst: &mut [u16]) {
    let lo = _mm512_loadu_ps(src.as_ptr());
    let hi = _mm512_loadu_ps(src.as_ptr().add(16));
    let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
    _mm512_storeu_si512(dst.as_mut_ptr() as *mut __m512i, v);
}

/// The tile's queries of `kv_head`'s heads, times the scale, as the tiles
/// take them: per lane group and 32 dims, row r = dims 2r and 2r + 1 of
/// each lane (a lane's 32 dims rounded at once, their 16 pairs scattered
/// down its column).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn queries_as_pairs<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    queries: &[TileQuery<'_>],
    kv_head: usize,
    group: usize,
    st: &mut Staged,
) {
    let (h, d) = (args.num_heads, args.head_dim);
    st.q.fill(0);
    let scale = _mm512_set1_ps(args.scale);
    // pair r of a lane's 32 dims goes to row r: 16 pairs (u32) apart
    let rows = strides(LANES as i32);
    for (e, &(t, ..)) in queries.iter().enumerate() {
        for g in 0..group {
            let lane = e * group + g;
            let q = args.q.as_ptr().add((t * h + kv_head * group + g) * d);
            let tiles = st.q.as_mut_ptr().add(lane / LANES * (d / 32) * 512) as *mut u32;
            let column = tiles.add(lane % LANES);
            for c in 0..d / 32 {
                let lo = _mm512_mul_ps(_mm512_loadu_ps(q.add(c * 32)), scale);
                let hi = _mm512_mul_ps(_mm512_loadu_ps(q.add(c * 32 + 16)), scale);
                let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_i32scatter_epi32::<4>(column.add(c * 256) as *mut i32, rows, pairs);
            }
        }
    }
}

/// `tileloadd tmm{reg}` of rows `stride` bytes apart from `at`.
#[inline(always)]
unsafe fn load(reg: usize, at: *const u8, stride: usize) {
    macro_rules! arms {
        ($($r:literal),*) => {
            match reg {
                $($r => asm!(
                    concat!("tileloadd tmm", $r, ", [{a} + {s} * 1]"),
                    a = in(reg) at,
                    s = in(reg) stride,
                    options(nostack, readonly),
                ),)*
                _ => unreachable!("tile {reg} holds no operand"),
            }
        };
    }
    arms!(4, 5, 6, 7)
}

/// `tdpbf16ps tmm{acc}, tmm{a}, tmm{b}`: acc (0-3) += a (4-5) . b (6-7).
#[inline(always)]
unsafe fn dot(acc: usize, a: usize, b: usize) {
    macro_rules! arms {
        ($(($c:literal, $a:literal, $b:literal)),*) => {
            match (acc, a, b) {
                $(($c, $a, $b) => asm!(
                    concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
                    options(nostack, nomem),
                ),)*
                _ => unreachable!("no such product"),
            }
        };
    }
    arms!(
        (0, 4, 6),
        (0, 4, 7),
        (0, 5, 6),
        (0, 5, 7),
        (1, 4, 6),
        (1, 4, 7),
        (1, 5, 6),
        (1, 5, 7),
        (2, 4, 6),
        (2, 4, 7),
        (2, 5, 6),
        (2, 5, 7),
        (3, 4, 6),
        (3, 4, 7),
        (3, 5, 6),
        (3, 5, 7)
    )
}

/// `tilestored` of sums tile `acc` (0-3) to rows of 64 bytes at `at`.
#[inline(always)]
unsafe fn store(acc: usize, at: *mut f32) {
    macro_rules! arms {
        ($($r:literal),*) => {
            match acc {
                $($r => asm!(
                    concat!("tilestored [{a} + {s} * 1], tmm", $r),
                    a = in(reg) at,
                    s = in(reg) 64usize,
                    options(nostack),
                ),)*
                _ => unreachable!("tile {acc} holds no sums"),
            }
        };
    }
    arms!(0, 1, 2, 3)
}

/// `tilezero tmm{acc}` (0-3).
#[inline(always)]
unsafe fn zero(acc: usize) {
    macro_rules! arms {
        ($($r:literal),*) => {
            match acc {
                $($r => asm!(concat!("tilezero tmm", $r), options(nostack, nomem)),)*
                _ => unreachable!("tile {acc} holds no sums"),
            }
        };
    }
    arms!(0, 1, 2, 3)
}

#[inline(always)]
unsafe fn zero_sums() {
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        options(nostack, nomem)
    );
}

/// A lane group's lanes: each one's keys [lo, hi) and sink (lanes past the
/// queries' see no key), and which are real.
struct LaneGroup {
    lo: __m512i,
    hi: __m512i,
    sink: Lanes16,
    /// The real lanes, and the keys every one of them sees.
    real: u16,
    all_see: Range<usize>,
}

impl LaneGroup {
    unsafe fn new<T: KvElement>(
        args: &PagedAttentionArgs<'_, T>,
        queries: &[TileQuery<'_>],
        kv_head: usize,
        group: usize,
        lg: usize,
    ) -> Self {
        let (mut lo, mut hi, mut sink) = ([0i32; LANES], [0i32; LANES], [f32::NEG_INFINITY; LANES]);
        for l in 0..LANES {
            let lane = lg * LANES + l;
            if let Some(&(_, _, first, end)) = queries.get(lane / group) {
                (lo[l], hi[l]) = (first as i32, end as i32);
                if let Some(sinks) = args.sinks {
                    sink[l] = sinks[kv_head * group + lane % group];
                }
            }
        }
        let real_lanes = (queries.len() * group - lg * LANES).min(LANES);
        let lo_max = lo[..real_lanes].iter().max().copied().unwrap_or(0) as usize;
        let hi_min = hi[..real_lanes].iter().min().copied().unwrap_or(0) as usize;
        Self {
            lo: Lanes16::load_int(lo.as_ptr()),
            hi: Lanes16::load_int(hi.as_ptr()),
            sink: Lanes16::load(sink.as_ptr()),
            real: (((1u32 << real_lanes) - 1) & 0xffff) as u16,
            all_see: lo_max..hi_min,
        }
    }
}

/// One KV head of the tile: each lane group's scores, maximum and
/// probabilities (tiles of keys x lanes), then its weighted values (tiles of
/// dims x lanes); each real lane's result emitted.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,f16c")]
unsafe fn kv_head_of_tile<T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    queries: &[TileQuery<'_>],
    kv_head: usize,
    group: usize,
    st: &mut Staged,
    emit: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let (d, units) = (args.head_dim, st.units.len());
    let groups = lane_groups(args, queries).1;
    // Each lane group's units (those any of its lanes read).
    let mine: Vec<Vec<usize>> = (0..groups)
        .map(|lg| {
            (0..units)
                .filter(|&u| st.masks[st.units[u].masks + lg] != 0)
                .collect()
        })
        .collect();
    // Each unit's keys, then its values transposed, as staged.
    let staged: Vec<*const u8> = st
        .units
        .iter()
        .map(|unit| {
            let (at, _) = st.index[&(unit.physical, kv_head)];
            st.data.as_ptr().add(at + unit.sub * 2 * KEYS * d) as *const u8
        })
        .collect();
    let entry = |u: usize| staged[u];
    let mut sums = vec![Lanes16::zero(); groups];
    // Scores: tmm0-3 four units' sums, tmm4-5 their keys, tmm6-7 two
    // 32-dim chunks of the lane group's queries.
    TileConfig::with_shapes([(16, 64); 8]).load();
    for (lg, sum) in sums.iter_mut().enumerate() {
        let lanes = LaneGroup::new(args, queries, kv_head, group, lg);
        let mine = &mine[lg];
        let q = st.q.as_ptr().add(lg * (d / 32) * 512) as *const u8;
        let neg = Lanes16::splat(f32::NEG_INFINITY);
        let mut max = lanes.sink;
        let mut whole = Vec::with_capacity(mine.len());
        // Two units at a time, in tmm0-1 or tmm2-3: the next two's products
        // are under way while these two's scores are masked.
        let pairs: Vec<&[usize]> = mine.chunks(2).collect();
        let issue = |two: &[usize], bank: usize| {
            for i in 0..two.len() {
                zero(2 * bank + i);
            }
            for c in (0..d / 32).step_by(2) {
                let both = c + 1 < d / 32;
                load(6, q.add(c * 1024), 64);
                if both {
                    load(7, q.add((c + 1) * 1024), 64);
                }
                for (i, &u) in two.iter().enumerate() {
                    load(4 + i, entry(u).add(c * 64), d * 2);
                    dot(2 * bank + i, 4 + i, 6);
                }
                if both {
                    for (i, &u) in two.iter().enumerate() {
                        load(4 + i, entry(u).add((c + 1) * 64), d * 2);
                        dot(2 * bank + i, 4 + i, 7);
                    }
                }
            }
        };
        if let Some(two) = pairs.first() {
            issue(two, 0);
        }
        for (n, two) in pairs.iter().enumerate() {
            for (i, &u) in two.iter().enumerate() {
                store(2 * (n % 2) + i, st.s.as_mut_ptr().add(u * KEYS * LANES));
            }
            if let Some(next) = pairs.get(n + 1) {
                issue(next, (n + 1) % 2);
            }
            for &u in two.iter() {
                let s = st.s.as_mut_ptr().add(u * KEYS * LANES);
                let (pos, m) = (st.units[u].pos, st.masks[st.units[u].masks + lg]);
                // Every lane sees every key of the unit: nothing to mask.
                let all = m == lanes.real
                    && lanes.all_see.start <= pos
                    && pos + KEYS <= lanes.all_see.end;
                whole.push(all);
                for r in 0..KEYS {
                    let mut row = Lanes16::load(s.add(r * LANES));
                    if !all {
                        let sees = Lanes16::inside(lanes.lo, lanes.hi, pos + r) & m;
                        row = row.select(sees, neg);
                        row.store(s.add(r * LANES));
                    }
                    max = max.max(row);
                }
            }
        }
        // A lane with no key (past the queries) keeps a finite maximum.
        let max = Lanes16::zero().select(_mm512_cmp_ps_mask::<_CMP_EQ_OQ>(to(max), to(neg)), max);
        *sum = match args.sinks {
            // a sink: a key of that score whose value is zero
            Some(_) => exp(lanes.sink.sub(max)),
            None => Lanes16::zero(),
        };
        // Probabilities as pairs of keys (tile rows of the values' product).
        let interleave = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        for (&u, &all) in mine.iter().zip(&whole) {
            let s = st.s.as_ptr().add(u * KEYS * LANES);
            let p = st.p.as_mut_ptr().add((lg * units + u) * KEYS * LANES);
            for r in 0..KEYS / 2 {
                let prob = |k: usize| {
                    let x = Lanes16::load(s.add(k * LANES));
                    let e = exp(x.sub(max));
                    match all {
                        true => e,
                        false => e.keep(_mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(to(x), to(neg))),
                    }
                };
                let (even, odd) = (prob(2 * r), prob(2 * r + 1));
                *sum = sum.add(even).add(odd);
                let halves: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(to(odd), to(even)));
                _mm512_storeu_si512(
                    p.add(r * 2 * LANES) as *mut __m512i,
                    _mm512_permutexvar_epi16(interleave, halves),
                );
            }
        }
    }
    // Weighted values: tmm0-3 four tiles of 16 dims, tmm4-5 the units'
    // values for them, tmm6-7 two units' probabilities.
    TileConfig::with_shapes([
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 32),
        (16, 32),
        (8, 64),
        (8, 64),
    ])
    .load();
    // lane l's 16 dims of a tile: 16 floats apart
    let down = strides(LANES as i32);
    for (lg, sum) in sums.iter().enumerate() {
        let mine = &mine[lg];
        for first in (0..d / 16).step_by(4) {
            let tiles = (d / 16 - first).min(4);
            zero_sums();
            for (j, &u) in mine.iter().enumerate() {
                let values_t = entry(u).add(KEYS * d * 2 + first * 16 * 32);
                let p = st.p.as_ptr().add((lg * units + u) * KEYS * LANES) as *const u8;
                load(6 + j % 2, p, 64);
                for t in 0..tiles {
                    load(4 + t % 2, values_t.add(t * 16 * 32), 32);
                    dot(t, 4 + t % 2, 6 + j % 2);
                }
            }
            for t in 0..tiles {
                store(t, st.o.as_mut_ptr().add((first + t) * 16 * LANES));
            }
        }
        let mut total = [0f32; LANES];
        sum.store(total.as_mut_ptr());
        for (l, total) in total.iter().enumerate() {
            let lane = lg * LANES + l;
            let Some(&(t, ..)) = queries.get(lane / group) else {
                break;
            };
            let inv = _mm512_set1_ps(1.0 / total);
            for (j, x) in st.out.chunks_exact_mut(16).enumerate() {
                let column = _mm512_i32gather_ps::<4>(down, st.o.as_ptr().add(j * 16 * LANES + l));
                _mm512_storeu_ps(x.as_mut_ptr(), _mm512_mul_ps(column, inv));
            }
            emit(t, kv_head * group + lane % group, &st.out);
        }
    }
}

/// e^x for x <= 0, lane by lane, to about 4e-5 relatively (a fiftieth of a
/// bfloat16 step, which the probabilities are rounded to next): 2^(x log2
/// e) as 2^n (`vscalefps`) times a degree-4 Taylor polynomial of 2^f, |f|
/// <= 1/2.
#[inline(always)]
unsafe fn exp(x: Lanes16) -> Lanes16 {
    const LN2: f32 = std::f32::consts::LN_2;
    const TAYLOR: [f32; 5] = [
        LN2 * LN2 * LN2 * LN2 / 24.0,
        LN2 * LN2 * LN2 / 6.0,
        LN2 * LN2 / 2.0,
        LN2,
        1.0,
    ];
    let t = x
        .max(Lanes16::splat(-87.0))
        .mul(Lanes16::splat(std::f32::consts::LOG2_E));
    let n = t.round();
    let f = t.sub(n);
    let mut p = Lanes16::splat(TAYLOR[0]);
    for &c in &TAYLOR[1..] {
        p = p.mul_add(f, Lanes16::splat(c));
    }
    Lanes16::from(_mm512_scalef_ps(to(p), to(n)))
}

/// The offsets 0, step, ..., 15 step (a gather's or a scatter's).
#[inline(always)]
unsafe fn strides(step: i32) -> __m512i {
    _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(step),
    )
}

#[inline(always)]
fn to(x: Lanes16) -> __m512 {
    x.into()
}
