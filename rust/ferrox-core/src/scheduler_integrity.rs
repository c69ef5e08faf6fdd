//! The scheduler's invariants as code, callable from tests and when idle.

use crate::block_allocator::NULL_BLOCK;
use crate::error::{ensure, Result};
use crate::radix_cache::NodeHandle;
use crate::request::{Request, RequestStatus};
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Checks the allocator, the cache and every request against each other:
    /// each block's reference count equals its owners (the cache plus the
    /// requests whose tables hold it), free + used + cached == total, a
    /// running request's shared prefix is exactly its locked cache path, and
    /// each request is either waiting (holding nothing) or running.
    pub fn check_integrity(&self) -> Result<()> {
        self.alloc.check_integrity()?;
        self.cache.check_integrity(&self.alloc)?;
        if let Some(walloc) = &self.window_alloc {
            walloc.check_integrity()?;
            self.cache.check_window_integrity(walloc)?;
        }
        let cfg = &self.config;
        let num_blocks = self.alloc.num_blocks();
        let mut owners = vec![0u32; num_blocks];
        let mut window_owners = vec![0u32; cfg.num_window_blocks];
        let mut num_live = 0;
        for (slot, entry) in self.slots.iter().enumerate() {
            let Some(req) = entry else { continue };
            num_live += 1;
            ensure!(
                self.index.get(&req.id) == Some(&slot),
                "request {} is not indexed at its slot",
                req.id
            );
            let key = self.priority_key(req);
            let is_waiting = self.waiting.contains(&(key, req.arrival, slot));
            let is_running = self.running.contains(&slot);
            match req.status {
                RequestStatus::Waiting => {
                    ensure!(is_waiting && !is_running, "request {} is misfiled", req.id);
                    ensure!(
                        req.block_table.is_empty()
                            && req.window_table.is_empty()
                            && req.cache_handle.is_none()
                            && req.state_slot.is_none(),
                        "waiting request {} holds blocks",
                        req.id
                    );
                    ensure!(
                        req.num_computed_tokens == 0,
                        "waiting request {} has KV",
                        req.id
                    );
                }
                RequestStatus::Running => {
                    ensure!(is_running && !is_waiting, "request {} is misfiled", req.id);
                    ensure!(
                        req.block_table.len() * cfg.block_size >= req.num_computed_tokens,
                        "request {} computed more tokens than its blocks hold",
                        req.id
                    );
                    ensure!(
                        req.num_computed_tokens < req.num_tokens(),
                        "running request {} has no pending token",
                        req.id
                    );
                    self.check_window_table(req)?;
                    ensure!(
                        req.state_slot.is_some() == (cfg.num_state_slots > 0),
                        "running request {} holds state slot {:?} of {}",
                        req.id,
                        req.state_slot,
                        cfg.num_state_slots
                    );
                    if let Some(handle) = req.cache_handle {
                        ensure!(
                            self.cache.is_locked(handle)?,
                            "request {} uses an unlocked cache path",
                            req.id
                        );
                        let ns = self.cache.namespace_of(handle)?;
                        ensure!(
                            ns == req.params.adapter as u64 || path_is_empty(&self.cache, handle)?,
                            "request {} of adapter {} shares namespace {ns}'s blocks",
                            req.id,
                            req.params.adapter
                        );
                        let path = self.cache.path_blocks(handle)?;
                        ensure!(
                            path.len() == req.num_shared_blocks
                                && req.block_table.starts_with(&path),
                            "request {} does not share its cache path",
                            req.id
                        );
                    } else {
                        ensure!(
                            req.num_shared_blocks == 0 && !cfg.enable_prefix_caching,
                            "running request {} holds no cache lock",
                            req.id
                        );
                    }
                }
            }
            for &block in &req.block_table {
                owners[block as usize] += 1;
            }
            for &block in req.window_table.iter().filter(|&&b| b != NULL_BLOCK) {
                window_owners[block as usize] += 1;
            }
        }
        ensure!(num_live == self.index.len(), "index and slots disagree");
        ensure!(
            num_live == self.waiting.len() + self.running.len(),
            "{num_live} requests, {} waiting + {} running",
            self.waiting.len(),
            self.running.len()
        );
        ensure!(
            self.running.len() <= cfg.max_num_seqs,
            "{} running requests exceed max_num_seqs",
            self.running.len()
        );
        let adapters = self.running_adapters();
        ensure!(
            adapters.len() <= cfg.max_adapters,
            "{} adapters running, max_adapters is {}",
            adapters.len(),
            cfg.max_adapters
        );
        self.check_state_slots()?;
        let (mut used, mut cached, mut free) = (0, 0, 0);
        for block in 0..num_blocks as u32 {
            let in_tree = self.cache.contains_block(block);
            let requests = owners[block as usize];
            ensure!(
                self.alloc.ref_count(block)? == requests + in_tree as u32,
                "block {block}: {} references for {requests} requests and cache={in_tree}",
                self.alloc.ref_count(block)?
            );
            match (requests > 0, in_tree) {
                (true, _) => used += 1,
                (false, true) => cached += 1,
                (false, false) => free += 1,
            }
        }
        ensure!(
            free + used + cached == num_blocks && free == self.alloc.num_free(),
            "free {free} + used {used} + cached {cached} != {num_blocks}"
        );
        ensure!(
            cached == self.cache.num_evictable_blocks(),
            "{cached} blocks held only by the cache, {} evictable",
            self.cache.num_evictable_blocks()
        );
        if let Some(walloc) = &self.window_alloc {
            for (block, &requests) in window_owners.iter().enumerate() {
                let block = block as u32;
                let in_tree = self.cache.contains_window_block(block);
                ensure!(
                    walloc.ref_count(block)? == requests + in_tree as u32,
                    "window block {block}: {} references for {requests} requests and \
                     cache={in_tree}",
                    walloc.ref_count(block)?
                );
            }
        }
        Ok(())
    }

    /// Every recurrent-state slot is either free or held by exactly one
    /// running request; the snapshots reserved are those the outstanding
    /// step writes.
    fn check_state_slots(&self) -> Result<()> {
        let mut pending = 0;
        for req in self.slots.iter().flatten() {
            pending += req.pending_saves.len();
            ensure!(
                self.outstanding_step.is_some()
                    || (req.pending_saves.is_empty() && req.restore_from.is_none()),
                "request {} holds a step's snapshots outside a step",
                req.id
            );
        }
        ensure!(
            pending == self.cache.num_reserved_snapshots(),
            "{pending} snapshots planned, {} reserved",
            self.cache.num_reserved_snapshots()
        );
        let n = self.config.num_state_slots;
        let mut holders = vec![0u32; n];
        for &s in &self.free_state_slots {
            ensure!((s as usize) < n, "free state slot {s} is out of range");
            holders[s as usize] += 1;
        }
        for &slot in &self.running {
            if let Some(s) = self.req(slot).state_slot {
                ensure!((s as usize) < n, "state slot {s} is out of range");
                holders[s as usize] += 1;
            }
        }
        if let Some(s) = holders.iter().position(|&h| h != 1) {
            return Err(crate::error::CoreError::Integrity(format!(
                "state slot {s} is free or held {} times",
                holders[s]
            )));
        }
        Ok(())
    }

    /// A running request's window table: as long as its block table, its
    /// blocks behind the window given back, every block from the window's
    /// first on held, and what it shares with its cache path the cache's.
    fn check_window_table(&self, req: &Request) -> Result<()> {
        let Some(window) = self.config.sliding_window else {
            ensure!(
                req.window_table.is_empty(),
                "request {} has a window table",
                req.id
            );
            return Ok(());
        };
        let table = &req.window_table;
        ensure!(
            table.len() == req.block_table.len(),
            "request {}: {} window blocks for {} blocks",
            req.id,
            table.len(),
            req.block_table.len()
        );
        let first = (req.num_computed_tokens + 1).saturating_sub(window) / self.config.block_size;
        for (j, &b) in table.iter().enumerate() {
            ensure!(
                (j < first) == (b == NULL_BLOCK),
                "request {}: window block {j} is {b} (the window starts in block {first})",
                req.id
            );
        }
        if let Some(handle) = req.cache_handle {
            let path = self.cache.path_window_blocks(handle)?;
            for (j, (&own, &cached)) in table.iter().zip(&path).enumerate() {
                ensure!(
                    own == NULL_BLOCK || own == cached,
                    "request {}: window block {j} is {own}, its cache path's {cached}",
                    req.id
                );
            }
        }
        Ok(())
    }
}

/// Whether a handle's path holds no block (the root: a request without a
/// hit locks it, whatever its namespace).
fn path_is_empty(cache: &crate::radix_cache::RadixCache, handle: NodeHandle) -> Result<bool> {
    Ok(cache.path_blocks(handle)?.is_empty())
}
