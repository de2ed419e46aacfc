"""Lesson 04's Triton kernels against their plain-torch references, under the interpreter, and their
ahead-of-time compile for a T4 (sm_75), an A100 (sm_80), an L4 (sm_89) and an H100 (sm_90).

Tolerances: fp32 caches, max abs error <= 1e-5; fp16 caches (inputs rounded to fp16, fp32 accumulation in
both kernel and reference), max abs error <= 2e-3. The write kernel must be bit-exact.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_identical, hf_greedy

from lesson_utils.cache import attention
from lesson_utils.kernels import paged_attention as K

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def make_case(seed, *, num_seqs, heads, kv_heads, head_dim, block_size, ctxs, dtype, share=False):
    """Random caches, shuffled non-monotonic block tables (optionally sharing physical blocks)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(per_seq) + 1  # one spare column: entries past a sequence's blocks must be ignored
    tables = torch.full((len(ctxs), max_blocks), num_blocks - 1, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(perm[taken : taken + n], dtype=torch.int32)
        taken += n
    if share and len(ctxs) > 1:
        shared = min(per_seq[0], per_seq[1]) - 1  # all but the last block shared, like a common prefix
        tables[1, :shared] = tables[0, :shared]
    q = torch.randn(len(ctxs), heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(ctxs, dtype=torch.int32)


def assert_matches(case, variant="tiled", **kw):
    q, kc, vc, bt, cl = case
    got = K.paged_attention_decode(q, kc, vc, bt, cl, variant=variant, **kw)
    want = attention.paged_attention_reference(q, kc, vc, bt, cl)
    assert got.dtype == q.dtype and got.shape == q.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[q.dtype], f"max abs error {err:.2e} > {TOL[q.dtype]:.0e}"


@pytest.mark.parametrize("variant", K.VARIANTS)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_context_lengths_one_multiples_and_long(variant, block_size):
    ctxs = [1, block_size, 3 * block_size, 5 * block_size + 3, 150]
    assert_matches(
        make_case(
            block_size,
            num_seqs=5,
            heads=2,
            kv_heads=2,
            head_dim=64,
            block_size=block_size,
            ctxs=ctxs,
            dtype=torch.float32,
        ),
        variant,
    )


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (2, 2)])
def test_head_dims_and_grouped_query(head_dim, heads, kv_heads):
    assert_matches(
        make_case(
            head_dim + heads,
            num_seqs=2,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=16,
            ctxs=[17, 40],
            dtype=torch.float32,
        )
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("variant", K.VARIANTS)
def test_dtypes_and_shared_blocks(dtype, variant):
    assert_matches(
        make_case(
            7, num_seqs=3, heads=4, kv_heads=2, head_dim=64, block_size=16, ctxs=[45, 40, 9], dtype=dtype, share=True
        ),
        variant,
    )


@pytest.mark.parametrize("where", ["cpu", "device discipline"])
def test_randomized_cases(where):
    """Also in the device-discipline mode: inputs on the stand-in device, as on a GPU; the wrappers and the
    reference must then neither mix in a host tensor nor read back more than their checks need."""
    from contextlib import nullcontext

    from lesson_utils.core import device_discipline as dd

    rng = random.Random(0)
    with dd.discipline() if where != "cpu" else nullcontext():
        for seed in range(6):
            bs = rng.choice([8, 16, 32])
            kv = rng.choice([1, 2])
            ctxs = [rng.randint(1, 90) for _ in range(rng.randint(1, 3))]
            case = make_case(
                seed,
                num_seqs=len(ctxs),
                heads=kv * rng.choice([1, 4]),
                kv_heads=kv,
                head_dim=rng.choice([64, 80]),
                block_size=bs,
                ctxs=ctxs,
                dtype=rng.choice([torch.float16, torch.float32]),
                share=rng.random() < 0.5,
            )
            if where != "cpu":
                case = tuple(t.to(dd.DEVICE) for t in case)
            assert_matches(case, rng.choice(K.VARIANTS))


def test_large_scores_do_not_overflow():
    q, kc, vc, bt, cl = make_case(
        3, num_seqs=2, heads=2, kv_heads=2, head_dim=64, block_size=16, ctxs=[70, 33], dtype=torch.float32
    )
    out = K.paged_attention_decode(q * 60, kc, vc, bt, cl)
    assert torch.isfinite(out).all()
    assert_matches((q * 60, kc, vc, bt, cl))


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda c: (c[0][:, :3], *c[1:]), "multiple of num_kv_heads"),
        (lambda c: (*c[:3], c[3].long(), c[4]), "int32"),
        (lambda c: (*c[:4], torch.zeros_like(c[4])), "at least 1"),
        (lambda c: (*c[:4], c[4] + 1000), "needs more than"),
        (lambda c: (c[0][:, :, :32], *c[1:]), "head_dim"),
    ],
)
def test_bad_inputs_get_clear_errors(mutate, message):
    case = make_case(1, num_seqs=2, heads=4, kv_heads=2, head_dim=64, block_size=16, ctxs=[5, 20], dtype=torch.float32)
    with pytest.raises((ValueError, TypeError), match=message):
        K.paged_attention_decode(*mutate(case))


@pytest.mark.parametrize(
    "kv_heads,head_dim,dtype", [(12, 64, torch.float16), (12, 64, torch.float32), (2, 80, torch.float32)]
)
def test_write_kv_any_row_width(kv_heads, head_dim, dtype):
    """OPT-125m's 12 x 64 = 768 is not a power of two; slot -1 is skipped."""
    g = torch.Generator().manual_seed(kv_heads)
    kc = torch.zeros(6, 16, kv_heads, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    k = torch.randn(7, kv_heads, head_dim, generator=g)
    v = torch.randn(7, kv_heads, head_dim, generator=g)
    slots = torch.tensor([0, 15, 16, -1, 95, 40, 41], dtype=torch.int32)
    K.write_kv_to_cache(k, v, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    K.write_kv_reference(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_write_kv_errors():
    kc = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="outside the cache's 8 slots"):
        K.write_kv_to_cache(
            torch.ones(1, 1, 8), torch.ones(1, 1, 8), kc, kc.clone(), torch.tensor([8], dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="one entry per token"):
        K.write_kv_to_cache(
            torch.ones(2, 1, 8), torch.ones(2, 1, 8), kc, kc.clone(), torch.tensor([0], dtype=torch.int32)
        )


@pytest.mark.slow
def test_every_course_kernel_compiles_for_every_target_gpu():
    from lesson_utils.kernels import aot

    results = aot.compile_report()
    report = aot.format_report(results)
    assert {r.target for r in results} == {"sm_75", "sm_80", "sm_89", "sm_90"}
    assert all(r.ok for r in results), report
    assert all(r.fits_t4 for r in results), report
    assert not any(r.tensor_cores for r in results if r.target == "sm_75"), report  # no mma on Turing via Triton
    assert all(r.spill_bytes in (0, None) for r in results), report


def test_engine_with_triton_backend_is_token_identical_to_hf():
    """The tiny OPT under the interpreter: Triton writes K/V and attends for decode tokens."""
    from lesson_utils.cache.triton_paged import TritonPagedKVCache
    from lesson_utils.core.env import Profile
    from lesson_utils.memory.block_manager import BlockManager
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights
    from lesson_utils.serving.engine import Engine

    lm = load_model(profile=Profile(name="ci", device="cpu", device_name="test"))
    w = OPTWeights.from_hf(lm.model)
    g = torch.Generator().manual_seed(5)
    prompts = [[2]] + [[2] + torch.randint(4, w.vocab_size, (n,), generator=g).tolist() for n in (7, 15, 22)]
    cache = TritonPagedKVCache(w.num_layers, w.num_heads, w.head_dim, BlockManager(9, 8))  # tight: forces waiting
    outs = Engine(w, cache).generate(prompts, 8)
    want = [hf_greedy(lm.model, p, 8, w.eos_token_id, check_ties=False) for p in prompts]
    assert_identical(lm.model, prompts, want, outs)
    assert cache.manager.num_free_blocks == 9
