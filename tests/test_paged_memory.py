"""Lesson 03's paged memory: the block allocator, block tables, the block manager and the paged cache.

What this file proves:

* the block manager never loses, double-books or leaks a block, whatever order sequences arrive in,
  grow and finish (a hypothesis state machine, checked after every step against ``is_free`` of every
  block id, not only against the manager's own ``check_invariants``), and a failed allocation or
  growth changes nothing;
* the allocator hands blocks out first-in first-out in constant time, and refuses bad ids and double
  frees with clear errors;
* the block-table maths (``grow_block_table``, ``slot_mapping``, ``gather_kv``) agree with brute-force
  per-token loops on shuffled, non-monotonic tables, at and around block boundaries;
* ``paged_attention_reference`` equals attention over a contiguous copy of the same K/V (GQA and MHA,
  block sizes 1 / 8 / 16, blocks shared by two tables, context length 1), and ``PagedKVCache`` equals
  ``DenseKVCache`` step after step;
* the memory accounting (``breakdown``, ``utilization``, ``slot_kinds``) adds up, and inputs that can
  never work fail with ``NeverFits`` / ``ValueError`` / ``TypeError`` naming the problem.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch
from helpers import ReservingPagedKVCache, step_beside_dense
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lesson_utils.cache.attention import (
    attention_over_context,
    decode_attention,
    decode_slot_index,
    fused_attention_over_context,
    paged_attention_reference,
)
from lesson_utils.cache.dense import DenseKVCache
from lesson_utils.cache.paged import PagedKVCache, gather_kv, slot_mapping
from lesson_utils.cache.seam import StepBatch
from lesson_utils.memory.block_allocator import BlockAllocator
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import BlockTable, blocks_needed, grow_block_table
from lesson_utils.types import FREE, INTERNAL, TOKEN, NeverFits, OutOfBlocks, Request, Sequence


def make_seq(seq_id: int, prompt_len: int, output_len: int = 1000) -> Sequence:
    return Sequence(Request(seq_id, 0.0, prompt_len, output_len))


def snapshot(m: BlockManager):
    """Everything a failed operation must leave untouched: every table, and which ids are free."""
    tables = {sid: (tuple(t.blocks), t.num_tokens) for sid, t in m.tables.items()}
    return tables, tuple(m.allocator.is_free(b) for b in range(m.num_blocks)), m.allocator.num_free


def scramble_free_queue(allocator: BlockAllocator, seed: int) -> None:
    """Take every block and give them back in random order, so later tables are non-monotonic."""
    ids = [allocator.allocate() for _ in range(allocator.num_blocks)]
    random.Random(seed).shuffle(ids)
    for b in ids:
        allocator.free(b)


# ---------------------------------------------------------------------------------------------------
# The block manager as a state machine
# ---------------------------------------------------------------------------------------------------

NUM_BLOCKS = 24


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences arrive, grow a token at a time and finish in random order; no block is ever lost,
    held twice, or both held and free, and every table holds exactly ceil(tokens / block_size) blocks."""

    def __init__(self):
        super().__init__()
        self.m: BlockManager | None = None
        self.live: dict[int, Sequence] = {}
        self.finished: list[Sequence] = []
        self.next_id = 0

    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), watermark=st.sampled_from([0.0, 0.1]))
    def setup(self, block_size, watermark):
        self.bs = block_size
        self.m = BlockManager(NUM_BLOCKS, block_size, watermark=watermark)
        assert self.m.watermark_blocks == int(watermark * NUM_BLOCKS)

    def _new_seq(self, prompt_len: int) -> Sequence:
        seq = make_seq(self.next_id, prompt_len)
        self.next_id += 1
        return seq

    @rule(data=st.data(), via_ensure=st.booleans())
    def add_sequence(self, data, via_ensure):
        # Mostly prompts of up to 4 blocks (the cache fills up after a dozen), sometimes up to the whole
        # cache and beyond (refused even when empty).
        bs = self.bs
        prompt_len = data.draw(st.integers(1, 4 * bs) | st.integers(1, (NUM_BLOCKS + 2) * bs), label="prompt_len")
        m, seq = self.m, self._new_seq(prompt_len)
        need = blocks_needed(prompt_len, self.bs)
        free_before = m.allocator.num_free
        if m.can_allocate(seq):
            assert need <= free_before
            if via_ensure:
                table = m.ensure_capacity(seq.seq_id, prompt_len)
            else:
                m.allocate(seq)
                table = m.tables[seq.seq_id]
            assert table.num_tokens == prompt_len and len(table.blocks) == need
            assert m.allocator.num_free == free_before - need
            self.live[seq.seq_id] = seq
            event("admitted")
            return
        # Refused: consistently so (not enough free blocks, or only the watermark holds it back) ...
        if m.allocator.num_used == 0:
            assert need > NUM_BLOCKS
        else:
            assert need + m.watermark_blocks > free_before
        event("refused: too few free blocks" if need > free_before else "refused: watermark")
        if need > free_before:  # ... and forcing it fails without touching anything
            before = snapshot(m)
            with pytest.raises(OutOfBlocks):
                if via_ensure:
                    m.ensure_capacity(seq.seq_id, prompt_len)
                else:
                    m.allocate(seq)
            assert snapshot(m) == before, "a failed allocation changed the manager's state"
            assert seq.seq_id not in m.tables

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow_by_one_token(self, data):
        m = self.m
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        table = m.tables[seq.seq_id]
        needs_block = seq.len % self.bs == 0
        event(f"grow: {'new' if needs_block else 'same'} block, {'some' if m.allocator.num_free else 'none'} free")
        if needs_block and m.allocator.num_free == 0:
            before = snapshot(m)
            msg = rf"needs 1 more block\(s\) for {seq.len + 1} tokens, but only 0 of the 24 blocks are free"
            with pytest.raises(OutOfBlocks, match=msg):
                m.append_slot(seq)
            assert snapshot(m) == before, "a failed append_slot changed the manager's state"
            return
        old_blocks, free_before = list(table.blocks), m.allocator.num_free
        free_ids = {b for b in range(NUM_BLOCKS) if m.allocator.is_free(b)}
        m.append_slot(seq)
        seq.num_generated += 1  # the token that slot was for has been generated
        assert table.blocks[: len(old_blocks)] == old_blocks, "existing blocks moved"
        if needs_block:
            assert len(table.blocks) == len(old_blocks) + 1 and table.blocks[-1] in free_ids
            assert m.allocator.num_free == free_before - 1
        else:
            assert len(table.blocks) == len(old_blocks) and m.allocator.num_free == free_before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_sequence(self, data):
        m = self.m
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        blocks, free_before = list(m.tables[seq.seq_id].blocks), m.allocator.num_free
        m.free(seq)
        assert m.allocator.num_free == free_before + len(blocks)
        assert all(m.allocator.is_free(b) for b in blocks)
        assert seq.seq_id not in m.tables
        self.finished.append(seq)

    @rule(data=st.data())
    def bad_frees(self, data):
        m = self.m
        before = snapshot(m)
        with pytest.raises(ValueError, match="holds no blocks"):
            m.free(make_seq(10_000 + self.next_id, 3))  # never admitted
        if self.finished:
            with pytest.raises(ValueError, match="holds no blocks"):
                m.free(data.draw(st.sampled_from(self.finished)))  # freed twice
        free_ids = [b for b in range(NUM_BLOCKS) if m.allocator.is_free(b)]
        if free_ids:
            with pytest.raises(ValueError, match="already free"):
                m.allocator.free(data.draw(st.sampled_from(free_ids)))
        if self.live:
            with pytest.raises(ValueError, match="already holds blocks"):
                m.allocate(self.live[data.draw(st.sampled_from(sorted(self.live)))])
        assert snapshot(m) == before, "a refused free changed the manager's state"

    @invariant()
    def every_block_is_free_or_owned_never_both_never_lost(self):
        m = self.m
        if m is None:
            return
        m.check_invariants()
        a = m.allocator
        free_ids = {b for b in range(NUM_BLOCKS) if a.is_free(b)}
        held = [b for t in m.tables.values() for b in t.blocks]
        assert len(held) == len(set(held)), "a block is in two tables (or twice in one)"
        assert not free_ids & set(held), "a block is both free and held"
        assert free_ids | set(held) == set(range(NUM_BLOCKS)), "a block is neither free nor held"
        assert a.num_free == len(free_ids) and a.num_free + a.num_used == NUM_BLOCKS
        assert set(m.tables) == set(self.live)
        for sid, t in m.tables.items():
            assert t.num_tokens == self.live[sid].len
            assert len(t.blocks) == -(-t.num_tokens // self.bs)
        br = m.breakdown()
        assert sum(br.values()) == m.total_slots and br["reserved"] == 0
        assert br["free"] == a.num_free * self.bs
        assert br["internal fragmentation"] == sum(t.last_block_waste for t in m.tables.values())
        assert all(0 <= t.last_block_waste < self.bs for t in m.tables.values())
        held_slots = br["token states"] + br["internal fragmentation"]
        assert m.utilization() == (br["token states"] / held_slots if held_slots else 1.0)


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase


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


def brute_force_slots(table: list[int], block_size: int) -> dict[int, int]:
    """position -> flat slot, by walking the table block by block (no // or % on positions)."""
    slots, pos = {}, 0
    for block in table:
        for offset in range(block_size):
            slots[pos] = block * block_size + offset
            pos += 1
    return slots


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


# ---------------------------------------------------------------------------------------------------
# paged_attention_reference vs contiguous attention
# ---------------------------------------------------------------------------------------------------


def scatter_into_blocks(kv: torch.Tensor, cache: torch.Tensor, table: list[int]) -> None:
    """Write a sequence's contiguous ``[ctx, kv_heads, d]`` keys (or values) into its blocks."""
    bs = cache.shape[1]
    for p in range(kv.shape[0]):
        cache[table[p // bs], p % bs] = kv[p]


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa-4to1", "mha"])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_paged_attention_matches_contiguous_attention(heads, kv_heads, block_size):
    gen = torch.Generator().manual_seed(100 * heads + block_size)
    dim = 16
    contexts = [1, block_size, 2 * block_size - 1, 2 * block_size + 1, 37]
    num_blocks = sum(blocks_needed(c, block_size) for c in contexts) + 3
    # Garbage everywhere first: unfilled tails of last blocks must be cut off, never attended to.
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen) * 100
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen) * 100
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_needed(c, block_size) for c in contexts) + 2
    tables, ks, vs, nxt = [], [], [], 0
    for ctx in contexts:
        k = torch.randn(ctx, kv_heads, dim, generator=gen)
        v = torch.randn(ctx, kv_heads, dim, generator=gen)
        n = blocks_needed(ctx, block_size)
        table = perm[nxt : nxt + n]
        nxt += n
        scatter_into_blocks(k, k_cache, table), scatter_into_blocks(v, v_cache, table)
        padding = torch.randint(0, num_blocks, (max_blocks - n,), generator=gen).tolist()  # must be ignored
        tables.append(table + padding)
        ks.append(k), vs.append(v)
    q = torch.randn(len(contexts), heads, dim, generator=gen)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    context_lens = torch.tensor(contexts, dtype=torch.int32)
    for scale in (None, 0.3):
        got = paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)
        s = dim**-0.5 if scale is None else scale
        assert got.shape == q.shape and got.dtype == q.dtype
        for i in range(len(contexts)):
            expected = attention_over_context(q[i : i + 1], ks[i], vs[i], s)[0]
            torch.testing.assert_close(got[i], expected, msg=f"context {contexts[i]}, scale {scale}")


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_paged_attention_with_blocks_shared_by_two_tables(block_size):
    """Two sequences with the same first two physical blocks (a shared prefix) read the same K/V there."""
    gen = torch.Generator().manual_seed(block_size)
    heads, kv_heads, dim, num_blocks = 8, 2, 8, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    shared = [11, 4]
    tables = [shared + [9, 0], shared + [2]]
    contexts = [3 * block_size + 1, 2 * block_size + 1]
    table_tensor = torch.tensor([tables[0], tables[1] + [13]])
    q = torch.randn(2, heads, dim, generator=gen)
    got = paged_attention_reference(q, k_cache, v_cache, table_tensor, torch.tensor(contexts))
    for i, (table, ctx) in enumerate(zip(tables, contexts)):
        walk = brute_force_slots(table, block_size)
        idx = [walk[p] for p in range(ctx)]
        k = k_cache.reshape(-1, kv_heads, dim)[idx]
        v = v_cache.reshape(-1, kv_heads, dim)[idx]
        torch.testing.assert_close(got[i], attention_over_context(q[i : i + 1], k, v, dim**-0.5)[0])
    # Only the shared prefix: both sequences see the same keys, so the same query gives the same answer.
    same_q = q[:1].expand(2, -1, -1).contiguous()
    prefix = torch.tensor([2 * block_size, 2 * block_size])
    out = paged_attention_reference(same_q, k_cache, v_cache, table_tensor, prefix)
    torch.testing.assert_close(out[0], out[1])


def test_paged_attention_context_length_one_and_zero():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 8, 1, 4, generator=gen)
    v_cache = torch.randn(4, 8, 1, 4, generator=gen)
    q = torch.randn(2, 4, 4, generator=gen)
    tables = torch.tensor([[3, 1], [0, 2]])
    out = paged_attention_reference(q, k_cache, v_cache, tables, torch.tensor([1, 1]))
    # One key: softmax is 1, the output is that token's value, whatever the query.
    torch.testing.assert_close(out[0], v_cache[3, 0].expand(4, 4))
    torch.testing.assert_close(out[1], v_cache[0, 0].expand(4, 4))
    with pytest.raises(ValueError, match="sequence 1 has context length 0"):
        paged_attention_reference(q, k_cache, v_cache, tables, torch.tensor([3, 0]))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("q_len,ctx", [(1, 1), (1, 37), (5, 5), (3, 20), (16, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_attention_matches_the_reference(heads, kv_heads, q_len, ctx, dtype):
    """The caches' fused attention == the readable einsum reference: decode, whole prompt (causal), and a
    prompt continuing a cached prefix (queries are the last tokens)."""
    gen = torch.Generator().manual_seed(q_len * 100 + ctx)
    q = torch.randn(q_len, heads, 8, generator=gen).to(dtype)
    k, v = (torch.randn(ctx, kv_heads, 8, generator=gen).to(dtype) for _ in range(2))
    got = fused_attention_over_context(q, k, v, 0.4)
    assert got.dtype == dtype and got.shape == q.shape
    tol = {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(got, attention_over_context(q, k, v, 0.4), **tol)


def test_fused_attention_errors():
    with pytest.raises(ValueError, match=r"context \(2\) is shorter than the queries \(3\)"):
        fused_attention_over_context(torch.randn(3, 2, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4), 1.0)
    with pytest.raises(ValueError, match="3 query heads is not a multiple of 2 kv heads"):
        fused_attention_over_context(torch.randn(1, 3, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4), 1.0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batched_decode_attention_matches_one_sequence_at_a_time(heads, kv_heads, block_size, dtype):
    """decode_attention (one gather, padded, masked) == attention_over_context per sequence, on shuffled
    tables, context lengths from 1 to several blocks, and grouped-query heads."""
    gen = torch.Generator().manual_seed(block_size * 10 + heads)
    dim, num_blocks = 8, 40
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    ctx = [1, block_size, block_size + 1, 3 * block_size - 1] + torch.randint(
        1, 5 * block_size, (4,), generator=gen
    ).tolist()
    tables, used = [], 0
    for c in ctx:
        n = blocks_needed(c, block_size)
        tables.append(
            perm[used % num_blocks : used % num_blocks + n] if used % num_blocks + n <= num_blocks else perm[:n]
        )
        used += n
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(dtype)
    index = decode_slot_index(tables, ctx, block_size, "cpu")
    assert index.shape == (len(ctx), max(ctx))
    got = decode_attention(
        q, k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim), index, torch.tensor(ctx), dim**-0.5
    )
    assert got.dtype == dtype
    tol = {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else {"atol": 1e-5, "rtol": 1e-5}
    for i, c in enumerate(ctx):
        k, v = gather_kv(k_cache, tables[i], c), gather_kv(v_cache, tables[i], c)
        torch.testing.assert_close(got[i], attention_over_context(q[i : i + 1], k, v, dim**-0.5)[0], **tol)


def test_batched_decode_on_a_contiguous_arena_and_its_errors():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(50, 2, 4, generator=gen), torch.randn(50, 2, 4, generator=gen)
    first, ctx = [30, 0, 7], [5, 1, 20]
    index = decode_slot_index(first, ctx, None, "cpu")
    assert index[0, :5].tolist() == [30, 31, 32, 33, 34] and index[1].max() == 0
    q = torch.randn(3, 2, 4, generator=gen)
    got = decode_attention(q, k, v, index, torch.tensor(ctx), 0.5)
    for i in range(3):
        sl = slice(first[i], first[i] + ctx[i])
        torch.testing.assert_close(got[i], attention_over_context(q[i : i + 1], k[sl], v[sl], 0.5)[0])
    with pytest.raises(ValueError, match="3 query heads is not a multiple of 2 kv heads"):
        decode_attention(torch.randn(3, 3, 4), k, v, index, torch.tensor(ctx), 0.5)


# ---------------------------------------------------------------------------------------------------
# PagedKVCache vs the dense reference
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batched_decode", [True, False])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_cache_matches_dense_reference(block_size, batched_decode):
    """Same K/V in, same attention out, step after step: prefills of random lengths, then decodes (one
    token: the batched path unless switched off; or a few), with sequences joining mid-way; afterwards
    every block is free again."""
    gen = torch.Generator().manual_seed(block_size)
    layers, heads, dim, num_blocks = 2, 3, 8, 64
    manager = BlockManager(num_blocks, block_size, watermark=0.0)
    scramble_free_queue(manager.allocator, seed=block_size)
    ours = ReservingPagedKVCache(layers, heads, dim, manager, batched_decode=batched_decode)
    ref = DenseKVCache(layers)
    lens: dict[int, int] = {0: 0, 1: 0, 2: 0}
    batched_steps = 0
    for step in range(7):
        if step == 3:
            lens[3] = 0  # a newcomer is prefilled while the others decode
        batch = step_beside_dense(ours, ref, gen, lens, heads, dim)
        batched_steps += batch.meta.decode is not None
        for sid, clen in zip(batch.seq_ids, batch.context_lens):
            assert len(manager.block_table(sid)) == blocks_needed(clen, block_size)
        manager.check_invariants()
    assert any(manager.block_table(s) != sorted(manager.block_table(s)) for s in lens) or block_size == 16
    assert (batched_steps > 0) == batched_decode  # the batched decode path ran (or was really off)
    # The cache stores exactly the dense K/V, reachable through the tables.
    for layer in range(layers):
        for sid, n in lens.items():
            assert torch.equal(gather_kv(ours.k_cache[layer], manager.block_table(sid), n), ref.k[layer][sid])
            assert torch.equal(gather_kv(ours.v_cache[layer], manager.block_table(sid), n), ref.v[layer][sid])
    for sid in lens:
        ours.free(sid)
    assert manager.allocator.num_free == num_blocks and not manager.tables
    assert all(manager.allocator.is_free(b) for b in range(num_blocks))
    with pytest.raises(ValueError, match="already freed, or never admitted"):
        ours.free(0)


@pytest.mark.parametrize("batched_decode", [True, False])
def test_reserved_cache_matches_dense_reference(batched_decode):
    """The naive engine's cache (contiguous reservations, lesson 07) attends like the dense reference,
    through its per-sequence prefill path and its batched decode path."""
    from lesson_utils.cache.reserved import ReservedKVCache
    from lesson_utils.memory.reservation import ContiguousReservationManager

    gen = torch.Generator().manual_seed(3)
    layers, heads, dim = 2, 2, 8
    manager = ContiguousReservationManager(200, "max", max_seq_len=60)
    ours, ref = ReservedKVCache(layers, heads, dim, manager, batched_decode=batched_decode), DenseKVCache(layers)
    lens = {0: 0, 1: 0, 2: 0}
    for sid in lens:
        manager.allocate(Sequence(Request(sid, 0.0, 5, 10)))
    decoded = 0
    for _ in range(6):
        batch = step_beside_dense(ours, ref, gen, lens, heads, dim)
        decoded += len(batch.meta.decode.indices) if batch.meta.decode else 0
        assert (batch.meta.decode is not None) <= batched_decode
    assert (decoded > 0) == batched_decode


def test_paged_cache_geometry_for_a_model():
    class W:  # just the geometry fields of OPTWeights, and where its tensors live
        num_layers, num_heads, num_kv_heads, head_dim, max_positions = 3, 4, 4, 16, 512
        dtype, device = torch.float16, torch.device("cpu")

    cache = PagedKVCache.for_model(W, 10, 8, watermark=0.2)
    assert cache.block_size == 8 and cache.manager.num_blocks == 10 and cache.manager.watermark_blocks == 2
    assert cache.manager.max_seq_len == 512
    assert len(cache.k_cache) == len(cache.v_cache) == 3 and cache.k_cache[0].shape == (10, 8, 4, 16)
    assert cache.k_cache[0].dtype == torch.float16  # the model's dtype, unless told otherwise
    assert cache.bytes_per_block == 2 * 3 * 8 * 4 * 16 * 2
    assert PagedKVCache.for_model(W, 10, 8, dtype=torch.float32).bytes_per_block == 2 * 3 * 8 * 4 * 16 * 4


# ---------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_breakdown_adds_up_and_only_last_blocks_waste(block_size):
    m = BlockManager(40, block_size, watermark=0.0)
    assert m.breakdown() == {"token states": 0, "reserved": 0, "internal fragmentation": 0, "free": m.total_slots}
    assert m.utilization() == 1.0
    lengths = [1, block_size, block_size + 1, 2 * block_size - 1, 33]
    for i, n in enumerate(lengths):
        m.allocate(make_seq(i, n))
    grown = make_seq(0, 1)
    m.append_slot(grown)  # sequence 0 grows to 2 tokens
    lengths[0] = 2
    br = m.breakdown()
    held = sum(blocks_needed(n, block_size) for n in lengths) * block_size
    waste = sum(blocks_needed(n, block_size) * block_size - n for n in lengths)
    assert br["token states"] == sum(lengths)
    assert br["reserved"] == 0
    assert br["internal fragmentation"] == waste == sum(t.last_block_waste for t in m.tables.values())
    assert br["free"] == m.allocator.num_free * block_size == m.total_slots - held
    assert sum(br.values()) == m.total_slots
    assert m.utilization() == pytest.approx(sum(lengths) / held)
    if block_size == 1:
        assert br["internal fragmentation"] == 0 and m.utilization() == 1.0
    kinds = m.slot_kinds()
    assert kinds.shape == (m.total_slots,)
    assert (kinds == TOKEN).sum() == br["token states"]
    assert (kinds == INTERNAL).sum() == br["internal fragmentation"]
    assert (kinds == FREE).sum() == br["free"]
    for sid in range(len(lengths)):
        m.free_seq(sid)
    assert m.breakdown()["free"] == m.total_slots


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------


def test_requests_that_can_never_fit():
    m = BlockManager(4, 4, max_seq_len=100)  # 16 slots
    m.check_admissible(make_seq(0, 10, 6))  # exactly 16 tokens = 4 blocks: fine
    with pytest.raises(NeverFits, match=r"request 1 may reach 17 tokens = 5 blocks of 4.*whole cache \(4 blocks\)"):
        m.check_admissible(make_seq(1, 10, 7))
    big = BlockManager(1000, 4, max_seq_len=100)
    big.check_admissible(make_seq(2, 60, 40))
    with pytest.raises(NeverFits, match=r"request 3 may reach 101 tokens; the model allows 100"):
        big.check_admissible(make_seq(3, 60, 41))
    assert issubclass(NeverFits, ValueError)


def test_freeing_twice_or_allocating_twice_is_an_error():
    m = BlockManager(8, 2)
    seq = make_seq(5, 3)
    m.allocate(seq)
    with pytest.raises(ValueError, match="sequence 5 already holds blocks"):
        m.allocate(seq)
    m.free(seq)
    with pytest.raises(ValueError, match="sequence 5 holds no blocks"):
        m.free(seq)
    with pytest.raises(ValueError, match="holds no blocks"):
        m.free_seq(99)
    assert m.allocator.num_free == 8


def test_failed_allocation_is_all_or_nothing():
    """A prompt that needs more blocks than are free raises OutOfBlocks and takes none of them."""
    m = BlockManager(6, 4, watermark=0.0)
    m.allocate(make_seq(0, 12))  # 3 blocks
    late = make_seq(1, 16)  # needs 4, 3 are free
    assert not m.can_allocate(late)
    with pytest.raises(OutOfBlocks):
        m.allocate(late)
    assert m.allocator.num_free == 3 and set(m.tables) == {0}
    m.free_seq(0)
    m.allocate(late)  # and the same sequence can be admitted once there is room
    assert len(m.block_table(1)) == 4


def test_watermark_holds_blocks_back_except_in_an_empty_cache():
    m = BlockManager(10, 4, watermark=0.2)  # keeps 2 blocks back
    assert m.can_allocate(make_seq(0, 40))  # empty cache: anything that fits at all
    assert not m.can_allocate(make_seq(0, 41))
    m.allocate(make_seq(1, 4))  # 9 free
    assert m.can_allocate(make_seq(2, 28)) and not m.can_allocate(make_seq(3, 29))


@pytest.mark.parametrize("block_size", [0, -1])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        BlockManager(8, block_size)


@pytest.mark.parametrize("watermark", [-0.01, 1.0, 2.0])
def test_bad_watermark(watermark):
    with pytest.raises(ValueError, match=r"watermark is a fraction of the blocks in \[0, 1\)"):
        BlockManager(8, 4, watermark=watermark)


def test_bad_number_of_blocks():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 4)
