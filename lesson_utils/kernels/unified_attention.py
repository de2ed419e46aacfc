"""Lesson 08: one Triton kernel for prefill chunks and decodes, over the paged KV cache.

Each sequence of a step brings ``query_len`` new tokens (1 for a decode, a chunk of its prompt for a chunked
prefill) whose K/V are already written; its context is ``context_len`` tokens, the new ones last. Query ``j``
of a sequence sits at position ``context_len - query_len + j`` and sees keys ``0 ..`` that position (the causal
rule). One launch serves the whole flat batch, in the style of vLLM v1's unified Triton attention:

* a program takes ``BLOCK_Q`` query tokens of one sequence and every query head of one KV head (grid: sequences
  x query tiles x KV heads): its ``BLOCK_Q x GROUP`` rows share each K/V tile it loads (grouped-query attention
  loads a KV head's keys once, not once per query head); a tile past the end of its sequence's queries returns at
  once;
* it walks the sequence's block table ``TILE`` keys at a time, up to the last position any of its queries sees,
  and keeps one online softmax per query row (lesson 04's, widened to a tile of queries);
* the causal mask is a ``constexpr`` building block (:func:`causal_mask`, lesson 08's exercise), so a learner's
  version can be dropped in.

Decodes and chunks share the kernel: a decode is a sequence whose only query sits at ``context_len - 1``.
Scores are computed with broadcasts and sums rather than ``tl.dot`` (tensor cores): the same code runs in the
interpreter, on a T4 (sm_75) and on newer GPUs, in fp16 or fp32, and the AOT report shows whether it compiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lesson_utils.core.device_discipline import check_kernel_args, kernel_launch
from lesson_utils.kernels.paged_attention import block_slots, load_tile, require_contiguous


@triton.jit
def causal_mask(query_pos, key_pos, context_len):
    """``[BLOCK_Q, TILE]``: may query (at ``query_pos``, ``[BLOCK_Q]``) see key (at ``key_pos``, ``[TILE]``)?

    A key is seen when it exists (``key_pos < context_len``) and is not in the query's future
    (``key_pos <= query_pos``). Reference for exercise 08-3."""
    return (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < context_len)


@triton.jit
def unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # lesson 10's int8 caches: float32 [num_blocks, block_size, num_kv_heads]; else unused
    v_scale_ptr,
    block_tables_ptr,
    query_start_ptr,  # [num_seqs + 1]: sequence s's queries are rows query_start[s] .. query_start[s + 1] - 1
    context_lens_ptr,
    scale,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_bt_seq,
    stride_slot,
    stride_kv_head,
    stride_scale_slot,  # num_kv_heads: one scale per slot and KV head
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program (times GROUP_P heads: its rows)
    TILE: tl.constexpr,  # keys per loop step
    MASK: tl.constexpr,  # the causal rule (causal_mask or a learner's version)
    LOAD: tl.constexpr,  # reads a K or V tile as fp32 (lesson 04's load_tile, or lesson 10's int8 version)
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < query_len:
        context_len = tl.load(context_lens_ptr + seq)
        # row r: query token r // GROUP_P of this tile, query head kv_head * GROUP + r % GROUP_P
        r = tl.arange(0, BLOCK_Q * GROUP_P)
        rows = q_tile * BLOCK_Q + r // GROUP_P  # this row's query, counted within the sequence
        g = r % GROUP_P
        row_mask = (rows < query_len) & (g < GROUP)
        head = kv_head * GROUP + g
        query_pos = context_len - query_len + rows
        d = tl.arange(0, HEAD_DIM_P)
        d_mask = d < HEAD_DIM
        q_offsets = (q_start + rows)[:, None] * stride_q_token + head[:, None] * stride_q_head + d[None, :]
        q_mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)  # [BLOCK_Q * GROUP_P, HEAD_DIM_P]

        m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
        # keys up to the tile's last query position, which the last valid row sees
        last = tl.minimum(context_len, context_len - query_len + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q))
        for start in range(0, last, TILE):
            slot, key_exists = block_slots(block_tables_ptr + seq * stride_bt_seq, start, last, TILE, BLOCK_SIZE)
            key_pos = start + tl.arange(0, TILE)
            # 64-bit: slot * stride_slot passes 2**31 in a pool of ~2.8M OPT-125m slots (a large GPU's memory)
            offsets = slot.to(tl.int64)[:, None] * stride_slot + kv_head * stride_kv_head + d[None, :]
            scale_offsets = slot.to(tl.int64) * stride_scale_slot + kv_head
            kv_mask = key_exists[:, None] & d_mask[None, :]
            k = LOAD(k_cache_ptr + offsets, k_scale_ptr + scale_offsets, kv_mask, key_exists)  # [TILE, HEAD_DIM_P]
            v = LOAD(v_cache_ptr + offsets, v_scale_ptr + scale_offsets, kv_mask, key_exists)
            scores = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale  # [rows, TILE]
            seen = MASK(query_pos, key_pos, context_len) & row_mask[:, None]
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays empty
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_offsets = (q_start + rows)[:, None] * stride_o_token + head[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


MAX_QUERY_TILE = 8  # on sm_75, 16 rows x a 16-key tile x head_dim 64 takes all 255 registers (see the AOT report)


def query_tile(max_query_len: int, group: int = 1) -> int:
    """Query tokens per program: the longest query rounded up to a power of two, at most MAX_QUERY_TILE rows in all
    with each token's ``group`` query heads (rounded up to a power of two), and at least 1."""
    rows_per_token = triton.next_power_of_2(group)
    return max(1, min(MAX_QUERY_TILE // rows_per_token, triton.next_power_of_2(max(1, max_query_len))))


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float | None = None,
    *,
    mask_fn=None,
    num_warps: int = 4,
    validate: bool = True,
    int8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    load_fn=None,
) -> torch.Tensor:
    """Attention of a step's flat batch of queries (chunks and decodes) through block tables, in one launch.

    ``q`` ``[num_tokens, num_heads, head_dim]``, sequence ``s``'s queries in rows ``query_start[s] ..
    query_start[s + 1] - 1`` (``query_start`` int32 ``[num_seqs + 1]``, from 0 to ``num_tokens``);
    ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` already holding the new tokens'
    K/V; ``block_tables`` int32 ``[num_seqs, max_blocks]``; ``context_lens`` int32 ``[num_seqs]`` (every token of
    the sequence, the new ones included). ``max_query_len`` (host int: the grid depends on it) is the longest
    query. ``mask_fn`` replaces :func:`causal_mask` (exercise 08-3). ``validate=False`` skips the checks that
    read lengths back from the device (a sync), for the engine and timed loops. ``int8_scales`` and ``load_fn``:
    lesson 10's int8 caches (:func:`lesson_utils.kernels.int8_kv.int8_unified_attention`).

    Long on purpose: every argument is checked before the launch, each with a message of its own."""
    check_kernel_args(
        "unified_attention",
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start=query_start,
        context_lens=context_lens,
    )
    require_contiguous("unified_attention", query_start=query_start, context_lens=context_lens)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be [num_tokens, num_heads, head_dim] and the caches [num_blocks, block_size, num_kv_heads, "
            f"head_dim]; got {tuple(q.shape)}, {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_seqs = context_lens.shape[0]
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q's {num_heads} heads of {head_dim} do not fit the cache's {num_kv_heads} of {cache_head_dim}"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for the kernel, got {block_size}")
    if block_tables.dtype != torch.int32 or query_start.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError("block_tables, query_start and context_lens must be int32")
    if query_start.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} sequences in context_lens, but query_start is {tuple(query_start.shape)} and block_tables "
            f"{tuple(block_tables.shape)}"
        )
    if validate and num_seqs:
        starts = query_start.long()
        qlens = starts[1:] - starts[:-1]
        first, last, shortest_q, longest_q, fits, longest_ctx = torch.stack(
            [
                starts[0],
                starts[-1],
                qlens.min(),
                qlens.max(),
                (context_lens.long() >= qlens).all().long(),
                context_lens.long().max(),
            ]
        ).tolist()  # one read-back for every check
        if first != 0 or last != num_tokens or shortest_q < 1:
            raise ValueError(
                f"query_start must rise from 0 to {num_tokens} (the rows of q), each sequence with at least one "
                f"query; got {query_start.tolist()}"
            )
        if longest_q > max_query_len:
            raise ValueError(f"a sequence has {longest_q} queries, more than max_query_len={max_query_len}")
        if not fits:
            raise ValueError("a sequence's context_len is shorter than its queries (the new tokens are in its context)")
        if longest_ctx > block_tables.shape[1] * block_size:
            raise ValueError(f"a context of {longest_ctx} tokens needs more blocks than block_tables has room for")
    if scale is None:
        scale = head_dim**-0.5
    q = q.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0 or num_tokens == 0:
        return out
    k_scale, v_scale = int8_scales if int8_scales is not None else (k_cache, v_cache)  # unused without int8
    group = num_heads // num_kv_heads
    block_q = query_tile(max_query_len, group)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    with kernel_launch():
        unified_attention_kernel[grid](
            out,
            q,
            k_cache.contiguous(),
            v_cache.contiguous(),
            k_scale.contiguous(),
            v_scale.contiguous(),
            block_tables.contiguous(),
            query_start,
            context_lens,
            float(scale),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            block_tables.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            num_kv_heads,
            GROUP=group,
            GROUP_P=triton.next_power_of_2(group),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_Q=block_q,
            TILE=block_size,
            MASK=causal_mask if mask_fn is None else mask_fn,
            LOAD=load_tile if load_fn is None else load_fn,
            num_warps=num_warps,
        )
    return out
