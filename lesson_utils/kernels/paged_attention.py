"""Lesson 04: Triton kernels that read and write the paged KV cache directly.

* :func:`paged_attention_decode` - decode attention (one new query token per sequence) that walks each
  sequence's block table and keeps an online softmax, so K/V are read once, block by block, and never
  gathered into a contiguous copy. Grouped-query attention (``num_heads`` a multiple of
  ``num_kv_heads``), any head_dim (padded to a power of two inside, masked), fp16 or fp32 caches,
  fp32 accumulation.
* :func:`write_kv_to_cache` - stores a step's new K/V into their slots (vLLM's "reshape and cache"),
  for any ``num_kv_heads * head_dim`` (OPT-125m's 768 is not a power of two).

On CUDA the kernels are compiled; on a CPU they run in Triton's interpreter, which ``lesson_utils.core.env``
switches on (``TRITON_INTERPRET=1``) before this module defines them. The interpreter checks
correctness, not speed: every program and loop step runs as Python.

Two variants of the decode kernel: ``"simple"`` (one block of the table per loop step, the version the
lesson builds first) and ``"tiled"`` (``TOKENS_PER_TILE`` tokens - several blocks - per step: longer
loads, fewer loop steps). The two building blocks every variant shares, :func:`block_slots` and
:func:`online_softmax_update`, are also lesson 04's exercises; kernels take them as ``constexpr``
arguments so a learner's versions can be dropped in. A third, :func:`load_tile`, reads a tile of K or V as
fp32; lesson 10 passes its int8 version (which also reads the tile's scales) to the same kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lesson_utils.core.device_discipline import check_kernel_args, kernel_launch

__all__ = [
    "block_slots",
    "group_query_heads",
    "online_softmax_update",
    "paged_attention_decode",
    "write_kv_to_cache",
    "write_kv_reference",
]


@triton.jit
def block_slots(block_table_row_ptr, start, context_len, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Cache slots of the tokens ``start .. start + TILE - 1`` of one sequence, and which of them exist.

    Returns ``(slots, token_mask)``: ``token_mask`` is False past ``context_len``; those tokens are never
    looked up (their logical block may lie past the end of the table: the load is masked) and get a slot in
    block 0, which nothing reads through them.
    """
    token = start + tl.arange(0, TILE)
    token_mask = token < context_len
    physical_block = tl.load(block_table_row_ptr + token // BLOCK_SIZE, mask=token_mask, other=0)
    return physical_block * BLOCK_SIZE + token % BLOCK_SIZE, token_mask


@triton.jit
def online_softmax_update(m_i, l_i, acc, scores, v):
    """Fold one tile of keys into a running softmax-weighted sum (Milakov & Gimelshein's online softmax).

    Axis 0 is always the tile's tokens; the kernel serves the ``G`` query heads of one KV head together
    (grouped-query attention; ``G = 1`` for multi-head attention), and every other axis just broadcasts:
    ``scores``: ``[TILE, G]`` (masked entries are ``-inf``), ``v``: ``[TILE, HEAD_DIM, 1]``;
    ``m_i``: running max of each head's scores so far, ``[G]``; ``l_i``: running sum of ``exp(score - m_i)``,
    ``[G]``; ``acc``: running ``sum(exp(score - m_i) * v)``, ``[HEAD_DIM, G]``. Rescaling by
    ``exp(m_old - m_new)`` keeps every exponent <= 0, so nothing overflows whatever the scores' size.
    """
    m_new = tl.maximum(m_i, tl.max(scores, 0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new)
    l_new = l_i * alpha + tl.sum(p, 0)
    acc = acc * alpha + tl.sum(p[:, None] * v, 0)
    return m_new, l_new, acc


@triton.jit
def group_query_heads(kv_head, GROUP: tl.constexpr, GROUP_P: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    """The query heads that read KV head ``kv_head``, ``[GROUP_P]``, and which of them exist (``GROUP_P`` is
    ``GROUP`` rounded up to a power of two). Hugging Face's ``repeat_kv`` repeats each KV head ``GROUP`` times in
    a row, so query head ``h`` reads KV head ``h // GROUP``: KV head ``j`` serves heads ``j * GROUP ..
    j * GROUP + GROUP - 1``. Reference for lesson 04's exercise 3."""
    g = tl.arange(0, GROUP_P)
    return kv_head * GROUP + g, g < GROUP


@triton.jit
def load_tile(ptrs, scale_ptrs, mask, token_mask):
    """A ``[TILE, HEAD_DIM_P]`` tile of K or V as fp32 (an fp16 or fp32 cache has no scales: ``scale_ptrs`` is
    unused). Lesson 10's int8 caches pass their own version, which multiplies by each token's scale."""
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def paged_decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # lesson 10's int8 caches: float32 [num_blocks, block_size, num_kv_heads]; else unused
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_bt_seq,
    stride_slot,
    stride_kv_head,
    stride_scale_slot,  # num_kv_heads: one scale per slot and KV head
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,  # tokens per loop step: BLOCK_SIZE ("simple") or several blocks ("tiled")
    SLOTS: tl.constexpr,  # the block-table lookup (block_slots or a learner's version)
    UPDATE: tl.constexpr,  # the online-softmax step (online_softmax_update or a learner's version)
    LOAD: tl.constexpr,  # reads a K or V tile as fp32 (load_tile, or lesson 10's int8 version)
    HEADS: tl.constexpr,  # the query heads of a KV head (group_query_heads or a learner's version)
):
    """One program per (sequence, KV head): each K/V tile is loaded once and serves every query head of the group."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)

    heads, head_mask = HEADS(kv_head, GROUP, GROUP_P, NUM_KV_HEADS)  # [GROUP_P]
    d = tl.arange(0, HEAD_DIM_P)
    d_mask = d < HEAD_DIM
    # the group's queries, one column per head: [HEAD_DIM_P, GROUP_P]
    qd_offsets = seq * stride_q_seq + heads[None, :] * stride_q_head + d[:, None]
    qd_mask = d_mask[:, None] & head_mask[None, :]
    q = tl.load(q_ptr + qd_offsets, mask=qd_mask, other=0.0).to(tl.float32)

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([HEAD_DIM_P, GROUP_P], tl.float32)
    for start in range(0, context_len, TILE):
        slot, token_mask = SLOTS(block_tables_ptr + seq * stride_bt_seq, start, context_len, TILE, BLOCK_SIZE)
        # 64-bit: slot * stride_slot passes 2**31 in a pool of ~2.8M OPT-125m slots (a large GPU's memory)
        offsets = slot.to(tl.int64)[:, None] * stride_slot + kv_head * stride_kv_head + d[None, :]
        scale_offsets = slot.to(tl.int64) * stride_scale_slot + kv_head
        kv_mask = token_mask[:, None] & d_mask[None, :]
        k = LOAD(k_cache_ptr + offsets, k_scale_ptr + scale_offsets, kv_mask, token_mask)  # [TILE, HEAD_DIM_P], once
        scores = tl.sum(k[:, :, None] * q[None, :, :], 1) * scale  # [TILE, GROUP_P]: every head of the group
        scores = tl.where(token_mask[:, None], scores, float("-inf"))
        v = LOAD(v_cache_ptr + offsets, v_scale_ptr + scale_offsets, kv_mask, token_mask)
        m_i, l_i, acc = UPDATE(m_i, l_i, acc, scores, v[:, :, None])

    out = acc / l_i[None, :]
    o_offsets = seq * stride_o_seq + heads[None, :] * stride_o_head + d[:, None]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=qd_mask)


VARIANTS = ("simple", "tiled")


TILE_ELEMENTS = 4096  # the tiled variant multiplies about this many K (and V) elements per loop step


def tile_tokens(variant: str, block_size: int, head_dim: int, group: int = 1) -> int:
    """Tokens per loop step: one block ("simple"), or enough blocks for ~TILE_ELEMENTS products ("tiled"): a tile
    of ``t`` tokens costs ``t x head_dim x group`` products per step (every query head of the group)."""
    if variant == "simple":
        return block_size
    return max(block_size, TILE_ELEMENTS // (triton.next_power_of_2(head_dim) * triton.next_power_of_2(group)))


def require_contiguous(kernel: str, **tensors: torch.Tensor) -> None:
    """A kernel reads a 1-D metadata tensor as consecutive values from its first element: a strided view (a column of a
    2-D tensor, an expanded one) would make it read other values than the view shows. Refused, naming the tensor."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(
                f"{kernel}: {name} is a strided view (strides {tuple(t.stride())}) - the kernel reads consecutive "
                f"values from its first element, not the ones this view shows; pass {name}.contiguous()"
            )


def _check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, validate: bool):
    """Shapes, dtypes and devices always (host-side metadata, no sync); with ``validate`` also the values of
    ``context_lens``, which reads them back from the device (a sync: keep it out of timed loops)."""
    check_kernel_args(
        "paged_attention_decode",
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        context_lens=context_lens,
    )
    require_contiguous("paged_attention_decode", context_lens=context_lens)
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, the cache {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for the kernel, got {block_size}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError(
            f"block_tables and context_lens must be int32, got {block_tables.dtype} and {context_lens.dtype}"
        )
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"{num_seqs} sequences in q, but block_tables is {tuple(block_tables.shape)} and context_lens "
            f"{tuple(context_lens.shape)}"
        )
    if not validate or not num_seqs:
        return
    # the used entries of each table (those that hold one of its tokens) must name real blocks; entries past
    # a sequence's blocks are padding and may hold anything. One read-back for all three checks.
    used = (
        torch.arange(block_tables.shape[1], device=block_tables.device)[None, :]
        < ((context_lens.long() + block_size - 1) // block_size)[:, None]
    )
    outside = ((block_tables < 0) | (block_tables >= num_blocks)) & used
    shortest, longest, bad = torch.stack([context_lens.min().long(), context_lens.max().long(), outside.sum()]).tolist()
    if shortest < 1:
        raise ValueError("every context length must be at least 1 (a decode query attends to itself)")
    if longest > block_tables.shape[1] * block_size:
        raise ValueError(
            f"a context of {longest} tokens needs more than the {block_tables.shape[1]} "
            f"blocks of {block_size} that block_tables has room for"
        )
    if bad:
        seq, col = (int(x) for x in outside.nonzero()[0])
        raise ValueError(
            f"block_tables[{seq}, {col}] = {int(block_tables[seq, col])} is used by sequence {seq} (context "
            f"{int(context_lens[seq])}) but the cache has blocks 0 .. {num_blocks - 1}"
        )


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    *,
    variant: str = "tiled",
    slots_fn=None,
    update_fn=None,
    heads_fn=None,
    num_warps: int = 4,
    validate: bool = True,
    int8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    load_fn=None,
) -> torch.Tensor:
    """Decode attention through block tables with a Triton kernel (see the module docstring).

    ``q`` ``[num_seqs, num_heads, head_dim]``; ``k_cache``/``v_cache``
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_tables`` int32
    ``[num_seqs, max_blocks_per_seq]``; ``context_lens`` int32 ``[num_seqs]``. Returns
    ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype. ``slots_fn``/``update_fn`` replace the two
    building blocks (lesson 04's exercises), ``heads_fn`` the query-head mapping (its exercise 3). Block ids are trusted: validate tables where they are built.
    ``validate=False`` skips the checks that read ``context_lens`` back from the device (one sync each): for
    the engine, which checks its host-side lengths itself, and for benchmarks' timed loops. Lesson 10's int8
    caches come through :func:`lesson_utils.kernels.int8_kv.int8_paged_attention_decode`, which passes their
    ``int8_scales`` (K's and V's, float32 ``[num_blocks, block_size, num_kv_heads]``) and ``load_fn``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
    _check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, validate)
    k_scale, v_scale = int8_scales if int8_scales is not None else (k_cache, v_cache)  # unused without int8
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if scale is None:
        scale = head_dim**-0.5
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    tile = tile_tokens(variant, block_size, head_dim, num_heads // num_kv_heads)
    with kernel_launch():
        group = num_heads // num_kv_heads
        paged_decode_kernel[(num_seqs, num_kv_heads)](
            out,
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            block_tables,
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
            NUM_KV_HEADS=num_kv_heads,
            GROUP=group,
            GROUP_P=triton.next_power_of_2(group),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
            TILE=tile,
            SLOTS=block_slots if slots_fn is None else slots_fn,
            UPDATE=online_softmax_update if update_fn is None else update_fn,
            LOAD=load_tile if load_fn is None else load_fn,
            HEADS=group_query_heads if heads_fn is None else heads_fn,
            num_warps=num_warps,
        )
    return out


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_v_token,
    stride_cache_slot,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: one token's K (or V)
    ROW_P: tl.constexpr,  # ROW rounded up to a power of two; the tail is masked
):
    """One program per new token: copy its K and V rows into its slot. Slot -1 means 'skip' (padding)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        i = tl.arange(0, ROW_P)
        mask = i < ROW
        k = tl.load(k_ptr + token * stride_k_token + i, mask=mask)
        v = tl.load(v_ptr + token * stride_v_token + i, mask=mask)
        tl.store(k_cache_ptr + slot * stride_cache_slot + i, k, mask=mask)
        tl.store(v_cache_ptr + slot * stride_cache_slot + i, v, mask=mask)


def write_kv_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Plain-torch reference of :func:`write_kv_to_cache`."""
    keep = slot_mapping >= 0
    flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    flat_k[slot_mapping[keep].long()] = k[keep].to(k_cache.dtype)
    flat_v[slot_mapping[keep].long()] = v[keep].to(v_cache.dtype)


def write_kv_to_cache(k, v, k_cache, v_cache, slot_mapping, *, validate: bool = True) -> None:
    """Store ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches at ``slot_mapping``.

    ``slot_mapping`` ``[num_tokens]`` (int32 or int64) holds flat slots ``block * block_size + offset``;
    -1 skips a token. The caches must be contiguous (they are written in place). ``validate=False`` skips
    the range check of ``slot_mapping``, which reads it back from the device (a sync): the engine's caches
    build their slot mappings from host-side block tables that are checked where they are made.
    """
    check_kernel_args("write_kv_to_cache", k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(
            f"k and v must be [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"the caches {tuple(k_cache.shape)} do not hold tokens of shape {tuple(k.shape[1:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous: the kernel writes them in place")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must have one entry per token ({k.shape[0]}), got {tuple(slot_mapping.shape)}")
    total_slots = k_cache.shape[0] * k_cache.shape[1]
    if validate and k.shape[0]:
        lowest, highest = torch.stack([slot_mapping.min(), slot_mapping.max()]).tolist()  # one read-back
        if highest >= total_slots:
            raise ValueError(f"slot {highest} is outside the cache's {total_slots} slots")
        if lowest < -1:
            raise ValueError(f"slot {lowest} is not a slot: slots are 0 .. {total_slots - 1}, and -1 skips a token")
    if k.shape[0] == 0:
        return
    k = k.to(k_cache.dtype).contiguous()
    v = v.to(v_cache.dtype).contiguous()
    row = k.shape[1] * k.shape[2]
    with kernel_launch():
        write_kv_kernel[(k.shape[0],)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping.contiguous(),
            k.stride(0),
            v.stride(0),
            k_cache.shape[2] * k_cache.shape[3],
            ROW=row,
            ROW_P=triton.next_power_of_2(row),
        )
