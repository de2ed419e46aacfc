"""The paged attention reference equals attention over a contiguous copy (GQA and MHA, block sizes 1 / 8 / 16,
blocks shared by two tables, context length 1), fused and batched decode attention match, and PagedKVCache and
the reserved cache equal DenseKVCache step after step."""

from __future__ import annotations

import pytest
import torch
from helpers import ReservingPagedKVCache, step_beside_dense
from helpers.paged import brute_force_slots, scramble_free_queue

from lesson_utils.cache.attention import (
    attention_over_context,
    decode_attention,
    decode_slot_index,
    fused_attention_over_context,
    paged_attention_reference,
)
from lesson_utils.cache.dense import DenseKVCache
from lesson_utils.cache.paged import PagedKVCache, gather_kv
from lesson_utils.core.types import Request, Sequence
from lesson_utils.memory.block_allocator import BlockAllocator
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import blocks_needed

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
    allocator = BlockAllocator(num_blocks)
    scramble_free_queue(allocator, seed=block_size)  # later tables are non-monotonic
    manager = BlockManager(num_blocks, block_size, watermark=0.0, allocator=allocator)
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
            assert len(manager.view.block_table(sid)) == blocks_needed(clen, block_size)
        manager.view.check_invariants()
    assert any(manager.view.block_table(s) != sorted(manager.view.block_table(s)) for s in lens) or block_size == 16
    assert (batched_steps > 0) == batched_decode  # the batched decode path ran (or was really off)
    # The cache stores exactly the dense K/V, reachable through the tables.
    for layer in range(layers):
        for sid, n in lens.items():
            assert torch.equal(gather_kv(ours.k_cache[layer], manager.view.block_table(sid), n), ref.k[layer][sid])
            assert torch.equal(gather_kv(ours.v_cache[layer], manager.view.block_table(sid), n), ref.v[layer][sid])
    for sid in lens:
        ours.free(sid)
    assert manager.num_free_blocks == num_blocks and not manager.view.tables()
    assert all(manager.view.block_is_free(b) for b in range(num_blocks))
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
    assert cache.block_size == 8 and cache.manager.view.num_blocks == 10 and cache.manager.watermark_blocks == 2
    assert cache.manager.view.max_seq_len == 512
    assert len(cache.k_cache) == len(cache.v_cache) == 3 and cache.k_cache[0].shape == (10, 8, 4, 16)
    assert cache.k_cache[0].dtype == torch.float16  # the model's dtype, unless told otherwise
    assert cache.bytes_per_block == 2 * 3 * 8 * 4 * 16 * 2
    assert PagedKVCache.for_model(W, 10, 8, dtype=torch.float32).bytes_per_block == 2 * 3 * 8 * 4 * 16 * 4
