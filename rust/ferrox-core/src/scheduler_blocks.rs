//! A running request's blocks: growing its tables, sharing its computed
//! blocks with the prefix cache, giving them back.
//!
//! A model with sliding-window layers has two pools (see
//! `SchedulerConfig::sliding_window`): every request then has two tables of
//! the same length, position `p` in block `p / block_size` of each. The
//! window table's blocks that lie wholly behind the window of the request's
//! next position are given back as soon as the request has computed past
//! them (`drop_behind_window`), so that a running sequence holds at most
//! `SchedulerConfig::window_blocks_for` window blocks however long it grows.
//!
//! ```text
//!  positions:      0 ...................................... c (next)
//!  full table:     [b0][b1][b2][b3][b4][b5][b6][b7][b8]
//!  window table:   [--][--][--][--][w4][w5][w6][w7][w8]
//!                                    ^ first block holding c - window + 1
//! ```

use crate::block_allocator::{BlockAllocator, BlockId, NULL_BLOCK};
use crate::error::Result;
use crate::radix_cache::PrefixMatch;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Gives back a request's blocks and its recurrent-state slot: its
    /// computed full blocks go into the prefix cache (when enabled), the
    /// rest to the pool.
    pub(crate) fn release_blocks(&mut self, slot: usize) -> Result<()> {
        let bs = self.config.block_size;
        let caching = self.config.enable_prefix_caching;
        let req = self.slots[slot].as_mut().expect("live slot");
        let table = std::mem::take(&mut req.block_table);
        let window_table = std::mem::take(&mut req.window_table);
        let num_full = (req.num_computed_tokens / bs).min(table.len());
        let keep = if caching { num_full } else { 0 };
        if keep > 0 {
            let tokens = &req.tokens[..keep * bs];
            let ns = req.params.adapter as u64;
            match self.window_alloc.as_mut() {
                None => self
                    .cache
                    .insert(ns, tokens, &table[..keep], &mut self.alloc)?,
                Some(walloc) => self.cache.insert_windowed(
                    ns,
                    tokens,
                    &table[..keep],
                    &window_table[..keep],
                    &mut self.alloc,
                    walloc,
                )?,
            };
        }
        self.alloc.release(&table[keep..])?;
        if let Some(walloc) = self.window_alloc.as_mut() {
            release_held(walloc, &window_table[keep.min(window_table.len())..])?;
        }
        if let Some(handle) = req.cache_handle.take() {
            self.cache.unlock(handle)?;
        }
        req.num_shared_blocks = 0;
        req.window_start = 0;
        if let Some(state) = req.state_slot.take() {
            self.free_state_slots.push(state);
        }
        req.restore_from = None;
        req.snapshot_boundaries.clear();
        for (id, _) in std::mem::take(&mut req.pending_saves) {
            self.cache.release_snapshot(id)?;
        }
        Ok(())
    }

    /// Puts the computed full blocks of a running request into the prefix
    /// cache so that requests arriving later share them, and adopts the
    /// cache's copy of any block that another request computed first.
    pub(crate) fn share_computed_blocks(&mut self, slot: usize) -> Result<()> {
        let bs = self.config.block_size;
        let req = self.slots[slot].as_mut().expect("live slot");
        let num_full = req.num_computed_tokens / bs;
        if num_full <= req.num_shared_blocks {
            return Ok(());
        }
        let tokens = &req.tokens[..num_full * bs];
        let ns = req.params.adapter as u64;
        self.alloc.share(&req.block_table[..num_full])?;
        let out = match self.window_alloc.as_mut() {
            None => self
                .cache
                .insert(ns, tokens, &req.block_table[..num_full], &mut self.alloc)?,
            Some(walloc) => {
                let window = &req.window_table[..num_full];
                share_held(walloc, window)?;
                self.cache.insert_windowed(
                    ns,
                    tokens,
                    &req.block_table[..num_full],
                    window,
                    &mut self.alloc,
                    walloc,
                )?
            }
        };
        let path = self.cache.path_blocks(out.handle)?;
        for (own, &cached) in req.block_table.iter_mut().zip(&path) {
            if *own != cached {
                self.alloc.share(&[cached])?;
                self.alloc.release_one(*own)?;
                *own = cached;
            }
        }
        if let Some(walloc) = self.window_alloc.as_mut() {
            let path = self.cache.path_window_blocks(out.handle)?;
            for (own, &cached) in req.window_table.iter_mut().zip(&path) {
                if *own != NULL_BLOCK && cached != NULL_BLOCK && *own != cached {
                    walloc.share(&[cached])?;
                    walloc.release_one(*own)?;
                    *own = cached;
                }
            }
        }
        self.cache.lock(out.handle)?;
        if let Some(old) = req.cache_handle.replace(out.handle) {
            self.cache.unlock(old)?;
        }
        req.num_shared_blocks = num_full;
        Ok(())
    }

    /// Gives back the window blocks that lie wholly behind the window of the
    /// request's next position (none without a window pool).
    pub(crate) fn drop_behind_window(&mut self, slot: usize) -> Result<()> {
        let (Some(window), Some(walloc)) = (self.config.sliding_window, self.window_alloc.as_mut())
        else {
            return Ok(());
        };
        let bs = self.config.block_size;
        let req = self.slots[slot].as_mut().expect("live slot");
        // The next position c reads c - window + 1 and later.
        let first_read = (req.num_computed_tokens + 1).saturating_sub(window);
        let end = (first_read / bs).min(req.window_table.len());
        for entry in &mut req.window_table[req.window_start.min(end)..end] {
            if *entry != NULL_BLOCK {
                walloc.release_one(*entry)?;
                *entry = NULL_BLOCK;
            }
        }
        req.window_start = req.window_start.max(end);
        Ok(())
    }

    /// Takes a prefix hit's blocks into a request being admitted: the full
    /// pool's all, the window pool's only those its next position reads.
    pub(crate) fn adopt_hit(&mut self, slot: usize, hit: PrefixMatch) -> Result<()> {
        self.alloc.share(&hit.blocks)?;
        let mut window_table = Vec::new();
        if let (Some(window), Some(walloc)) =
            (self.config.sliding_window, self.window_alloc.as_mut())
        {
            let bs = self.config.block_size;
            let first = (hit.num_tokens + 1).saturating_sub(window) / bs;
            window_table = hit.window_blocks;
            for entry in &mut window_table[..first.min(hit.blocks.len())] {
                *entry = NULL_BLOCK;
            }
            share_held(walloc, &window_table)?;
        }
        let req = self.req_mut(slot);
        req.block_table = hit.blocks;
        req.window_table = window_table;
        req.cache_handle = Some(hit.handle);
        Ok(())
    }

    /// Makes `num_blocks` free blocks available in each pool (evicting from
    /// the cache as needed) and appends them to the request's tables; false
    /// if impossible (then nothing changed).
    pub(crate) fn grow_table(&mut self, slot: usize, num_blocks: usize) -> Result<bool> {
        if num_blocks == 0 {
            return Ok(true);
        }
        if !self.has_room(num_blocks) {
            return Ok(false);
        }
        let free = self.alloc.num_free();
        match self.window_alloc.as_mut() {
            None => {
                if free < num_blocks {
                    self.cache.evict(num_blocks - free, &mut self.alloc)?;
                }
            }
            Some(walloc) => {
                if free < num_blocks {
                    self.cache
                        .evict_windowed(num_blocks - free, &mut self.alloc, walloc)?;
                }
                let wfree = walloc.num_free();
                if wfree < num_blocks {
                    self.cache.evict_window(num_blocks - wfree, walloc)?;
                }
            }
        }
        let req = self.slots[slot].as_mut().expect("live slot");
        self.alloc.allocate_into(num_blocks, &mut req.block_table)?;
        if let Some(walloc) = self.window_alloc.as_mut() {
            walloc.allocate_into(num_blocks, &mut req.window_table)?;
        }
        Ok(true)
    }

    /// Whether each pool can give `num_blocks` blocks, counting what the
    /// cache would let go of.
    pub(crate) fn has_room(&self, num_blocks: usize) -> bool {
        let full = self.alloc.num_free() + self.cache.num_evictable_blocks() >= num_blocks;
        full && self
            .window_alloc
            .as_ref()
            .is_none_or(|w| w.num_free() + w.num_cached_only() >= num_blocks)
    }

    /// `has_room` for a request about to take the prefix hit `hit`: the
    /// window blocks it will share are evictable no more.
    pub(crate) fn has_room_after(&self, num_blocks: usize, hit: Option<&PrefixMatch>) -> bool {
        let (Some(window), Some(walloc), Some(hit)) =
            (self.config.sliding_window, self.window_alloc.as_ref(), hit)
        else {
            return self.has_room(num_blocks);
        };
        let first = (hit.num_tokens + 1).saturating_sub(window) / self.config.block_size;
        let pinned = hit.window_blocks[first.min(hit.window_blocks.len())..]
            .iter()
            .filter(|&&w| walloc.is_cached_only(w))
            .count();
        self.has_room(num_blocks)
            && walloc.num_free() + walloc.num_cached_only() >= num_blocks + pinned
    }

    /// Drops every prefix-cache entry no request is using; returns how many
    /// blocks went back to the pools.
    pub fn reset_prefix_cache(&mut self) -> Result<usize> {
        match self.window_alloc.as_mut() {
            None => self.cache.evict(usize::MAX, &mut self.alloc),
            Some(walloc) => {
                let full = self
                    .cache
                    .evict_windowed(usize::MAX, &mut self.alloc, walloc)?;
                Ok(full + self.cache.evict_window(usize::MAX, walloc)?)
            }
        }
    }
}

/// Adds a reference to each held (not null) block of a window table.
fn share_held(walloc: &mut BlockAllocator, table: &[BlockId]) -> Result<()> {
    for &w in table.iter().filter(|&&w| w != NULL_BLOCK) {
        walloc.share(&[w])?;
    }
    Ok(())
}

/// Drops a reference of each held block of a window table.
fn release_held(walloc: &mut BlockAllocator, table: &[BlockId]) -> Result<()> {
    for &w in table.iter().filter(|&&w| w != NULL_BLOCK) {
        walloc.release_one(w)?;
    }
    Ok(())
}
