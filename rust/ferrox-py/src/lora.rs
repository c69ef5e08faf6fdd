//! `CpuLoraLayer`: the LoRA adapters of one linear layer, held in Rust, and
//! their deltas for a step's tokens (`ferrox_cpu::LoraLayer`).

use ferrox_cpu::LoraLayer;
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::invalid_argument;
use crate::kernels::{contiguous, contiguous_mut};

#[pyclass(module = "ferrox._native")]
pub struct CpuLoraLayer {
    inner: LoraLayer,
}

#[pymethods]
impl CpuLoraLayer {
    /// A layer of `in_features` inputs and `out_features` outputs whose
    /// output holds `slices` (first column, columns) an adapter may adapt.
    #[new]
    fn new(in_features: usize, out_features: usize, slices: Vec<(usize, usize)>) -> PyResult<Self> {
        let inner =
            LoraLayer::new(in_features, out_features, slices).map_err(|e| invalid_argument(e.0))?;
        Ok(Self { inner })
    }

    /// Installs adapter `adapter` (not 0): `a` float32 [len(b) * rank,
    /// in_features]; `b`: (slice index, float32 [slice columns, rank]) per
    /// slice it adapts, in A's order, its scale folded in.
    fn add(
        &mut self,
        adapter: u32,
        rank: usize,
        a: PyReadonlyArray2<'_, f32>,
        b: Vec<(usize, PyReadonlyArray2<'_, f32>)>,
    ) -> PyResult<()> {
        let a = contiguous(&a)?.to_vec();
        let b = b
            .iter()
            .map(|(j, w)| Ok((*j, contiguous(w)?.to_vec())))
            .collect::<PyResult<Vec<_>>>()?;
        self.inner
            .add(adapter, rank, a, b)
            .map_err(|e| invalid_argument(e.0))
    }

    fn remove(&mut self, adapter: u32) -> bool {
        self.inner.remove(adapter)
    }

    /// `out` (float32 [T, out_features]) += each token's delta for `x`
    /// (float32 [T, in_features]) under `token_adapters` ([T], 0: none).
    fn apply(
        &self,
        py: Python<'_>,
        x: PyReadonlyArray2<'_, f32>,
        mut out: PyReadwriteArray2<'_, f32>,
        token_adapters: PyReadonlyArray1<'_, u32>,
        num_threads: usize,
    ) -> PyResult<()> {
        if x.shape()[0] != token_adapters.len() {
            return Err(invalid_argument("one adapter per token of x".into()));
        }
        let x = contiguous(&x)?;
        let out = contiguous_mut(&mut out, "out")?;
        let tokens = contiguous(&token_adapters)?;
        let inner = &self.inner;
        py.detach(|| inner.apply(x, out, tokens, num_threads))
            .map_err(|e| invalid_argument(e.0))
    }
}
