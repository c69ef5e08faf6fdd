//! State snapshots for a model with recurrent state: where a request saves
//! its state for the prefix cache (`radix_cache_snapshots.rs`), and the
//! chunks that end there.

use crate::error::Result;
use crate::scheduler::{Chosen, Scheduler};

impl Scheduler {
    /// Where a newly admitted request of a model with recurrent state saves
    /// its state for the prefix cache (chunked prefill only): where the
    /// cached KV it shares with others ends, if that lies past its hit (the
    /// point where sequences branch, which later requests may share), and
    /// its last full block before its last token.
    pub(crate) fn snapshot_boundaries(
        &self,
        slot: usize,
        hit_tokens: usize,
        kv_tokens: usize,
    ) -> Vec<usize> {
        let req = self.req(slot);
        if !self.config.enable_chunked_prefill || !req.params.use_prefix_cache {
            return Vec::new();
        }
        let bs = self.config.block_size;
        let own = (req.num_tokens() - 1) / bs * bs;
        let mut boundaries = Vec::with_capacity(2);
        if kv_tokens > hit_tokens && kv_tokens < own {
            boundaries.push(kv_tokens);
        }
        if own > hit_tokens {
            boundaries.push(own);
        }
        boundaries
    }

    /// `num_tokens`, cut so that the running request's chunk ends no later
    /// than its next snapshot boundary.
    pub(crate) fn up_to_boundary(&self, slot: usize, num_tokens: usize) -> usize {
        let req = self.req(slot);
        match req.snapshot_boundaries.first() {
            Some(&b) if b > req.num_computed_tokens => num_tokens.min(b - req.num_computed_tokens),
            _ => num_tokens,
        }
    }

    /// After choosing `num_tokens` of the request for this step: if they end
    /// at its next snapshot boundary, the step saves its state there (when a
    /// snapshot can be had).
    pub(crate) fn plan_snapshot(&mut self, slot: usize, num_tokens: usize) {
        let req = self.req(slot);
        let end = req.num_computed_tokens + num_tokens;
        if req.snapshot_boundaries.first() != Some(&end) {
            return;
        }
        let id = self.cache.reserve_snapshot();
        let req = self.req_mut(slot);
        req.snapshot_boundaries.remove(0);
        if let Some(id) = id {
            req.pending_saves.push((id, end));
        }
    }

    /// A model with recurrent state: the leader a waiting request waits for
    /// also saves its state where their shared prefix ends, so that the
    /// waiting request's hit can resume there. A chunk of the leader's
    /// already chosen for this step that reaches past that point is cut
    /// there (the saves it planned further on wait for a later step).
    pub(crate) fn snapshot_for_follower(
        &mut self,
        leader: usize,
        boundary: usize,
        chosen: &mut [Chosen],
        budget: &mut usize,
    ) -> Result<()> {
        let req = self.req_mut(leader);
        let computed = req.num_computed_tokens;
        if boundary <= computed || req.snapshot_boundaries.contains(&boundary) {
            return Ok(());
        }
        let planned = std::mem::take(&mut req.pending_saves);
        for b in planned.iter().map(|&(_, b)| b).chain([boundary]) {
            let at = req.snapshot_boundaries.partition_point(|&x| x < b);
            req.snapshot_boundaries.insert(at, b);
        }
        for (id, _) in planned {
            self.cache.release_snapshot(id)?;
        }
        if let Some(c) = chosen.iter_mut().find(|c| c.slot == leader) {
            if computed + c.num_tokens > boundary {
                *budget += computed + c.num_tokens - boundary;
                c.num_tokens = boundary - computed;
            }
            let num_tokens = c.num_tokens;
            self.plan_snapshot(leader, num_tokens);
        }
        Ok(())
    }
}
