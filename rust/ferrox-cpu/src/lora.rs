//! LoRA deltas of one linear layer for a step's tokens, each token under
//! its own adapter (or none): `out[t] += B_a @ (A_a @ x[t])` for token t of
//! adapter a, in one call however many adapters the step mixes.
//!
//! A layer's output may hold several checkpoint modules side by side (q, k
//! and v of a merged projection): its `slices`, column ranges of `out`. An
//! adapter adapts some of them at one rank r: A stacks the A matrices of
//! the slices it adapts ([s * r, K]), and each slice it adapts has its own
//! B ([size, r], the adapter's scale folded in). The tokens of one adapter
//! are gathered once; `h = x_a @ A^T` is one product for all its slices,
//! then per slice each token's row of h, times B^T ([r, size], transposed
//! once when the adapter is added), adds into that slice's columns: r rows
//! of B^T streamed, each scaled by one element of h (a rank is small, so
//! this beats r-long dot products). Adapters run in parallel (their tokens
//! are distinct rows of `out`); A's product is the float32 kernel of
//! `f32_matmul`.

use std::collections::HashMap;

use crate::f32_matmul::{f32_matmul, F32MatmulArgs};
use crate::kv_element::f32_to_f16;
use crate::pool::run_parts;
use crate::quant_matmul::f16_to_f32;
use crate::quant_matmul::{OutPtr, QuantShapeError};

/// One adapter's weights in a layer, as float16 bits: half the bytes a
/// step streams (with several adapters in a step on a small model, the
/// adapters' bytes rival the base model's), widened to float32 per call.
struct Adapter {
    rank: usize,
    a: Vec<u16>,               // [b.len() * rank, K]
    b: Vec<(usize, Vec<u16>)>, // (slice index, B^T [rank, size]) per adapted slice, in A's order
}

pub struct LoraLayer {
    k: usize,
    n: usize,
    slices: Vec<(usize, usize)>, // (first column, columns)
    adapters: HashMap<u32, Adapter>,
}

impl LoraLayer {
    pub fn new(k: usize, n: usize, slices: Vec<(usize, usize)>) -> Result<Self, QuantShapeError> {
        if k == 0
            || slices
                .iter()
                .any(|&(start, size)| size == 0 || start + size > n)
        {
            return Err(QuantShapeError(format!(
                "slices {slices:?} must be non-empty column ranges of {n} columns (K={k})"
            )));
        }
        Ok(Self {
            k,
            n,
            slices,
            adapters: HashMap::new(),
        })
    }

    /// Installs adapter `id` (not 0): `a` is [b.len() * rank, K]; each of
    /// `b` is (slice index, [size of that slice, rank]), the slices in A's
    /// order, each at most once.
    pub fn add(
        &mut self,
        id: u32,
        rank: usize,
        a: Vec<f32>,
        b: Vec<(usize, Vec<f32>)>,
    ) -> Result<(), QuantShapeError> {
        let mut seen = vec![false; self.slices.len()];
        let bad_b = b.iter().any(|(j, w)| {
            let bad = *j >= self.slices.len() || seen[*j] || w.len() != self.slices[*j].1 * rank;
            if !bad {
                seen[*j] = true;
            }
            bad
        });
        if id == 0 || rank == 0 || b.is_empty() || bad_b || a.len() != b.len() * rank * self.k {
            return Err(QuantShapeError(format!(
                "adapter {id}: rank {rank}, A of {} floats and {} B matrices do not fit slices \
                 {:?} of K={}",
                a.len(),
                b.len(),
                self.slices,
                self.k
            )));
        }
        let b = b
            .into_iter()
            .map(|(j, w)| (j, halves(&transposed(&w, self.slices[j].1, rank))))
            .collect();
        let a = halves(&a);
        self.adapters.insert(id, Adapter { rank, a, b });
        Ok(())
    }

    pub fn remove(&mut self, id: u32) -> bool {
        self.adapters.remove(&id).is_some()
    }

    pub fn contains(&self, id: u32) -> bool {
        self.adapters.contains_key(&id)
    }

    /// `out` ([T, N]) += each token's delta; `x` is [T, K], `token_adapters`
    /// [T] (0: the base model, no delta; an adapter this layer does not
    /// hold leaves its tokens as they are).
    pub fn apply(
        &self,
        x: &[f32],
        out: &mut [f32],
        token_adapters: &[u32],
        num_threads: usize,
    ) -> Result<(), QuantShapeError> {
        let t = token_adapters.len();
        if x.len() != t * self.k || out.len() != t * self.n {
            return Err(QuantShapeError(format!(
                "x has {} floats and out {} for {t} tokens of K={} and N={}",
                x.len(),
                out.len(),
                self.k,
                self.n
            )));
        }
        // The tokens of each adapter the layer holds, in order of appearance.
        let mut groups: Vec<(&Adapter, Vec<usize>)> = Vec::new();
        for (i, &id) in token_adapters.iter().enumerate() {
            let Some(adapter) = self.adapters.get(&id) else {
                continue;
            };
            match groups.iter_mut().find(|(a, _)| std::ptr::eq(*a, adapter)) {
                Some((_, rows)) => rows.push(i),
                None => groups.push((adapter, vec![i])),
            }
        }
        let ptr = OutPtr(out.as_mut_ptr());
        // Threads over adapters; those left over split each adapter's A product.
        let threads = num_threads.clamp(1, groups.len().max(1));
        let inner = (num_threads / threads).max(1);
        run_parts(threads, &|part| {
            for (adapter, rows) in groups.iter().skip(part).step_by(threads) {
                // SAFETY: the groups' rows are disjoint rows of `out`, which
                // has T * N floats (checked above).
                unsafe { self.apply_group(adapter, rows, x, ptr, inner) };
            }
        });
        Ok(())
    }

    /// # Safety
    /// `out` points to T * N floats whose rows `rows` no other thread touches.
    unsafe fn apply_group(
        &self,
        adapter: &Adapter,
        rows: &[usize],
        x: &[f32],
        out: OutPtr,
        num_threads: usize,
    ) {
        let (k, n, r, m) = (self.k, self.n, adapter.rank, rows.len());
        let xs: Vec<f32> = rows
            .iter()
            .flat_map(|&i| x[i * k..(i + 1) * k].iter().copied())
            .collect();
        let stacked = adapter.b.len() * r;
        let mut h = vec![0f32; m * stacked];
        let mut a = vec![0f32; adapter.a.len()];
        widen(&adapter.a, &mut a);
        let args = F32MatmulArgs {
            x: &xs,
            w: &a,
            bias: None,
            m,
            k,
            n: stacked,
            num_threads,
        };
        f32_matmul(&args, &mut h).expect("shapes were checked");
        let expand = expand_kernel();
        let mut bt = Vec::new();
        for (pos, (j, bt_half)) in adapter.b.iter().enumerate() {
            let (start, size) = self.slices[*j];
            bt.resize(bt_half.len(), 0.0);
            widen(bt_half, &mut bt);
            for (i, &row) in rows.iter().enumerate() {
                let hi = &h[i * stacked + pos * r..i * stacked + (pos + 1) * r];
                let dst = std::slice::from_raw_parts_mut(out.get().add(row * n + start), size);
                expand(dst, hi, &bt);
            }
        }
    }
}

type Expand = unsafe fn(&mut [f32], &[f32], &[f32]);

/// `out[c] += sum_q h[q] * bt[q][c]` for `bt` = B^T ([rank, size]): each
/// rank's row of B^T streamed once, scaled by one element of h.
fn expand_kernel() -> Expand {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa::avx512() {
            return expand_avx512;
        }
        if crate::isa::avx2() {
            return expand_avx2;
        }
    }
    expand_portable
}

#[inline(always)]
fn expand_fma(out: &mut [f32], h: &[f32], bt: &[f32]) {
    let size = out.len();
    for (q, &c) in h.iter().enumerate() {
        for (o, w) in out.iter_mut().zip(&bt[q * size..(q + 1) * size]) {
            *o = c.mul_add(*w, *o);
        }
    }
}

/// # Safety
/// The CPU has AVX-512F (the loop is compiled for it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn expand_avx512(out: &mut [f32], h: &[f32], bt: &[f32]) {
    expand_fma(out, h, bt)
}

/// # Safety
/// The CPU has AVX2 and FMA (the loop is compiled for them).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn expand_avx2(out: &mut [f32], h: &[f32], bt: &[f32]) {
    expand_fma(out, h, bt)
}

/// # Safety
/// None: portable code (a separate multiply and add, as without FMA).
unsafe fn expand_portable(out: &mut [f32], h: &[f32], bt: &[f32]) {
    let size = out.len();
    for (q, &c) in h.iter().enumerate() {
        for (o, w) in out.iter_mut().zip(&bt[q * size..(q + 1) * size]) {
            *o += c * w;
        }
    }
}

fn halves(w: &[f32]) -> Vec<u16> {
    w.iter().map(|&v| f32_to_f16(v)).collect()
}

/// float16 bits to float32, eight at a time with F16C where the CPU has it.
fn widen(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::avx2() {
        // SAFETY: the CPU has AVX2 and F16C.
        unsafe { widen_f16c(src, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16_to_f32(s);
    }
}

/// # Safety
/// The CPU has AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_f16c(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(i) as *const __m128i));
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), v);
        i += 8;
    }
    for j in i..n {
        dst[j] = f16_to_f32(src[j]);
    }
}

/// `w` ([rows, cols]) transposed: [cols, rows].
fn transposed(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; w.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = w[i * cols + j];
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An adapter as the test keeps it: rank, A, and (slice, B) per slice.
    type Kept = (usize, Vec<f32>, Vec<(usize, Vec<f32>)>);

    fn reference(
        slices: &[(usize, usize)],
        adapters: &HashMap<u32, Kept>,
        x: &[f32],
        out: &mut [f32],
        tokens: &[u32],
        k: usize,
        n: usize,
    ) {
        for (t, id) in tokens.iter().enumerate() {
            let Some((r, a, b)) = adapters.get(id) else {
                continue;
            };
            for (pos, (j, bj)) in b.iter().enumerate() {
                let (start, size) = slices[*j];
                for c in 0..size {
                    let mut acc = 0f64;
                    for i in 0..*r {
                        let row = &a[(pos * r + i) * k..(pos * r + i + 1) * k];
                        let h: f64 = row
                            .iter()
                            .zip(&x[t * k..(t + 1) * k])
                            .map(|(w, v)| (*w as f64) * (*v as f64))
                            .sum();
                        acc += h * bj[c * r + i] as f64;
                    }
                    out[t * n + start + c] += acc as f32;
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn equals_the_reference_over_mixed_tokens(
            k in 1usize..40,
            sizes in prop::collection::vec(1usize..20, 1..4),
            rank in 1usize..9,
            tokens in prop::collection::vec(0u32..5, 0..24),
            threads in 1usize..4,
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut rand = || {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            };
            let mut slices = vec![];
            let mut n = 0;
            for size in &sizes {
                slices.push((n, *size));
                n += size + 1; // a column no slice covers stays as it is
            }
            let mut layer = LoraLayer::new(k, n, slices.clone()).unwrap();
            let mut kept = HashMap::new();
            for id in 1u32..4 { // adapter 4 is never loaded; 0 is the base model
                // adapter id adapts every slice but slice (id % slices) when there are several
                let mine: Vec<usize> = (0..slices.len())
                    .filter(|j| slices.len() == 1 || *j != id as usize % slices.len())
                    .collect();
                // (float16 values: the layer holds its weights as float16)
                let mut half = || f16_to_f32(f32_to_f16(rand()));
                let a: Vec<f32> = (0..mine.len() * rank * k).map(|_| half()).collect();
                let b: Vec<(usize, Vec<f32>)> = mine
                    .iter()
                    .map(|&j| (j, (0..slices[j].1 * rank).map(|_| half()).collect()))
                    .collect();
                layer.add(id, rank, a.clone(), b.clone()).unwrap();
                kept.insert(id, (rank, a, b));
            }
            let t = tokens.len();
            let x: Vec<f32> = (0..t * k).map(|_| rand()).collect();
            let base: Vec<f32> = (0..t * n).map(|_| rand()).collect();
            let mut got = base.clone();
            layer.apply(&x, &mut got, &tokens, threads).unwrap();
            let mut want = base;
            reference(&slices, &kept, &x, &mut want, &tokens, k, n);
            for (g, w) in got.iter().zip(&want) {
                prop_assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{g} vs {w}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(LoraLayer::new(4, 8, vec![(6, 4)]).is_err());
        let mut layer = LoraLayer::new(4, 8, vec![(0, 4), (4, 4)]).unwrap();
        assert!(layer
            .add(0, 1, vec![0.0; 4], vec![(0, vec![0.0; 4])])
            .is_err());
        assert!(layer
            .add(1, 1, vec![0.0; 3], vec![(0, vec![0.0; 4])])
            .is_err());
        assert!(layer
            .add(
                1,
                1,
                vec![0.0; 8],
                vec![(0, vec![0.0; 4]), (0, vec![0.0; 4])]
            )
            .is_err());
        assert!(layer
            .add(1, 1, vec![0.0; 4], vec![(1, vec![0.0; 4])])
            .is_ok());
        assert!(layer.contains(1) && layer.remove(1) && !layer.contains(1));
        let mut out = vec![0.0; 8];
        assert!(layer.apply(&[0.0; 3], &mut out, &[1], 1).is_err());
    }
}
