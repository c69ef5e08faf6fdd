//! Fixed pool of paged-KV blocks with reference counts.
//!
//! Allocation pops from a free stack and release pushes back, so both are O(1)
//! per block. A block shared by several owners (running requests, the radix
//! cache) is returned to the pool only when its last reference is released.
//!
//! A pool may also count the blocks whose only reference is the prefix
//! cache's (`mark_cached`): the sliding-window pool evicts those whatever
//! the tree's locks, since no running request reads them.

use crate::error::{ensure, CoreError, Result};

pub type BlockId = u32;

/// A table entry whose block was given back (a sliding-window position
/// outside every window that reads it).
pub const NULL_BLOCK: BlockId = BlockId::MAX;

#[derive(Debug, Clone)]
pub struct BlockAllocator {
    block_size: usize,
    ref_counts: Vec<u32>,
    free_ids: Vec<BlockId>,
    /// By block id: whether the prefix cache holds one of its references.
    cached: Vec<bool>,
    /// Blocks whose one reference is the cache's.
    num_cached_only: usize,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if num_blocks == 0 || num_blocks > u32::MAX as usize {
            return Err(CoreError::InvalidArgument(format!(
                "num_blocks must be in [1, {}], got {num_blocks}",
                u32::MAX
            )));
        }
        if block_size == 0 {
            return Err(CoreError::InvalidArgument(
                "block_size must be positive".into(),
            ));
        }
        // Reverse so that block 0 is handed out first.
        let free_ids = (0..num_blocks as BlockId).rev().collect();
        Ok(Self {
            block_size,
            ref_counts: vec![0; num_blocks],
            free_ids,
            cached: vec![false; num_blocks],
            num_cached_only: 0,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free_ids.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    fn check_id(&self, block: BlockId) -> Result<usize> {
        let idx = block as usize;
        if idx >= self.ref_counts.len() {
            return Err(CoreError::BlockOutOfRange {
                block,
                num_blocks: self.ref_counts.len(),
            });
        }
        Ok(idx)
    }

    pub fn ref_count(&self, block: BlockId) -> Result<u32> {
        Ok(self.ref_counts[self.check_id(block)?])
    }

    /// Records whether the prefix cache holds a reference of `block` (an
    /// allocated one): the cache calls it when it takes or drops a block.
    pub fn mark_cached(&mut self, block: BlockId, cached: bool) -> Result<()> {
        let idx = self.check_id(block)?;
        if self.ref_counts[idx] == 0 {
            return Err(CoreError::BlockNotAllocated { block });
        }
        if self.cached[idx] != cached && self.ref_counts[idx] == 1 {
            if cached {
                self.num_cached_only += 1;
            } else {
                self.num_cached_only -= 1;
            }
        }
        self.cached[idx] = cached;
        Ok(())
    }

    /// Whether the cache's reference is the block's only one.
    pub fn is_cached_only(&self, block: BlockId) -> bool {
        let idx = block as usize;
        idx < self.ref_counts.len() && self.cached[idx] && self.ref_counts[idx] == 1
    }

    /// Blocks whose only reference is the cache's (evictable at once).
    pub fn num_cached_only(&self) -> usize {
        self.num_cached_only
    }

    /// Bookkeeping of one reference count change of block `idx`.
    fn on_count_change(&mut self, idx: usize, old: u32) {
        if self.cached[idx] {
            let new = self.ref_counts[idx];
            if old == 1 && new != 1 {
                self.num_cached_only -= 1;
            } else if new == 1 && old != 1 {
                self.num_cached_only += 1;
            }
        }
    }

    /// Takes one free block with a reference count of one.
    pub fn allocate_one(&mut self) -> Result<BlockId> {
        let block = self.free_ids.pop().ok_or(CoreError::OutOfBlocks {
            requested: 1,
            available: 0,
        })?;
        self.ref_counts[block as usize] = 1;
        Ok(block)
    }

    /// Appends `n` fresh blocks to `out`; all or nothing.
    pub fn allocate_into(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<()> {
        if n > self.free_ids.len() {
            return Err(CoreError::OutOfBlocks {
                requested: n,
                available: self.free_ids.len(),
            });
        }
        let start = self.free_ids.len() - n;
        for &block in self.free_ids[start..].iter().rev() {
            self.ref_counts[block as usize] = 1;
            out.push(block);
        }
        self.free_ids.truncate(start);
        Ok(())
    }

    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>> {
        let mut out = Vec::with_capacity(n);
        self.allocate_into(n, &mut out)?;
        Ok(out)
    }

    /// Adds one reference to each block (a new owner shares it).
    pub fn share(&mut self, blocks: &[BlockId]) -> Result<()> {
        for &block in blocks {
            let idx = self.check_id(block)?;
            if self.ref_counts[idx] == 0 {
                return Err(CoreError::BlockNotAllocated { block });
            }
        }
        for &block in blocks {
            let idx = block as usize;
            self.ref_counts[idx] += 1;
            self.on_count_change(idx, self.ref_counts[idx] - 1);
        }
        Ok(())
    }

    pub fn release_one(&mut self, block: BlockId) -> Result<()> {
        let idx = self.check_id(block)?;
        match self.ref_counts[idx] {
            0 => Err(CoreError::BlockNotAllocated { block }),
            1 => {
                self.ref_counts[idx] = 0;
                self.on_count_change(idx, 1);
                self.cached[idx] = false;
                self.free_ids.push(block);
                Ok(())
            }
            old => {
                self.ref_counts[idx] -= 1;
                self.on_count_change(idx, old);
                Ok(())
            }
        }
    }

    /// Drops one reference from each block; a block whose count reaches zero
    /// returns to the pool. All or nothing: a bad id (or one block listed more
    /// often than it is referenced) fails the call with nothing released.
    pub fn release(&mut self, blocks: &[BlockId]) -> Result<()> {
        for (i, &block) in blocks.iter().enumerate() {
            let failure = match self.check_id(block) {
                Err(e) => Some(e),
                Ok(idx) if self.ref_counts[idx] == 0 => {
                    Some(CoreError::BlockNotAllocated { block })
                }
                Ok(idx) => {
                    self.ref_counts[idx] -= 1;
                    None
                }
            };
            if let Some(err) = failure {
                for &undo in &blocks[..i] {
                    self.ref_counts[undo as usize] += 1;
                }
                return Err(err);
            }
        }
        // Valid: undo the trial and release one by one.
        for &block in blocks {
            self.ref_counts[block as usize] += 1;
        }
        for &block in blocks {
            self.release_one(block)?;
        }
        Ok(())
    }

    /// free + referenced == total; no id both free and referenced; no id free twice.
    pub fn check_integrity(&self) -> Result<()> {
        let mut is_free = vec![false; self.num_blocks()];
        for &block in &self.free_ids {
            let idx = block as usize;
            ensure!(
                idx < is_free.len(),
                "free list holds out-of-range block {block}"
            );
            ensure!(!is_free[idx], "block {block} is on the free list twice");
            ensure!(
                self.ref_counts[idx] == 0,
                "block {block} is free but has {} references",
                self.ref_counts[idx]
            );
            is_free[idx] = true;
        }
        let cached_only = (0..self.num_blocks())
            .filter(|&i| self.cached[i] && self.ref_counts[i] == 1)
            .count();
        ensure!(
            cached_only == self.num_cached_only,
            "{cached_only} blocks held by the cache alone, counter says {}",
            self.num_cached_only
        );
        ensure!(
            (0..self.num_blocks()).all(|i| !self.cached[i] || self.ref_counts[i] > 0),
            "a free block is marked cached"
        );
        let referenced = self.ref_counts.iter().filter(|&&c| c > 0).count();
        ensure!(
            referenced + self.free_ids.len() == self.num_blocks(),
            "free ({}) + referenced ({referenced}) != total ({})",
            self.free_ids.len(),
            self.num_blocks()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_and_release_round_trip() {
        let mut alloc = BlockAllocator::new(4, 16).unwrap();
        let blocks = alloc.allocate(3).unwrap();
        assert_eq!(blocks, vec![0, 1, 2]);
        assert_eq!(alloc.num_free(), 1);
        alloc.release(&blocks).unwrap();
        assert_eq!(alloc.num_free(), 4);
        alloc.check_integrity().unwrap();
    }

    #[test]
    fn out_of_blocks_changes_nothing() {
        let mut alloc = BlockAllocator::new(2, 16).unwrap();
        let err = alloc.allocate(3).unwrap_err();
        assert_eq!(
            err,
            CoreError::OutOfBlocks {
                requested: 3,
                available: 2
            }
        );
        assert_eq!(alloc.num_free(), 2);
        alloc.check_integrity().unwrap();
    }

    #[test]
    fn shared_block_is_freed_by_last_owner() {
        let mut alloc = BlockAllocator::new(2, 16).unwrap();
        let b = alloc.allocate_one().unwrap();
        alloc.share(&[b]).unwrap();
        assert_eq!(alloc.ref_count(b).unwrap(), 2);
        alloc.release_one(b).unwrap();
        assert_eq!(alloc.num_free(), 1);
        alloc.release_one(b).unwrap();
        assert_eq!(alloc.num_free(), 2);
        alloc.check_integrity().unwrap();
    }

    #[test]
    fn double_free_is_an_error_and_atomic() {
        let mut alloc = BlockAllocator::new(4, 16).unwrap();
        let blocks = alloc.allocate(2).unwrap();
        let err = alloc
            .release(&[blocks[0], blocks[1], blocks[0]])
            .unwrap_err();
        assert_eq!(err, CoreError::BlockNotAllocated { block: blocks[0] });
        assert_eq!(alloc.num_free(), 2);
        assert_eq!(alloc.ref_count(blocks[0]).unwrap(), 1);
        alloc.check_integrity().unwrap();
        alloc.release(&blocks).unwrap();
        assert!(matches!(
            alloc.release_one(blocks[0]),
            Err(CoreError::BlockNotAllocated { .. })
        ));
    }

    #[test]
    fn out_of_range_ids_are_rejected() {
        let mut alloc = BlockAllocator::new(4, 16).unwrap();
        assert!(matches!(
            alloc.release(&[7]),
            Err(CoreError::BlockOutOfRange { block: 7, .. })
        ));
        assert!(matches!(
            alloc.share(&[4]),
            Err(CoreError::BlockOutOfRange { .. })
        ));
        assert!(alloc.ref_count(100).is_err());
        alloc.check_integrity().unwrap();
    }

    #[test]
    fn cached_only_blocks_are_counted() {
        let mut alloc = BlockAllocator::new(4, 16).unwrap();
        let b = alloc.allocate(2).unwrap();
        alloc.mark_cached(b[0], true).unwrap();
        assert_eq!(alloc.num_cached_only(), 1);
        alloc.share(&[b[0], b[0]]).unwrap();
        assert_eq!(alloc.num_cached_only(), 0);
        alloc.release(&[b[0], b[1]]).unwrap();
        assert_eq!(alloc.num_cached_only(), 0);
        alloc.release_one(b[0]).unwrap();
        assert!(alloc.is_cached_only(b[0]));
        assert_eq!(alloc.num_cached_only(), 1);
        alloc.check_integrity().unwrap();
        alloc.mark_cached(b[0], false).unwrap();
        alloc.release_one(b[0]).unwrap();
        assert_eq!((alloc.num_cached_only(), alloc.num_free()), (0, 4));
        assert!(alloc.mark_cached(b[0], true).is_err());
        alloc.check_integrity().unwrap();
    }

    #[test]
    fn bad_config_is_rejected() {
        assert!(BlockAllocator::new(0, 16).is_err());
        assert!(BlockAllocator::new(4, 0).is_err());
    }
}
