use super::*;
use proptest::prelude::*;

fn setup(num_blocks: usize, bs: usize) -> (BlockAllocator, RadixCache) {
    (
        BlockAllocator::new(num_blocks, bs).unwrap(),
        RadixCache::new(bs, num_blocks).unwrap(),
    )
}

fn insert_fresh(
    cache: &mut RadixCache,
    alloc: &mut BlockAllocator,
    tokens: &[u32],
) -> InsertOutcome {
    let blocks = alloc.allocate(tokens.len() / cache.block_size()).unwrap();
    cache.insert(0, tokens, &blocks, alloc).unwrap()
}

#[test]
fn match_returns_longest_block_aligned_prefix() {
    let (mut alloc, mut cache) = setup(16, 4);
    let seq: Vec<u32> = (0..12).collect();
    insert_fresh(&mut cache, &mut alloc, &seq);
    // 10 shared tokens: only two whole blocks count.
    let mut query: Vec<u32> = (0..10).collect();
    query.extend([99, 98, 97]);
    let m = cache.match_prefix(0, &query);
    assert_eq!(m.num_tokens, 8);
    assert_eq!(m.blocks, vec![0, 1]);
    assert_eq!(cache.num_hit_tokens(), 8);
    assert_eq!(cache.num_queried_tokens(), 13);
    cache.check_integrity(&alloc).unwrap();
}

#[test]
fn partial_blocks_are_ignored_on_insert() {
    let (mut alloc, mut cache) = setup(8, 4);
    let seq: Vec<u32> = (0..10).collect();
    let blocks = alloc.allocate(2).unwrap();
    let out = cache.insert(0, &seq, &blocks, &mut alloc).unwrap();
    assert_eq!(out.num_new_blocks, 2);
    assert_eq!(cache.num_cached_blocks(), 2);
    let err = cache.insert(0, &seq, &[5], &mut alloc).unwrap_err();
    assert!(matches!(err, CoreError::InvalidArgument(_)));
    cache.check_integrity(&alloc).unwrap();
}

#[test]
fn duplicate_blocks_are_released_not_kept() {
    let (mut alloc, mut cache) = setup(8, 2);
    insert_fresh(&mut cache, &mut alloc, &[1, 2, 3, 4]);
    // Same tokens computed again into other blocks.
    let dup = alloc.allocate(3).unwrap();
    let out = cache
        .insert(0, &[1, 2, 3, 4, 5, 6], &dup, &mut alloc)
        .unwrap();
    assert_eq!(out.num_new_blocks, 1);
    assert_eq!(cache.num_cached_blocks(), 3);
    assert_eq!(alloc.num_used(), 3);
    assert_eq!(alloc.ref_count(dup[0]).unwrap(), 0);
    assert_eq!(alloc.ref_count(dup[2]).unwrap(), 1);
    cache.check_integrity(&alloc).unwrap();
}

#[test]
fn split_keeps_handles_and_locks_valid() {
    let (mut alloc, mut cache) = setup(16, 2);
    let first = insert_fresh(&mut cache, &mut alloc, &[1, 2, 3, 4, 5, 6]);
    cache.lock(first.handle).unwrap();
    assert_eq!(cache.num_locked_blocks(), 3);
    // Diverges after one block: splits the locked node.
    insert_fresh(&mut cache, &mut alloc, &[1, 2, 9, 9]);
    assert_eq!(cache.num_locked_blocks(), 3);
    assert_eq!(cache.num_evictable_blocks(), 1);
    cache.check_integrity(&alloc).unwrap();
    assert_eq!(cache.evict(10, &mut alloc).unwrap(), 1);
    cache.unlock(first.handle).unwrap();
    assert_eq!(cache.num_evictable_blocks(), 3);
    assert_eq!(cache.evict(10, &mut alloc).unwrap(), 3);
    assert_eq!(alloc.num_free(), 16);
    cache.check_integrity(&alloc).unwrap();
}

#[test]
fn eviction_is_lru_and_trims_tails() {
    let (mut alloc, mut cache) = setup(16, 2);
    insert_fresh(&mut cache, &mut alloc, &[1, 1, 1, 1]); // older
    insert_fresh(&mut cache, &mut alloc, &[2, 2, 2, 2]); // newer
    cache.match_prefix(0, &[1, 1, 1, 1]); // now [1..] is the most recent
    assert_eq!(cache.evict(1, &mut alloc).unwrap(), 1);
    assert_eq!(cache.match_prefix(0, &[2, 2, 2, 2]).num_tokens, 2);
    assert_eq!(cache.match_prefix(0, &[1, 1, 1, 1]).num_tokens, 4);
    assert_eq!(cache.num_evicted_blocks(), 1);
    cache.check_integrity(&alloc).unwrap();
}

#[test]
fn locked_nodes_are_never_evicted() {
    let (mut alloc, mut cache) = setup(8, 2);
    let out = insert_fresh(&mut cache, &mut alloc, &[1, 2, 3, 4]);
    cache.lock(out.handle).unwrap();
    assert_eq!(cache.evict(8, &mut alloc).unwrap(), 0);
    assert_eq!(cache.match_prefix(0, &[1, 2, 3, 4]).num_tokens, 4);
    cache.unlock(out.handle).unwrap();
    assert!(matches!(
        cache.unlock(out.handle),
        Err(CoreError::NotLocked { .. })
    ));
    cache.check_integrity(&alloc).unwrap();
}

#[test]
fn stale_handles_are_rejected() {
    let (mut alloc, mut cache) = setup(8, 2);
    let out = insert_fresh(&mut cache, &mut alloc, &[1, 2]);
    cache.evict(1, &mut alloc).unwrap();
    insert_fresh(&mut cache, &mut alloc, &[3, 4]); // reuses the slot
    assert!(matches!(
        cache.lock(out.handle),
        Err(CoreError::InvalidHandle { .. })
    ));
    assert!(matches!(
        cache.lock(NodeHandle(12345)),
        Err(CoreError::InvalidHandle { .. })
    ));
    cache.check_integrity(&alloc).unwrap();
}

#[test]
fn insert_rejects_foreign_or_reused_blocks_without_change() {
    let (mut alloc, mut cache) = setup(8, 2);
    insert_fresh(&mut cache, &mut alloc, &[1, 2]);
    let cached_block = cache.match_prefix(0, &[1, 2]).blocks[0];
    alloc.share(&[cached_block]).unwrap();
    // The tree's block offered for other tokens.
    assert!(cache
        .insert(0, &[7, 7], &[cached_block], &mut alloc)
        .is_err());
    alloc.release_one(cached_block).unwrap();
    // A free block: the caller holds no reference.
    assert!(matches!(
        cache.insert(0, &[7, 7], &[5], &mut alloc),
        Err(CoreError::BlockNotAllocated { block: 5 })
    ));
    assert!(matches!(
        cache.insert(0, &[7, 7], &[50], &mut alloc),
        Err(CoreError::BlockOutOfRange { .. })
    ));
    let b = alloc.allocate(1).unwrap();
    assert!(cache
        .insert(0, &[7, 7, 8, 8], &[b[0], b[0]], &mut alloc)
        .is_err());
    assert_eq!(cache.num_cached_blocks(), 1);
    cache.check_integrity(&alloc).unwrap();
    alloc.check_integrity().unwrap();
}

// ---- state machine against a naive reference ------------------------------

#[derive(Debug, Clone)]
enum Op {
    Insert(Namespace, Vec<u32>),
    Match(Namespace, Vec<u32>),
    Lock(usize),
    Unlock(usize),
    Evict(usize),
    Hold(usize),
    Drop(usize),
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..3, 0..20)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..3, tokens()).prop_map(|(ns, t)| Op::Insert(ns, t)),
        3 => (0u64..3, tokens()).prop_map(|(ns, t)| Op::Match(ns, t)),
        1 => (0usize..8).prop_map(Op::Lock),
        1 => (0usize..8).prop_map(Op::Unlock),
        1 => (0usize..6).prop_map(Op::Evict),
        1 => (0usize..4).prop_map(Op::Hold),
        1 => (0usize..4).prop_map(Op::Drop),
    ]
}

struct Reference {
    sequences: Vec<(Namespace, Vec<u32>)>,
    /// (Namespace, block-aligned prefix) -> the block the tree last reported for it.
    block_of: std::collections::HashMap<(Namespace, Vec<u32>), BlockId>,
}

impl Reference {
    /// The longest prefix of `query` inserted in namespace `ns`: another
    /// namespace's sequences never count.
    fn longest(&self, ns: Namespace, query: &[u32], bs: usize) -> usize {
        self.sequences
            .iter()
            .filter(|(n, _)| *n == ns)
            .map(|(_, s)| common_blocks(s, query, bs) * bs)
            .max()
            .unwrap_or(0)
    }
}

fn run_machine(ops: Vec<Op>, bs: usize, num_blocks: usize) {
    let (mut alloc, mut cache) = setup(num_blocks, bs);
    let mut reference = Reference {
        sequences: vec![],
        block_of: Default::default(),
    };
    let mut handles: Vec<NodeHandle> = vec![];
    let mut locked: Vec<NodeHandle> = vec![];
    let mut held: Vec<BlockId> = vec![];
    let mut evicted = false;
    for op in ops {
        match op {
            Op::Insert(ns, seq) => {
                let need = seq.len() / bs;
                if alloc.num_free() < need {
                    let missing = need - alloc.num_free();
                    evicted |= cache.evict(missing, &mut alloc).unwrap() > 0;
                }
                if alloc.num_free() < need {
                    continue;
                }
                let blocks = alloc.allocate(need).unwrap();
                let out = cache.insert(ns, &seq, &blocks, &mut alloc).unwrap();
                handles.push(out.handle);
                let aligned = &seq[..need * bs];
                let found = cache.split_and_touch_prefix(ns, aligned);
                assert_eq!(found.num_tokens, aligned.len());
                for (i, &b) in found.blocks.iter().enumerate() {
                    reference
                        .block_of
                        .insert((ns, aligned[..(i + 1) * bs].to_vec()), b);
                }
                reference.sequences.push((ns, aligned.to_vec()));
            }
            Op::Match(ns, query) => {
                let m = cache.match_prefix(ns, &query);
                assert_eq!(m.num_tokens % bs, 0);
                assert_eq!(m.blocks.len(), m.num_tokens / bs);
                let longest = reference.longest(ns, &query, bs);
                assert!(
                    m.num_tokens <= longest,
                    "tree reports a prefix the reference lacks"
                );
                if !evicted {
                    assert_eq!(m.num_tokens, longest);
                }
                for (i, &b) in m.blocks.iter().enumerate() {
                    assert_eq!(reference.block_of[&(ns, query[..(i + 1) * bs].to_vec())], b);
                }
                handles.push(m.handle);
            }
            Op::Lock(i) => {
                if let Some(&h) = handles.get(i % handles.len().max(1)) {
                    if cache.lock(h).is_ok() {
                        locked.push(h);
                    }
                }
            }
            Op::Unlock(i) => {
                if !locked.is_empty() {
                    let h = locked.swap_remove(i % locked.len());
                    cache.unlock(h).unwrap();
                }
            }
            Op::Evict(n) => {
                let before = cache.num_evictable_blocks();
                let freed = cache.evict(n, &mut alloc).unwrap();
                assert_eq!(freed, n.min(before));
                evicted |= freed > 0;
            }
            Op::Hold(n) => {
                if let Ok(mut blocks) = alloc.allocate(n) {
                    held.append(&mut blocks);
                }
            }
            Op::Drop(n) => {
                let n = n.min(held.len());
                let dropped: Vec<_> = held.drain(..n).collect();
                alloc.release(&dropped).unwrap();
            }
        }
        alloc.check_integrity().unwrap();
        cache.check_integrity(&alloc).unwrap();
        assert_eq!(
            cache.num_evictable_blocks() + cache.num_locked_blocks(),
            cache.num_cached_blocks()
        );
        for block in 0..num_blocks as BlockId {
            let expected = cache.contains_block(block) as u32
                + held.iter().filter(|&&b| b == block).count() as u32;
            assert_eq!(alloc.ref_count(block).unwrap(), expected, "block {block}");
        }
    }
    for h in locked.drain(..) {
        cache.unlock(h).unwrap();
    }
    cache.evict(usize::MAX, &mut alloc).unwrap();
    assert_eq!(cache.num_cached_blocks(), 0);
    assert_eq!(
        cache.num_namespaces(),
        0,
        "an empty namespace's root outlived it"
    );
    assert_eq!(cache.num_nodes(), 1);
    assert_eq!(alloc.num_free() + held.len(), num_blocks);
    cache.check_integrity(&alloc).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn radix_cache_state_machine(ops in prop::collection::vec(op(), 1..60), bs in 1usize..4) {
        run_machine(ops, bs, 24);
    }
}

#[test]
fn namespaces_never_share_blocks() {
    let (mut alloc, mut cache) = setup(8, 2);
    insert_fresh(&mut cache, &mut alloc, &[1, 2, 3, 4]);
    assert_eq!(cache.match_prefix(7, &[1, 2, 3, 4, 5]).num_tokens, 0);
    let blocks = alloc.allocate(2).unwrap();
    let out = cache.insert(7, &[1, 2, 3, 4], &blocks, &mut alloc).unwrap();
    assert_eq!(
        out.num_new_blocks, 2,
        "namespace 7 must not reuse namespace 0's blocks"
    );
    let ours = cache.match_prefix(7, &[1, 2, 3, 4, 5]);
    assert_eq!(ours.blocks, blocks);
    assert_ne!(cache.match_prefix(0, &[1, 2, 3, 4, 5]).blocks, blocks);
    assert_eq!(cache.num_namespaces(), 1);
    cache.lock(ours.handle).unwrap();
    assert_eq!(
        cache.evict(usize::MAX, &mut alloc).unwrap(),
        2,
        "only namespace 0's"
    );
    cache.unlock(ours.handle).unwrap();
    assert_eq!(cache.evict(usize::MAX, &mut alloc).unwrap(), 2);
    assert_eq!(cache.num_namespaces(), 0);
    cache.check_integrity(&alloc).unwrap();
    assert_eq!(alloc.num_free(), 8);
}
