"""Checkers for lesson 10 (an int8 KV cache): quantize on write, the bytes of each layout, the kernels' int8 tile
loader. Each compares the learner's code with the course's reference on randomized and edge cases and, on a
mismatch, recomputes the usual wrong ways to name the likely mistake as a question."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lesson_utils.cache import quantize as Q
from lesson_utils.lab import kv_math

from .core import CheckResult, case_device, check_function, expect_error, failed, not_implemented, passed

# ---- exercise 1: quantize_kv -------------------------------------------------------------------------------


def _quantize_cases(device) -> list[tuple]:
    g = torch.Generator().manual_seed(10)
    cases = [
        (torch.tensor([[[0.5, 1.5, 2.5, -0.5, -1.5, 127.0]]], device=device),),  # exact halves, scale 1
        (torch.zeros(2, 3, 8, device=device),),  # all zero: scale 0, no division by zero
        (torch.tensor([[[-4.0, 1.0, 2.0, 3.0]]], device=device),),  # the largest value is negative
    ]
    for shape, dtype, mult in (
        ((5, 2, 16), torch.float32, 1.0),
        ((7, 3, 24), torch.float32, 1e4),  # a head dim that is no power of two, large values
        ((4, 12, 64), torch.float16, 3.0),  # OPT-125m's heads, fp16 values
        ((3, 2, 5, 8), torch.float32, 1.0),  # [..., head_dim]: any leading axes
        ((1, 1, 80), torch.float32, 1e-3),  # one token, tiny values
    ):
        x = (torch.randn(shape, generator=g) * mult).to(dtype).to(device)
        if len(shape) == 3 and shape[0] > 2:
            x[1, 0] = 0  # one all-zero head among others
            x[2] *= 50  # one outlier token: a per-tensor scale would flatten the others
        cases.append((x,))
    # magnitudes near zero: one token around 1e-30, one near float32's smallest normal (1.2e-38; its scale, 127x
    # smaller, is subnormal) and one of subnormal values - a quantizer that divides by `scale + eps`, or multiplies by
    # `1 / scale` (inf for a scale below 3e-39), is off by many levels here
    tiny = torch.randn(3, 2, 16, generator=g) * torch.tensor([1e-30, 1e-37, 1e-40])[:, None, None]
    cases.append((tiny.to(device),))
    return cases


def _near_tie(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Where ``x / scale`` sits within 1e-3 of a half step: there either neighbour is a fair rounding."""
    y = x.float() / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    return ((y - torch.floor(y)) - 0.5).abs() < 1e-3


def _quantized_equal(expected, got) -> bool:
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return False
    (q, s), (gq, gs) = expected, got
    if gq.dtype != torch.int8 or gs.dtype != torch.float32 or gq.shape != q.shape or gs.shape != s.shape:
        return False
    if gq.device != q.device or gs.device != s.device:
        return False
    if not torch.allclose(gs, s, rtol=1e-5, atol=0):
        return False
    off = (gq.int() - q.int()).abs()
    return bool((off == 0).all()) or bool(((off <= 1) & _near_tie(_quantize_input[0], s) | (off == 0)).all())


# the case being compared: check_function calls the reference on a copy of each case just before the learner's
# code, and equal() sees only the two outputs - the tie tolerance needs the input too
_quantize_input: list = [None]


def _quantize_reference(x):
    _quantize_input[0] = x
    return Q.quantize_kv(x)


def _explain_quantize(case, expected, got) -> str:
    (x,), (_, s) = case, expected
    if not (isinstance(got, tuple) and len(got) == 2):
        return "return a tuple (q, scale): q int8 like x, scale float32 with one entry per vector (x.shape[:-1])"
    gq, gs = got
    if not isinstance(gq, torch.Tensor) or gq.dtype != torch.int8:
        return "q holds int8 values: what dtype does your q have?"
    if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32:
        return "the scale is float32 whatever the input's dtype: did you keep x's dtype for it?"
    if gs.shape != s.shape:
        if tuple(gs.shape) == tuple(s.shape) + (1,):
            return f"one scale per vector, shape {tuple(s.shape)}: drop the kept last axis (keepdim) before returning"
        if gs.dim() == 0 or gs.numel() == 1:
            return "one scale per token and head, not one for the whole tensor: which axis does your max run over?"
        return f"one scale per vector: shape {tuple(s.shape)} (did you keep the last axis with keepdim?)"
    if not bool(torch.isfinite(gs).all()):
        bad = ~torch.isfinite(gs)
        kind = "NaN" if bool(torch.isnan(gs[bad]).any()) else "-inf" if bool((gs[bad] < 0).any()) else "inf"
        if bool((s[bad] == 0).all()):
            return f"an all-zero vector got scale {kind}: its scale is 0 - what do you divide by then?"
        return (
            f"your scale is {kind} for a vector of finite values (the expected scale there is "
            f"{float(s[bad][0]):.3g}): which operation of yours can turn a finite max|x| / 127 into {kind}?"
        )
    tiny = x.float().abs().amax(dim=-1) < 1e-20
    if bool(tiny.any()) and not torch.equal(gq[tiny], expected[0][tiny]):
        return (
            "your values are off for vectors of tiny magnitude (largest |x| from 1e-30 down to subnormal 1e-40, "
            "so scales below float32's smallest normal, 1.2e-38): what does 1 / scale give in float32 there, and "
            "what does adding a small epsilon to a scale of 1e-40 do to x / scale?"
        )
    if torch.allclose(gs, torch.full_like(gs, float(s.max())), rtol=1e-5) and not torch.allclose(s, gs):
        return "all your scales are the same: one scale for the whole tensor lets one large token flatten the rest"
    if int(gq.min()) == -128 or any(torch.allclose(gs, s * 127 / k, rtol=1e-5) for k in (127.5, 128, 255)):
        return (
            "a symmetric int8 scale is max|x| / 127 and never uses -128 (so -q always fits): which divisor and "
            "which clamp did you use?"
        )
    zero = s == 0
    if bool(zero.any()) and torch.equal(gs[~zero], s[~zero]) and not torch.equal(gs[zero], s[zero]):
        return "an all-zero vector has scale 0 (nothing to scale), and its q is all 0: what does yours return?"
    xf = x.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))[..., None]
    if torch.equal(gq, torch.trunc(xf / safe).clamp(-127, 127).to(torch.int8)):
        return "your values are truncated towards zero (.to(torch.int8) or int()): which operation rounds to nearest?"
    if torch.equal(gq, torch.floor(xf / safe).clamp(-127, 127).to(torch.int8)):
        return "floor rounds negative values away from their nearest integer: which operation rounds to nearest?"
    return ""


def check_quantize_kv(fn, quiet: bool = False) -> CheckResult:
    """Exercise 10-1: ``quantize_kv(x) -> (q int8, scale float32)``, per token and head, symmetric, rounded, +-127;
    zero vectors give scale 0; tiny and subnormal magnitudes exact; NaN, inf, -inf refused with a ValueError; the
    input left unchanged."""
    name = "quantize_kv"
    device = case_device()
    result = check_function(
        name, fn, _quantize_reference, _quantize_cases(device), equal=_quantized_equal, explain=_explain_quantize,
        quiet=True, arg_names=("x",),
    )  # fmt: skip
    if not result.passed:
        return _reissue(result, quiet, Q.quantize_kv)
    bad = torch.ones(3, 2, 4, device=device)
    bad[2, 1, 3] = float("nan")
    refused = expect_error(
        name, fn, (bad,), ValueError, "a vector holding NaN cannot be stored in int8 (it would poison the scale)",
        Q.quantize_kv, quiet,
    )  # fmt: skip
    if refused is not None:
        return refused
    if not (
        bool(torch.isnan(bad[2, 1, 3])) and int(torch.isnan(bad).sum()) == 1 and bool((bad.nan_to_num(1.0) == 1).all())
    ):
        return failed(
            name, "a refused call must leave its input as it was: after refusing the NaN, your x had changed",
            Q.quantize_kv, quiet,
        )  # fmt: skip
    for value in ("inf", "-inf"):
        inf = torch.ones(2, 1, 4, device=device)
        inf[0, 0, 0] = float(value)
        what = f"a vector holding {value} cannot be stored in int8"
        refused = expect_error(name, fn, (inf,), ValueError, what, Q.quantize_kv, quiet)
        if refused is not None:
            return refused
    return passed(name, result.message.split(": ", 1)[-1].split("\n")[0] + " NaN, inf and -inf are refused.", fn, quiet)


def _reissue(result: CheckResult, quiet: bool, reference=None) -> CheckResult:
    """Show a quiet result's message and apply strict mode, as a checker's own result would."""
    reference = result.use if reference is None else reference
    if not result.implemented:
        return not_implemented(result.name, reference, quiet)
    detail = result.message.split(": ", 1)[-1].rsplit("\n(The rest", 1)[0]
    return failed(result.name, detail, reference, quiet)


# ---- exercise 2: bytes per token by layout -----------------------------------------------------------------


def _config(layers, heads, hidden, kv_heads=None, head_dim=None):
    return SimpleNamespace(
        num_hidden_layers=layers, num_attention_heads=heads, hidden_size=hidden, num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )  # fmt: skip


def _layout_cases() -> list[tuple]:
    configs = [
        _config(12, 12, 768),  # OPT-125m
        _config(32, 32, 4096, kv_heads=8),  # grouped-query (Llama-3-8B's shape)
        _config(2, 4, 320),  # head dim 80: inline 84 -> 96
        _config(24, 16, 2048, head_dim=128),  # an explicit head_dim: inline 132 -> 144
        _config(3, 5, 60),  # head dim 12: inline 16, already aligned
        _config(28, 16, 1024, kv_heads=8, head_dim=128),  # Qwen3-0.6B's: head_dim 128, not hidden / heads = 64
    ]
    return [(c, layout) for c in configs for layout in kv_math.KV_LAYOUTS]


def _explain_layout(case, expected, got) -> str:
    config, layout = case
    if not isinstance(got, int) or isinstance(got, bool):
        return f"return a whole number of bytes (an int), got {type(got).__name__}"
    layers, kvh, d = config.num_hidden_layers, kv_math.kv_heads_of(config), kv_math.head_dim_of(config)
    plain = _config(layers, config.num_attention_heads, config.hidden_size, config.num_key_value_heads)
    if config.head_dim and got == kv_math.int8_kv_bytes_per_token(plain, layout) != expected:
        return (
            f"this config names its head size (head_dim={config.head_dim}) and it is not hidden / heads "
            f"({config.hidden_size} / {config.num_attention_heads}): where does your head size come from?"
        )
    if got * 2 == expected:
        return "a token stores a key AND a value in every layer: did you count both?"
    if layout != "fp16" and got == 2 * layers * kvh * d:
        return "where are the scales? Each head's vector carries one float32 scale (4 bytes)"
    if layout != "fp16" and got == 2 * layers * (kvh * d + 4):
        return "one scale per token AND head: how many vectors does a token have in a layer?"
    if layout == "int8, inline scales" and got == 2 * layers * kvh * (d + 4):
        return "inline, each head's bytes start on a 16-byte boundary: round d + 4 up to a multiple of 16"
    if layout == "int8, separate scales" and got != expected and got % 16 == 0:
        return "a separate scale tensor needs no padding: only the inline layout rounds each head up"
    if (
        got == 2 * layers * d * (2 if layout == "fp16" else 1) * config.num_attention_heads
        and kvh != config.num_attention_heads
    ):
        return "grouped-query models store K/V for their KV heads only (kv_math.kv_heads_of)"
    return ""


def check_kv_bytes_per_token(fn, quiet: bool = False) -> CheckResult:
    """Exercise 10-2: bytes per token of K and V across all layers in each layout; an unknown layout is refused."""
    name = "kv_bytes_per_token"
    result = check_function(
        name, fn, kv_math.int8_kv_bytes_per_token, _layout_cases(), explain=_explain_layout, quiet=True,
        show_input=lambda c: f"config(layers={c[0].num_hidden_layers}, heads={c[0].num_attention_heads}, "
        f"hidden={c[0].hidden_size}, kv_heads={c[0].num_key_value_heads}, head_dim={c[0].head_dim}), {c[1]!r}",
        arg_names=("config", "layout"),
    )  # fmt: skip
    if not result.passed:
        return _reissue(result, quiet)
    refused = expect_error(
        name, fn, (_config(12, 12, 768), "int4"), ValueError, "a layout the function does not know ('int4')",
        kv_math.int8_kv_bytes_per_token, quiet,
    )  # fmt: skip
    if refused is not None:
        return refused
    return passed(
        name, f"all {len(_layout_cases())} cases match (six geometries x three layouts); 'int4' refused.", fn, quiet
    )


from .int8_loader import check_load_int8_tile  # noqa: E402, F401 - exercise 10-3, checked in its own module
