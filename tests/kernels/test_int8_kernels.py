"""Lesson 10's kernels against the plain-torch dequantize-then-attend references (interpreter), random and edge
cases: block boundaries, grouped-query heads, head dims that are not powers of two, one-token contexts, all-zero and
very large values, fp32 and fp16 queries. The quantizing write must match quantize_kv exactly."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from lesson_utils import kernels  # noqa: F401 - picks Triton's mode before the kernels are defined
from lesson_utils.cache import quantize as Q
from lesson_utils.kernels import int8_kv as I


@triton.jit
def no_scale(ptrs, scale_ptrs, mask, token_mask):
    """A wrong tile loader: the int8 values without their scales."""
    return tl.load(ptrs, mask=mask, other=0).to(tl.float32)


def _int8_cache(seed, nb, bs, kvh, d, *, big=0.0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randint(-127, 128, (nb, bs, kvh, d), generator=g, dtype=torch.int8)
    vc = torch.randint(-127, 128, (nb, bs, kvh, d), generator=g, dtype=torch.int8)
    ks = torch.rand(nb, bs, kvh, generator=g) * (big or 0.05)
    vs = torch.rand(nb, bs, kvh, generator=g) * (big or 0.05)
    return kc, vc, ks, vs


def _rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernel_matches_the_dequantizing_reference(seed, dtype):
    rng = random.Random(seed)
    bs, kvh, group, d = rng.choice([4, 8, 16]), rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([16, 24, 64, 80])
    lens = [rng.choice([1, bs, bs + 1, rng.randint(1, 5 * bs)]) for _ in range(rng.randint(1, 4))]
    width = max(-(-c // bs) for c in lens)
    nb = len(lens) * width + 1
    big = (1e3 if dtype == torch.float32 else 300.0) if seed % 3 == 0 else 0.0  # values up to 127 x 300 fit fp16
    kc, vc, ks, vs = _int8_cache(seed, nb, bs, kvh, d, big=big)
    ks[0, 0] = 0  # an all-zero vector's scale
    tables = torch.randperm(nb)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    q = torch.randn(len(lens), kvh * group, d).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    want = Q.int8_paged_attention_reference(q, kc, vc, ks, vs, tables, lens_t)
    for variant in ("simple", "tiled"):
        got = I.int8_paged_attention_decode(q, kc, vc, ks, vs, tables, lens_t, variant=variant)
        assert got.dtype == dtype and _rel_err(got, want) < (1e-3 if dtype == torch.float32 else 5e-3), variant


@pytest.mark.parametrize("seed", range(4))
def test_unified_kernel_matches_the_dequantizing_reference(seed):
    rng = random.Random(seed)
    bs, kvh, group, d = rng.choice([4, 8]), rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([16, 24, 64])
    qlens = [rng.choice([1, rng.randint(2, 2 * bs)]) for _ in range(rng.randint(1, 3))]
    ctxs = [q + rng.randint(0, 2 * bs) for q in qlens]
    width = max(-(-c // bs) for c in ctxs)
    nb = len(ctxs) * width
    kc, vc, ks, vs = _int8_cache(seed, nb, bs, kvh, d)
    tables = torch.randperm(nb).view(len(ctxs), width).to(torch.int32)
    starts = torch.tensor([0] + [sum(qlens[: i + 1]) for i in range(len(qlens))], dtype=torch.int32)
    q = torch.randn(sum(qlens), kvh * group, d)
    lens = torch.tensor(ctxs, dtype=torch.int32)
    want = Q.int8_unified_attention_reference(q, kc, vc, ks, vs, tables, starts, lens)
    got = I.int8_unified_attention(q, kc, vc, ks, vs, tables, starts, lens, max(qlens))
    assert _rel_err(got, want) < 1e-3


@pytest.mark.parametrize("kvh, d", [(12, 64), (2, 24), (3, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_write_kernel_quantizes_exactly_as_quantize_kv(kvh, d, dtype):
    g = torch.Generator().manual_seed(kvh * d)
    nb, bs, n = 6, 4, 9
    x = (torch.randn(n, kvh, d, generator=g) * 3).to(dtype)
    x[1] = 0  # all zero: scale 0, values 0
    x[2, 0, 0] = 6e4 if dtype == torch.float16 else 1e30  # very large
    x[3] = torch.round(torch.randn(kvh, d, generator=g) * 4) / 2  # exact halves: round half to even must agree
    kc = torch.zeros(nb, bs, kvh, d, dtype=torch.int8)
    vc, ks, vs = torch.zeros_like(kc), torch.zeros(nb, bs, kvh), torch.zeros(nb, bs, kvh)
    slots = torch.tensor([3, 0, 23, 7, -1, 12, 5, 16, 1], dtype=torch.int32)
    I.write_int8_kv_to_cache(x, -x, kc, vc, ks, vs, slots)
    q, s = Q.quantize_kv(x)
    keep = slots >= 0
    assert torch.equal(kc.view(-1, kvh, d)[slots[keep].long()], q[keep])
    assert torch.equal(vc.view(-1, kvh, d)[slots[keep].long()], -q[keep])
    assert torch.equal(ks.view(-1, kvh)[slots[keep].long()], s[keep])
    assert int(kc.min()) >= -127 and bool((ks.view(-1, kvh)[0] == 0).all())  # -128 never; zeros stay zero
    assert bool((kc.view(-1, kvh, d)[4] == 0).all())  # slot -1 wrote nothing (slot 4 is no one's)


def test_the_write_refuses_nan_and_inf_naming_the_token_and_head():
    kc = torch.zeros(4, 4, 2, 8, dtype=torch.int8)
    vc, ks, vs = torch.zeros_like(kc), torch.zeros(4, 4, 2), torch.zeros(4, 4, 2)
    x = torch.randn(3, 2, 8)
    x[2, 1, 5] = float("nan")
    with pytest.raises(Q.KVQuantError, match="token 2, head 1"):
        I.write_int8_kv_to_cache(torch.randn(3, 2, 8), x, kc, vc, ks, vs, torch.tensor([0, 1, 2], dtype=torch.int32))
    assert not bool(vc.any()) and not bool(kc.any())  # nothing written


def test_bad_caches_are_refused_with_what_they_should_be():
    kc = torch.zeros(4, 4, 2, 8, dtype=torch.int8)
    q, t, lens = torch.randn(1, 2, 8), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(TypeError, match="int8 values"):
        I.int8_paged_attention_decode(q, kc.float(), kc.float(), torch.zeros(4, 4, 2), torch.zeros(4, 4, 2), t, lens)
    with pytest.raises(ValueError, match="one per slot"):
        I.int8_paged_attention_decode(q, kc, kc, torch.zeros(4, 4), torch.zeros(4, 4), t, lens)
    with pytest.raises(TypeError, match="float32"):
        I.int8_paged_attention_decode(q, kc, kc, torch.zeros(4, 4, 2).half(), torch.zeros(4, 4, 2), t, lens)


def test_a_loader_that_forgets_the_scale_is_caught_by_the_reference():
    """The check a learner's tile loader faces (exercise 10-3) can fail."""
    kc, vc, ks, vs = _int8_cache(0, 4, 4, 1, 16)
    q, tables, lens = (
        torch.randn(1, 1, 16),
        torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([7], dtype=torch.int32),
    )
    want = Q.int8_paged_attention_reference(q, kc, vc, ks, vs, tables, lens)
    got = I.int8_paged_attention_decode(q, kc, vc, ks, vs, tables, lens, load_fn=no_scale)
    assert _rel_err(got, want) > 0.1
