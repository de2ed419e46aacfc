"""Checkers for lesson 12 (the same engine on a modern model): rotating a key by its position (RoPE), and predicting
how many requests a KV budget runs for a model, from its config."""

from __future__ import annotations

import random

import torch

from lesson_utils.lab import kv_math
from lesson_utils.model.rope import rotate_at

from .core import CheckResult, check_function
from .lesson00 import _config as _cfg  # one fake-config builder for both lessons

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def _interleaved(x, position, inv_freq):
    """The RoPE paper's (and Meta's original code's) pairing: channel 2i with 2i + 1."""
    angles = (position * inv_freq.float()).repeat_interleave(2).to(x.dtype)
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * angles.cos() + turned * angles.sin()


def _cases() -> list[tuple]:
    g = torch.Generator().manual_seed(12)
    cases = []
    for shape, position, theta, dtype in [
        ((64,), 0, 10000.0, torch.float32),  # position 0: no turn at all
        ((64,), 1, 10000.0, torch.float32),
        ((3, 64), 7, 100000.0, torch.float32),  # SmolLM2's theta, three KV heads at once
        ((2, 80), 300, 10000.0, torch.float32),
        ((4, 128), 2999, 1000000.0, torch.float32),  # Qwen3's head_dim and theta
        ((2, 5, 64), 42, 10000.0, torch.float32),  # five tokens at the same position
        ((3, 64), 123, 100000.0, torch.float16),  # fp16, as a GPU caches it
        ((3, 64), 7, 500000.0, torch.float32),  # position 7 again, with another model's frequencies
        ((3, 64), 7, 100000.0, torch.float16),  # and again with the first frequencies, for an fp16 key
        ((2, 64), 5001, 10000.0, torch.float16),  # a position fp16 cannot hold (5000 and 5004 are its neighbours)
        ((2, 64), 77, 10000.0, torch.bfloat16),  # bf16, as an Ampere GPU caches it
        ((2, 64), 1000, 10000.0, "fp16 inv_freq"),  # frequencies handed over in fp16 (a model converted with .half())
    ]:
        d = shape[-1]
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if dtype == "fp16 inv_freq":
            dtype, inv_freq = torch.float32, inv_freq.half()
        cases.append((torch.randn(shape, generator=g).to(dtype), position, inv_freq))
    return cases


def _variant(
    x,
    position,
    inv_freq,
    *,
    angle_dtype=torch.float32,
    interleave=False,
    sign=1.0,
    first_half=False,
    position_dtype=None,
):
    """A rotation with one of the plausible mistakes, to name it in a hint."""
    if position_dtype is not None:
        position = float(torch.tensor(position, dtype=position_dtype))
    freqs = position * inv_freq.to(angle_dtype)
    angles = freqs.repeat_interleave(2) if interleave else torch.cat((freqs, freqs))
    half = x.shape[-1] // 2
    turned = torch.cat((sign * -x[..., half:], x[..., :half]), dim=-1)
    out = x * angles.cos().to(x.dtype) + turned * angles.sin().to(x.dtype)
    if first_half:
        out = torch.cat((out[..., :half], x[..., half:]), dim=-1)
    return out


class _Aliased:
    """What the checker sees when a learner returns x itself (or a view of it) - never right, even when equal."""

    def __repr__(self) -> str:
        return "x itself (the same memory as the input)"


def _guarded(fn):
    def call(x, position, inv_freq):
        out = fn(x, position, inv_freq)
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            return _Aliased()
        return out

    return call


def _equal(expected, got) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    err = (got.float() - expected.float()).abs().max()
    return bool(err <= TOLERANCE[expected.dtype])  # NaN-safe: a NaN compares False


def _close(a, b) -> bool:
    return isinstance(b, torch.Tensor) and a.shape == b.shape and bool((a.float() - b.float()).abs().max() <= 1e-2)


def _hint(case, expected, got) -> str:
    x, position, inv_freq = case
    if isinstance(got, _Aliased):
        return "return a new tensor, not x itself (nor a view of it): the caller keeps using x"
    if not isinstance(got, torch.Tensor):
        return "return a tensor shaped like x"
    if got.shape != x.shape:
        return f"the rotation keeps x's shape {tuple(x.shape)}; got {tuple(got.shape)}"
    if got.dtype != x.dtype:
        return f"keep x's dtype ({x.dtype}): cast cos and sin to it, as the model does"
    if position != 0 and _close(x, got):
        return "x came back unturned: each pair (i, i + head_dim/2) turns by the angle position * inv_freq[i]"
    if _close(_interleaved(x, position, inv_freq), got):
        return (
            "you paired channel 2i with channel 2i + 1 - the interleaved convention of the RoPE paper and Meta's "
            "original code. Hugging Face's Llama and Qwen pair channel i with channel i + head_dim / 2 (their "
            "checkpoints are permuted to match): which channel is channel i's partner there?"
        )
    if _close(rotate_at(x, -position, inv_freq), got):
        return "your rotation turns the wrong way: check the sign in front of the rotated half"
    mistakes = [
        (
            dict(angle_dtype=torch.float64),
            "compute the angles in fp32, as the model does: at far positions float64 "
            "angles differ from the model's by more than rounding, and the cached keys are the model's",
        ),
        (
            dict(angle_dtype=x.dtype),
            "compute the angles in fp32 and cast only cos and sin to x's dtype: an fp16 "
            "angle at a far position is off by whole fractions of a turn",
        ),
        (
            dict(interleave=True),
            "the pairs are rotate-half pairs (i, i + head_dim/2), so the angle vector is the "
            "head_dim/2 angles twice in a row, not each angle repeated in place",
        ),
        (
            dict(position_dtype=x.dtype),
            f"the position itself went through {x.dtype}, which cannot hold every whole number this far out: "
            "multiply the position in fp32",
        ),
        (
            dict(angle_dtype=inv_freq.dtype),
            f"inv_freq came in {inv_freq.dtype}: turn it into fp32 before multiplying by the position",
        ),
        (dict(sign=-1.0), "the turned half is [-x2, x1]: which half gets the minus sign?"),
        (dict(first_half=True), "both channels of each pair change: the second half of x turns too"),
    ]
    for kw, hint in mistakes:
        if kw.get("angle_dtype") is torch.float32:  # for an fp32 key, "angles in x's dtype" is the right answer
            continue
        try:
            if _close(_variant(x, position, inv_freq, **kw), got):
                return hint
        except Exception:  # noqa: BLE001, S112 - a variant that cannot be built for this case names nothing
            continue
    for other in _cases():  # the angles of an earlier case at this position: a cache keyed by the position alone
        if other[1] == position and other[2].shape == inv_freq.shape and not torch.equal(other[2], inv_freq):
            if _close(rotate_at(x, position, other[2]), got):
                return (
                    "those are the angles of an earlier call at this position with other frequencies: the angles "
                    "depend on inv_freq as well as the position (anything reused must be keyed by both)"
                )
    for p in (position - 1, position + 1):
        if _close(rotate_at(x, p, inv_freq), got):
            return f"that is the rotation for position {p}: positions count from 0, and the key is at `position`"
    if position == 0:
        return "at position 0 every angle is 0: the key must come back unchanged"
    return "each pair (i, i + head_dim/2) turns by the angle position * inv_freq[i]: cos and sin of that angle"


def check_rotate_at(fn) -> CheckResult:
    """Exercise 12-1: ``rotate_at(x, position, inv_freq)`` - x turned as a token at ``position`` (rotate-half
    pairs, fp32 angles, x's dtype), returned as a new tensor with x unchanged."""
    result = check_function(
        "rotate_at",
        _guarded(fn),
        rotate_at,
        _cases(),
        equal=_equal,
        show_input=lambda c: f"x of shape {tuple(c[0].shape)} ({c[0].dtype}), position={c[1]}, inv_freq[:{len(c[2])}]",
        explain=_hint,
        arg_names=("x", "position", "inv_freq"),
    )
    if result.passed:
        result.use = fn
    return result


# ---- exercise 12-2: requests running in one KV budget ------------------------------------------------------------
OPT_LIKE = _cfg(12, 768, 12, name="OPT-125m")
SMOL_LIKE = _cfg(30, 576, 9, kv_heads=3, name="SmolLM2-135M")
QWEN3_LIKE = _cfg(28, 1024, 16, kv_heads=8, head_dim=128, name="Qwen3-0.6B")


def _running_cases() -> list[tuple]:
    mib = 2**20
    line = [40, 17, 33, 64, 5, 90, 16, 48, 31, 70, 12, 26]
    cases = [
        (OPT_LIKE, 4 * mib, 2, 16, list(line)),
        (SMOL_LIKE, 4 * mib, 2, 16, list(line)),  # the same bytes: more blocks for the GQA model
        (QWEN3_LIKE, 8 * mib, 2, 16, list(line)),  # head_dim stated, not hidden / heads
        (SMOL_LIKE, 4 * mib, 4, 16, list(line)),  # fp32: twice the bytes per token
        (OPT_LIKE, 3 * 16 * 36864 + 36863, 2, 16, [16, 16, 16, 1]),  # a budget one byte short of 4 blocks
        (SMOL_LIKE, 6 * 16 * 23040, 2, 16, [17, 17, 17]),  # 17 tokens take two blocks each
        (SMOL_LIKE, 5 * 16 * 23040, 2, 16, [16, 90, 16, 16]),  # the second does not fit: it stops the line
        (OPT_LIKE, 16 * 36864 - 1, 2, 16, [1]),  # less than one block: nothing runs
        (SMOL_LIKE, 100 * mib, 2, 16, [30, 40]),  # everything fits
        (SMOL_LIKE, 2 * mib, 2, 1, [3, 9, 4, 7] * 5),  # blocks of one token
        (SMOL_LIKE, 2 * mib, 2, 16, []),  # nobody waiting
    ]
    rng = random.Random(122)
    for _ in range(10):
        heads = rng.choice([4, 8, 16])
        kv = rng.choice([h for h in (1, 2, 4, heads) if heads % h == 0])
        cfg = _cfg(rng.randint(2, 32), heads * 64, heads, kv_heads=kv, head_dim=rng.choice([None, 32, 128]))
        held = [rng.randint(1, 200) for _ in range(rng.randint(3, 30))]
        cases.append((cfg, rng.randint(1, 64) * mib, rng.choice([2, 4]), rng.choice([8, 16, 32]), held))
    return cases


def _show_running(case) -> str:
    cfg, budget, nbytes, bs, held = case
    fields = ", ".join(f"{k}={v}" for k, v in vars(cfg).items())
    return f"config({fields}), budget_bytes={budget:,}, dtype_bytes={nbytes}, block_size={bs}, tokens_held={held}"


def _running_hint(case, expected, got) -> str:
    cfg, budget, nbytes, bs, held = case
    if not isinstance(got, int) or isinstance(got, bool):
        return "return a count of requests (an int)"
    if kv_math.kv_heads_of(cfg) != cfg.num_attention_heads:
        no_gqa = _cfg(
            cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, head_dim=kv_math.head_dim_of(cfg)
        )
        if got == kv_math.predict_running(no_gqa, budget, nbytes, bs, held) != expected:
            return "for how many heads does this model store K and V?"
    skipped = 0
    blocks_left = budget // (bs * kv_math.kv_bytes_per_token(cfg, nbytes))
    for t in held:
        need = -(-t // bs)
        if need <= blocks_left:
            blocks_left -= need
            skipped += 1
    if got == skipped != expected:
        return "the line is first come, first served: may a later request go ahead of one that does not fit?"
    if got > expected:
        return (
            "more than fit: does a request that holds 17 tokens in blocks of 16 take 17 slots, or more? And can the "
            "budget hold a block it has only part of the bytes for?"
        )
    return (
        "fewer than fit: how many bytes does one token take in this model (both K and V, every layer), and so a block?"
    )


def check_predict_running(fn) -> CheckResult:
    """Exercise 12-2: ``predict_running(config, budget_bytes, dtype_bytes, block_size, tokens_held)`` - the requests
    of a first-come line that run at once in the budget (whole blocks; the line stops at the first that does not fit);
    the inputs unchanged."""
    return check_function(
        "predict_running",
        fn,
        kv_math.predict_running,
        _running_cases(),
        show_input=_show_running,
        explain=_running_hint,
        arg_names=("config", "budget_bytes", "dtype_bytes", "block_size", "tokens_held"),
    )
