//! `ferrox._native.RadixCache`, bound to one `BlockAllocator`.

use ferrox_core::{NodeHandle, RadixCache};
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

use crate::allocator::PyBlockAllocator;
use crate::convert::extract_ids;
use crate::errors::OrRaise;

/// Radix tree over token ids caching whole KV blocks of finished sequences.
#[pyclass(name = "RadixCache", module = "ferrox._native")]
pub struct PyRadixCache {
    inner: RadixCache,
    allocator: Py<PyBlockAllocator>,
}

#[pymethods]
impl PyRadixCache {
    #[new]
    fn new(allocator: Bound<'_, PyBlockAllocator>) -> PyResult<Self> {
        let (block_size, num_blocks) = {
            let a = allocator.borrow();
            (a.inner.block_size(), a.inner.num_blocks())
        };
        Ok(Self {
            inner: RadixCache::new(block_size, num_blocks).or_raise()?,
            allocator: allocator.unbind(),
        })
    }

    #[getter]
    fn allocator(&self, py: Python<'_>) -> Py<PyBlockAllocator> {
        self.allocator.clone_ref(py)
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.inner.num_cached_blocks()
    }
    #[getter]
    fn num_evictable_blocks(&self) -> usize {
        self.inner.num_evictable_blocks()
    }
    #[getter]
    fn num_locked_blocks(&self) -> usize {
        self.inner.num_locked_blocks()
    }
    #[getter]
    fn num_queried_tokens(&self) -> u64 {
        self.inner.num_queried_tokens()
    }
    #[getter]
    fn num_hit_tokens(&self) -> u64 {
        self.inner.num_hit_tokens()
    }
    #[getter]
    fn num_evicted_blocks(&self) -> u64 {
        self.inner.num_evicted_blocks()
    }
    #[getter]
    fn num_nodes(&self) -> usize {
        self.inner.num_nodes()
    }

    /// Longest cached block-aligned prefix: `(block_ids, num_matched_tokens,
    /// handle)`, where `handle` names the node ending at the match (for
    /// `lock`). Counted in the hit statistics. `namespace`: only sequences
    /// inserted under the same one match.
    #[pyo3(signature = (tokens, namespace = 0))]
    fn match_prefix<'py>(
        &mut self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        namespace: u64,
    ) -> PyResult<(Bound<'py, PyArray1<u32>>, usize, u64)> {
        let tokens = extract_ids(tokens, "tokens")?;
        let inner = &mut self.inner;
        let found = py.detach(|| inner.match_prefix(namespace, &tokens));
        Ok((
            found.blocks.into_pyarray(py),
            found.num_tokens,
            found.handle.0,
        ))
    }

    /// Caches a sequence's full blocks, taking over one reference of each
    /// block given; returns `(handle, num_new_blocks)`.
    #[pyo3(signature = (tokens, blocks, namespace = 0))]
    fn insert(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        namespace: u64,
    ) -> PyResult<(u64, usize)> {
        let tokens = extract_ids(tokens, "tokens")?;
        let blocks = extract_ids(blocks, "blocks")?;
        let mut allocator = self.allocator.borrow_mut(py);
        let alloc = &mut allocator.inner;
        let inner = &mut self.inner;
        let out = py
            .detach(|| inner.insert(namespace, &tokens, &blocks, alloc))
            .or_raise()?;
        Ok((out.handle.0, out.num_new_blocks))
    }

    fn lock(&mut self, handle: u64) -> PyResult<()> {
        self.inner.lock(NodeHandle(handle)).or_raise()
    }

    fn unlock(&mut self, handle: u64) -> PyResult<()> {
        self.inner.unlock(NodeHandle(handle)).or_raise()
    }

    /// Frees up to `num_blocks` blocks of least recently used unlocked leaves;
    /// returns how many were freed.
    fn evict(&mut self, py: Python<'_>, num_blocks: usize) -> PyResult<usize> {
        let mut allocator = self.allocator.borrow_mut(py);
        let alloc = &mut allocator.inner;
        let inner = &mut self.inner;
        py.detach(|| inner.evict(num_blocks, alloc)).or_raise()
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let allocator = self.allocator.borrow(py);
        let alloc = &allocator.inner;
        let inner = &self.inner;
        py.detach(|| inner.check_integrity(alloc)).or_raise()
    }

    fn __repr__(&self) -> String {
        format!(
            "RadixCache(block_size={}, cached_blocks={}, locked_blocks={})",
            self.inner.block_size(),
            self.inner.num_cached_blocks(),
            self.inner.num_locked_blocks()
        )
    }
}
