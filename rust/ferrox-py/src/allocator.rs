//! `ferrox._native.BlockAllocator`.

use ferrox_core::BlockAllocator;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

use crate::convert::extract_ids;
use crate::errors::OrRaise;

/// A fixed pool of paged-KV blocks with reference counts.
#[pyclass(name = "BlockAllocator", module = "ferrox._native")]
pub struct PyBlockAllocator {
    pub inner: BlockAllocator,
}

#[pymethods]
impl PyBlockAllocator {
    #[new]
    fn new(num_blocks: usize, block_size: usize) -> PyResult<Self> {
        Ok(Self {
            inner: BlockAllocator::new(num_blocks, block_size).or_raise()?,
        })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }
    #[getter]
    fn num_used(&self) -> usize {
        self.inner.num_used()
    }

    /// Takes `n` free blocks (all or nothing); each starts with one reference.
    fn allocate<'py>(&mut self, py: Python<'py>, n: usize) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let inner = &mut self.inner;
        let blocks = py.detach(|| inner.allocate(n)).or_raise()?;
        Ok(blocks.into_pyarray(py))
    }

    /// Drops one reference of each block (all or nothing).
    fn free(&mut self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let blocks = extract_ids(blocks, "blocks")?;
        let inner = &mut self.inner;
        py.detach(|| inner.release(&blocks)).or_raise()
    }

    /// Adds one reference to each block (all or nothing).
    fn share(&mut self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let blocks = extract_ids(blocks, "blocks")?;
        let inner = &mut self.inner;
        py.detach(|| inner.share(&blocks)).or_raise()
    }

    fn ref_count(&self, block: i64) -> PyResult<u32> {
        let block = u32::try_from(block).map_err(|_| {
            crate::errors::invalid_argument(format!("block id {block} is out of range"))
        })?;
        self.inner.ref_count(block).or_raise()
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| inner.check_integrity()).or_raise()
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockAllocator(num_blocks={}, block_size={}, num_free={})",
            self.inner.num_blocks(),
            self.inner.block_size(),
            self.inner.num_free()
        )
    }
}
