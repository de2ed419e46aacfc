"""Lesson 03's block allocator (first in, first out, constant time, clear errors) and the block-table maths
(grow_block_table, slot_mapping, gather_kv) against brute-force loops on shuffled tables."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch
from helpers.paged import brute_force_slots

from lesson_utils.cache.paged import gather_kv, slot_mapping
from lesson_utils.cache.seam import StepBatch
from lesson_utils.core.types import OutOfBlocks
from lesson_utils.memory.block_allocator import BlockAllocator
from lesson_utils.memory.block_table import BlockTable, blocks_needed, grow_block_table

# ---------------------------------------------------------------------------------------------------
# BlockAllocator
# ---------------------------------------------------------------------------------------------------


def test_allocator_hands_out_every_block_then_says_out_of_blocks():
    a = BlockAllocator(8)
    assert (a.num_free, a.num_used) == (8, 0)
    assert [a.allocate() for _ in range(8)] == list(range(8))
    assert (a.num_free, a.num_used) == (0, 8)
    assert not any(a.is_free(b) for b in range(8))
    with pytest.raises(OutOfBlocks, match="all 8 blocks are in use"):
        a.allocate()
    assert (a.num_free, a.num_used) == (0, 8)  # the failure took nothing
    assert issubclass(OutOfBlocks, RuntimeError)


def test_allocator_reuses_freed_blocks_first_in_first_out():
    a = BlockAllocator(8)
    for _ in range(8):
        a.allocate()
    for b in (5, 2, 7):
        a.free(b)
    assert [a.is_free(b) for b in (5, 2, 7, 0)] == [True, True, True, False]
    assert [a.allocate() for _ in range(3)] == [5, 2, 7]
    b = BlockAllocator(4)
    first = b.allocate()  # 0
    b.free(first)  # goes to the back: 1, 2, 3 are older free blocks
    assert [b.allocate() for _ in range(4)] == [1, 2, 3, 0]


def _seconds_for_ops(num_blocks: int, ops: int = 3000) -> float:
    a = BlockAllocator(num_blocks)
    held = [a.allocate() for _ in range(64)]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(ops):
            a.free(held[i % 64])
            held[i % 64] = a.allocate()
        best = min(best, time.perf_counter() - t0)
    return best


def test_allocate_and_free_cost_does_not_grow_with_the_cache():
    """O(1): a free list that is scanned or shifted (``list.pop(0)``, ``in list``) is ~1000x slower at
    a million blocks than at a thousand; a deque with a membership bitmap is not."""
    small, large = _seconds_for_ops(1_000), _seconds_for_ops(1_000_000)
    assert large < 10 * small + 0.01, f"{large:.4f}s at 1M blocks vs {small:.4f}s at 1k blocks"


def test_allocator_errors_are_clear():
    a = BlockAllocator(4)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match="block 0 is already free"):
        a.free(b)
    with pytest.raises(ValueError, match="already free"):
        a.free(3)  # never allocated
    for bad in (4, 100):
        with pytest.raises(ValueError, match=rf"block id {bad} is out of range.*4 blocks"):
            a.free(bad)
        with pytest.raises(ValueError, match="out of range"):
            a.is_free(bad)
    with pytest.raises(ValueError, match="block id -1 is out of range"):
        a.free(-1)
    for bad in (1.0, "1", None, True, np.float64(2)):
        with pytest.raises(TypeError, match="a block id is an int"):
            a.free(bad)
        with pytest.raises(TypeError, match="a block id is an int"):
            a.is_free(bad)
    assert a.num_free == 4 and [a.is_free(i) for i in range(4)] == [True] * 4  # errors changed nothing


@pytest.mark.parametrize("bad", [0, -2, 2.5, None])
def test_allocator_needs_at_least_one_block(bad):
    with pytest.raises(ValueError, match="at least one block"):
        BlockAllocator(bad)


# ---------------------------------------------------------------------------------------------------
# Block tables
# ---------------------------------------------------------------------------------------------------


def test_blocks_needed_is_ceiling_division():
    for bs in (1, 2, 3, 4, 16):
        for n in range(0, 70):
            assert blocks_needed(n, bs) == len(range(0, n, bs))


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_grow_block_table_allocates_exactly_at_block_boundaries(block_size):
    counter = iter(range(1000, 2000))
    table: list[int] = []
    for n in range(70):  # the sequence holds n tokens and is about to get token n + 1
        before = len(table)
        grow_block_table(table, n, block_size, lambda: next(counter))
        grew = len(table) - before
        assert grew == (1 if n % block_size == 0 else 0), f"{n} tokens, block size {block_size}"
        assert len(table) == blocks_needed(n + 1, block_size)
    assert table == list(range(1000, 1000 + blocks_needed(70, block_size)))


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_slot_mapping_on_shuffled_tables_matches_brute_force(block_size):
    rng = random.Random(block_size)
    num_blocks = 64
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    before = [0, 5, block_size, 2 * block_size - 1, 17]  # tokens already cached per sequence
    new = [[7] * n for n in (9, 1, 1, block_size + 2, 1)]  # prefills and decodes side by side
    tables, nxt = [], 0
    for b, toks in zip(before, new):
        k = blocks_needed(b + len(toks), block_size)
        tables.append(ids[nxt : nxt + k])
        nxt += k
    assert any(t != sorted(t) for t in tables if len(t) > 1)  # non-monotonic
    batch = StepBatch.build(list(range(10, 15)), new, before)
    got = slot_mapping(batch, tables, block_size)
    assert got.dtype == torch.long and got.shape == (batch.num_tokens,)
    expected = []
    for table, b, toks in zip(tables, before, new):
        walk = brute_force_slots(table, block_size)
        expected += [walk[p] for p in range(b, b + len(toks))]
    assert got.tolist() == expected
    assert len(set(expected)) == len(expected)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gather_kv_matches_a_loop_over_positions(block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim = 12, 2, 3
    cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:5].tolist()
    contexts = {1, block_size, 2 * block_size, 3 * block_size - 1, 5 * block_size - 1, 5 * block_size}
    for ctx in sorted(contexts):
        got = gather_kv(cache, table, ctx)
        expected = torch.stack([cache[table[p // block_size], p % block_size] for p in range(ctx)])
        assert got.shape == (ctx, heads, dim)
        assert torch.equal(got, expected), f"context {ctx}"
        walk = brute_force_slots(table, block_size)
        flat = cache.reshape(-1, heads, dim)
        assert torch.equal(got, flat[[walk[p] for p in range(ctx)]])


def test_block_table_slot_and_its_errors():
    t = BlockTable(block_size=4, blocks=[7, 2, 9], num_tokens=10)
    assert (t.capacity, t.last_block_waste) == (12, 2)
    assert [t.slot(p) for p in range(10)] == [brute_force_slots(t.blocks, 4)[p] for p in range(10)]
    assert t.slot(0) == 28 and t.slot(4) == 8 and t.slot(9) == 37
    for bad in (10, 11, -1):
        with pytest.raises(IndexError, match=f"position {bad} is outside this sequence's 10 tokens"):
            t.slot(bad)
    with pytest.raises(IndexError):
        BlockTable(block_size=4).slot(0)
