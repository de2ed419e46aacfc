"""Lesson 12's RoPE exercise: the reference passes; the plausible wrong rotations are rejected with a hint that names
the mistake without giving the code (interleaved pairs, the wrong sign, the position off by one, a dtype change, an
in-place rotation, no rotation at all)."""

from __future__ import annotations

import torch
from helpers import rejected

from lesson_utils.checks.lesson12 import _interleaved, check_rotate_at
from lesson_utils.model.rope import rotate_at, rotate_half


def _angles(x, position, inv_freq):
    f = position * inv_freq.float()
    a = torch.cat((f, f))
    return a.cos().to(x.dtype), a.sin().to(x.dtype)


def backwards(x, position, inv_freq):
    cos, sin = _angles(x, position, inv_freq)
    return x * cos - rotate_half(x) * sin


def off_by_one(x, position, inv_freq):
    return rotate_at(x, position + 1, inv_freq)


def in_fp32(x, position, inv_freq):
    return rotate_at(x.float(), position, inv_freq)


def in_place(x, position, inv_freq):
    cos, sin = _angles(x, position, inv_freq)
    r = rotate_half(x)
    x.mul_(cos).add_(r * sin)
    return x


def untouched(x, position, inv_freq):
    return x.clone()


def unsolved(x, position, inv_freq):
    raise NotImplementedError("Exercise 'rotate_at' is not solved yet")


def test_the_reference_passes():
    assert check_rotate_at(rotate_at).passed


def test_wrong_rotations_are_rejected_with_their_hint(not_strict):
    assert rejected(check_rotate_at(_interleaved), "interleaved", "i + head_dim / 2")
    assert rejected(check_rotate_at(backwards), "wrong way")
    assert rejected(check_rotate_at(off_by_one), "that is the rotation for position 1")
    assert rejected(check_rotate_at(in_fp32), "keep x's dtype")
    assert rejected(check_rotate_at(in_place), "return a new tensor")  # position 0 first: x returned itself
    assert rejected(check_rotate_at(untouched), "position * inv_freq")


def test_an_unsolved_exercise_says_so(not_strict):
    r = check_rotate_at(unsolved)
    assert not r.passed and not r.implemented


def test_the_reference_is_what_the_model_applies():
    """rotate_at at position p equals the forward's apply_rope for a token at p (the model's own path)."""
    from lesson_utils.model.rope import Rope, apply_rope

    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    x = torch.randn(5, 3, 64)
    cos, sin = Rope(inv).cos_sin(torch.arange(5), x.dtype)
    rotated = apply_rope(x, cos, sin)
    for p in range(5):
        assert torch.equal(rotate_at(x[p], p, inv), rotated[p])


def _mistake(**kw):
    from lesson_utils.checks.lesson12 import _variant

    return lambda x, position, inv_freq: _variant(x, position, inv_freq, **kw)


def test_the_common_slips_get_their_own_hint(not_strict):
    assert rejected(check_rotate_at(_mistake(angle_dtype=torch.float64)), "compute the angles in fp32")
    assert rejected(check_rotate_at(_mistake(interleave=True)), "the head_dim/2 angles twice in a row")
    assert rejected(check_rotate_at(_mistake(sign=-1.0)), "which half gets the minus sign")
    assert rejected(check_rotate_at(_mistake(first_half=True)), "the second half of x turns too")
    alias = lambda x, position, inv_freq: x if position == 0 else rotate_at(x, position, inv_freq)  # noqa: E731
    assert rejected(check_rotate_at(alias), "return a new tensor")


# ---- wrong answers the earlier cases let through (issue 43) -------------------------------------------------------
def cached_by_position():
    cache = {}

    def rotate(x, position, inv_freq):
        if position not in cache:  # the angles of the first call at this position, whatever inv_freq says now
            freqs = position * inv_freq.float()
            cache[position] = torch.cat((freqs, freqs))
        angles = cache[position]
        return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)

    return rotate


def position_in_the_keys_dtype(x, position, inv_freq):
    freqs = torch.tensor(position, dtype=x.dtype).float() * inv_freq.float()
    angles = torch.cat((freqs, freqs))
    return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)


def half_unless_fp32(x, position, inv_freq):
    freqs = position * inv_freq.float()
    angles = torch.cat((freqs, freqs))
    cos, sin = angles.cos(), angles.sin()
    if x.dtype != torch.float32:  # fp16 in mind: a bf16 key times fp16 cos comes back fp32
        cos, sin = cos.half(), sin.half()
    return x * cos + rotate_half(x) * sin


def angles_in_inv_freqs_dtype(x, position, inv_freq):
    freqs = position * inv_freq
    angles = torch.cat((freqs, freqs))
    return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)


def test_wrong_answers_the_old_cases_let_through_are_rejected(not_strict):
    assert rejected(check_rotate_at(cached_by_position()), "keyed by both")
    assert rejected(check_rotate_at(position_in_the_keys_dtype), "multiply the position in fp32")
    assert rejected(check_rotate_at(half_unless_fp32), "keep x's dtype (torch.bfloat16)")
    assert rejected(check_rotate_at(angles_in_inv_freqs_dtype), "turn it into fp32 before multiplying")


def cached_without_the_dtype():
    cache = {}

    def rotate(x, position, inv_freq):
        key = (position, tuple(inv_freq.tolist()))
        if key not in cache:  # cos and sin in the first caller's dtype, reused for every later key
            freqs = position * inv_freq.float()
            angles = torch.cat((freqs, freqs))
            cache[key] = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        cos, sin = cache[key]
        return x * cos + rotate_half(x) * sin

    return rotate


def test_a_cache_that_forgets_the_dtype_is_rejected(not_strict):
    assert rejected(check_rotate_at(cached_without_the_dtype()), "keep x's dtype")


def test_a_wrong_tensor_shows_where_it_differs(not_strict):
    """Two tensors of one shape and dtype print alike; the message says where they first differ and by how much."""
    r = check_rotate_at(backwards)
    assert "first difference at index" in r.message and "values differ; largest |difference|" in r.message


# ---- exercise 12-2: requests running in one KV budget ------------------------------------------------------------
import pytest  # noqa: E402

from lesson_utils.checks.lesson12 import check_predict_running  # noqa: E402
from lesson_utils.lab import kv_math  # noqa: E402


def _admit(blocks, held, block_size, *, ceil=True, stop=True):
    running = 0
    for t in held:
        need = -(-t // block_size) if ceil else t / block_size
        if need > blocks:
            if stop:
                break
            continue
        blocks -= need
        running += 1
    return running


def query_heads(cfg, budget, nbytes, bs, held):
    per_token = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * kv_math.head_dim_of(cfg) * nbytes
    return _admit(budget // (bs * per_token), held, bs)


def tokens_not_blocks(cfg, budget, nbytes, bs, held):
    return _admit(budget / (bs * kv_math.kv_bytes_per_token(cfg, nbytes)), held, bs, ceil=False)


def skips_ahead(cfg, budget, nbytes, bs, held):
    return _admit(budget // (bs * kv_math.kv_bytes_per_token(cfg, nbytes)), held, bs, stop=False)


def k_only(cfg, budget, nbytes, bs, held):
    return _admit(budget // (bs * kv_math.kv_bytes_per_token(cfg, nbytes) // 2), held, bs)


def hidden_over_heads(cfg, budget, nbytes, bs, held):
    dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_math.kv_heads_of(cfg) * dim * nbytes
    return _admit(budget // (bs * per_token), held, bs)


def partial_block_counts(cfg, budget, nbytes, bs, held):
    return _admit(-(-budget // (bs * kv_math.kv_bytes_per_token(cfg, nbytes))), held, bs)


def a_float(cfg, budget, nbytes, bs, held):
    return float(kv_math.predict_running(cfg, budget, nbytes, bs, held))


def eats_the_line(cfg, budget, nbytes, bs, held):
    out = kv_math.predict_running(cfg, budget, nbytes, bs, held)
    held.clear()
    return out


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (query_heads, "how many heads does this model store K and V"),
        (tokens_not_blocks, "take 17 slots"),
        (skips_ahead, "first come, first served"),
        (k_only, "more than fit"),
        (hidden_over_heads, "expected"),
        (partial_block_counts, "only part of the bytes"),
        (a_float, "an int"),
        (eats_the_line, "changed its input `tokens_held`"),
    ],
)
def test_wrong_running_predictions_are_rejected(wrong, needle):
    assert rejected(check_predict_running(wrong), needle)


def test_the_running_prediction_passes_the_reference():
    assert check_predict_running(kv_math.predict_running).passed
