"""Block allocator and radix cache through the bindings: a hypothesis state
machine against a naive reference, and bad input."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from ferrox._native import BlockAllocator, RadixCache
from ferrox.common import errors

BLOCK_SIZE = 2
NUM_BLOCKS = 24
tokens_st = st.lists(st.integers(0, 2), max_size=16)


def longest_cached(sequences: list[list[int]], query: list[int]) -> int:
    best = 0
    for seq in sequences:
        n = 0
        while (
            n + BLOCK_SIZE <= min(len(seq), len(query))
            and seq[n : n + BLOCK_SIZE] == query[n : n + BLOCK_SIZE]
        ):
            n += BLOCK_SIZE
        best = max(best, n)
    return best


class KvMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        self.cache = RadixCache(self.alloc)
        self.held: list[int] = []
        self.locked: list[int] = []
        self.sequences: list[list[int]] = []
        self.evicted = False

    @rule(target=handles, seq=tokens_st)
    def insert(self, seq: list[int]) -> int:
        need = len(seq) // BLOCK_SIZE
        if self.alloc.num_free < need:
            self.evicted |= self.cache.evict(need - self.alloc.num_free) > 0
        if self.alloc.num_free < need:
            return self.cache.match_prefix([])[2]
        blocks = self.alloc.allocate(need)
        handle, _ = self.cache.insert(np.array(seq, dtype=np.int64), blocks)
        self.sequences.append(seq[: need * BLOCK_SIZE])
        return handle

    @rule(target=handles, query=tokens_st)
    def match(self, query: list[int]) -> int:
        blocks, num_tokens, handle = self.cache.match_prefix(query)
        assert num_tokens % BLOCK_SIZE == 0
        assert len(blocks) == num_tokens // BLOCK_SIZE
        longest = longest_cached(self.sequences, query)
        assert num_tokens <= longest
        if not self.evicted:
            assert num_tokens == longest
        return handle

    @rule(handle=handles)
    def lock(self, handle: int) -> None:
        try:
            self.cache.lock(handle)
        except errors.InvalidHandleError:
            return  # the node was evicted since
        self.locked.append(handle)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        handle = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1)))
        self.cache.unlock(handle)

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        before = self.cache.num_evictable_blocks
        freed = self.cache.evict(n)
        assert freed == min(n, before)
        self.evicted |= freed > 0

    @rule(n=st.integers(0, 3))
    def hold(self, n: int) -> None:
        if self.alloc.num_free >= n:
            self.held.extend(int(b) for b in self.alloc.allocate(n))

    @precondition(lambda self: self.held)
    @rule(n=st.integers(1, 3))
    def drop(self, n: int) -> None:
        dropped, self.held = self.held[:n], self.held[n:]
        self.alloc.free(dropped)

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_integrity()
        self.cache.check_integrity()
        c = self.cache
        assert c.num_evictable_blocks + c.num_locked_blocks == c.num_cached_blocks
        assert self.alloc.num_used == len(self.held) + c.num_cached_blocks
        for block in self.held:
            assert self.alloc.ref_count(block) == 1

    def teardown(self) -> None:
        for handle in self.locked:
            self.cache.unlock(handle)
        self.cache.evict(NUM_BLOCKS)
        assert self.cache.num_cached_blocks == 0
        assert self.alloc.num_free + len(self.held) == NUM_BLOCKS


TestKvMachine = KvMachine.TestCase
TestKvMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.fixture
def kv() -> tuple[BlockAllocator, RadixCache]:
    alloc = BlockAllocator(8, 4)
    return alloc, RadixCache(alloc)


def check(kv: tuple[BlockAllocator, RadixCache]) -> None:
    kv[0].check_integrity()
    kv[1].check_integrity()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda a, c: a.free([-1]), errors.InvalidArgumentError),
        (lambda a, c: a.free([8]), errors.InvalidBlockError),
        (lambda a, c: a.free([3]), errors.BlockNotAllocatedError),
        (lambda a, c: a.share([100]), errors.InvalidBlockError),
        (lambda a, c: a.free("abc"), errors.InvalidArgumentError),
        (lambda a, c: a.free([1.5]), errors.InvalidArgumentError),
        (lambda a, c: a.free(np.zeros((2, 2), dtype=np.int64)), errors.InvalidArgumentError),
        (lambda a, c: a.free(np.zeros(2, dtype=np.float32)), errors.InvalidArgumentError),
        (lambda a, c: a.allocate(9), errors.OutOfBlocksError),
        (lambda a, c: a.ref_count(-5), errors.InvalidArgumentError),
        (lambda a, c: c.insert(list(range(8)), [0]), errors.InvalidArgumentError),
        (lambda a, c: c.insert(list(range(4)), [0, 1]), errors.InvalidArgumentError),
        (lambda a, c: c.insert([1, 2, 3, 4], [5]), errors.BlockNotAllocatedError),
        (lambda a, c: c.insert([1, 2, 3, 4], [-2]), errors.InvalidArgumentError),
        (lambda a, c: c.insert([-1, 2, 3, 4], [0]), errors.InvalidArgumentError),
        (lambda a, c: c.unlock(c.match_prefix([])[2]), errors.NotLockedError),
        (lambda a, c: c.lock(987654321), errors.InvalidHandleError),
        (lambda a, c: BlockAllocator(0, 16), errors.InvalidArgumentError),
        (lambda a, c: BlockAllocator(4, 0), errors.InvalidArgumentError),
    ],
)
def test_bad_input_raises_and_changes_nothing(kv, call, error) -> None:
    alloc, cache = kv
    alloc.allocate(2)
    before = (alloc.num_free, cache.num_cached_blocks)
    with pytest.raises(error) as info:
        call(alloc, cache)
    assert str(info.value)  # a message, not a bare exception
    assert (alloc.num_free, cache.num_cached_blocks) == before
    check(kv)


def test_double_free_is_reported(kv) -> None:
    alloc, _ = kv
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(errors.BlockNotAllocatedError, match="not allocated"):
        alloc.free(blocks)
    with pytest.raises(ValueError):
        alloc.free([blocks[0], blocks[0]])
    check(kv)


def test_match_lock_evict_round_trip(kv) -> None:
    alloc, cache = kv
    blocks = alloc.allocate(3)
    _, num_new = cache.insert(np.arange(12, dtype=np.int32), blocks)
    assert num_new == 3
    got, n, h = cache.match_prefix(np.arange(10, dtype=np.uint32))
    assert (list(got), n) == ([int(b) for b in blocks[:2]], 8)
    cache.lock(h)
    assert cache.evict(8) == 1  # only the unlocked tail block
    cache.unlock(h)
    assert cache.evict(8) == 2
    assert alloc.num_free == 8
    assert (cache.num_hit_tokens, cache.num_queried_tokens, cache.num_evicted_blocks) == (8, 10, 3)
    check(kv)
