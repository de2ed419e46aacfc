"""Lesson 10: int8 K/V - symmetric quantization per token and head, and the plain-torch references.

A K (or V) vector of one token and one head, ``x`` of ``head_dim`` values, is stored as ``head_dim`` int8
values and one fp32 scale:

    scale = max|x| / 127,   q = clamp(round(x / scale), -127, 127),   x ~ q * scale

* symmetric: no zero point, and -128 is never used, so ``-q`` is always representable;
* ``round`` is round-half-to-even (``torch.round``): truncation would bias every value towards 0;
* an all-zero vector gets scale 0 and q = 0 (nothing is divided by zero; it dequantizes to exact zeros);
* one scale per token and head, not per tensor: one outlier token would otherwise flatten every other token's
  values into a few levels (lesson 10 measures how much);
* NaN or inf in a vector cannot be stored: :func:`quantize_kv` refuses it naming the token and head (the engine's
  cache names the layer and slot), rather than writing a NaN scale that would poison every later step. So is a
  finite float64 vector whose scale float32 cannot hold (a largest value above 127 x 3.4e38); one within float32's
  reach is quantized in float64, correctly. A stored scale is always finite.

The error of one value is at most half a step, ``scale / 2`` - relative to the vector's largest value,
``1 / 254`` (0.4 %).
"""

from __future__ import annotations

import torch

from lesson_utils.core.types import KVQuantError, check_finite, token_of

QMAX = 127
__all__ = [
    "KVQuantError",
    "QMAX",
    "check_finite",
    "dequantize_kv",
    "quantize_finite_kv",
    "quantize_kv",
    "quantize_int4_levels",
    "quantize_per_tensor",
]


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` (float) -> ``(q, scale)``: ``q`` int8 of ``x``'s shape, ``scale`` float32
    ``x.shape[:-1]``, one per vector (per token and head). Reference for exercise 10-1. ``x`` is not changed."""
    if not torch.is_floating_point(x):
        raise TypeError(f"quantize_kv takes a float tensor, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"quantize_kv takes [..., head_dim] with at least a head axis, got shape {tuple(x.shape)}")
    check_finite(x)
    return quantize_finite_kv(x)


def quantize_finite_kv(x: torch.Tensor, qmax: int = QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_kv` of a float ``x`` already known to be finite (the int8 cache checked it, naming the layer
    and slot): the same result without a second finiteness pass. ``qmax`` other than 127 keeps fewer levels (7:
    int4's), held in int8 all the same."""
    # a float64 input may hold finite values beyond float32's range: work in float64 then, and refuse a vector whose
    # scale float32 cannot hold (the stored scale is float32; an inf there would poison every later step)
    xw = x.double() if x.dtype == torch.float64 else x.float()
    scale = (xw.abs().amax(dim=-1) / qmax).float()
    if x.dtype == torch.float64:  # (a finite float32, fp16 or bf16 vector's scale always fits: no read-back for it)
        _refuse_unstorable_scales(xw, scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(xw.dtype)  # an all-zero vector: q = 0, scale 0
    q = torch.round(xw / safe[..., None]).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def _refuse_unstorable_scales(x: torch.Tensor, scale: torch.Tensor) -> None:
    """A finite vector whose scale overflows float32 (largest value above 127 x float32's max) cannot be stored."""
    bad = ~torch.isfinite(scale)
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        raise KVQuantError(
            f"a K/V vector's largest value is {float(x[tuple(index)].abs().max()):.3g} at token "
            f"{token_of(index[:-1])}, head {index[-1]}: its scale ({QMAX}ths of it) overflows float32, "
            "the scales' dtype, so int8 with a scale cannot store it (the model produced it: check its inputs)"
        )


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (``scale`` has ``q``'s shape without its last axis); computed in float32, or in
    float64 when that is asked for (a value beyond float32's range stays finite there)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(work) * scale.to(work)[..., None]).to(dtype)


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contrast: one scale for the whole tensor (what lesson 10 measures against per-token scales)."""
    check_finite(x)
    scale = x.float().abs().amax() / QMAX
    safe = scale if scale > 0 else torch.ones_like(scale)
    q = torch.round(x.float() / safe).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.expand(x.shape[:-1])


def int8_paged_attention_reference(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale=None):
    """Decode attention over an int8 paged cache, in plain torch: dequantize every block, then lesson 04's
    reference. ``k_cache``/``v_cache`` int8 ``[num_blocks, block_size, kv_heads, d]``, ``k_scale``/``v_scale``
    float32 ``[num_blocks, block_size, kv_heads]``. What the int8 decode kernel must reproduce."""
    from lesson_utils.cache.attention import paged_attention_reference

    k = dequantize_kv(k_cache, k_scale, torch.float32)
    v = dequantize_kv(v_cache, v_scale, torch.float32)
    return paged_attention_reference(q.float(), k, v, block_tables, context_lens, scale).to(q.dtype)


def int8_unified_attention_reference(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start, context_lens, scale=None
):
    """Lesson 08's unified attention over an int8 paged cache, dequantize-then-attend (reference)."""
    from lesson_utils.cache.attention import unified_attention_reference

    k = dequantize_kv(k_cache, k_scale, torch.float32)
    v = dequantize_kv(v_cache, v_scale, torch.float32)
    out = unified_attention_reference(q.float(), k, v, block_tables, query_start, context_lens, scale)
    return out.to(q.dtype)


def quantize_int4_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The other contrast: int4's 15 levels per token and head (``scale = max|x| / 7``), the values held in int8. It
    gives a 4-bit cache's values (lesson 10 measures their accuracy), not its bytes: it still stores one per byte."""
    check_finite(x)
    return quantize_finite_kv(x, qmax=7)
