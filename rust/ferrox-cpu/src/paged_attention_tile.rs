//! The tile loops of the CPU paged attention: the queries of a tile that
//! read one physical block (rows behind a shared prefix, the queries of one
//! prefill chunk or speculative verification) take it together, as two
//! small matrix products per KV head, with the (query, head) pairs in the
//! lanes of the vectors:
//!
//! ```text
//!  scores[j][lane] = sum_i qt[i][lane] * key_j[i]      (i over the head dim)
//!  out[i][lane]   += sum_j p[j][lane] * value_j[i]     (j over the block's keys)
//! ```
//!
//! Each key and value element is broadcast once for the (query, head)
//! pairs of a vector (eight with AVX2, sixteen with AVX-512: one set of
//! loops over `Lanes`, the same operations per lane and so the same bits),
//! where the per-query loops multiply each query head by every key on its
//! own and reduce each score across the lanes. The softmax's running
//! maxima, sums and rescaling are vectors over the lanes too, and a lane's
//! keys outside its query's range (causal end, sliding window, another
//! query's chunk) are masked out.
//!
//! The sums run in another order than the per-query loops' (over the head
//! dimension one element at a time, not eight partial sums), so a query's
//! result depends on whether it shared a block with another one: the
//! default, not `batch_invariant`. A tile keeps both kinds of state: blocks
//! one query reads alone go through the per-query loops, and each query's
//! two partial softmax states are merged when the tile ends.

use std::ops::Range;

use super::{chunk, widen_rows, PagedAttentionArgs, Scratch, TileQuery, VectorOps};
use crate::kv_element::KvElement;

/// Where a tile's queries stand in the lanes, and the running state of the
/// blocks they took together (empty until `start`).
#[derive(Default)]
pub(crate) struct TileState {
    /// Whether this tile's state is set up (`start`): a tile whose queries
    /// share no block never needs it.
    pub(crate) started: bool,
    /// Query heads per KV head.
    group: usize,
    /// Lanes a vector of the loops holds (8: AVX2, 16: AVX-512).
    width: usize,
    head_dim: usize,
    /// Lanes a head-dim element spans: the tile's (query, head) pairs of one
    /// KV head, `query * group + head`, rounded up to whole vectors.
    lanes: usize,
    /// Per KV head of the part: the queries, scaled, [D][lanes].
    qt: Vec<f32>,
    /// Per KV head: the weighted values so far, [D][lanes].
    ot: Vec<f32>,
    /// Per KV head: the running maximum and sum, [lanes].
    max: Vec<f32>,
    sum: Vec<f32>,
    /// One block's scores, then probabilities, [BS][lanes].
    scores: Vec<f32>,
    /// Each lane's keys in this block, offsets [lo, hi) (empty: masked).
    lo: Vec<i32>,
    hi: Vec<i32>,
    /// Each lane's rescaling of this block.
    correction: Vec<f32>,
}

/// The running maximum before any key: finite, so that a lane whose keys
/// are all masked (scores of minus infinity) keeps a correction of 1.
const NO_MAX: f32 = f32::MIN;

impl TileState {
    /// Starts a tile: `queries[e]` is query e's row of `q` ([H, D]), each
    /// head scaled by `scale` into its lane; `kv_heads` those of the part;
    /// `width` lanes a vector (the lanes past the queries' are masked).
    pub(crate) fn start(
        &mut self,
        queries: &[&[f32]],
        (num_heads, num_kv_heads, head_dim, block_size): (usize, usize, usize, usize),
        kv_heads: Range<usize>,
        scale: f32,
        width: usize,
    ) {
        self.started = true;
        let group = num_heads / num_kv_heads;
        let lanes = (queries.len() * group).div_ceil(width) * width;
        let heads = kv_heads.len();
        (self.group, self.width, self.head_dim, self.lanes) = (group, width, head_dim, lanes);
        let plane = head_dim * lanes;
        for buffer in [&mut self.qt, &mut self.ot] {
            buffer.clear();
            buffer.resize(heads * plane, 0.0);
        }
        self.max.clear();
        self.max.resize(heads * lanes, NO_MAX);
        self.sum.clear();
        self.sum.resize(heads * lanes, 0.0);
        self.scores.resize(block_size * lanes, 0.0);
        self.lo.resize(lanes, 0);
        self.hi.resize(lanes, 0);
        self.correction.resize(lanes, 1.0);
        self.clear_lanes();
        for (local, kv_head) in kv_heads.enumerate() {
            let qt = &mut self.qt[local * plane..(local + 1) * plane];
            for (e, q) in queries.iter().enumerate() {
                for g in 0..group {
                    let lane = e * group + g;
                    let head = &q[(kv_head * group + g) * head_dim..][..head_dim];
                    for (i, &x) in head.iter().enumerate() {
                        qt[i * lanes + lane] = x * scale;
                    }
                }
            }
        }
    }

    /// Query `e`'s keys in the next block: offsets `lo..hi` (its lanes'
    /// masks until `clear_lanes`).
    pub(crate) fn set_lanes(&mut self, e: usize, lo: usize, hi: usize) {
        for lane in e * self.group..(e + 1) * self.group {
            self.lo[lane] = lo as i32;
            self.hi[lane] = hi as i32;
        }
    }

    pub(crate) fn clear_lanes(&mut self) {
        self.lo.fill(0);
        self.hi.fill(0);
    }

    /// The vectors holding query `first..=last`'s lanes.
    pub(crate) fn vectors(&self, first: usize, last: usize) -> Range<usize> {
        first * self.group / self.width..((last + 1) * self.group).div_ceil(self.width)
    }

    /// Query `e`'s head `g` (of KV head `local` of the part): this state's
    /// maximum, sum and weighted values merged into the per-query loops'
    /// (`max`, `sum`, `acc`), which then hold the whole context's.
    pub(crate) fn merge_into(
        &self,
        local: usize,
        e: usize,
        g: usize,
        max: &mut f32,
        sum: &mut f32,
        acc: &mut [f32],
    ) {
        let lane = e * self.group + g;
        let (m2, s2) = (
            self.max[local * self.lanes + lane],
            self.sum[local * self.lanes + lane],
        );
        if s2 == 0.0 {
            return; // no block taken together (or its keys all masked)
        }
        let m = max.max(m2);
        let (c1, c2) = ((*max - m).exp(), (m2 - m).exp());
        let plane = &self.ot[local * self.head_dim * self.lanes..];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = *a * c1 + plane[i * self.lanes + lane] * c2;
        }
        *sum = *sum * c1 + s2 * c2;
        *max = m;
    }
}

/// Whether two of a tile's queries read one physical block. Rows whose
/// tables share blocks are neighbours in the tile (`tiles`), and so are one
/// row's queries, so neighbours are compared: at the first block position
/// both read.
pub(super) fn shares_a_block(queries: &[TileQuery<'_>], bs: usize) -> bool {
    queries.windows(2).any(|pair| {
        let (a, b) = (&pair[0], &pair[1]);
        let block = (a.2.max(b.2)) / bs;
        block * bs < a.3.min(b.3) && a.1[block] == b.1[block]
    })
}

/// Block position `block` of a tile whose queries take the blocks they
/// share together: each physical block read there by two or more of them
/// goes through the tile loops once (widened to float32 once). Returns the
/// queries served (bit e: query e); a block one query reads alone is left
/// to the per-query loops.
#[inline(always)]
pub(super) fn attend_together<V: VectorOps, T: KvElement>(
    args: &PagedAttentionArgs<'_, T>,
    queries: &[TileQuery<'_>],
    block: usize,
    kv_heads: &Range<usize>,
    s: &mut Scratch,
) -> u32 {
    let (h, hkv, d, bs) = (
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        args.block_size,
    );
    let token = hkv * d;
    let mut served = 0u32; // (tiles of at most 32 queries)
    for (e, query) in queries.iter().enumerate() {
        if served & (1 << e) != 0 {
            continue;
        }
        let Some((lo, hi)) = chunk(query, block, bs) else {
            continue;
        };
        // The later queries reading the same physical block here.
        let physical = query.1[block];
        let (mut members, mut keys, mut last) = (1u32 << e, (lo, hi), e);
        for (o, other) in queries.iter().enumerate().skip(e + 1) {
            if other.1[block] != physical {
                continue;
            }
            if let Some((olo, ohi)) = chunk(other, block, bs) {
                members |= 1 << o;
                keys = (keys.0.min(olo), keys.1.max(ohi));
                last = o;
            }
        }
        if members == 1 << e {
            continue;
        }
        served |= members;
        if !s.tile.started {
            let rows: Vec<&[f32]> = queries
                .iter()
                .map(|&(t, ..)| &args.q[t * h * d..(t + 1) * h * d])
                .collect();
            let shape = (h, hkv, d, bs);
            s.tile
                .start(&rows, shape, kv_heads.clone(), args.scale, V::TILE_WIDTH);
        }
        let at = physical as usize * bs * token;
        widen_rows::<V, T>(args, at, keys.0..keys.1, s);
        s.tile.clear_lanes();
        for (o, other) in queries.iter().enumerate().skip(e) {
            if members & (1 << o) != 0 {
                let (olo, ohi) = chunk(other, block, bs).expect("a member reads the block");
                s.tile.set_lanes(o, olo, ohi);
            }
        }
        let vectors = s.tile.vectors(e, last);
        for (local, kv_head) in kv_heads.clone().enumerate() {
            V::tile_block(
                &mut s.tile,
                local,
                &s.keys,
                &s.values,
                keys.0 * token + kv_head * d,
                token,
                (keys.0, keys.1 - keys.0),
                vectors.clone(),
            );
        }
    }
    served
}

/// What the tile loops need of a vector of lanes: AVX2's eight (`Lanes8`)
/// or AVX-512's sixteen (`Lanes16`). Every operation acts lane by lane, so
/// a lane's result does not depend on the width.
///
/// Every method is unsafe: it runs only where the CPU has the features its
/// type is built on (AVX2 and FMA; AVX-512 F for `Lanes16`), inlined into
/// a function compiled for them; pointers are to `WIDTH` readable (or
/// writable) elements.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Lanes: Copy {
    /// Lanes a vector holds.
    const WIDTH: usize;
    /// Keys (scores) or head-dim elements (values) a register tile takes
    /// for 1, 2 or 3 vectors of lanes.
    const PER_TILE: [usize; 3];
    /// Integer lanes (the keys' offsets) and a set of lanes.
    type Int: Copy;
    type Mask: Copy;

    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// self * b + c, fused.
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
    unsafe fn add(self, b: Self) -> Self;
    unsafe fn sub(self, b: Self) -> Self;
    unsafe fn max(self, b: Self) -> Self;
    /// 2^n for lanes holding whole numbers n in -127..=127.
    unsafe fn exp2_int(n: Self) -> Self;
    /// Lanes rounded to the nearest whole number (ties to even).
    unsafe fn round(self) -> Self;
    unsafe fn load_int(p: *const i32) -> Self::Int;
    /// The lanes where lo <= pos < hi.
    unsafe fn inside(lo: Self::Int, hi: Self::Int, pos: usize) -> Self::Mask;
    unsafe fn both(a: Self::Mask, b: Self::Mask) -> Self::Mask;
    unsafe fn every(m: Self::Mask) -> bool;
    /// `self` in the lanes of `m`, `other` elsewhere.
    unsafe fn select(self, m: Self::Mask, other: Self) -> Self;
    /// `self` in the lanes of `m`, zero elsewhere.
    unsafe fn keep(self, m: Self::Mask) -> Self;

    /// e^x for x <= 0, lane by lane: `fast_exp`'s polynomial, its steps
    /// fused (FMA).
    #[inline(always)]
    unsafe fn exp(x: Self) -> Self {
        let t = x
            .max(Self::splat(-87.0))
            .mul(Self::splat(std::f32::consts::LOG2_E));
        let n = t.round();
        let f = t.sub(n);
        let mut p = Self::splat(EXP2_TAYLOR[0]);
        for &c in &EXP2_TAYLOR[1..] {
            p = p.mul_add(f, Self::splat(c));
        }
        p.mul(Self::exp2_int(n))
    }
}

#[cfg(target_arch = "x86_64")]
use crate::paged_attention::EXP2_TAYLOR;

#[cfg(target_arch = "x86_64")]
pub(crate) use lanes::{Lanes16, Lanes8};

#[cfg(target_arch = "x86_64")]
mod lanes {
    use std::arch::x86_64::*;

    use super::Lanes;

    /// Eight lanes: AVX2 and FMA.
    #[derive(Clone, Copy)]
    pub(crate) struct Lanes8(__m256);

    /// Sixteen lanes: AVX-512 F.
    #[derive(Clone, Copy)]
    pub(crate) struct Lanes16(__m512);

    impl Lanes for Lanes8 {
        const WIDTH: usize = 8;
        // eight or nine accumulators (twelve spill one: the broadcasts
        // take two of the sixteen registers)
        const PER_TILE: [usize; 3] = [8, 4, 3];
        type Int = __m256i;
        type Mask = __m256;

        #[inline(always)]
        unsafe fn zero() -> Self {
            Self(_mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Self(_mm256_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Self(_mm256_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn mul_add(self, b: Self, c: Self) -> Self {
            Self(_mm256_fmadd_ps(self.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            Self(_mm256_mul_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            Self(_mm256_add_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            Self(_mm256_sub_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            Self(_mm256_max_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn exp2_int(n: Self) -> Self {
            let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n.0), _mm256_set1_epi32(127));
            Self(_mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)))
        }
        #[inline(always)]
        unsafe fn round(self) -> Self {
            Self(_mm256_round_ps(
                self.0,
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            ))
        }
        #[inline(always)]
        unsafe fn load_int(p: *const i32) -> __m256i {
            _mm256_loadu_si256(p as *const __m256i)
        }
        #[inline(always)]
        unsafe fn inside(lo: __m256i, hi: __m256i, pos: usize) -> __m256 {
            let pos = _mm256_set1_epi32(pos as i32);
            _mm256_castsi256_ps(_mm256_andnot_si256(
                _mm256_cmpgt_epi32(lo, pos),
                _mm256_cmpgt_epi32(hi, pos),
            ))
        }
        #[inline(always)]
        unsafe fn both(a: __m256, b: __m256) -> __m256 {
            _mm256_and_ps(a, b)
        }
        #[inline(always)]
        unsafe fn every(m: __m256) -> bool {
            _mm256_movemask_ps(m) == 0xff
        }
        #[inline(always)]
        unsafe fn select(self, m: __m256, other: Self) -> Self {
            Self(_mm256_blendv_ps(other.0, self.0, m))
        }
        #[inline(always)]
        unsafe fn keep(self, m: __m256) -> Self {
            Self(_mm256_and_ps(self.0, m))
        }
    }

    impl From<__m512> for Lanes16 {
        #[inline(always)]
        fn from(x: __m512) -> Self {
            Self(x)
        }
    }

    impl From<Lanes16> for __m512 {
        #[inline(always)]
        fn from(x: Lanes16) -> Self {
            x.0
        }
    }

    impl Lanes for Lanes16 {
        const WIDTH: usize = 16;
        // up to 24 accumulators of the 32 registers (a block of 16 keys
        // and a head of 64 divide evenly)
        const PER_TILE: [usize; 3] = [8, 8, 8];
        type Int = __m512i;
        type Mask = __mmask16;

        #[inline(always)]
        unsafe fn zero() -> Self {
            Self(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Self(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Self(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn mul_add(self, b: Self, c: Self) -> Self {
            Self(_mm512_fmadd_ps(self.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            Self(_mm512_mul_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            Self(_mm512_add_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            Self(_mm512_sub_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            Self(_mm512_max_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn exp2_int(n: Self) -> Self {
            let biased = _mm512_add_epi32(_mm512_cvtps_epi32(n.0), _mm512_set1_epi32(127));
            Self(_mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased)))
        }
        #[inline(always)]
        unsafe fn round(self) -> Self {
            Self(_mm512_roundscale_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(self.0))
        }
        #[inline(always)]
        unsafe fn load_int(p: *const i32) -> __m512i {
            _mm512_loadu_si512(p as *const _)
        }
        #[inline(always)]
        unsafe fn inside(lo: __m512i, hi: __m512i, pos: usize) -> __mmask16 {
            let pos = _mm512_set1_epi32(pos as i32);
            _mm512_cmpgt_epi32_mask(hi, pos) & !_mm512_cmpgt_epi32_mask(lo, pos)
        }
        #[inline(always)]
        unsafe fn both(a: __mmask16, b: __mmask16) -> __mmask16 {
            a & b
        }
        #[inline(always)]
        unsafe fn every(m: __mmask16) -> bool {
            m == 0xffff
        }
        #[inline(always)]
        unsafe fn select(self, m: __mmask16, other: Self) -> Self {
            Self(_mm512_mask_blend_ps(m, other.0, self.0))
        }
        #[inline(always)]
        unsafe fn keep(self, m: __mmask16) -> Self {
            Self(_mm512_maskz_mov_ps(m, self.0))
        }
    }
}

/// scores[j][v] = sum_i qt[i][v] * key_j[i] for `K` keys and `VC` vectors
/// of lanes (`K * VC` accumulators).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores_tile<L: Lanes, const K: usize, const VC: usize>(
    qt: *const f32,
    lanes: usize,
    keys: *const f32,
    stride: usize,
    d: usize,
    out: *mut f32,
) {
    let w = L::WIDTH;
    let mut acc = [[L::zero(); VC]; K];
    for i in 0..d {
        let mut q = [L::zero(); VC];
        for (v, q) in q.iter_mut().enumerate() {
            *q = L::load(qt.add(i * lanes + w * v));
        }
        for (j, acc) in acc.iter_mut().enumerate() {
            let k = L::splat(*keys.add(j * stride + i));
            for (a, q) in acc.iter_mut().zip(&q) {
                *a = q.mul_add(k, *a);
            }
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        for (v, a) in acc.iter().enumerate() {
            a.store(out.add(j * lanes + w * v));
        }
    }
}

/// ot[i][v] = ot[i][v] * correction[v] + sum_j p[j][v] * value_j[i] for
/// `DC` head-dim elements and `VC` vectors of lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn values_tile<L: Lanes, const DC: usize, const VC: usize>(
    probs: *const f32,
    lanes: usize,
    values: *const f32,
    stride: usize,
    n: usize,
    ot: *mut f32,
    correction: *const f32,
) {
    let w = L::WIDTH;
    let mut acc = [[L::zero(); VC]; DC];
    for (i, acc) in acc.iter_mut().enumerate() {
        for (v, a) in acc.iter_mut().enumerate() {
            let c = L::load(correction.add(w * v));
            *a = L::load(ot.add(i * lanes + w * v)).mul(c);
        }
    }
    for j in 0..n {
        let mut p = [L::zero(); VC];
        for (v, p) in p.iter_mut().enumerate() {
            *p = L::load(probs.add(j * lanes + w * v));
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let x = L::splat(*values.add(j * stride + i));
            for (a, p) in acc.iter_mut().zip(&p) {
                *a = p.mul_add(x, *a);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (v, a) in acc.iter().enumerate() {
            a.store(ot.add(i * lanes + w * v));
        }
    }
}

/// `$f::<L, A, VC>(...)` for `$vc` (1 to 3) vectors of lanes, `A` the
/// lanes' `PER_TILE` count for `VC` (the remainder loops pass `1`).
#[cfg(target_arch = "x86_64")]
macro_rules! by_vectors {
    ($l:ty, $vc:expr, $f:ident::<$a1:literal, $a2:literal, $a3:literal>($($arg:expr),* $(,)?)) => {
        match $vc {
            1 => $f::<$l, $a1, 1>($($arg),*),
            2 => $f::<$l, $a2, 2>($($arg),*),
            _ => $f::<$l, $a3, 3>($($arg),*),
        }
    };
}

/// Whole register tiles of `L::PER_TILE` keys (or head-dim elements), for
/// `vc` vectors: an arm for each `PER_TILE` a `Lanes` type has (another
/// one stops at the first call rather than run a tile of the wrong size).
#[cfg(target_arch = "x86_64")]
macro_rules! by_tile {
    ($l:ty, $vc:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match <$l as Lanes>::PER_TILE {
            [8, 8, 8] => by_vectors!($l, $vc, $f::<8, 8, 8>($($arg),*)),
            [8, 4, 3] => by_vectors!($l, $vc, $f::<8, 4, 3>($($arg),*)),
            other => unreachable!("no register tile of {other:?} keys"),
        }
    };
}

/// Keys `first..first + n` of one block for the lanes of `vectors`, KV head
/// `local` of the part: its `n` keys (and values) at `keys[at + j *
/// stride..][..D]`, float32. Lanes outside their `lo..hi` get no weight.
///
/// # Safety
/// The CPU features `L` is built on (AVX2 and FMA; AVX-512 F for
/// `Lanes16`); `st` started for this tile with `L::WIDTH` lanes a vector and
/// `local` among its KV heads, `vectors` within its lanes, `n` at most the
/// block size; every key and value row read lies inside `keys` / `values`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn block<L: Lanes>(
    st: &mut TileState,
    local: usize,
    keys: &[f32],
    values: &[f32],
    at: usize,
    stride: usize,
    (first, n): (usize, usize),
    vectors: Range<usize>,
) {
    debug_assert_eq!(st.width, L::WIDTH);
    let (d, lanes, w) = (st.head_dim, st.lanes, L::WIDTH);
    let plane = local * d * lanes;
    let (k, vals) = (keys.as_ptr().add(at), values.as_ptr().add(at));
    // Scores, a few keys (and up to three vectors) at a time.
    let mut v = vectors.start;
    while v < vectors.end {
        let vc = (vectors.end - v).min(3);
        let qt = st.qt.as_ptr().add(plane + w * v);
        let out = st.scores.as_mut_ptr().add(w * v);
        let step = L::PER_TILE[vc - 1];
        let mut j = 0;
        while j + step <= n {
            let (kj, oj) = (k.add(j * stride), out.add(j * lanes));
            by_tile!(L, vc, scores_tile(qt, lanes, kj, stride, d, oj));
            j += step;
        }
        while j < n {
            let (kj, oj) = (k.add(j * stride), out.add(j * lanes));
            by_vectors!(L, vc, scores_tile::<1, 1, 1>(qt, lanes, kj, stride, d, oj));
            j += 1;
        }
        v += vc;
    }
    // The softmax's update, a vector of lanes at a time.
    let neg_inf = L::splat(f32::NEG_INFINITY);
    let state = local * lanes;
    for v in vectors.clone() {
        let lo = L::load_int(st.lo.as_ptr().add(w * v));
        let hi = L::load_int(st.hi.as_ptr().add(w * v));
        // Every lane reading every key (a decode step's rows behind a
        // shared prefix): nothing to mask.
        let whole = L::every(L::both(
            L::inside(lo, hi, first),
            L::inside(lo, hi, first + n - 1),
        ));
        let scores = st.scores.as_mut_ptr().add(w * v);
        let mut block_max = [neg_inf; 2];
        for j in 0..n {
            let mut s = L::load(scores.add(j * lanes));
            if !whole {
                s = s.select(L::inside(lo, hi, first + j), neg_inf);
                s.store(scores.add(j * lanes));
            }
            block_max[j % 2] = block_max[j % 2].max(s);
        }
        let block_max = block_max[0].max(block_max[1]);
        let max = st.max.as_mut_ptr().add(state + w * v);
        let old = L::load(max);
        let new = old.max(block_max);
        new.store(max);
        let correction = L::exp(old.sub(new));
        correction.store(st.correction.as_mut_ptr().add(w * v));
        let mut sum = L::zero();
        for j in 0..n {
            let p = L::exp(L::load(scores.add(j * lanes)).sub(new));
            let p = match whole {
                true => p,
                false => p.keep(L::inside(lo, hi, first + j)),
            };
            p.store(scores.add(j * lanes));
            sum = sum.add(p);
        }
        let total = st.sum.as_mut_ptr().add(state + w * v);
        L::load(total).mul(correction).add(sum).store(total);
    }
    // The values, a few head-dim elements (and up to three vectors) at a
    // time.
    let mut v = vectors.start;
    while v < vectors.end {
        let vc = (vectors.end - v).min(3);
        let probs = st.scores.as_ptr().add(w * v);
        let correction = st.correction.as_ptr().add(w * v);
        let ot = st.ot.as_mut_ptr().add(plane + w * v);
        let chunk = L::PER_TILE[vc - 1];
        let mut i = 0;
        while i + chunk <= d {
            let (x, o) = (vals.add(i), ot.add(i * lanes));
            by_tile!(
                L,
                vc,
                values_tile(probs, lanes, x, stride, n, o, correction)
            );
            i += chunk;
        }
        while i < d {
            let (x, o) = (vals.add(i), ot.add(i * lanes));
            by_vectors!(
                L,
                vc,
                values_tile::<1, 1, 1>(probs, lanes, x, stride, n, o, correction)
            );
            i += 1;
        }
        v += vc;
    }
}
