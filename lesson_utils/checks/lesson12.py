"""Checkers for lesson 12 (the same engine on a modern model): rotating a key by its position (RoPE)."""

from __future__ import annotations

import torch

from lesson_utils.model.rope import rotate_at

from .core import CheckResult, check_function

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
