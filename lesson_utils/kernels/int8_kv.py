"""Lesson 10: the paged kernels over an int8 KV cache.

The cache per layer: ``k_cache``/``v_cache`` int8 ``[num_blocks, block_size, num_kv_heads, head_dim]`` and, beside
them, ``k_scale``/``v_scale`` float32 ``[num_blocks, block_size, num_kv_heads]``: one scale per token and head,
indexed by the same slots (:mod:`lesson_utils.cache.quantize` for the rule).

* :func:`write_int8_kv_to_cache` quantizes as it stores: one program per new token computes each head's
  ``max|x| / 127``, rounds half to even, clamps to +-127 and writes the int8 values and the scales;
* :func:`int8_paged_attention_decode` and :func:`int8_unified_attention` are lesson 04's and lesson 08's kernels
  with :func:`load_int8_tile` as their tile loader: the K/V tile is dequantized as it is loaded (int8 -> fp32,
  times each token's scale), so everything after the load - scores, online softmax, P.V - is unchanged.

Why dequantize on load rather than scale the scores by the key's scale and the probabilities by the value's
(the same maths, fewer multiplications per token)? One building block serves both kernels and K and V alike, and
on a memory-bound decode the multiplications are free: the bytes read are what the time follows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lesson_utils.core.device_discipline import check_kernel_args, kernel_launch
from lesson_utils.core.types import check_finite
from lesson_utils.kernels.paged_attention import paged_attention_decode
from lesson_utils.kernels.unified_attention import unified_attention


@triton.jit
def load_int8_tile(ptrs, scale_ptrs, mask, token_mask):
    """A ``[TILE, HEAD_DIM_P]`` int8 tile of K or V, dequantized to fp32 with each token's scale (``scale_ptrs``:
    ``[TILE]``). Masked tokens read 0 and scale 0. Reference for exercise 10-3."""
    x = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
    s = tl.load(scale_ptrs, mask=token_mask, other=0.0)
    return x * s[:, None]


@triton.jit
def _round_half_even(y):
    """torch.round's rule in Triton (the interpreter has no libdevice.rint): round half to even."""
    f = tl.floor(y + 0.5)
    tie = (f - y) == 0.5
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where(tie & odd, f - 1.0, f)


@triton.jit
def _quantize_store(x, dst_ptr, dst_scale_ptr, slot, row, h, mask, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Quantize one token's ``[HEADS_P, HEAD_DIM_P]`` values per head and store them and the scales in ``slot``."""
    scale = tl.max(tl.abs(x), 1) / 127.0
    safe = tl.where(scale > 0, scale, 1.0)  # an all-zero head: q = 0, scale 0
    q = _round_half_even(x / safe[:, None])
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(dst_ptr + slot * (HEADS * HEAD_DIM) + row, q.to(tl.int8), mask=mask)
    tl.store(dst_scale_ptr + slot * HEADS + h, scale, mask=h < HEADS)


@triton.jit
def write_int8_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_v_token,
    HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    """One program per new token: quantize its K and V per head and store values and scales in its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HEADS_P)
        d = tl.arange(0, HEAD_DIM_P)
        mask = (h[:, None] < HEADS) & (d[None, :] < HEAD_DIM)
        row = h[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + token * stride_k_token + row, mask=mask, other=0.0).to(tl.float32)
        _quantize_store(k, k_cache_ptr, k_scale_ptr, slot, row, h, mask, HEADS, HEAD_DIM)
        v = tl.load(v_ptr + token * stride_v_token + row, mask=mask, other=0.0).to(tl.float32)
        _quantize_store(v, v_cache_ptr, v_scale_ptr, slot, row, h, mask, HEADS, HEAD_DIM)


def _check_int8_cache(k_cache, v_cache, k_scale, v_scale) -> None:
    if k_cache.dtype != torch.int8 or v_cache.dtype != torch.int8:
        raise TypeError(f"an int8 cache holds int8 values, got {k_cache.dtype} and {v_cache.dtype}")
    if k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
        raise TypeError(f"the scales are float32, got {k_scale.dtype} and {v_scale.dtype}")
    if k_scale.shape != k_cache.shape[:3] or v_scale.shape != v_cache.shape[:3]:
        raise ValueError(
            f"the scales must be [num_blocks, block_size, num_kv_heads] = {tuple(k_cache.shape[:3])}, one per slot "
            f"and head; got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}"
        )
    if not all(t.is_contiguous() for t in (k_cache, v_cache, k_scale, v_scale)):
        raise ValueError("the int8 caches and their scales must be contiguous (the kernels index them by slot)")


def write_int8_kv_to_cache(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, *, validate: bool = True) -> None:
    """Quantize ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` (float) into the int8 caches and their scales at
    ``slot_mapping`` (int32 or int64, -1 skips a token). ``validate`` (a read-back: a sync) checks the slots and
    refuses NaN/inf naming the token and head; the engine checks its inputs where it builds them."""
    check_kernel_args(
        "write_int8_kv_to_cache", k=k, v=v, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale,
        slot_mapping=slot_mapping,
    )  # fmt: skip
    _check_int8_cache(k_cache, v_cache, k_scale, v_scale)
    if k.shape != v.shape or k.dim() != 3 or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"k and v must be [num_tokens, num_kv_heads, head_dim] = [n, {k_cache.shape[2]}, {k_cache.shape[3]}]; "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must have one entry per token ({k.shape[0]}), got {tuple(slot_mapping.shape)}")
    total = k_cache.shape[0] * k_cache.shape[1]
    if validate and k.shape[0]:
        lowest, highest = torch.stack([slot_mapping.min(), slot_mapping.max()]).tolist()
        if highest >= total or lowest < -1:
            raise ValueError(f"slots must be 0 .. {total - 1} (or -1 to skip); got {lowest} .. {highest}")
        check_finite(k, "K: ")
        check_finite(v, "V: ")
    if k.shape[0] == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    heads, head_dim = k.shape[1], k.shape[2]
    with kernel_launch():
        write_int8_kv_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping.contiguous(), k.stride(0), v.stride(0),
            HEADS=heads, HEADS_P=triton.next_power_of_2(heads), HEAD_DIM=head_dim,
            HEAD_DIM_P=triton.next_power_of_2(head_dim),
        )  # fmt: skip


def int8_paged_attention_decode(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale=None, *,
                                variant: str = "tiled", load_fn=None, validate: bool = True) -> torch.Tensor:  # fmt: skip
    """Lesson 04's decode kernel over an int8 cache (``load_fn``: a learner's :func:`load_int8_tile`)."""
    check_kernel_args("int8_paged_attention_decode", k_scale=k_scale, v_scale=v_scale)
    _check_int8_cache(k_cache, v_cache, k_scale, v_scale)
    return paged_attention_decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, variant=variant, validate=validate,
        int8_scales=(k_scale, v_scale), load_fn=load_int8_tile if load_fn is None else load_fn,
    )  # fmt: skip


def int8_unified_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start, context_lens,
                           max_query_len: int, scale=None, *, load_fn=None, validate: bool = True) -> torch.Tensor:  # fmt: skip
    """Lesson 08's unified kernel (chunks and decodes in one launch) over an int8 cache."""
    check_kernel_args("int8_unified_attention", k_scale=k_scale, v_scale=v_scale)
    _check_int8_cache(k_cache, v_cache, k_scale, v_scale)
    return unified_attention(
        q, k_cache, v_cache, block_tables, query_start, context_lens, max_query_len, scale, validate=validate,
        int8_scales=(k_scale, v_scale), load_fn=load_int8_tile if load_fn is None else load_fn,
    )  # fmt: skip
