//! `RadixCache::check_integrity`: the tree's invariants, checked from scratch.

use std::collections::BTreeSet;

use super::{RadixCache, ROOT};
use crate::block_allocator::{BlockAllocator, NULL_BLOCK};
use crate::error::{ensure, Result};

impl RadixCache {
    /// Every cached block is held once by the tree and referenced in the
    /// allocator; evictable + locked == cached; the eviction set holds exactly
    /// the unlocked leaves; a lock on a node covers its ancestors.
    pub fn check_integrity(&self, alloc: &BlockAllocator) -> Result<()> {
        self.check_snapshot_integrity()?;
        let bs = self.block_size;
        let mut seen = vec![false; self.in_tree.len()];
        let (mut num_blocks, mut num_locked, mut num_reached) = (0usize, 0usize, 0usize);
        let mut leaves = BTreeSet::new();
        let mut stack = vec![ROOT];
        for (&ns, &root) in &self.namespace_roots {
            let node = &self.nodes[root as usize];
            ensure!(ns != 0, "namespace 0 has a root of its own");
            ensure!(
                node.parent == ROOT && node.key.is_empty() && node.blocks.is_empty(),
                "namespace {ns}'s root {root} holds tokens or hangs below another node"
            );
            stack.push(root);
        }
        while let Some(id) = stack.pop() {
            let node = &self.nodes[id as usize];
            ensure!(node.is_live, "node {id} is reachable but not live");
            num_reached += 1;
            if node.key.is_empty() && id != ROOT {
                if node.children.is_empty() && node.lock_ref == 0 {
                    leaves.insert((node.last_access, id));
                }
            } else if id != ROOT {
                ensure!(!node.blocks.is_empty(), "node {id} owns no block");
                ensure!(
                    node.key.len() == node.blocks.len() * bs,
                    "node {id} has {} tokens for {} blocks",
                    node.key.len(),
                    node.blocks.len()
                );
                let parent = &self.nodes[node.parent as usize];
                ensure!(
                    parent.children.get(&node.key[..bs]) == Some(&id),
                    "node {id} is not its parent's child under its first block"
                );
                if node.parent != ROOT {
                    ensure!(
                        parent.lock_ref >= node.lock_ref,
                        "node {id} is locked more than its parent"
                    );
                }
                if node.children.is_empty() && node.lock_ref == 0 {
                    leaves.insert((node.last_access, id));
                }
            }
            for &block in &node.blocks {
                let idx = block as usize;
                ensure!(idx < seen.len(), "cached block {block} is out of range");
                ensure!(!seen[idx], "block {block} is cached twice");
                seen[idx] = true;
                ensure!(self.in_tree[idx], "block {block} is cached but not marked");
                ensure!(
                    alloc.ref_count(block)? >= 1,
                    "cached block {block} holds no allocator reference"
                );
            }
            num_blocks += node.blocks.len();
            if node.lock_ref > 0 {
                num_locked += node.blocks.len();
            }
            for (first, &child) in &node.children {
                ensure!(
                    self.nodes[child as usize].parent == id,
                    "child {child} of {id} names another parent"
                );
                ensure!(
                    self.nodes[child as usize].key.starts_with(first),
                    "child {child} is filed under a key it does not start with"
                );
                stack.push(child);
            }
        }
        ensure!(
            num_reached == self.num_nodes(),
            "{} live nodes, {num_reached} reachable",
            self.num_nodes()
        );
        ensure!(
            seen == self.in_tree,
            "the in-tree marks disagree with the tree"
        );
        ensure!(
            num_blocks == self.num_cached_blocks,
            "tree holds {num_blocks} blocks, counter says {}",
            self.num_cached_blocks
        );
        ensure!(
            num_locked == self.num_locked_blocks,
            "{num_locked} locked blocks, counter says {}",
            self.num_locked_blocks
        );
        ensure!(
            leaves == self.evictable_leaves,
            "the eviction set differs from the unlocked leaves"
        );
        Ok(())
    }

    /// The window pool's side: each node names one window block (or none)
    /// per block; every held one is held once, marked, and marked cached
    /// in the window pool's allocator; the counter agrees.
    pub fn check_window_integrity(&self, window_alloc: &BlockAllocator) -> Result<()> {
        ensure!(
            window_alloc.num_blocks() == self.window_in_tree.len(),
            "the window pool does not match the cache"
        );
        let mut seen = vec![false; self.window_in_tree.len()];
        let mut num_held = 0;
        for (id, node) in self.nodes.iter().enumerate() {
            if !node.is_live || id == ROOT as usize {
                continue;
            }
            ensure!(
                node.window_blocks.len() == node.blocks.len(),
                "node {id} names {} window blocks for {} blocks",
                node.window_blocks.len(),
                node.blocks.len()
            );
            for &w in node.window_blocks.iter().filter(|&&w| w != NULL_BLOCK) {
                let idx = w as usize;
                ensure!(idx < seen.len(), "window block {w} is out of range");
                ensure!(!seen[idx], "window block {w} is cached twice");
                seen[idx] = true;
                ensure!(
                    window_alloc.ref_count(w)? >= 1,
                    "cached window block {w} holds no reference"
                );
                num_held += 1;
            }
        }
        ensure!(
            seen == self.window_in_tree,
            "the window in-tree marks disagree with the tree"
        );
        ensure!(
            num_held == self.num_window_cached,
            "tree holds {num_held} window blocks, counter says {}",
            self.num_window_cached
        );
        let cached_only = (0..seen.len() as u32)
            .filter(|&w| seen[w as usize] && window_alloc.ref_count(w).ok() == Some(1))
            .count();
        ensure!(
            cached_only == window_alloc.num_cached_only(),
            "{cached_only} window blocks held by the tree alone, the pool counts {}",
            window_alloc.num_cached_only()
        );
        Ok(())
    }
}
