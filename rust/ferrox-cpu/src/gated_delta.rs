//! The decode step of the gated delta rule (Gated DeltaNet linear
//! attention), in place on the state pool: for each row (one token) and
//! value head, with S the `Dk x Dv` state its slot holds (zero for a row
//! that starts afresh), decay `exp(g)` and step size `beta`,
//!
//! ```text
//!  m = exp(g) S^T k            what the decayed state recalls for k
//!  S = exp(g) S + k ((v - m) beta)^T
//!  o = S^T q
//! ```
//!
//! Two passes over S (one reads, one reads and writes) instead of the
//! several a composition of tensor operations makes, parallel over (row,
//! head) pairs. q and k arrive L2-normalised (q scaled), one per value head.
//!
//! The pool holds S as float32 or as bfloat16 (`StateElement`): a bfloat16
//! state is widened as it is read and rounded (to nearest, ties to even)
//! once a step as it is written back, the step's arithmetic float32 either
//! way. Half the bytes a decode step reads and writes, and half the memory
//! a sequence holds, for eight bits of mantissa in what it carries over.

use crate::paged_attention::ShapeError;
use crate::pool::run_parts;

pub struct GatedDeltaDecode<'a> {
    pub q: &'a [f32],    // [B, H, Dk]
    pub k: &'a [f32],    // [B, H, Dk]
    pub v: &'a [f32],    // [B, H, Dv]
    pub g: &'a [f32],    // [B, H] log decay
    pub beta: &'a [f32], // [B, H]
    /// [B] each row's slot in the state pool; distinct.
    pub slots: &'a [i64],
    /// [B] rows that start from a zero state.
    pub fresh: &'a [bool],
    pub num_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

/// Each row's slot lies in the pool of `num_slots` and no two rows share
/// one (`what` names the caller in the error).
pub(crate) fn check_slots(slots: &[i64], num_slots: usize, what: &str) -> Result<(), ShapeError> {
    let mut seen = vec![false; num_slots];
    for &s in slots {
        if s < 0 || s as usize >= num_slots || std::mem::replace(&mut seen[s as usize], true) {
            return Err(ShapeError(format!(
                "{what}: slot {s} out of range or given to two rows"
            )));
        }
    }
    Ok(())
}

/// The element types a state pool may hold.
pub trait StateElement: Copy + Send + Sync + 'static {
    fn load(self) -> f32;
    fn store(x: f32) -> Self;
}

impl StateElement for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(x: f32) -> Self {
        x
    }
}

/// A bfloat16, as its bits (float32's upper half).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl StateElement for Bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    /// Rounded to nearest, ties to even (a carry out of the mantissa goes
    /// into the exponent, to infinity past the largest finite value); a NaN
    /// stays a NaN.
    #[inline(always)]
    fn store(x: f32) -> Self {
        let bits = x.to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
        Bf16(if x.is_nan() {
            (bits >> 16) as u16 | 0x40
        } else {
            rounded as u16
        })
    }
}

struct SharedPtr<T>(*mut T);
impl<T> Clone for SharedPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedPtr<T> {}
unsafe impl<T> Send for SharedPtr<T> {}
unsafe impl<T> Sync for SharedPtr<T> {}

impl<T> SharedPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// Runs the step for every row; `states` is the pool [S, H, Dk, Dv],
/// `out` [B, H, Dv].
pub fn gated_delta_decode<E: StateElement>(
    args: &GatedDeltaDecode<'_>,
    states: &mut [E],
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), ShapeError> {
    let (h, dk, dv) = (args.num_heads, args.k_dim, args.v_dim);
    let b = args.slots.len();
    let fail = |what: &str| Err(ShapeError(what.to_string()));
    if h == 0 || dk == 0 || dv == 0 {
        return fail("gated delta: empty heads");
    }
    if args.q.len() != b * h * dk || args.k.len() != b * h * dk {
        return fail("gated delta: q and k must be [B, H, Dk]");
    }
    if args.v.len() != b * h * dv || out.len() != b * h * dv {
        return fail("gated delta: v and out must be [B, H, Dv]");
    }
    if args.g.len() != b * h || args.beta.len() != b * h || args.fresh.len() != b {
        return fail("gated delta: g and beta must be [B, H], fresh [B]");
    }
    let per_slot = h * dk * dv;
    if !states.len().is_multiple_of(per_slot) {
        return fail("gated delta: the state pool must be [S, H, Dk, Dv]");
    }
    check_slots(args.slots, states.len() / per_slot, "gated delta")?;
    let pairs = b * h;
    let threads = num_threads.clamp(1, pairs.max(1));
    let per = pairs.div_ceil(threads);
    let state_ptr = SharedPtr(states.as_mut_ptr());
    let out_ptr = SharedPtr(out.as_mut_ptr());
    run_parts(threads, &|part| {
        let mut scratch = vec![0f32; 2 * dv];
        for pair in part * per..((part + 1) * per).min(pairs) {
            let (row, head) = (pair / h, pair % h);
            let slot = args.slots[row] as usize;
            // SAFETY: slots are distinct (checked), so each (slot, head)
            // matrix and each output row belongs to one pair only.
            let s = unsafe {
                std::slice::from_raw_parts_mut(
                    state_ptr.get().add((slot * h + head) * dk * dv),
                    dk * dv,
                )
            };
            let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(pair * dv), dv) };
            if args.fresh[row] {
                s.fill(E::store(0.0));
            }
            let vecs = Pair {
                q: &args.q[pair * dk..(pair + 1) * dk],
                k: &args.k[pair * dk..(pair + 1) * dk],
                v: &args.v[pair * dv..(pair + 1) * dv],
                decay: args.g[pair].exp(),
                beta: args.beta[pair],
            };
            step(s, &vecs, o, &mut scratch);
        }
    });
    Ok(())
}

struct Pair<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    decay: f32,
    beta: f32,
}

fn step<E: StateElement>(s: &mut [E], p: &Pair<'_>, o: &mut [f32], scratch: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY (both): the features were detected.
        if crate::isa::avx512() {
            unsafe { step_avx512(s, p, o, scratch) };
            return;
        }
        if crate::isa::avx2() {
            unsafe { step_avx2(s, p, o, scratch) };
            return;
        }
    }
    step_portable::<E, false>(s, p, o, scratch);
}

// The same loops compiled for AVX-512 and for AVX2, with fused
// multiply-adds: the compiler vectorises them, sixteen or eight lanes (the
// step is as much arithmetic as memory: a 128 x 128 state is 16k
// multiply-adds a pass, 64 KiB in float32).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn step_avx512<E: StateElement>(
    s: &mut [E],
    p: &Pair<'_>,
    o: &mut [f32],
    scratch: &mut [f32],
) {
    step_portable::<E, true>(s, p, o, scratch);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn step_avx2<E: StateElement>(
    s: &mut [E],
    p: &Pair<'_>,
    o: &mut [f32],
    scratch: &mut [f32],
) {
    step_portable::<E, true>(s, p, o, scratch);
}

/// a * b + c, fused where the caller is compiled with FMA (else a library
/// call would do it, far slower).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[inline(always)]
fn step_portable<E: StateElement, const FMA: bool>(
    s: &mut [E],
    p: &Pair<'_>,
    o: &mut [f32],
    scratch: &mut [f32],
) {
    let dv = o.len();
    if dv == 128 {
        return step_of_width::<E, FMA, 128>(s, p, o, scratch);
    }
    let (recall, delta) = scratch.split_at_mut(dv);
    recall.fill(0.0);
    for (row, &ki) in s.chunks_exact(dv).zip(p.k) {
        for (m, x) in recall.iter_mut().zip(row) {
            *m = madd::<FMA>(x.load(), ki, *m);
        }
    }
    for ((d, &m), &vj) in delta.iter_mut().zip(recall.iter()).zip(p.v) {
        *d = (vj - p.decay * m) * p.beta;
    }
    o.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(p.k).zip(p.q) {
        for ((x, &d), out) in row.iter_mut().zip(delta.iter()).zip(o.iter_mut()) {
            let updated = madd::<FMA>(p.decay, x.load(), ki * d);
            *x = E::store(updated);
            *out = madd::<FMA>(qi, updated, *out);
        }
    }
}

/// The step on a state whose rows are `DV` wide (the models' 128), row
/// after row in memory order, the recall and the output summed in registers
/// across the rows (a narrow state's elements widened as they are loaded
/// and rounded as they are stored): the same arithmetic, in the same order
/// per element, as the loops for any width, in fewer loads and stores.
#[inline(always)]
fn step_of_width<E: StateElement, const FMA: bool, const DV: usize>(
    s: &mut [E],
    p: &Pair<'_>,
    o: &mut [f32],
    scratch: &mut [f32],
) {
    let mut recall = [0f32; DV];
    for (row, &ki) in s.chunks_exact(DV).zip(p.k) {
        let row: &[E; DV] = row.try_into().unwrap();
        for j in 0..DV {
            recall[j] = madd::<FMA>(row[j].load(), ki, recall[j]);
        }
    }
    let delta = &mut scratch[..DV];
    for j in 0..DV {
        delta[j] = (p.v[j] - p.decay * recall[j]) * p.beta;
    }
    let delta: &[f32; DV] = (&*delta).try_into().unwrap();
    let mut out = [0f32; DV];
    for ((row, &ki), &qi) in s.chunks_exact_mut(DV).zip(p.k).zip(p.q) {
        let row: &mut [E; DV] = row.try_into().unwrap();
        for j in 0..DV {
            let updated = madd::<FMA>(p.decay, row[j].load(), ki * delta[j]);
            row[j] = E::store(updated);
            out[j] = madd::<FMA>(qi, updated, out[j]);
        }
    }
    o.copy_from_slice(&out);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule as written: decay, recall, update, read, in f64.
    fn reference(s: &mut [f64], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32) -> Vec<f64> {
        let (dk, dv) = (k.len(), v.len());
        let decay = (g as f64).exp();
        for x in s.iter_mut() {
            *x *= decay;
        }
        let recall: Vec<f64> = (0..dv)
            .map(|j| (0..dk).map(|i| s[i * dv + j] * k[i] as f64).sum())
            .collect();
        for i in 0..dk {
            for j in 0..dv {
                s[i * dv + j] += k[i] as f64 * (v[j] as f64 - recall[j]) * beta as f64;
            }
        }
        (0..dv)
            .map(|j| (0..dk).map(|i| s[i * dv + j] * q[i] as f64).sum())
            .collect()
    }

    #[test]
    fn decode_steps_match_the_rule_over_odd_shapes_and_slots() {
        decode_steps_match_the_rule::<f32>(1e-4);
    }

    /// A bfloat16 pool: the step reads the values it holds and computes in
    /// float32 (the outputs as close to the rule as with a float32 pool);
    /// the state it leaves is the exact one rounded to 8 bits of mantissa.
    #[test]
    fn decode_steps_over_a_bfloat16_pool_round_only_what_they_store() {
        decode_steps_match_the_rule::<Bf16>(1.0 / 256.0);
    }

    fn decode_steps_match_the_rule<E: StateElement>(state_tolerance: f64) {
        let mut seed = 7u64;
        let mut rand = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for &(h, dk, dv) in &[(1, 1, 1), (2, 5, 3), (3, 16, 33), (4, 128, 128)] {
            let slots = [3i64, 0, 2];
            let num_slots = 4;
            let mut states: Vec<E> = (0..num_slots * h * dk * dv)
                .map(|_| E::store(rand()))
                .collect();
            states[h * dk * dv * 2] = E::store(f32::NAN); // slot 2 is a fresh row's: never read
            let mut want: Vec<f64> = states.iter().map(|&x| x.load() as f64).collect();
            let fresh = [false, false, true];
            let b = slots.len();
            let mut n = |len: usize| -> Vec<f32> { (0..len).map(|_| rand()).collect() };
            let (q, k, v) = (n(b * h * dk), n(b * h * dk), n(b * h * dv));
            let g: Vec<f32> = n(b * h).iter().map(|x| x - 0.6).collect();
            let beta: Vec<f32> = n(b * h).iter().map(|x| x + 0.5).collect();
            let args = GatedDeltaDecode {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                beta: &beta,
                slots: &slots,
                fresh: &fresh,
                num_heads: h,
                k_dim: dk,
                v_dim: dv,
            };
            let mut out = vec![0f32; b * h * dv];
            gated_delta_decode(&args, &mut states, &mut out, 3).unwrap();
            for row in 0..b {
                for head in 0..h {
                    let pair = row * h + head;
                    let at = (slots[row] as usize * h + head) * dk * dv;
                    let s = &mut want[at..at + dk * dv];
                    if fresh[row] {
                        s.fill(0.0);
                    }
                    let expected = reference(
                        s,
                        &q[pair * dk..(pair + 1) * dk],
                        &k[pair * dk..(pair + 1) * dk],
                        &v[pair * dv..(pair + 1) * dv],
                        g[pair],
                        beta[pair],
                    );
                    for (j, e) in expected.iter().enumerate() {
                        let got = out[pair * dv + j] as f64;
                        assert!((got - e).abs() < 1e-4 * (1.0 + e.abs()), "{h} {dk} {dv}");
                    }
                }
            }
            for (got, w) in states.iter().zip(&want) {
                let got = got.load() as f64;
                assert!((got - w).abs() < state_tolerance * (1e-3 + w.abs()) || w.is_nan());
            }
        }
    }

    /// Every bfloat16 rounding is to the nearest of the two neighbours
    /// (ties to the even one), over random bit patterns and the edges.
    #[test]
    fn bfloat16_rounds_to_nearest_even() {
        let mut seed = 11u64;
        let mut bits = (0..200_000)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (seed >> 32) as u32
            })
            .collect::<Vec<u32>>();
        bits.extend([
            0,
            0x8000_0000,
            0x3f80_8000,
            0x3f81_8000,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f80_0000,
            0x0000_8000,
            0x0001_8000,
            0x7f80_0001,
            0xffc0_0000,
        ]);
        for b in bits {
            let x = f32::from_bits(b);
            let got = Bf16::store(x).load();
            if !x.is_finite() {
                assert!(
                    got.is_nan() == x.is_nan() && (x.is_nan() || got == x),
                    "{b:#x}"
                );
                continue;
            }
            let down = f32::from_bits(b & 0xffff_0000);
            let up = f32::from_bits((b & 0xffff_0000).wrapping_add(0x1_0000));
            // (past the largest finite value, the next step up is 2^128)
            let up_value = if up.is_infinite() {
                up.signum() as f64 * 2f64.powi(128)
            } else {
                up as f64
            };
            let (dd, du) = ((x as f64 - down as f64).abs(), (up_value - x as f64).abs());
            let want = if dd < du || (dd == du && (b >> 16) & 1 == 0) {
                down
            } else {
                up
            };
            assert_eq!(got.to_bits(), want.to_bits(), "{b:#x}");
        }
    }

    #[test]
    fn a_slot_given_to_two_rows_is_refused() {
        let z = [0f32; 4];
        let args = GatedDeltaDecode {
            q: &z,
            k: &z,
            v: &z,
            g: &z[..2],
            beta: &z[..2],
            slots: &[1, 1],
            fresh: &[false, false],
            num_heads: 1,
            k_dim: 2,
            v_dim: 2,
        };
        let mut states = vec![0f32; 2 * 4];
        let mut out = vec![0f32; 4];
        assert!(gated_delta_decode(&args, &mut states, &mut out, 1).is_err());
    }
}
