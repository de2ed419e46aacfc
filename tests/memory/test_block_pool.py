"""Lesson 05's block pool and sharing: reference counts, O(1) free-queue operations, the prefix cache (token
verification, eviction order, the last prompt token recomputed), fork, copy-on-write."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from helpers.sharing import compute, make_seq

from lesson_utils.core.types import OutOfBlocks, Sequence
from lesson_utils.memory.block_pool import NO_PARENT, BlockPool, block_hash
from lesson_utils.memory.block_table import BlockTable
from lesson_utils.memory.sharing import SharingBlockManager, copy_on_write, fork_table

# ---------------------------------------------------------------------------------------------------
# BlockPool
# ---------------------------------------------------------------------------------------------------


def test_pool_counts_references():
    pool = BlockPool(4)
    assert (pool.num_free, pool.num_used) == (4, 0)
    b = pool.allocate()
    assert pool.ref_count[b] == 1 and not pool.is_free(b)
    pool.incref(b)
    pool.incref(b)
    assert pool.ref_count[b] == 3 and pool.num_free == 3
    pool.decref(b)
    pool.decref(b)
    assert pool.ref_count[b] == 1 and not pool.is_free(b) and pool.num_free == 3
    pool.decref(b)
    assert pool.ref_count[b] == 0 and pool.is_free(b) and pool.num_free == 4
    pool.incref(b)  # a free block can be revived (a prefix-cache hit): it leaves the free queue
    assert pool.ref_count[b] == 1 and pool.num_free == 3
    assert [pool.allocate() for _ in range(3)] == [x for x in range(4) if x != b]
    with pytest.raises(OutOfBlocks, match="all 4 blocks are in use"):
        pool.allocate()
    pool.incref(b)
    pool.free(b)  # lesson 03's name: one reference fewer, so the block stays held
    assert pool.ref_count[b] == 1 and not pool.is_free(b)
    pool.free(b)
    assert pool.is_free(b) and pool.num_free == 1


def test_pool_errors_are_clear_and_change_nothing():
    pool = BlockPool(4)
    b = pool.allocate()
    pool.decref(b)
    with pytest.raises(ValueError, match=f"block {b} is already free"):
        pool.decref(b)
    with pytest.raises(ValueError, match="already free"):
        pool.decref(3)  # never allocated
    for bad in (4, 100, -1):
        for op in (pool.incref, pool.decref, pool.is_free):
            with pytest.raises(ValueError, match=rf"block id {bad} is out of range.*4 blocks"):
                op(bad)
    for bad in (1.0, "1", None, True):
        for op in (pool.incref, pool.decref, pool.is_free):
            with pytest.raises(TypeError, match="a block id is an int"):
                op(bad)
    assert pool.num_free == 4 and pool.ref_count == [0] * 4
    for bad in (0, -2, 2.5, None):
        with pytest.raises(ValueError, match="at least one block"):
            BlockPool(bad)


def test_pool_reuses_the_least_recently_freed_block_first():
    pool = BlockPool(6)
    ids = [pool.allocate() for _ in range(6)]
    for b in (4, 1, 5, 0, 3, 2):
        pool.decref(ids[b])
    pool.incref(ids[5])  # revived from the middle of the queue: no longer a candidate
    assert [pool.allocate() for _ in range(5)] == [ids[b] for b in (4, 1, 0, 3, 2)]


def _seconds_for_queue_ops(num_blocks: int, ops: int = 2000) -> float:
    pool = BlockPool(num_blocks)
    ids = [pool.allocate() for _ in range(num_blocks)]
    for b in ids:
        pool.decref(b)
    middle = ids[num_blocks // 2 - ops // 2 : num_blocks // 2 + ops // 2]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for b in middle:  # hits revive blocks from the middle of the free queue ...
            pool.incref(b)
        for b in middle:  # ... and hand them back to its newest end
            pool.decref(b)
        for _ in range(ops):  # evict the oldest
            pool.decref(pool.allocate())
        best = min(best, time.perf_counter() - t0)
    return best


def test_free_queue_operations_cost_the_same_in_a_large_pool():
    """O(1): a list-based queue (``list.remove``, ``pop(0)``) is ~50x slower at 100k blocks than at 2k."""
    small, large = _seconds_for_queue_ops(2_000), _seconds_for_queue_ops(100_000)
    assert large < 8 * small + 0.01, f"{large:.4f}s at 100k blocks vs {small:.4f}s at 2k blocks"


def test_pool_cache_and_lookup():
    pool = BlockPool(4)
    b = pool.allocate()
    h = block_hash(NO_PARENT, [1, 2])
    pool.cache(b, h, [1, 2])
    assert pool.lookup(h, [1, 2]) == b and pool.lookup(h, (1, 2)) == b
    assert pool.lookup(h, [1, 3]) is None, "a hash whose block holds other tokens must miss"
    assert pool.lookup(block_hash(NO_PARENT, [9, 9]), [9, 9]) is None
    assert (pool.lookups, pool.hits) == (4, 2)
    c = pool.allocate()
    pool.cache(c, h, [1, 2])  # the hash is known: the first block keeps it
    pool.cache(b, block_hash(NO_PARENT, [5, 5]), [5, 5])  # the block is known: keeps its hash
    assert pool.hash_of == {b: h} and pool.block_of == {h: b}
    pool.decref(b)
    assert pool.lookup(h, [1, 2]) == b and pool.num_cached_free == 1  # free, still findable
    for _ in range(2):
        pool.allocate()  # blocks 2 and 3 (never used): older in the queue than b
    assert pool.lookup(h, [1, 2]) == b and pool.evictions == 0
    assert pool.allocate() == b and pool.evictions == 1  # reused: now it is evicted
    assert pool.lookup(h, [1, 2]) is None and not pool.hash_of and not pool.block_of and not pool.tokens_of
    off = BlockPool(2, enable_caching=False)
    off.cache(off.allocate(), h, [1, 2])
    assert off.lookup(h, [1, 2]) is None and not off.hash_of and off.lookups == 0


# ---------------------------------------------------------------------------------------------------
# The prefix cache in the manager
# ---------------------------------------------------------------------------------------------------


def test_lookup_rejects_a_hash_collision():
    """With a hash function that calls every block the same, token verification alone keeps wrong
    blocks out: a block whose tokens differ is never a hit."""
    m = SharingBlockManager(16, 2, hash_fn=lambda parent, tokens: 42, watermark=0.0)
    a = make_seq(0, [5, 6, 7, 8, 9])
    compute(m, a)
    assert m.view.cached_blocks() == {m.view.tables()[0].blocks[0]: 42}  # the second block's "hash" was taken already
    b = make_seq(1, [1, 2, 7, 8, 9])  # same hash, other tokens
    m.allocate(b)
    assert b.num_computed == 0 and not set(m.view.tables()[1].blocks) & set(m.view.tables()[0].blocks)
    c = make_seq(2, [5, 6, 3, 4, 9])  # first block really equal: hit; second: same hash, other tokens
    m.allocate(c)
    assert c.num_computed == 2 and m.view.tables()[2].blocks[0] == m.view.tables()[0].blocks[0]
    assert m.view.tables()[2].blocks[1] != m.view.tables()[0].blocks[0]
    m.view.check_invariants()


@pytest.mark.xfail(
    strict=True,
    reason=(
        "known limit: lookup verifies a block's own tokens, not its prefix, so a chained-hash collision "
        "between equal blocks at different places would be a wrong hit; a strong hash makes it negligible"
    ),
)
def test_a_collision_with_equal_tokens_but_another_prefix_is_not_a_hit():
    m = SharingBlockManager(16, 2, hash_fn=lambda parent, tokens: 42, watermark=0.0)
    compute(m, make_seq(0, [5, 6, 7, 8, 9]))
    d = make_seq(1, [5, 6, 5, 6, 9])  # block 1 holds [5, 6] like block 0 - but after another prefix
    m.allocate(d)
    assert d.num_computed == 2, "block 0's K/V (positions 0-1) handed out for positions 2-3"


def test_the_tail_block_is_evicted_first():
    """Freeing a sequence returns its blocks tail first, so eviction eats prefixes from the end and the
    shared head of a prompt stays cached longest."""
    m = SharingBlockManager(3, 2, watermark=0.0)
    a = make_seq(0, [1, 2, 3, 4, 5, 6])
    compute(m, a)
    head, middle, tail = m.view.tables()[0].blocks
    assert set(m.view.cached_blocks()) == {head, middle, tail}
    m.free(a.seq_id)
    assert m.view.prefix_cache_stats().cached_free_blocks == 3
    b = make_seq(1, [7])  # one block, shares nothing
    m.allocate(b)
    assert m.view.tables()[1].blocks == [tail], "the tail block must be reused first"
    assert set(m.view.cached_blocks()) == {head, middle} and m.view.prefix_cache_stats().evictions == 1
    m.free(b.seq_id)
    c = make_seq(2, [1, 2, 3, 4, 9])  # the first two blocks are still cached: hit both
    m.allocate(c)
    assert m.view.tables()[2].blocks[:2] == [head, middle] and c.num_computed == 4
    m.view.check_invariants()


def test_a_freed_cached_block_is_hit_until_it_is_evicted():
    m = SharingBlockManager(4, 2, watermark=0.0)
    compute(m, make_seq(0, [1, 2, 3]))
    first = m.view.tables()[0].blocks[0]
    m.free(0)
    assert m.view.block_is_free(first) and m.view.cached_blocks() == {first: block_hash(NO_PARENT, [1, 2])}
    again = make_seq(1, [1, 2, 7])
    assert m.can_allocate(again)
    m.allocate(again)
    assert m.view.tables()[1].blocks[0] == first and again.num_computed == 2 and m.view.ref_count(first) == 1
    m.free(1)
    filler = make_seq(2, [9] * 7)  # needs all four blocks: the cached one is reused, so evicted
    m.allocate(filler)
    assert first in m.view.tables()[2].blocks and not m.view.cached_blocks()
    m.free(2)
    late = make_seq(3, [1, 2, 7])
    m.allocate(late)
    assert late.num_computed == 0


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_the_last_prompt_token_is_always_recomputed(block_size):
    m = SharingBlockManager(32, block_size, watermark=0.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2][: 2 * block_size]  # exactly two blocks (one block: 2 tokens at bs 1)
    compute(m, make_seq(0, prompt))
    assert len(m.view.cached_blocks()) == len(prompt) // block_size  # every block of it is cached
    again = make_seq(1, prompt)
    m.allocate(again)
    hit = (len(prompt) - 1) // block_size
    assert again.num_computed == hit * block_size < len(prompt)
    assert m.view.tables()[1].blocks[:hit] == m.view.tables()[0].blocks[:hit]
    assert m.view.tables()[1].blocks[hit] != m.view.tables()[0].blocks[hit]  # recomputed in a block of its own
    assert m.view.prefix_hits(prompt) == m.view.tables()[0].blocks[:hit]
    longer = make_seq(2, prompt + [0])  # one token more: every block of the prompt hits
    m.allocate(longer)
    assert longer.num_computed == len(prompt)
    assert m.view.cached_prompt_tokens == again.num_computed + longer.num_computed
    assert m.view.prompt_tokens == 3 * len(prompt) + 1
    m.view.check_invariants()


def test_prefix_caching_off_never_hits():
    m = SharingBlockManager(16, 2, enable_prefix_caching=False, watermark=0.0)
    compute(m, make_seq(0, [1, 2, 3, 4, 5]))
    again = make_seq(1, [1, 2, 3, 4, 5])
    m.allocate(again)
    assert again.num_computed == 0 and not m.view.cached_blocks() and m.view.cached_prompt_tokens == 0
    assert not set(m.view.tables()[0].blocks) & set(m.view.tables()[1].blocks)


# ---------------------------------------------------------------------------------------------------
# Fork and copy-on-write
# ---------------------------------------------------------------------------------------------------


def test_fork_never_allocates():
    m = SharingBlockManager(8, 4, watermark=0.0)
    parent = make_seq(0, list(range(10)))
    m.allocate(parent)
    free_before, blocks = m.num_free_blocks, list(m.view.tables()[0].blocks)
    for child in (1, 2, 3):
        m.fork(0, child)
    assert m.num_free_blocks == free_before
    assert all(m.view.tables()[c].blocks == blocks and m.view.tables()[c].num_tokens == 10 for c in (1, 2, 3))
    assert all(m.view.ref_count(b) == 4 for b in blocks)
    assert m.view.sharing() == (4 * len(blocks), len(blocks))
    with pytest.raises(ValueError, match="sequence 1 already holds blocks"):
        m.fork(0, 1)
    with pytest.raises(ValueError, match="cannot fork sequence 9: it holds no blocks"):
        m.fork(9, 10)
    m.view.check_invariants()
    t = fork_table(BlockTable(4, [5, 6], 7), BlockPool(8))  # the reference on its own
    assert (t.blocks, t.num_tokens) == ([5, 6], 7)


def test_copy_on_write_repoints_only_the_writer():
    pool = BlockPool(4)
    old = pool.allocate()
    mine, theirs = BlockTable(2, [old], 1), BlockTable(2, [old], 1)
    pool.incref(old)
    copy = copy_on_write(mine, 0, pool)
    assert copy is not None
    src, dst = copy
    assert src == old and dst != old
    assert mine.blocks == [dst] and theirs.blocks == [old]
    assert pool.ref_count[old] == 1 and pool.ref_count[dst] == 1
    assert copy_on_write(theirs, 0, pool) is None and theirs.blocks == [old]  # sole holder: in place


def test_make_writable_records_the_copies_for_the_cache():
    m = SharingBlockManager(8, 4, watermark=0.0)
    parent = make_seq(0, list(range(6)))  # blocks: [0..3] full, [4, 5] partial
    m.allocate(parent)
    m.fork(0, 1)
    full, partial = m.view.tables()[0].blocks
    free_before = m.num_free_blocks
    m._make_writable(1, 6, 8)  # the child writes positions 6 and 7: only the partial block is copied
    assert m.view.tables()[1].blocks[0] == full and m.view.tables()[1].blocks[1] not in (full, partial)
    assert m.view.tables()[0].blocks == [full, partial]
    assert m.pop_copies() == [(partial, m.view.tables()[1].blocks[1])] and m.pop_copies() == []
    assert m.num_free_blocks == free_before - 1 and m.view.num_cow == 1
    m._make_writable(0, 6, 8)  # the parent is now the partial block's only holder
    assert m.pop_copies() == [] and m.view.tables()[0].blocks == [full, partial]
    m.view.check_invariants()


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("prompt_len", [5, 8])
def test_n_holders_of_a_shared_partial_block_cost_n_minus_1_copies(n, prompt_len):
    """Parent + n forked children write their next token into the block they share: the first n each
    copy it, and the last remaining holder writes in place - n copies for n + 1 holders.

    With a prompt of 8 (two whole blocks) that block was taken for the first new token before the fork and
    holds nothing yet; it is copied all the same (a wasted copy, not a wrong one)."""
    m = SharingBlockManager(32, 4, watermark=0.0)
    parent = make_seq(0, list(range(prompt_len)))
    m.allocate(parent)
    parent.num_computed = parent.len
    parent.output_ids.append(99)
    parent.num_generated += 1  # computed up to its first generated token, as the engine forks
    m.append_slot(parent)
    m.pop_copies()
    seqs = [parent]
    for c in range(1, n + 1):
        m.fork(0, c)
        child = Sequence(
            replace(parent.request, req_id=c), num_generated=1, output_ids=[100 + c], num_computed=parent.num_computed
        )
        seqs.append(child)
    last = m.view.tables()[0].blocks[prompt_len // 4]  # holds position prompt_len, written next step
    assert m.view.ref_count(last) == n + 1
    for s in seqs:
        m.append_slot(s)
    copies = m.pop_copies()
    assert len(copies) == n == m.view.num_cow
    assert all(src == last for src, _ in copies)
    owners = [m.view.tables()[s.seq_id].blocks[prompt_len // 4] for s in seqs]
    assert len(set(owners)) == n + 1 and owners[-1] == last  # the last writer kept the original
    assert m.view.ref_count(last) == 1
    m.view.check_invariants()


def test_the_invariant_check_sees_a_free_queue_that_disagrees_with_the_counts():
    from lesson_utils.memory.sharing import SharingBlockManager

    pool = BlockPool(4)
    m = SharingBlockManager(4, 2, watermark=0, pool=pool)
    m.view.check_invariants()
    del pool._free_queue[
        3
    ]  # corrupt the pool the test handed in: block 3 has count 0 but is no longer in the free queue: it is lost
    with pytest.raises(AssertionError, match="block 3: count 0, not in the free queue"):
        m.view.check_invariants()
