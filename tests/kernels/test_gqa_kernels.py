"""Grouped-query attention in every course kernel: equal to the plain-torch references at GQA ratios 1, 3, 4 and
8 and head dims 64, 80 and 128, and each K/V element of a context loaded once per KV head - counted load by load
in Triton's interpreter (``lab/kernel_reads``), not inferred from a timing. A kernel that reloaded K/V for every
query head of a group (one program per query head) reads each element ``group`` times: the count test fails it,
as ``test_the_count_sees_a_per_query_head_kernel`` shows."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lesson_utils.cache.attention import paged_attention_reference, unified_attention_reference
from lesson_utils.cache.quantize import int8_paged_attention_reference, int8_unified_attention_reference, quantize_kv
from lesson_utils.kernels import paged_attention as K
from lesson_utils.kernels.int8_kv import int8_paged_attention_decode, int8_unified_attention
from lesson_utils.kernels.unified_attention import unified_attention
from lesson_utils.lab.kernel_reads import count_reads

# (query heads per KV head, KV heads, head_dim): every ratio and head dim the issue names, one case each
GEOMETRIES = [(1, 3, 64), (3, 2, 80), (4, 2, 128), (8, 1, 64)]
BS = 4


def _case(seed, group, kv_heads, head_dim, ctxs, dtype=torch.float32, q_lens=None):
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // BS) for c in ctxs]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 never used: shuffled physical blocks
    tables, at = [], 0
    for n in per_seq:
        tables.append(perm[at : at + n].tolist() + [0] * (max(per_seq) - n))
        at += n
    kc = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g).to(dtype)
    rows = sum(q_lens) if q_lens else len(ctxs)
    q = torch.randn(rows, group * kv_heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, torch.tensor(tables, dtype=torch.int32), torch.tensor(ctxs, dtype=torch.int32)


def _context_mask(kc, tables, ctxs) -> torch.Tensor:
    """1 for every cache element holding a context token, else 0 (shape of ``kc``)."""
    want = torch.zeros(kc.shape, dtype=torch.long)
    for table, ctx in zip(tables.tolist(), ctxs.tolist()):
        for t in range(ctx):
            want[table[t // BS], t % BS] = 1
    return want


@pytest.mark.parametrize("variant", K.VARIANTS)
@pytest.mark.parametrize("group,kv_heads,head_dim", GEOMETRIES)
def test_decode_kernel_equals_the_reference_and_loads_each_kv_element_once(variant, group, kv_heads, head_dim):
    q, kc, vc, tables, ctxs = _case(group * 7 + head_dim, group, kv_heads, head_dim, [9, 1, 16])
    with count_reads(kc, vc) as (rk, rv):
        got = K.paged_attention_decode(q, kc, vc, tables, ctxs, variant=variant)
    want = paged_attention_reference(q, kc, vc, tables, ctxs)
    assert (got - want).abs().max().item() <= 1e-5
    mask = _context_mask(kc, tables, ctxs).numpy()
    assert (rk == mask).all() and (rv == mask).all(), f"max loads per element: K {rk.max()}, V {rv.max()}"


@pytest.mark.parametrize("group,kv_heads,head_dim", GEOMETRIES)
def test_unified_kernel_equals_the_reference_on_chunks_and_decodes(group, kv_heads, head_dim):
    q_lens, ctxs = [5, 1, 3], [9, 7, 3]  # a chunk after 4 cached tokens, a decode, a whole short prompt
    q, kc, vc, tables, ctx = _case(head_dim + group, group, kv_heads, head_dim, ctxs, q_lens=q_lens)
    starts = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    got = unified_attention(q, kc, vc, tables, starts, ctx, max(q_lens))
    want = unified_attention_reference(q, kc, vc, tables, starts, ctx)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("group,kv_heads,head_dim", GEOMETRIES)
def test_unified_kernel_loads_each_kv_element_once_per_query_tile(group, kv_heads, head_dim):
    """A decode step (one query per sequence, one query tile): every context element loaded exactly once."""
    q, kc, vc, tables, ctxs = _case(3, group, kv_heads, head_dim, [6, 13])
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    with count_reads(kc, vc) as (rk, rv):
        unified_attention(q, kc, vc, tables, starts, ctxs, 1)
    mask = _context_mask(kc, tables, ctxs).numpy()
    assert (rk == mask).all() and (rv == mask).all(), f"max loads per element: K {rk.max()}, V {rv.max()}"


def _int8(kc, vc):
    (k8, ks), (v8, vs) = quantize_kv(kc), quantize_kv(vc)
    return k8, v8, ks.contiguous(), vs.contiguous()


@pytest.mark.parametrize("group,kv_heads,head_dim", [(3, 2, 80), (8, 1, 64)])
def test_int8_kernels_equal_their_references_and_load_each_element_once(group, kv_heads, head_dim):
    q, kc, vc, tables, ctxs = _case(11, group, kv_heads, head_dim, [10, 3])
    k8, v8, ks, vs = _int8(kc, vc)
    with count_reads(k8, v8, ks, vs) as reads:
        got = int8_paged_attention_decode(q, k8, v8, ks, vs, tables, ctxs)
    want = int8_paged_attention_reference(q, k8, v8, ks, vs, tables, ctxs)
    assert (got - want).abs().max().item() <= 1e-5
    mask = _context_mask(kc, tables, ctxs).numpy()
    assert all((r == mask).all() for r in reads[:2])
    assert all((r == mask[..., 0]).all() for r in reads[2:]), "each token's scale is loaded once per KV head too"
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    got = int8_unified_attention(q, k8, v8, ks, vs, tables, starts, ctxs, 1)
    want = int8_unified_attention_reference(q, k8, v8, ks, vs, tables, starts, ctxs)
    assert (got - want).abs().max().item() <= 1e-5


@triton.jit
def _one_program_per_query_head(out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, scale, stride_bt,
                                H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS_: tl.constexpr):  # fmt: skip
    """The layout the course's kernels replaced: each query head walks the context alone, reloading its KV head."""
    seq, head = tl.program_id(0), tl.program_id(1)
    kv = head // (H // KVH)
    ctx = tl.load(ctx_ptr + seq)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (seq * H + head) * D + d)
    m, l_, acc = float("-inf"), 0.0, tl.zeros([D], tl.float32)
    for start in range(0, ctx, BS_):
        tok = start + tl.arange(0, BS_)
        ok = tok < ctx
        slot = tl.load(bt_ptr + seq * stride_bt + tok // BS_, mask=ok, other=0) * BS_ + tok % BS_
        offs = (slot[:, None] * KVH + kv) * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)
        s = tl.where(ok, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(s, 0))
        p = tl.exp(s - m_new)
        acc = acc * tl.exp(m - m_new) + tl.sum(p[:, None] * v, 0)
        l_ = l_ * tl.exp(m - m_new) + tl.sum(p, 0)
        m = m_new
    tl.store(out_ptr + (seq * H + head) * D + d, acc / l_)


def test_the_count_sees_a_per_query_head_kernel():
    """The load count can fail: a kernel with one program per query head is right, and reads each K/V element
    ``group`` times."""
    group, kv_heads, head_dim = 4, 2, 64
    q, kc, vc, tables, ctxs = _case(5, group, kv_heads, head_dim, [9, 4])
    out = torch.empty_like(q)
    with count_reads(kc, vc) as (rk, _):
        _one_program_per_query_head[(2, group * kv_heads)](
            out, q, kc, vc, tables, ctxs, head_dim**-0.5, tables.stride(0), group * kv_heads, kv_heads, head_dim, BS
        )
    assert (out - paged_attention_reference(q, kc, vc, tables, ctxs)).abs().max().item() <= 1e-5
    mask = _context_mask(kc, tables, ctxs).numpy()
    assert (rk == group * mask).all()


@triton.jit
def _three_loads(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    unmasked = tl.load(x_ptr + i)
    masked = tl.load(x_ptr + i, mask=i < 3, other=0.0)
    scalar = tl.load(x_ptr + 5)
    tl.store(out_ptr + i, unmasked + masked + scalar)


def test_the_count_sees_every_kind_of_load_and_leaves_triton_as_it_was():
    """Unmasked, masked (masked-out lanes read nothing) and scalar loads are all counted; tensors not watched are not;
    ``tl.load`` is Triton's own again afterwards, and no interpreter method was replaced (the count wraps the public
    ``tl.load``, so it works on Triton 3.6 as on the newest)."""
    from triton.runtime import interpreter

    x, other, out = torch.arange(8.0), torch.zeros(8), torch.empty(8)
    builder = dict(vars(interpreter.InterpreterBuilder))
    before, core_before = tl.load, tl.core.load  # (Triton 3.6's interpreter leaves tl.core patched after a launch)
    with count_reads(x, other) as (cx, co):
        assert vars(interpreter.InterpreterBuilder) == builder
        _three_loads[(1,)](x, out, 8)
    assert cx.tolist() == [2, 2, 2, 1, 1, 2, 1, 1] and not co.any()
    assert torch.equal(out, x + torch.where(torch.arange(8) < 3, x, 0.0) + 5)
    assert tl.load is before and tl.core.load is core_before
