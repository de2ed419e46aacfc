"""Lesson 10's checkers against the reference and against plausible wrong answers: each wrong answer must fail,
with a message that names the property (and, where recognised, the mistake), and never crash."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers import rejected

from lesson_utils.cache import quantize as Q
from lesson_utils.checks import lesson10 as C
from lesson_utils.kernels.int8_kv import load_int8_tile
from lesson_utils.lab import kv_math

# ---- exercise 1 ----------------------------------------------------------------------------------------------


def _scale(x):
    return x.float().abs().amax(-1) / 127


def _safe(s):
    return torch.where(s > 0, s, torch.ones_like(s))[..., None]


def per_tensor(x):
    q, s = Q.quantize_per_tensor(x)
    return q, s.contiguous().float()


def truncated(x):
    s = _scale(x)
    return (x.float() / _safe(s)).clamp(-127, 127).to(torch.int8), s


def allows_minus_128(x):
    s = x.float().abs().amax(-1) / 127.5
    return torch.round(x.float() / _safe(s)).clamp(-128, 127).to(torch.int8), s


def zero_gets_scale_one(x):
    Q.check_finite(x)
    s = _scale(x)
    return torch.round(x.float() / _safe(s)).clamp(-127, 127).to(torch.int8), torch.where(s > 0, s, torch.ones_like(s))


def keeps_the_input_dtype(x):
    q, s = Q.quantize_kv(x)
    return q, s.to(x.dtype)


def keepdim_scale(x):
    q, s = Q.quantize_kv(x)
    return q, s[..., None]


def accepts_nan(x):
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0)
    return Q.quantize_kv(x)


def in_place(x):
    q, s = Q.quantize_kv(x)
    x.zero_()
    return q, s


def cleans_then_refuses(x):
    if not torch.isfinite(x).all():
        x.nan_to_num_(0.0)  # "repairs" the caller's tensor, then refuses anyway
        raise ValueError("NaN")
    return Q.quantize_kv(x)


def int32_values(x):
    q, s = Q.quantize_kv(x)
    return q.int(), s


def no_clamp(x):
    s = x.float().abs().amax(-1) / 126  # a wrong divisor: the largest values overflow int8 without a clamp
    return torch.round(x.float() / _safe(s)).to(torch.int8), s


def reciprocal_scale(x):
    Q.check_finite(x)
    s = _scale(x)
    return torch.round(x.float() * (1 / _safe(s))).clamp(-127, 127).to(torch.int8), s  # 1 / 2e-39 is inf in float32


def eps_in_the_divisor(x):
    Q.check_finite(x)
    s = _scale(x)
    return torch.round(x.float() / (s[..., None] + 1e-12)).clamp(-127, 127).to(torch.int8), s


def refuses_nan_and_plus_inf_only(x):
    if torch.isnan(x).any() or (x == float("inf")).any():
        raise ValueError("not storable")
    s = _scale(x)  # -inf gets through: scale inf, q NaN -> garbage
    return torch.round(x.float() / _safe(s)).clamp(-127, 127).to(torch.int8), s


def inverted_scale(x):
    Q.check_finite(x)
    inv = 127 / x.float().abs().amax(-1)  # inf for an all-zero vector
    return torch.round(x.float() * inv[..., None]).nan_to_num(0).clamp(-127, 127).to(torch.int8), inv


def test_the_reference_passes_and_a_stub_is_unsolved():
    assert C.check_quantize_kv(Q.quantize_kv, quiet=True).passed

    def stub(x):
        raise NotImplementedError("exercise 10-1")

    r = C.check_quantize_kv(stub, quiet=True)
    assert not r.passed and not r.implemented and r.use is Q.quantize_kv


@pytest.mark.parametrize(
    "wrong, needles",
    [
        (per_tensor, ["the same"]),
        (truncated, ["truncated"]),
        (allows_minus_128, ["-128"]),
        (zero_gets_scale_one, ["scale 0"]),
        (keeps_the_input_dtype, ["float32"]),
        (keepdim_scale, ["one scale per vector"]),
        (accepts_nan, ["NaN"]),
        (in_place, ["changed its input"]),
        (cleans_then_refuses, ["refused call", "changed"]),
        (int32_values, ["int8"]),
        (no_clamp, ["expected"]),
        # issue 35: magnitudes near zero and subnormal, -inf, a non-finite scale named as such
        (reciprocal_scale, ["tiny magnitude", "1 / scale"]),
        (eps_in_the_divisor, ["tiny magnitude", "epsilon"]),
        (refuses_nan_and_plus_inf_only, ["-inf", "ValueError"]),
        (inverted_scale, ["scale inf"]),
    ],
)
def test_wrong_quantizers_fail_naming_the_mistake(wrong, needles):
    assert rejected(C.check_quantize_kv(wrong, quiet=True), *needles)


def test_a_rounding_that_breaks_ties_upwards_is_accepted():
    """floor(y + 0.5) differs from round-half-to-even only at exact halves: both are fair roundings."""

    def half_up(x):
        Q.check_finite(x)
        s = _scale(x)
        return torch.floor(x.float() / _safe(s) + 0.5).clamp(-127, 127).to(torch.int8), s

    assert C.check_quantize_kv(half_up, quiet=True).passed


# ---- exercise 2 ----------------------------------------------------------------------------------------------


def _layers_heads_dim(c):
    return c.num_hidden_layers, kv_math.kv_heads_of(c), kv_math.head_dim_of(c)


def only_k(c, layout):
    return kv_math.int8_kv_bytes_per_token(c, layout) // 2


def no_scales(c, layout):
    n, h, d = _layers_heads_dim(c)
    return 2 * n * h * d * (2 if layout == "fp16" else 1)


def scale_per_token(c, layout):
    n, h, d = _layers_heads_dim(c)
    return 2 * n * h * 2 * d if layout == "fp16" else 2 * n * (h * d + 4)


def no_alignment(c, layout):
    n, h, d = _layers_heads_dim(c)
    return kv_math.int8_kv_bytes_per_token(c, layout) if layout == "fp16" else 2 * n * h * (d + 4)


def query_heads(c, layout):
    d = kv_math.head_dim_of(c)
    per = {"fp16": 2 * d, "int8, separate scales": d + 4, "int8, inline scales": -(-(d + 4) // 16) * 16}[layout]
    return 2 * c.num_hidden_layers * c.num_attention_heads * per


def hidden_over_heads(c, layout):
    d = c.hidden_size // c.num_attention_heads  # ignores an explicit head_dim
    per = {"fp16": 2 * d, "int8, separate scales": d + 4, "int8, inline scales": -(-(d + 4) // 16) * 16}[layout]
    return 2 * c.num_hidden_layers * kv_math.kv_heads_of(c) * per


def float_bytes(c, layout):
    return float(kv_math.int8_kv_bytes_per_token(c, layout))


def no_refusal(c, layout):
    try:
        return kv_math.int8_kv_bytes_per_token(c, layout)
    except ValueError:
        return 0


@pytest.mark.parametrize(
    "wrong, needles",
    [
        (only_k, ["key AND a value"]),
        (no_scales, ["scales"]),
        (scale_per_token, ["token AND head"]),
        (no_alignment, ["16-byte boundary"]),
        (query_heads, ["KV heads"]),
        (hidden_over_heads, ["head_dim=128", "where does your head size come from"]),  # issue 35
        (float_bytes, ["an int"]),
        (no_refusal, ["int4", "ValueError"]),
    ],
)
def test_wrong_byte_counts_fail_naming_the_mistake(wrong, needles):
    assert rejected(C.check_kv_bytes_per_token(wrong, quiet=True), *needles)


def test_the_byte_count_reference_passes():
    assert C.check_kv_bytes_per_token(kv_math.int8_kv_bytes_per_token, quiet=True).passed


# ---- exercise 3 ----------------------------------------------------------------------------------------------


@triton.jit
def forgets_the_scale(ptrs, scale_ptrs, mask, token_mask):
    return tl.load(ptrs, mask=mask, other=0).to(tl.float32)


@triton.jit
def one_scale_for_the_tile(ptrs, scale_ptrs, mask, token_mask):
    x = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
    s = tl.load(scale_ptrs, mask=token_mask, other=0.0)
    return x * tl.max(s, 0)  # the tile's largest scale for every row: not each token's own
    # (an earlier wrong answer here read the next slot's scale, which for a tile's last slot lies past the scales
    # tensor: the interpreter then read whatever memory followed - a flaky test)


@triton.jit
def multiplies_in_int8(ptrs, scale_ptrs, mask, token_mask):
    x = tl.load(ptrs, mask=mask, other=0)
    s = tl.load(scale_ptrs, mask=token_mask, other=0.0)
    return (x * s.to(tl.int8)[:, None]).to(tl.float32)  # the scale truncated to an int8: 0


@triton.jit
def unmasked_scale_load(ptrs, scale_ptrs, mask, token_mask):
    x = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
    s = tl.load(scale_ptrs)  # every lane's scale, tokens past the context included
    return x * s[:, None]


@triton.jit
def scales_without_a_row_axis(ptrs, scale_ptrs, mask, token_mask):
    x = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
    s = tl.load(scale_ptrs, mask=token_mask, other=0.0)
    return x * s  # [TILE, HEAD_DIM_P] x [TILE]: the interpreter's raw error is about sizes the learner never sees


@triton.jit
def multiplies_in_fp16(ptrs, scale_ptrs, mask, token_mask):
    x = tl.load(ptrs, mask=mask, other=0).to(tl.float16)
    s = tl.load(scale_ptrs, mask=token_mask, other=0.0).to(tl.float16)
    return (x * s[:, None]).to(tl.float32)  # right at scales near 0.05; a scale of 1e-7 is subnormal in fp16


@triton.jit
def not_implemented_loader(ptrs, scale_ptrs, mask, token_mask):
    raise NotImplementedError("exercise 10-3")


def test_the_loader_reference_passes():
    assert C.check_load_int8_tile(load_int8_tile, quiet=True).passed


@pytest.mark.parametrize(
    "wrong, needles",
    [
        (forgets_the_scale, ["relative error", "every scale were 1"]),
        (one_scale_for_the_tile, ["relative error", "THAT token"]),
        (multiplies_in_int8, ["relative error"]),
        (unmasked_scale_load, ["holds NaN", "which mask guards each of your two loads"]),
        # issue 35: a shape error asked about, and a scale far from the typical one
        (scales_without_a_row_axis, ["do not combine", "what shape must the scales have"]),
        (multiplies_in_fp16, ["relative error", "scales up to 1e-07", "in which dtype is your product"]),
    ],
)
def test_wrong_loaders_fail_without_crashing(wrong, needles):
    assert rejected(C.check_load_int8_tile(wrong, quiet=True), *needles)


def test_a_plain_python_function_is_refused_with_the_decorator_named():
    assert rejected(C.check_load_int8_tile(lambda *a: None, quiet=True), "@triton.jit")


def test_an_unsolved_loader_is_reported_as_unsolved():
    r = C.check_load_int8_tile(not_implemented_loader, quiet=True)
    assert not r.passed and not r.implemented and r.use is load_int8_tile


@triton.jit
def nan_tile(ptrs, scale_ptrs, mask, token_mask):
    x = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
    s = tl.load(scale_ptrs, mask=token_mask, other=0.0)
    return x * s[:, None] * float("nan")


def test_a_loader_that_returns_nan_is_rejected():
    assert rejected(C.check_load_int8_tile(nan_tile, quiet=True), "holds NaN")


@triton.jit
def unmasked_value_load(ptrs, scale_ptrs, mask, token_mask):
    x = tl.load(ptrs).to(tl.float32)  # every lane's values: harmless to the output (their scale is 0), not to memory
    s = tl.load(scale_ptrs, mask=token_mask, other=0.0)
    return x * s[:, None]


def test_an_unmasked_value_load_is_caught_by_what_it_reads():
    """Issue 43: the output cannot show it (int8 values are finite, their masked scale 0); the interpreter's load
    count does."""
    assert rejected(C.check_load_int8_tile(unmasked_value_load, quiet=True), "K values the mask turns off")


def test_the_loader_cases_are_well_conditioned():
    """Found on the first GPU run: with scales of 1e3 and unit queries the attention scores reached about 1e6, and on an
    H200 the compiled kernel with the course's own loader then differed from the fp64 reference by 1.4e-2 (its fp32
    rounding, amplified by the softmax: the check failed the reference answer); with the queries scaled by 1/scale, by
    1.6e-5. Every case's scores stay within the range a model's have."""
    from lesson_utils.cache import quantize as Q
    from lesson_utils.checks.int8_loader import _loader_cases

    for c in _loader_cases("cpu"):
        k = Q.dequantize_kv(c["k"], c["ks"].double(), torch.float64)  # [blocks, block_size, kv_heads, d]
        group = c["q"].shape[1] // k.shape[2]
        for s, (table, n) in enumerate(zip(c["tables"].tolist(), c["lens"].tolist())):
            keys = torch.stack([k[table[t // k.shape[1]], t % k.shape[1]] for t in range(n)])  # [n, kv_heads, d]
            q = c["q"][s].double().view(k.shape[2], group, -1)
            scores = torch.einsum("hgd,nhd->hgn", q, keys) / q.shape[-1] ** 0.5
            assert scores.abs().max().item() < 1e3, (c["shown"], scores.abs().max().item())


@triton.jit
def masks_values_by_token_only(ptrs, scale_ptrs, mask, token_mask):
    x = tl.load(ptrs, mask=token_mask[:, None], other=0).to(tl.float32)  # columns past head_dim read anyway
    s = tl.load(scale_ptrs, mask=token_mask, other=0.0)
    return x * s[:, None]


def test_a_value_load_masked_by_token_only_is_caught_by_what_it_reads():
    assert rejected(C.check_load_int8_tile(masks_values_by_token_only, quiet=True), "K values the mask turns off")
