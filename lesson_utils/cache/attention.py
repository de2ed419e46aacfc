from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lesson_utils.core.host_copy import move, to_device
from lesson_utils.memory.block_table import blocks_needed


def _check_shapes(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int]:
    """``(q_len, ctx, query heads per kv head)`` of one sequence's attention, or a clear error."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    if ctx < q_len:
        raise ValueError(f"context ({ctx}) is shorter than the queries ({q_len})")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} kv heads")
    return q_len, ctx, heads // kv_heads


def attention_over_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference attention for one sequence.

    ``q``: ``[q_len, heads, d]`` - the last ``q_len`` tokens of the sequence;
    ``k``, ``v``: ``[ctx, kv_heads, d]`` - all of its tokens, ``ctx >= q_len``; ``heads`` a multiple of
    ``kv_heads`` (grouped-query attention). Query ``j`` sees keys ``0 .. ctx - q_len + j``.
    Computed in fp32, returned in ``q``'s dtype.
    """
    q_len, ctx, group = _check_shapes(q, k)
    kf = k.float().repeat_interleave(group, dim=1)  # [ctx, heads, d]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    first_query_pos = ctx - q_len
    query_pos = torch.arange(q_len, device=q.device)[:, None] + first_query_pos
    key_pos = torch.arange(ctx, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, -math.inf)
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vf)
    return out.to(q.dtype)


def fused_attention_over_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`attention_over_context` through PyTorch's fused ``scaled_dot_product_attention`` (what the
    caches call; the einsum version stays as the readable reference the tests compare with).

    Same shapes and causal rule; computed in ``q``'s dtype. Fused means no ``[heads, q_len, ctx]`` score
    tensor and no fp32 copies of K and V: on a CPU those copies, not the arithmetic, dominated attention.
    Hugging Face's OPT attends through the same function.
    """
    q_len, ctx, group = _check_shapes(q, k)
    if q_len == 1 and group > 1:  # a decode: each KV head's query heads become its query rows, so K/V are not copied
        kv_heads, d = k.shape[1], k.shape[2]
        out = F.scaled_dot_product_attention(  # 4-D: PyTorch's fused CPU kernel takes only [batch, heads, len, d]
            q.reshape(1, kv_heads, group, d),
            k.to(q.dtype).transpose(0, 1)[None],
            v.to(q.dtype).transpose(0, 1)[None],
            scale=scale,
        )
        return out.reshape(1, kv_heads * group, d)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = None
    if 1 < q_len < ctx:  # queries are the last q_len tokens: query j sees keys 0 .. ctx - q_len + j
        mask = (
            torch.arange(ctx, device=q.device)[None, :] <= torch.arange(q_len, device=q.device)[:, None] + ctx - q_len
        )
    out = F.scaled_dot_product_attention(  # 4-D: PyTorch's fused CPU kernel takes only [batch, heads, len, d]
        q.transpose(0, 1)[None],
        k.to(q.dtype).transpose(0, 1)[None],
        v.to(q.dtype).transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=q_len == ctx and q_len > 1,
        scale=scale,
    )
    return out[0].transpose(0, 1)


def decode_slot_index(first_slots_or_tables, context_lens: list[int], block_size: int | None, device) -> torch.Tensor:
    """Flat cache slot of every context token of every decoding sequence, padded: ``[num_seqs, max_ctx]``.

    Paged caches pass block tables and their ``block_size``: token ``p`` lives in slot
    ``table[p // block_size] * block_size + p % block_size``. A contiguous arena passes each sequence's first
    slot and ``block_size=None``: token ``p`` lives in slot ``first + p``. Entries past a sequence's context
    repeat its last slot (any valid slot would do: :func:`decode_attention` masks them out). Computed on the
    host and copied to ``device`` without a wait (:mod:`lesson_utils.core.host_copy`).
    """
    max_ctx = max(context_lens)
    pos = torch.arange(max_ctx)[None, :].minimum(torch.tensor(context_lens)[:, None] - 1)  # [num_seqs, max_ctx]
    if block_size is None:
        index = torch.tensor(first_slots_or_tables)[:, None] + pos
    else:
        width = max(len(t) for t in first_slots_or_tables)
        tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in first_slots_or_tables])
        index = tables.gather(1, pos // block_size) * block_size + pos % block_size
    return move(index, device)


def decode_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slot_index: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence, all sequences at once (the decode half of a step).

    ``q``: ``[num_seqs, heads, d]``; ``k_flat``/``v_flat``: a layer's cache viewed as ``[num_slots, kv_heads, d]``;
    ``slot_index``: ``[num_seqs, max_ctx]`` from :func:`decode_slot_index`; ``context_lens``: ``[num_seqs]``.
    Keys at positions ``>= context_lens[i]`` are masked. Same maths as :func:`attention_over_context` with
    ``q_len == 1`` per sequence, through the fused attention (computed in ``q``'s dtype), but one gather and
    one call instead of a Python loop over sequences - the better trade on a GPU, where every call in that
    loop is a kernel launch. On a CPU the loop wins (see :mod:`lesson_utils.cache.paged`).
    """
    return decode_attention_over(q, k_flat[slot_index], v_flat[slot_index], context_lens, scale)


def decode_attention_over(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`decode_attention` once the keys and values are gathered: ``k``/``v`` ``[num_seqs, max_ctx, kv_heads, d]``
    (each sequence's context, padded; a quantized cache hands them over dequantized)."""
    n, heads, d = q.shape
    kv_heads = k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} kv heads")
    group = heads // kv_heads
    k, v = k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2)  # [n, kv_heads, max_ctx, d]
    keep = torch.arange(k.shape[2], device=q.device)[None, :] < context_lens.to(q.device)[:, None]
    # each KV head's `group` query heads are its query rows (one token each, the same context): K/V are not copied
    out = F.scaled_dot_product_attention(
        q.reshape(n, kv_heads, group, d), k, v, attn_mask=keep[:, None, None, :], scale=scale
    )
    return out.reshape(n, heads, d)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention through block tables, in plain torch: what lesson 04's kernel must reproduce.

    ``q``: ``[num_seqs, num_heads, head_dim]`` (one new token per sequence); ``k_cache``/``v_cache``:
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_tables``: int ``[num_seqs, max_blocks]``
    (entries past a sequence's blocks are ignored); ``context_lens``: int ``[num_seqs]``, each >= 1.
    Returns ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype; softmax computed in fp32.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        ctx = int(context_lens[i])
        if ctx < 1:
            raise ValueError(f"sequence {i} has context length {ctx}; decode needs at least one token")
        table = block_tables[i].tolist()
        k = gather_kv(k_cache, table, ctx)
        v = gather_kv(v_cache, table, ctx)
        out[i] = attention_over_context(q[i : i + 1], k, v, scale)[0]
    return out


def gather_kv(cache: torch.Tensor, block_table: list[int] | torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first ``context_len`` tokens, contiguous: ``[context_len, kv_heads, head_dim]``.

    ``cache`` is one layer's ``[num_blocks, block_size, kv_heads, head_dim]`` K or V cache; ``block_table`` the
    sequence's blocks, a list or (what the paged cache passes, copied once a step) a long tensor on the
    cache's device. The last block is usually only partly filled: its tail is garbage and must be cut off.
    """
    num_blocks_used = blocks_needed(context_len, cache.shape[1])
    if isinstance(block_table, torch.Tensor):
        ids = block_table[:num_blocks_used]
    else:
        ids = to_device(block_table[:num_blocks_used], torch.long, cache.device)
    return cache[ids].reshape(-1, cache.shape[2], cache.shape[3])[:context_len]


def unified_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a flat batch of chunks and decodes through block tables, in plain torch: what lesson 08's
    kernel must reproduce. Sequence ``s``'s queries are rows ``query_start[s] .. query_start[s + 1] - 1`` of
    ``q`` ``[num_tokens, heads, d]``, the last tokens of its ``context_lens[s]``; each sees its cached keys and
    the chunk's keys up to itself (:func:`chunk_attention`, sequence by sequence)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    starts = query_start.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        a, b = starts[s], starts[s + 1]
        out[a:b] = chunk_attention(q[a:b], k_cache, v_cache, block_tables[s].tolist(), ctx, scale)
    return out


def chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: list[int],
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one sequence's prefill chunk through its block table. Reference for exercise 08-2.

    ``q`` ``[n, heads, d]``: the sequence's newest ``n`` tokens (positions ``context_len - n .. context_len - 1``),
    their K/V already in ``k_cache``/``v_cache`` (one layer, ``[num_blocks, block_size, kv_heads, d]``). Query
    ``j`` sees the cached keys and the chunk's keys up to itself. Returns ``[n, heads, d]`` in ``q``'s dtype."""
    k = gather_kv(k_cache, block_table, context_len)
    v = gather_kv(v_cache, block_table, context_len)
    return attention_over_context(q, k, v, scale)
