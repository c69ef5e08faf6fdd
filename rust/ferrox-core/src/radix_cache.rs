//! Radix tree over token ids that caches the KV blocks of finished (or
//! preempted, or prefilled) sequences so that later requests reuse them.
//!
//! The tree is block-aligned: every node's key is a whole number of blocks and
//! the node owns exactly one KV block per `block_size` tokens. Children are
//! keyed by the tokens of their first block and compared token by token (no
//! hashes stand in for tokens, so two different prefixes never collide).
//!
//! ```text
//!   root
//!    └─ [A A A A | B B B B]        blocks 3, 7      (a system prompt)
//!        ├─ [C C C C]              block 9          (user 1's question)
//!        └─ [D D D D | E E E E]    blocks 2, 5      (user 2's question)
//! ```
//!
//! The tree holds one allocator reference on each of its blocks. A running
//! request locks the deepest node of the prefix it uses; a lock pins that node
//! and all its ancestors. Only unlocked leaves are evicted, least recently
//! used first, and a leaf may be trimmed from its tail block by block.
//!
//! A model with sliding-window layers has a second pool: each cached block
//! then also names the sliding layers' block for the same tokens, or
//! `NULL_BLOCK` once that one was evicted. Those blocks are evicted on their
//! own (`evict_window`), whatever the locks, as soon as no running request
//! reads them; a prefix serves a hit only up to where the window before it
//! is still held (`split_and_touch_windowed_prefix`).
//!
//! A model with recurrent state (linear-attention layers) may keep state
//! snapshots in the tree: a node then names the snapshot of the state after
//! its last token (`radix_cache_snapshots.rs`), and a hit for such a model
//! ends at the deepest node with one.
//!
//! Every lookup and insert names a namespace: sequences of different
//! namespaces never share a node, whatever their tokens (a LoRA adapter's
//! KV differs from the base model's for the same prompt). Namespace 0 hangs
//! off the root; another namespace has a root of its own, a node without
//! tokens or blocks below the root, made by its first insert and removed
//! like a leaf once it has no children left.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::block_allocator::{BlockAllocator, BlockId, NULL_BLOCK};
use crate::error::{CoreError, Result};
use snapshots::SnapshotPool;
pub use snapshots::{SnapshotId, SnapshotMatch};

pub(crate) type NodeId = u32;
pub(crate) const ROOT: NodeId = 0;

/// Which sequences may share cached KV: only those of the same namespace.
pub type Namespace = u64;

/// Children of a node `partial_block_match` scans at most.
pub const MAX_PARTIAL_CHILDREN: usize = 32;

/// Names a node for `lock` / `unlock`: the node's index in the low 32 bits and
/// its generation in the high ones, so a handle to a removed node is detected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeHandle(pub u64);

impl NodeHandle {
    fn new(id: NodeId, generation: u32) -> Self {
        NodeHandle(((generation as u64) << 32) | id as u64)
    }
    fn id(self) -> NodeId {
        self.0 as u32
    }
    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

#[derive(Debug, Clone, Default)]
struct Node {
    parent: NodeId,
    generation: u32,
    is_live: bool,
    key: Vec<u32>,
    blocks: Vec<BlockId>,
    /// The sliding-window pool's block of each of `blocks` (or NULL_BLOCK);
    /// empty without a window pool.
    window_blocks: Vec<BlockId>,
    children: FxHashMap<Vec<u32>, NodeId>,
    lock_ref: u32,
    last_access: u64,
    /// The recurrent-state snapshot after this node's last token, if any.
    pub(crate) snapshot: Option<SnapshotId>,
}

/// The longest cached block-aligned prefix of a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    pub blocks: Vec<BlockId>,
    /// The window pool's blocks for the same tokens (NULL_BLOCK where
    /// evicted); empty without a window pool.
    pub window_blocks: Vec<BlockId>,
    pub num_tokens: usize,
    /// The node that ends exactly at the matched prefix (the root for no match).
    pub handle: NodeHandle,
}

/// Where a lookup ends: see `RadixCache::walk`.
pub(crate) struct Walk {
    pub(crate) node: NodeId,
    pub(crate) blocks: Vec<BlockId>,
    window_blocks: Vec<BlockId>,
    pub(crate) num_tokens: usize,
    /// A child whose first `n` blocks matched, but not all of them.
    pub(crate) partial: Option<(NodeId, usize)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InsertOutcome {
    /// The node that ends exactly at the inserted prefix.
    pub handle: NodeHandle,
    /// Blocks the tree did not hold before (their references now belong to it).
    pub num_new_blocks: usize,
}

#[derive(Debug, Clone)]
pub struct RadixCache {
    block_size: usize,
    nodes: Vec<Node>,
    free_slots: Vec<NodeId>,
    /// Unlocked leaves ordered by (last access, node id): the eviction order.
    evictable_leaves: BTreeSet<(u64, NodeId)>,
    /// By block id: whether the tree holds the block.
    in_tree: Vec<bool>,
    /// By window-pool block id: whether the tree holds it (empty: no window pool).
    window_in_tree: Vec<bool>,
    num_window_cached: usize,
    clock: u64,
    num_cached_blocks: usize,
    num_locked_blocks: usize,
    num_queried_tokens: u64,
    num_hit_tokens: u64,
    num_evicted_blocks: u64,
    /// The root of each namespace but 0 (whose root is ROOT).
    namespace_roots: FxHashMap<Namespace, NodeId>,
    /// Recurrent-state snapshots (none: the model keeps no recurrent state).
    pub(crate) snapshots: SnapshotPool,
}

/// Number of leading whole blocks on which `a` and `b` agree.
fn common_blocks(a: &[u32], b: &[u32], block_size: usize) -> usize {
    let max_blocks = a.len().min(b.len()) / block_size;
    (0..max_blocks)
        .take_while(|&i| {
            let r = i * block_size..(i + 1) * block_size;
            a[r.clone()] == b[r]
        })
        .count()
}

impl RadixCache {
    pub fn new(block_size: usize, num_blocks: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(CoreError::InvalidArgument(
                "block_size must be positive".into(),
            ));
        }
        let root = Node {
            is_live: true,
            ..Node::default()
        };
        Ok(Self {
            block_size,
            nodes: vec![root],
            free_slots: Vec::new(),
            evictable_leaves: BTreeSet::new(),
            in_tree: vec![false; num_blocks],
            window_in_tree: Vec::new(),
            num_window_cached: 0,
            clock: 0,
            num_cached_blocks: 0,
            num_locked_blocks: 0,
            num_queried_tokens: 0,
            num_hit_tokens: 0,
            num_evicted_blocks: 0,
            namespace_roots: FxHashMap::default(),
            snapshots: SnapshotPool::default(),
        })
    }

    /// A cache whose blocks also name a sliding-window pool's blocks.
    pub fn new_windowed(
        block_size: usize,
        num_blocks: usize,
        num_window_blocks: usize,
    ) -> Result<Self> {
        if num_window_blocks == 0 {
            return Err(CoreError::InvalidArgument(
                "the window pool needs at least one block".into(),
            ));
        }
        let mut cache = Self::new(block_size, num_blocks)?;
        cache.window_in_tree = vec![false; num_window_blocks];
        Ok(cache)
    }

    pub fn is_windowed(&self) -> bool {
        !self.window_in_tree.is_empty()
    }
    /// Window-pool blocks the tree holds.
    pub fn num_window_cached_blocks(&self) -> usize {
        self.num_window_cached
    }
    pub fn contains_window_block(&self, block: BlockId) -> bool {
        self.window_in_tree
            .get(block as usize)
            .copied()
            .unwrap_or(false)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_cached_blocks(&self) -> usize {
        self.num_cached_blocks
    }
    pub fn num_locked_blocks(&self) -> usize {
        self.num_locked_blocks
    }
    pub fn num_evictable_blocks(&self) -> usize {
        self.num_cached_blocks - self.num_locked_blocks
    }
    pub fn num_queried_tokens(&self) -> u64 {
        self.num_queried_tokens
    }
    pub fn num_hit_tokens(&self) -> u64 {
        self.num_hit_tokens
    }
    pub fn num_evicted_blocks(&self) -> u64 {
        self.num_evicted_blocks
    }
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free_slots.len()
    }
    pub fn root_handle(&self) -> NodeHandle {
        NodeHandle::new(ROOT, self.nodes[ROOT as usize].generation)
    }
    pub fn contains_block(&self, block: BlockId) -> bool {
        self.in_tree.get(block as usize).copied().unwrap_or(false)
    }

    /// Counts a lookup in the hit statistics (the scheduler records a query
    /// once, when the request is admitted, not on every retry).
    pub fn record_query(&mut self, num_queried: usize, num_hit: usize) {
        self.num_queried_tokens += num_queried as u64;
        self.num_hit_tokens += num_hit as u64;
    }

    /// The longest cached block-aligned prefix of `tokens` in namespace
    /// `ns`, counted in the stats.
    pub fn match_prefix(&mut self, ns: Namespace, tokens: &[u32]) -> PrefixMatch {
        let found = self.split_and_touch_prefix(ns, tokens);
        self.record_query(tokens.len(), found.num_tokens);
        found
    }

    /// Like `match_prefix`, without touching the hit statistics. Marks the path
    /// as recently used and splits a node so that the handle ends exactly at
    /// the match.
    pub fn split_and_touch_prefix(&mut self, ns: Namespace, tokens: &[u32]) -> PrefixMatch {
        let walk = self.walk(ns, tokens);
        let mut node = walk.node;
        if let Some((child, n)) = walk.partial {
            node = self.split(child, n);
        }
        self.touch(node);
        PrefixMatch {
            blocks: walk.blocks,
            window_blocks: walk.window_blocks,
            num_tokens: walk.num_tokens,
            handle: self.handle_of(node),
        }
    }

    /// Like `split_and_touch_prefix`, for a model whose sliding-window
    /// layers attend over the last `window` positions: the match ends where
    /// the window pool still holds every block the next position reads.
    pub fn split_and_touch_windowed_prefix(
        &mut self,
        ns: Namespace,
        tokens: &[u32],
        window: usize,
    ) -> PrefixMatch {
        let walk = self.walk(ns, tokens);
        let usable = usable_window_prefix(&walk.window_blocks, window, self.block_size);
        let end = if self.is_windowed() {
            usable
        } else {
            walk.blocks.len()
        };
        self.split_and_touch_prefix(ns, &tokens[..end * self.block_size])
    }

    /// The cached block after the node of `handle` (a match's end) whose
    /// first tokens are `next`'s first, for the most tokens: that block and
    /// the count (at least 1, less than a block: `next` is at most a block of
    /// the tokens after the match, and a whole block would have matched).
    /// Those positions' KV are the same as the block's, which a request may
    /// copy instead of computing them. Below the root, give a handle inside
    /// the namespace (a match of at least a block): the root's children are
    /// namespace 0's. None when no child begins as `next`
    /// does, or the node has more than `MAX_PARTIAL_CHILDREN` children (the
    /// root of many prompts: not worth the scan).
    pub fn partial_block_match(
        &self,
        handle: NodeHandle,
        next: &[u32],
    ) -> Result<Option<(BlockId, usize)>> {
        let node = &self.nodes[self.resolve(handle)? as usize];
        if next.is_empty() || node.children.len() > MAX_PARTIAL_CHILDREN {
            return Ok(None);
        }
        let best = node
            .children
            .values()
            .map(|&child| &self.nodes[child as usize])
            .filter(|child| !child.blocks.is_empty()) // (not a namespace's root)
            .map(|child| {
                let same = child
                    .key
                    .iter()
                    .zip(next)
                    .take_while(|(a, b)| a == b)
                    .count();
                (same.min(self.block_size - 1), child.blocks[0])
            })
            .max();
        Ok(best.filter(|&(n, _)| n > 0).map(|(n, block)| (block, n)))
    }

    /// Follows `tokens` down the tree without changing it: the deepest node
    /// matched whole, the blocks matched, and a child matched only in part.
    /// A namespace without a root matches nothing (at the root).
    pub(crate) fn walk(&self, ns: Namespace, tokens: &[u32]) -> Walk {
        let bs = self.block_size;
        let mut walk = Walk {
            node: ROOT,
            blocks: Vec::new(),
            window_blocks: Vec::new(),
            num_tokens: 0,
            partial: None,
        };
        match self.namespace_root(ns) {
            Some(root) => walk.node = root,
            None => return walk,
        }
        while tokens.len() - walk.num_tokens >= bs {
            let pos = walk.num_tokens;
            let Some(&child) = self.nodes[walk.node as usize]
                .children
                .get(&tokens[pos..pos + bs])
            else {
                break;
            };
            let child_node = &self.nodes[child as usize];
            let n = common_blocks(&child_node.key, &tokens[pos..], bs);
            walk.blocks.extend_from_slice(&child_node.blocks[..n]);
            if !child_node.window_blocks.is_empty() {
                walk.window_blocks
                    .extend_from_slice(&child_node.window_blocks[..n]);
            }
            walk.num_tokens += n * bs;
            if n < child_node.blocks.len() {
                walk.partial = Some((child, n));
                break;
            }
            walk.node = child;
        }
        walk
    }

    /// Adds the full blocks of a sequence. Takes over one reference of every
    /// block in `blocks`: blocks the tree lacked become its own, and a block
    /// whose tokens the tree already holds is released (not duplicated).
    /// `blocks.len()` must be `tokens.len() / block_size`; a partial last
    /// block of tokens is ignored. Only for a cache without a window pool.
    pub fn insert(
        &mut self,
        ns: Namespace,
        tokens: &[u32],
        blocks: &[BlockId],
        alloc: &mut BlockAllocator,
    ) -> Result<InsertOutcome> {
        if self.is_windowed() {
            return Err(CoreError::InvalidArgument(
                "this cache has a window pool: insert_windowed".into(),
            ));
        }
        self.insert_groups(ns, tokens, blocks, alloc, None)
    }

    /// `insert` for a cache with a window pool: `window_blocks` are the
    /// window pool's blocks of the same tokens (NULL_BLOCK for one given
    /// back); the tree takes over one reference of each that is not null,
    /// keeping it where it lacked that position's block.
    pub fn insert_windowed(
        &mut self,
        ns: Namespace,
        tokens: &[u32],
        blocks: &[BlockId],
        window_blocks: &[BlockId],
        alloc: &mut BlockAllocator,
        window_alloc: &mut BlockAllocator,
    ) -> Result<InsertOutcome> {
        if !self.is_windowed() {
            return Err(CoreError::InvalidArgument(
                "this cache has no window pool: insert".into(),
            ));
        }
        if window_blocks.len() != blocks.len()
            || window_alloc.num_blocks() != self.window_in_tree.len()
        {
            return Err(CoreError::InvalidArgument(format!(
                "insert_windowed needs one window block per block ({} for {}) from this \
                 cache's window pool",
                window_blocks.len(),
                blocks.len()
            )));
        }
        self.insert_groups(
            ns,
            tokens,
            blocks,
            alloc,
            Some((window_blocks, window_alloc)),
        )
    }

    fn insert_groups(
        &mut self,
        ns: Namespace,
        tokens: &[u32],
        blocks: &[BlockId],
        alloc: &mut BlockAllocator,
        mut window: Option<(&[BlockId], &mut BlockAllocator)>,
    ) -> Result<InsertOutcome> {
        let bs = self.block_size;
        let num_blocks = tokens.len() / bs;
        if blocks.len() != num_blocks {
            return Err(CoreError::InvalidArgument(format!(
                "insert needs one block per {bs} tokens: {} tokens give {num_blocks} full \
                 blocks, but {} block ids were given",
                tokens.len(),
                blocks.len()
            )));
        }
        if alloc.num_blocks() != self.in_tree.len() || alloc.block_size() != bs {
            return Err(CoreError::InvalidArgument(
                "the allocator does not match this cache's pool".into(),
            ));
        }
        let present = self.walk(ns, &tokens[..num_blocks * bs]);
        let num_present = present.num_tokens / bs;
        self.validate_insert(blocks, num_present, alloc)?;
        if let Some((wblocks, walloc)) = &window {
            self.validate_window_insert(wblocks, &present.window_blocks, walloc)?;
        }

        let mut node = if num_blocks == 0 {
            self.namespace_root(ns).unwrap_or(ROOT)
        } else {
            self.namespace_root_or_new(ns)
        };
        let mut pos = 0;
        let mut num_new_blocks = 0;
        while pos < num_blocks {
            let start = pos * bs;
            let first = &tokens[start..start + bs];
            let Some(&child) = self.nodes[node as usize].children.get(first) else {
                let wblocks = window
                    .as_ref()
                    .map_or(Vec::new(), |(w, _)| w[pos..].to_vec());
                node = self.add_leaf(
                    node,
                    tokens[start..num_blocks * bs].to_vec(),
                    blocks[pos..].to_vec(),
                    wblocks,
                );
                if let Some((_, walloc)) = window.as_mut() {
                    for &w in &self.nodes[node as usize].window_blocks {
                        if w != NULL_BLOCK {
                            walloc.mark_cached(w, true)?;
                        }
                    }
                }
                num_new_blocks = num_blocks - pos;
                break;
            };
            let n = common_blocks(
                &self.nodes[child as usize].key,
                &tokens[start..num_blocks * bs],
                bs,
            );
            node = if n < self.nodes[child as usize].blocks.len() {
                self.split(child, n)
            } else {
                child
            };
            for &dup in &blocks[pos..pos + n] {
                alloc.release_one(dup)?;
            }
            if let Some((wblocks, walloc)) = window.as_mut() {
                for (i, &w) in wblocks[pos..pos + n].iter().enumerate() {
                    if w == NULL_BLOCK {
                        continue;
                    }
                    let held = &mut self.nodes[node as usize].window_blocks[i];
                    if *held == NULL_BLOCK {
                        *held = w; // the tree lacked it: it takes this reference
                        self.window_in_tree[w as usize] = true;
                        self.num_window_cached += 1;
                        walloc.mark_cached(w, true)?;
                    } else {
                        walloc.release_one(w)?;
                    }
                }
            }
            pos += n;
        }
        self.touch(node);
        Ok(InsertOutcome {
            handle: self.handle_of(node),
            num_new_blocks,
        })
    }

    /// The window pool's blocks from the root down to the handle's node.
    pub fn path_window_blocks(&self, handle: NodeHandle) -> Result<Vec<BlockId>> {
        let path = self.path_nodes(handle)?;
        Ok(path
            .iter()
            .flat_map(|&id| self.nodes[id as usize].window_blocks.iter().copied())
            .collect())
    }

    /// Gives back up to `num_blocks` window-pool blocks that only the tree
    /// references (no running request reads them), from the least recently
    /// used nodes, earliest positions first; returns how many.
    pub fn evict_window(
        &mut self,
        num_blocks: usize,
        window_alloc: &mut BlockAllocator,
    ) -> Result<usize> {
        if num_blocks == 0 || !self.is_windowed() {
            return Ok(0);
        }
        let mut order: Vec<(u64, NodeId)> = (0..self.nodes.len() as NodeId)
            .filter(|&id| {
                let n = &self.nodes[id as usize];
                n.is_live && n.window_blocks.iter().any(|&w| w != NULL_BLOCK)
            })
            .map(|id| (self.nodes[id as usize].last_access, id))
            .collect();
        order.sort_unstable();
        let mut num_freed = 0;
        'nodes: for (_, id) in order {
            for i in 0..self.nodes[id as usize].window_blocks.len() {
                if num_freed == num_blocks {
                    break 'nodes;
                }
                let w = self.nodes[id as usize].window_blocks[i];
                if w != NULL_BLOCK && window_alloc.is_cached_only(w) {
                    self.drop_window_block(w, window_alloc)?;
                    self.nodes[id as usize].window_blocks[i] = NULL_BLOCK;
                    num_freed += 1;
                }
            }
        }
        Ok(num_freed)
    }

    fn drop_window_block(
        &mut self,
        block: BlockId,
        window_alloc: &mut BlockAllocator,
    ) -> Result<()> {
        window_alloc.mark_cached(block, false)?;
        window_alloc.release_one(block)?;
        self.window_in_tree[block as usize] = false;
        self.num_window_cached -= 1;
        Ok(())
    }

    /// Blocks from the root down to the handle's node, in order.
    pub fn path_blocks(&self, handle: NodeHandle) -> Result<Vec<BlockId>> {
        let path = self.path_nodes(handle)?;
        Ok(path
            .iter()
            .flat_map(|&id| self.nodes[id as usize].blocks.iter().copied())
            .collect())
    }

    /// The nodes from the root's child down to the handle's node.
    fn path_nodes(&self, handle: NodeHandle) -> Result<Vec<NodeId>> {
        let mut node = self.resolve(handle)?;
        let mut path = Vec::new();
        while node != ROOT {
            path.push(node);
            node = self.nodes[node as usize].parent;
        }
        path.reverse();
        Ok(path)
    }

    /// Whether the handle's node is locked (by any owner).
    pub fn is_locked(&self, handle: NodeHandle) -> Result<bool> {
        Ok(self.nodes[self.resolve(handle)? as usize].lock_ref > 0)
    }

    /// Pins a node and its ancestors against eviction.
    pub fn lock(&mut self, handle: NodeHandle) -> Result<()> {
        let mut node = self.resolve(handle)?;
        loop {
            let n = &mut self.nodes[node as usize];
            if n.lock_ref == 0 {
                self.num_locked_blocks += n.blocks.len();
                let key = (n.last_access, node);
                self.evictable_leaves.remove(&key);
            }
            let n = &mut self.nodes[node as usize];
            n.lock_ref += 1;
            if node == ROOT {
                return Ok(());
            }
            node = n.parent;
        }
    }

    pub fn unlock(&mut self, handle: NodeHandle) -> Result<()> {
        let start = self.resolve(handle)?;
        if self.nodes[start as usize].lock_ref == 0 {
            return Err(CoreError::NotLocked { handle: handle.0 });
        }
        let mut node = start;
        loop {
            let n = &mut self.nodes[node as usize];
            n.lock_ref -= 1;
            let parent = n.parent;
            if n.lock_ref == 0 {
                self.num_locked_blocks -= n.blocks.len();
                if node != ROOT && n.children.is_empty() {
                    let key = (n.last_access, node);
                    self.evictable_leaves.insert(key);
                }
            }
            if node == ROOT {
                return Ok(());
            }
            node = parent;
        }
    }

    /// Frees up to `num_blocks` blocks from least recently used unlocked
    /// leaves (trimming the last leaf from its tail) and returns how many the
    /// tree let go of.
    pub fn evict(&mut self, num_blocks: usize, alloc: &mut BlockAllocator) -> Result<usize> {
        if self.is_windowed() {
            return Err(CoreError::InvalidArgument(
                "this cache has a window pool: evict_windowed".into(),
            ));
        }
        self.evict_groups(num_blocks, alloc, None)
    }

    /// `evict` for a cache with a window pool: the window blocks of what is
    /// evicted go back too.
    pub fn evict_windowed(
        &mut self,
        num_blocks: usize,
        alloc: &mut BlockAllocator,
        window_alloc: &mut BlockAllocator,
    ) -> Result<usize> {
        self.evict_groups(num_blocks, alloc, Some(window_alloc))
    }

    fn evict_groups(
        &mut self,
        num_blocks: usize,
        alloc: &mut BlockAllocator,
        mut window_alloc: Option<&mut BlockAllocator>,
    ) -> Result<usize> {
        let mut num_freed = 0;
        while num_freed < num_blocks {
            let Some(&(last_access, leaf)) = self.evictable_leaves.first() else {
                break;
            };
            let want = num_blocks - num_freed;
            let num_own = self.nodes[leaf as usize].blocks.len();
            self.drop_snapshot(leaf); // (its last token moves or goes)
            let node = &mut self.nodes[leaf as usize];
            if num_own > want {
                let keep = num_own - want;
                for block in node.blocks.drain(keep..) {
                    alloc.release_one(block)?;
                    self.in_tree[block as usize] = false;
                }
                node.key.truncate(keep * self.block_size);
                let dropped: Vec<BlockId> = node
                    .window_blocks
                    .drain(keep.min(node.window_blocks.len())..)
                    .collect();
                self.drop_window_blocks(&dropped, window_alloc.as_deref_mut())?;
                num_freed += want;
                continue;
            }
            self.evictable_leaves.remove(&(last_access, leaf));
            for &block in &node.blocks {
                alloc.release_one(block)?;
                self.in_tree[block as usize] = false;
            }
            let dropped = std::mem::take(&mut node.window_blocks);
            self.drop_window_blocks(&dropped, window_alloc.as_deref_mut())?;
            let node = &self.nodes[leaf as usize];
            num_freed += num_own;
            let parent = node.parent;
            if node.key.is_empty() {
                // A namespace's root, left without children.
                self.namespace_roots.retain(|_, &mut root| root != leaf);
                self.remove_node(leaf);
                continue;
            }
            let first_block = node.key[..self.block_size].to_vec();
            self.remove_node(leaf);
            let p = &mut self.nodes[parent as usize];
            p.children.remove(&first_block);
            if parent != ROOT && p.children.is_empty() && p.lock_ref == 0 {
                self.evictable_leaves.insert((p.last_access, parent));
            }
        }
        self.num_cached_blocks -= num_freed;
        self.num_evicted_blocks += num_freed as u64;
        Ok(num_freed)
    }

    // ---- internals -------------------------------------------------------

    /// The node a namespace's sequences hang from, if it has one.
    fn namespace_root(&self, ns: Namespace) -> Option<NodeId> {
        if ns == 0 {
            Some(ROOT)
        } else {
            self.namespace_roots.get(&ns).copied()
        }
    }

    /// The namespace's root, made (below the root, without tokens or
    /// blocks) if it has none; the insert that needs it adds a child at once.
    fn namespace_root_or_new(&mut self, ns: Namespace) -> NodeId {
        if let Some(root) = self.namespace_root(ns) {
            return root;
        }
        let now = self.clock;
        let id = self.alloc_node(Node {
            parent: ROOT,
            is_live: true,
            last_access: now,
            ..Node::default()
        });
        self.namespace_roots.insert(ns, id);
        id
    }

    /// The namespace of the handle's node (0 for the root itself).
    pub fn namespace_of(&self, handle: NodeHandle) -> Result<Namespace> {
        let mut node = self.resolve(handle)?;
        while node != ROOT && self.nodes[node as usize].parent != ROOT {
            node = self.nodes[node as usize].parent;
        }
        if node == ROOT || !self.nodes[node as usize].key.is_empty() {
            return Ok(0);
        }
        let found = self.namespace_roots.iter().find(|(_, &root)| root == node);
        Ok(found.map_or(0, |(&ns, _)| ns))
    }

    /// Namespaces other than 0 that have a root.
    pub fn num_namespaces(&self) -> usize {
        self.namespace_roots.len()
    }

    fn drop_window_blocks(
        &mut self,
        blocks: &[BlockId],
        window_alloc: Option<&mut BlockAllocator>,
    ) -> Result<()> {
        let held: Vec<BlockId> = blocks
            .iter()
            .copied()
            .filter(|&w| w != NULL_BLOCK)
            .collect();
        if held.is_empty() {
            return Ok(());
        }
        let walloc = window_alloc.ok_or_else(|| {
            CoreError::InvalidArgument("evicting window blocks needs the window pool".into())
        })?;
        for w in held {
            self.drop_window_block(w, walloc)?;
        }
        Ok(())
    }

    pub(crate) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    pub(crate) fn handle_of(&self, node: NodeId) -> NodeHandle {
        NodeHandle::new(node, self.nodes[node as usize].generation)
    }

    fn resolve(&self, handle: NodeHandle) -> Result<NodeId> {
        let id = handle.id();
        match self.nodes.get(id as usize) {
            Some(n) if n.is_live && n.generation == handle.generation() => Ok(id),
            _ => Err(CoreError::InvalidHandle { handle: handle.0 }),
        }
    }

    /// Marks `node` and its ancestors as used now.
    pub(crate) fn touch(&mut self, node: NodeId) {
        let now = self.tick();
        let n = &mut self.nodes[node as usize];
        if self.evictable_leaves.remove(&(n.last_access, node)) {
            self.evictable_leaves.insert((now, node));
        }
        let mut id = node;
        loop {
            let n = &mut self.nodes[id as usize];
            n.last_access = now;
            if id == ROOT {
                break;
            }
            id = n.parent;
        }
    }

    fn validate_insert(
        &self,
        blocks: &[BlockId],
        num_present: usize,
        alloc: &BlockAllocator,
    ) -> Result<()> {
        let mut listed = FxHashMap::default();
        for (i, &block) in blocks.iter().enumerate() {
            let refs = alloc.ref_count(block)?;
            if listed.insert(block, i).is_some() {
                return Err(CoreError::InvalidArgument(format!(
                    "block {block} is listed twice"
                )));
            }
            let held_by_tree = self.in_tree[block as usize];
            if i >= num_present && held_by_tree {
                return Err(CoreError::InvalidArgument(format!(
                    "block {block} already caches other tokens"
                )));
            }
            if refs < 1 + held_by_tree as u32 {
                return Err(CoreError::BlockNotAllocated { block });
            }
        }
        Ok(())
    }

    fn validate_window_insert(
        &self,
        blocks: &[BlockId],
        present: &[BlockId],
        alloc: &BlockAllocator,
    ) -> Result<()> {
        let mut listed = FxHashMap::default();
        for (i, &block) in blocks.iter().enumerate() {
            if block == NULL_BLOCK {
                continue;
            }
            let refs = alloc.ref_count(block)?;
            if listed.insert(block, i).is_some() {
                return Err(CoreError::InvalidArgument(format!(
                    "window block {block} is listed twice"
                )));
            }
            let held_by_tree = self.window_in_tree[block as usize];
            if held_by_tree && present.get(i) != Some(&block) {
                return Err(CoreError::InvalidArgument(format!(
                    "window block {block} already caches other tokens"
                )));
            }
            if refs < 1 + held_by_tree as u32 {
                return Err(CoreError::BlockNotAllocated { block });
            }
        }
        Ok(())
    }

    fn alloc_node(&mut self, node: Node) -> NodeId {
        match self.free_slots.pop() {
            Some(id) => {
                let generation = self.nodes[id as usize].generation;
                self.nodes[id as usize] = Node { generation, ..node };
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    fn remove_node(&mut self, id: NodeId) {
        let n = &mut self.nodes[id as usize];
        n.is_live = false;
        n.generation = n.generation.wrapping_add(1);
        n.key = Vec::new();
        n.blocks = Vec::new();
        n.window_blocks = Vec::new();
        n.children = FxHashMap::default();
        debug_assert!(
            n.snapshot.is_none(),
            "a removed node's snapshot is dropped first"
        );
        self.free_slots.push(id);
    }

    fn add_leaf(
        &mut self,
        parent: NodeId,
        key: Vec<u32>,
        blocks: Vec<BlockId>,
        window_blocks: Vec<BlockId>,
    ) -> NodeId {
        let bs = self.block_size;
        let p = &self.nodes[parent as usize];
        if parent != ROOT && p.children.is_empty() && p.lock_ref == 0 {
            let old = (p.last_access, parent);
            self.evictable_leaves.remove(&old);
        }
        for &block in &blocks {
            self.in_tree[block as usize] = true;
        }
        for &w in window_blocks.iter().filter(|&&w| w != NULL_BLOCK) {
            self.window_in_tree[w as usize] = true;
            self.num_window_cached += 1;
        }
        self.num_cached_blocks += blocks.len();
        let first_block = key[..bs].to_vec();
        let now = self.clock;
        let leaf = self.alloc_node(Node {
            parent,
            generation: 0,
            is_live: true,
            key,
            blocks,
            window_blocks,
            children: FxHashMap::default(),
            lock_ref: 0,
            last_access: now,
            snapshot: None,
        });
        self.nodes[parent as usize]
            .children
            .insert(first_block, leaf);
        self.evictable_leaves.insert((now, leaf));
        leaf
    }

    /// Splits `child` after its first `num_blocks` blocks; returns the new
    /// upper node. `child` keeps its id (and so every handle to it).
    pub(crate) fn split(&mut self, child: NodeId, num_blocks: usize) -> NodeId {
        let bs = self.block_size;
        let c = &mut self.nodes[child as usize];
        let upper_key: Vec<u32> = c.key.drain(..num_blocks * bs).collect();
        let upper_blocks: Vec<BlockId> = c.blocks.drain(..num_blocks).collect();
        let upper_window: Vec<BlockId> = c
            .window_blocks
            .drain(..num_blocks.min(c.window_blocks.len()))
            .collect();
        let parent = c.parent;
        let (lock_ref, last_access) = (c.lock_ref, c.last_access);
        let child_first = c.key[..bs].to_vec();
        let upper_first = upper_key[..bs].to_vec();
        let mut children = FxHashMap::default();
        children.insert(child_first, child);
        let upper = self.alloc_node(Node {
            parent,
            generation: 0,
            is_live: true,
            key: upper_key,
            blocks: upper_blocks,
            window_blocks: upper_window,
            children,
            lock_ref,
            last_access,
            snapshot: None, // (the snapshot stays with the node that ends where it was taken)
        });
        self.nodes[child as usize].parent = upper;
        self.nodes[parent as usize]
            .children
            .insert(upper_first, upper);
        upper
    }
}

/// Blocks of a cached path (whose window-pool blocks are `window_blocks`)
/// that a hit may use: the longest prefix after which every position the
/// next token reads, the `window - 1` before it, is still held.
pub fn usable_window_prefix(window_blocks: &[BlockId], window: usize, block_size: usize) -> usize {
    let mut last_null: Option<usize> = None;
    let mut best = 0;
    for k in 1..=window_blocks.len() {
        if window_blocks[k - 1] == NULL_BLOCK {
            last_null = Some(k - 1);
        }
        let first_read = (k * block_size + 1).saturating_sub(window) / block_size;
        if last_null.is_none_or(|j| j < first_read) {
            best = k;
        }
    }
    best
}

#[path = "radix_cache_integrity.rs"]
mod integrity;

#[path = "radix_cache_snapshots.rs"]
mod snapshots;

#[cfg(test)]
#[path = "radix_cache_tests.rs"]
mod tests;
