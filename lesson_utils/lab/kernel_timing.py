"""Lesson 08: lesson 08's unified kernel timed against what it replaces, on synthetic paged K/V - lesson 04's
decode kernel for decodes, the gather and PyTorch's SDPA for chunks - with the outputs compared once before any
timing (:func:`time_unified_kernel`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch


@dataclass
class KernelTiming:
    """One case of :func:`time_unified_kernel`: ``seqs`` sequences of ``query_len`` queries over ``context`` tokens."""

    seqs: int
    query_len: int
    context: int
    unified_ms: float
    baseline_ms: float
    baseline: str  # "decode kernel" (lesson 04's) for decodes, "gather + SDPA" for chunks
    max_error: float  # unified vs the baseline's output, checked once before timing


def _unified_inputs(seqs, query_len, context, heads, head_dim, block_size, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    nb = seqs * per_seq
    kc = torch.randn(nb, block_size, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    vc = torch.randn(nb, block_size, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    tables = torch.randperm(nb, generator=g).view(seqs, per_seq).to(dtype=torch.int32, device=device)
    q = torch.randn(seqs * query_len, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    starts = torch.arange(0, seqs * query_len + 1, query_len, dtype=torch.int32, device=device)
    lens = torch.full((seqs,), context, dtype=torch.int32, device=device)
    return q, kc, vc, tables, starts, lens


def _gather_sdpa(q, kc, vc, tables, query_len):
    """Chunks the lesson 03 way: gather every sequence's K/V into a contiguous copy, then PyTorch's SDPA."""
    seqs, heads, head_dim = tables.shape[0], q.shape[1], q.shape[2]
    k = kc[tables.long()].flatten(1, 2).transpose(1, 2)  # [seqs, heads, context (padded to blocks), d]
    v = vc[tables.long()].flatten(1, 2).transpose(1, 2)
    ctx = k.shape[2]
    qq = q.view(seqs, query_len, heads, head_dim).transpose(1, 2)
    mask = (
        torch.arange(ctx, device=q.device)[None, :]
        <= torch.arange(query_len, device=q.device)[:, None] + ctx - query_len
    )
    out = torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(seqs * query_len, heads, head_dim)


def time_unified_kernel(cases, *, heads, head_dim, block_size, dtype, device, timer) -> list[KernelTiming]:
    """Lesson 08 on a GPU: the unified kernel against lesson 04's decode kernel on decodes (``query_len`` 1) and
    against gather + SDPA on chunks, for each ``(seqs, query_len, context)`` in ``cases`` (``context`` a multiple
    of ``block_size``). Each pair is checked against the other once, untimed, then ``timer(fn) -> ms`` times it
    (``triton.testing.do_bench`` on a GPU). Validation off in the timed calls: no host sync inside them."""
    from lesson_utils.kernels.paged_attention import paged_attention_decode
    from lesson_utils.kernels.unified_attention import unified_attention

    results = []
    for i, (seqs, query_len, context) in enumerate(cases):
        if context % block_size:
            raise ValueError(f"context {context} is not a multiple of the block size {block_size}")
        q, kc, vc, tables, starts, lens = _unified_inputs(
            seqs, query_len, context, heads, head_dim, block_size, dtype, device, seed=i
        )

        unified = partial(unified_attention, q, kc, vc, tables, starts, lens, query_len, validate=False)
        if query_len == 1:
            name, baseline = "decode kernel", partial(paged_attention_decode, q, kc, vc, tables, lens, validate=False)
        else:
            name, baseline = "gather + SDPA", partial(_gather_sdpa, q, kc, vc, tables, query_len)
        error = float((unified().float() - baseline().float()).abs().max())
        results.append(KernelTiming(seqs, query_len, context, timer(unified), timer(baseline), name, error))
    return results
