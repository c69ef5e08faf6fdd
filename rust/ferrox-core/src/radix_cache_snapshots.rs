//! Recurrent-state snapshots in the radix tree, for a model whose
//! linear-attention layers keep a fixed-size state per sequence: KV blocks
//! alone cannot resume such a sequence, the state after the prefix is
//! needed too.
//!
//! A bounded pool of `num_snapshots` snapshot ids (the runner holds one
//! copy of every layer's state per id). A node may name one: the state after
//! its last token (a block boundary). A hit for such a model ends at the
//! deepest node of the matched path that has a snapshot
//! (`split_and_touch_snapshot_prefix`), whatever KV lies beyond it.
//!
//! ```text
//!   root
//!    └─ [A A A A | B B B B]  s3        a hit on "A..B.." restores s3
//!        ├─ [C C C C]        s1        a hit on "A..B..C.." restores s1
//!        └─ [D D D D]        -         a hit on "A..B..D.." restores s3 and
//!                                      recomputes D (its KV is cached, its
//!                                      state is not)
//! ```
//!
//! Ids go through three states: free, reserved (the scheduler planned a
//! step that writes the state into it: `reserve_snapshot`) and attached (to
//! the node that ends where it was taken: `attach_snapshot`). When no id is
//! free, reserving takes the least recently used attached one from its
//! node. A node that loses its last block (eviction trims or removes it)
//! loses its snapshot; a split keeps it on the lower part (whose end is
//! unchanged).

use std::collections::BTreeSet;

use super::{Namespace, NodeId, PrefixMatch, RadixCache};
use crate::error::{ensure, CoreError, Result};

pub type SnapshotId = u32;

/// A lookup for a model with recurrent state: the hit (ending at a node
/// with a snapshot), that snapshot, and how far the cached KV alone reaches
/// (where a snapshot would serve a longer hit next time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotMatch {
    pub hit: PrefixMatch,
    pub snapshot: Option<SnapshotId>,
    pub kv_tokens: usize,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct SnapshotPool {
    num_snapshots: usize,
    free: Vec<SnapshotId>,
    /// By id: the node it is attached to.
    node_of: Vec<Option<NodeId>>,
    /// By id: its last use (for `lru`).
    last_use: Vec<u64>,
    /// Attached ids by (last use, id): the eviction order.
    lru: BTreeSet<(u64, SnapshotId)>,
    num_reserved: usize,
}

impl RadixCache {
    /// Gives the tree a pool of `num_snapshots` snapshot ids (a model with
    /// recurrent state); the tree must not have one yet.
    pub fn enable_snapshots(&mut self, num_snapshots: usize) -> Result<()> {
        if self.snapshots.num_snapshots != 0 || num_snapshots == 0 {
            return Err(CoreError::InvalidArgument(
                "snapshots are enabled once, with at least one".into(),
            ));
        }
        if num_snapshots > i32::MAX as usize {
            return Err(CoreError::InvalidArgument(
                "num_snapshots must fit in 32 bits".into(),
            ));
        }
        self.snapshots = SnapshotPool {
            num_snapshots,
            free: (0..num_snapshots as SnapshotId).rev().collect(),
            node_of: vec![None; num_snapshots],
            last_use: vec![0; num_snapshots],
            lru: BTreeSet::new(),
            num_reserved: 0,
        };
        Ok(())
    }

    pub fn num_snapshots(&self) -> usize {
        self.snapshots.num_snapshots
    }
    /// Snapshots attached to nodes.
    pub fn num_cached_snapshots(&self) -> usize {
        self.snapshots.lru.len()
    }
    /// Snapshots reserved for a planned step and not attached yet.
    pub fn num_reserved_snapshots(&self) -> usize {
        self.snapshots.num_reserved
    }

    /// An id for a step to write a state into: a free one, else the least
    /// recently used attached one (taken from its node). None: every id is
    /// reserved (or there is no pool).
    pub fn reserve_snapshot(&mut self) -> Option<SnapshotId> {
        let pool = &mut self.snapshots;
        let id = match pool.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = pool.lru.pop_first()?;
                let node = pool.node_of[id as usize].take().expect("attached");
                self.nodes[node as usize].snapshot = None;
                id
            }
        };
        self.snapshots.num_reserved += 1;
        Some(id)
    }

    /// Gives back a reserved id that will not be attached.
    pub fn release_snapshot(&mut self, id: SnapshotId) -> Result<()> {
        let pool = &mut self.snapshots;
        if id as usize >= pool.num_snapshots || pool.num_reserved == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "snapshot {id} was not reserved"
            )));
        }
        pool.num_reserved -= 1;
        pool.free.push(id);
        Ok(())
    }

    /// Attaches the reserved snapshot `id`, the state after `tokens` (whole
    /// blocks, all cached in namespace `ns`), to the node that ends there
    /// (splitting one). Returns false, and frees `id`, when the tokens are
    /// not all cached or that node has a snapshot already.
    pub fn attach_snapshot(
        &mut self,
        ns: Namespace,
        tokens: &[u32],
        id: SnapshotId,
    ) -> Result<bool> {
        let bs = self.block_size;
        let walk = self.walk(ns, tokens);
        if tokens.is_empty() || !tokens.len().is_multiple_of(bs) || walk.num_tokens != tokens.len()
        {
            self.release_snapshot(id)?;
            return Ok(false);
        }
        let node = match walk.partial {
            Some((child, n)) => self.split(child, n),
            None => walk.node,
        };
        if self.nodes[node as usize].snapshot.is_some() {
            self.release_snapshot(id)?;
            return Ok(false);
        }
        self.snapshots.num_reserved -= 1;
        let now = self.tick();
        let pool = &mut self.snapshots;
        pool.node_of[id as usize] = Some(node);
        pool.last_use[id as usize] = now;
        pool.lru.insert((now, id));
        self.nodes[node as usize].snapshot = Some(id);
        Ok(true)
    }

    /// The longest prefix of `tokens` in namespace `ns` that ends at a node
    /// with a snapshot (split and touched as `split_and_touch_prefix`
    /// does), that snapshot (marked recently used), and how many tokens the
    /// cached KV alone would serve.
    pub fn split_and_touch_snapshot_prefix(
        &mut self,
        ns: Namespace,
        tokens: &[u32],
    ) -> SnapshotMatch {
        let walk = self.walk(ns, tokens);
        let bs = self.block_size;
        let kv_tokens = walk.num_tokens;
        // The fully matched path ends at walk.node, at `end` tokens.
        let mut end = kv_tokens - walk.partial.map_or(0, |(_, n)| n * bs);
        let mut node = walk.node;
        while node != super::ROOT && self.nodes[node as usize].snapshot.is_none() {
            end -= self.nodes[node as usize].key.len();
            node = self.nodes[node as usize].parent;
        }
        let snapshot = self.nodes[node as usize].snapshot;
        if let Some(id) = snapshot {
            let now = self.tick();
            let pool = &mut self.snapshots;
            pool.lru.remove(&(pool.last_use[id as usize], id));
            pool.last_use[id as usize] = now;
            pool.lru.insert((now, id));
        }
        let hit = self.split_and_touch_prefix(ns, &tokens[..end]);
        SnapshotMatch {
            hit,
            snapshot,
            kv_tokens,
        }
    }

    /// Frees the snapshot of `node`, if it has one.
    pub(crate) fn drop_snapshot(&mut self, node: NodeId) {
        if let Some(id) = self.nodes[node as usize].snapshot.take() {
            let pool = &mut self.snapshots;
            pool.lru.remove(&(pool.last_use[id as usize], id));
            pool.node_of[id as usize] = None;
            pool.free.push(id);
        }
    }

    /// free + reserved + attached == the pool, and each attached id and its
    /// node name each other.
    pub(crate) fn check_snapshot_integrity(&self) -> Result<()> {
        let pool = &self.snapshots;
        ensure!(
            pool.free.len() + pool.num_reserved + pool.lru.len() == pool.num_snapshots,
            "snapshots: {} free + {} reserved + {} attached != {}",
            pool.free.len(),
            pool.num_reserved,
            pool.lru.len(),
            pool.num_snapshots
        );
        for &(when, id) in &pool.lru {
            let node = pool.node_of[id as usize];
            ensure!(
                pool.last_use[id as usize] == when
                    && node.is_some_and(|n| {
                        let n = &self.nodes[n as usize];
                        n.is_live && n.snapshot == Some(id)
                    }),
                "snapshot {id} and its node disagree"
            );
        }
        let mut free: Vec<_> = pool.free.clone();
        free.sort_unstable();
        free.dedup();
        ensure!(
            free.len() == pool.free.len()
                && free.iter().all(|&id| pool.node_of[id as usize].is_none()),
            "a free snapshot is listed twice or attached"
        );
        let attached = self
            .nodes
            .iter()
            .filter(|n| n.is_live && n.snapshot.is_some())
            .count();
        ensure!(
            attached == pool.lru.len(),
            "{attached} nodes name a snapshot, {} are attached",
            pool.lru.len()
        );
        Ok(())
    }
}
