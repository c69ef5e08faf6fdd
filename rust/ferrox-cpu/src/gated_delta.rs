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

#[derive(Clone, Copy)]
struct StatePtr(*mut f32);
unsafe impl Send for StatePtr {}
unsafe impl Sync for StatePtr {}

impl StatePtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Runs the step for every row; `states` is the pool [S, H, Dk, Dv],
/// `out` [B, H, Dv].
pub fn gated_delta_decode(
    args: &GatedDeltaDecode<'_>,
    states: &mut [f32],
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
    let state_ptr = StatePtr(states.as_mut_ptr());
    let out_ptr = StatePtr(out.as_mut_ptr());
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
                s.fill(0.0);
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

fn step(s: &mut [f32], p: &Pair<'_>, o: &mut [f32], scratch: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::avx2() {
        // SAFETY: the features were detected.
        unsafe { step_avx2(s, p, o, scratch) };
        return;
    }
    step_portable(s, p, o, scratch);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn step_avx2(s: &mut [f32], p: &Pair<'_>, o: &mut [f32], scratch: &mut [f32]) {
    // (the same loops, compiled for AVX2 + FMA: the compiler vectorises them)
    step_portable(s, p, o, scratch);
}

#[inline(always)]
fn step_portable(s: &mut [f32], p: &Pair<'_>, o: &mut [f32], scratch: &mut [f32]) {
    let dv = o.len();
    let (recall, delta) = scratch.split_at_mut(dv);
    recall.fill(0.0);
    for (row, &ki) in s.chunks_exact(dv).zip(p.k) {
        for (m, &x) in recall.iter_mut().zip(row) {
            *m += x * ki;
        }
    }
    for ((d, &m), &vj) in delta.iter_mut().zip(recall.iter()).zip(p.v) {
        *d = (vj - p.decay * m) * p.beta;
    }
    o.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(p.k).zip(p.q) {
        for ((x, &d), out) in row.iter_mut().zip(delta.iter()).zip(o.iter_mut()) {
            let updated = p.decay * *x + ki * d;
            *x = updated;
            *out += qi * updated;
        }
    }
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
            let mut states: Vec<f32> = (0..num_slots * h * dk * dv).map(|_| rand()).collect();
            states[h * dk * dv * 2] = f32::NAN; // slot 2 is a fresh row's: never read
            let mut want: Vec<f64> = states.iter().map(|&x| x as f64).collect();
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
                assert!((*got as f64 - w).abs() < 1e-4 * (1.0 + w.abs()) || w.is_nan());
            }
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
