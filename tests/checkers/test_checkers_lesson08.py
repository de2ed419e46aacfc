"""Lesson 08's checkers: the references pass; plausible wrong answers are rejected with the rule they break."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import rejected

from lesson_utils.cache import attention
from lesson_utils.checks import lesson08
from lesson_utils.kernels.unified_attention import causal_mask
from lesson_utils.serving.token_budget import Chunk, budgeted_schedule

pytestmark = pytest.mark.usefixtures("not_strict")


def test_the_references_pass():
    assert lesson08.check_budgeted_schedule(budgeted_schedule).passed
    assert lesson08.check_chunk_attention(attention.chunk_attention).passed
    assert lesson08.check_causal_mask(causal_mask).passed


def test_unsolved_exercises_say_so():
    def stub(*args):
        raise NotImplementedError("not solved yet")

    for check in (lesson08.check_budgeted_schedule, lesson08.check_chunk_attention):
        result = check(stub)
        assert not result.passed and not result.implemented


# ---- 08-1 ---------------------------------------------------------------------------------------------------


def prompts_first(running, waiting, budget, admit):
    out, left = [], budget
    for s in [r for r in running if r.length - r.num_computed > 1] + [
        r for r in running if r.length - r.num_computed == 1
    ]:
        if left:
            n = min(left, s.length - s.num_computed)
            out.append(Chunk(s.seq_id, s.num_computed, s.num_computed + n))
            left -= n
    return out


def no_chunking(running, waiting, budget, admit):  # whole prompts, whatever the budget
    out = [Chunk(s.seq_id, s.num_computed, s.length) for s in running]
    for s in waiting:
        c = admit(s.seq_id)
        if c is None:
            break
        out.append(Chunk(s.seq_id, c, s.length))
    return out


def overtakes(running, waiting, budget, admit):
    out = budgeted_schedule(running, [], budget, admit)
    left = budget - sum(c.end - c.start for c in out)
    for s in waiting:
        if left:
            c = admit(s.seq_id)
            if c is None:
                continue  # tries the next one
            n = min(left, s.length - c)
            out.append(Chunk(s.seq_id, c, c + n))
            left -= n
    return out


def ignores_the_cache(running, waiting, budget, admit):
    out = budgeted_schedule(running, [], budget, admit)
    left = budget - sum(c.end - c.start for c in out)
    for s in waiting:
        if not left or admit(s.seq_id) is None:
            break
        n = min(left, s.length)
        out.append(Chunk(s.seq_id, 0, n))
        left -= n
    return out


def tuples(running, waiting, budget, admit):
    return [(c.seq_id, c.start, c.end) for c in budgeted_schedule(running, waiting, budget, admit)]


def pops(running, waiting, budget, admit):
    out = budgeted_schedule(running, waiting, budget, admit)
    waiting.clear()
    return out


def never_admits(running, waiting, budget, admit):
    return budgeted_schedule(running, [], budget, admit)


@pytest.mark.parametrize(
    "fn, needle",
    [
        (prompts_first, "(a decode) runs first"),
        (no_chunking, "over the budget"),
        (overtakes, "no overtaking"),
        (ignores_the_cache, "what admit() returned"),
        (tuples, "return a list of Chunk"),
        (pops, "changed the running or waiting list"),
        (never_admits, "admit() was asked for [], expected"),
    ],
)
def test_wrong_schedules_are_rejected(fn, needle):
    assert rejected(lesson08.check_budgeted_schedule(fn), needle)


# ---- 08-2 ---------------------------------------------------------------------------------------------------


def _gathered(k_cache, v_cache, table, ctx):
    return attention.gather_kv(k_cache, table, ctx), attention.gather_kv(v_cache, table, ctx)


def no_causal_rule(q, k_cache, v_cache, table, ctx, scale):
    k, v = _gathered(k_cache, v_cache, table, ctx)
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)


def queries_at_the_start(q, k_cache, v_cache, table, ctx, scale):
    k, v = _gathered(k_cache, v_cache, table, ctx)
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    mask = torch.arange(ctx)[None, :].to(q.device) > torch.arange(q.shape[0])[:, None].to(q.device)
    return torch.einsum("hqk,khd->qhd", s.masked_fill(mask, -math.inf).softmax(-1), v).to(q.dtype)


def _masked(q, k, v, scale, visible, interleave=True):
    group = q.shape[1] // k.shape[1]
    if interleave:
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    else:
        k, v = k.float().repeat(1, group, 1), v.float().repeat(1, group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    kpos = torch.arange(k.shape[0], device=q.device)[None, :]
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~visible(kpos), -math.inf).softmax(-1), v).to(q.dtype)


def _qpos(q, ctx):
    return torch.arange(q.shape[0], device=q.device)[:, None] + ctx - q.shape[0]


def not_its_own_key(q, k_cache, v_cache, table, ctx, scale):  # strict <: a whole prompt's first row sees nothing
    k, v = _gathered(k_cache, v_cache, table, ctx)
    return _masked(q, k, v, scale, lambda kp: kp < _qpos(q, ctx))


def one_key_too_many(q, k_cache, v_cache, table, ctx, scale):
    k, v = _gathered(k_cache, v_cache, table, ctx)
    return _masked(q, k, v, scale, lambda kp: kp <= _qpos(q, ctx) + 1)


def whole_blocks(q, k_cache, v_cache, table, ctx, scale):  # every slot of every block, as if all held tokens
    slots = len(table) * k_cache.shape[1]
    k, v = _gathered(k_cache, v_cache, table, slots)
    return _masked(q, k, v, scale, lambda kp: kp <= _qpos(q, slots))


def heads_repeated(q, k_cache, v_cache, table, ctx, scale):  # repeat, not repeat_interleave: head h reads h % kv
    k, v = _gathered(k_cache, v_cache, table, ctx)
    return _masked(q, k, v, scale, lambda kp: kp <= _qpos(q, ctx), interleave=False)


def softmax_in_fp16(q, k_cache, v_cache, table, ctx, scale):  # scores in q's dtype, and the scale applied twice
    return attention.chunk_attention(q, k_cache, v_cache, table, ctx, scale * scale)


def blocks_in_order(q, k_cache, v_cache, table, ctx, scale):  # ignores the table
    return attention.chunk_attention(q, k_cache, v_cache, list(range(len(table))), ctx, scale)


def no_scale(q, k_cache, v_cache, table, ctx, scale):
    return attention.chunk_attention(q, k_cache, v_cache, table, ctx, 1.0)


def float32_out(q, k_cache, v_cache, table, ctx, scale):
    return attention.chunk_attention(q, k_cache, v_cache, table, ctx, scale).float()


def writes_the_cache(q, k_cache, v_cache, table, ctx, scale):
    out = attention.chunk_attention(q, k_cache, v_cache, table, ctx, scale)
    k_cache.zero_()
    return out


@pytest.mark.parametrize(
    "fn, needle",
    [
        (no_causal_rule, "which keys lie in a query's future"),
        (queries_at_the_start, "start of the sequence"),
        (not_its_own_key, "its own"),
        (one_key_too_many, "one key too many"),
        (whole_blocks, "run past context_len"),
        (heads_repeated, "wrong K/V heads"),
        (softmax_in_fp16, "expected"),
        (blocks_in_order, "expected"),
        (no_scale, "expected"),
        (float32_out, "dtype"),
        (writes_the_cache, "changed its input `k_cache`"),
    ],
)
def test_wrong_chunk_attention_is_rejected(fn, needle):
    assert rejected(lesson08.check_chunk_attention(fn), needle)


# ---- 08-3 ---------------------------------------------------------------------------------------------------


@triton.jit
def sees_everything(query_pos, key_pos, context_len):
    return (key_pos[None, :] < context_len) & (query_pos[:, None] >= 0)


@triton.jit
def not_itself(query_pos, key_pos, context_len):
    return (key_pos[None, :] < query_pos[:, None]) & (key_pos[None, :] < context_len)


@triton.jit
def wrong_shape(query_pos, key_pos, context_len):
    return key_pos < tl.max(query_pos, 0) + context_len * 0


@triton.jit
def future_only(query_pos, key_pos, context_len):
    return (key_pos[None, :] >= query_pos[:, None]) & (key_pos[None, :] < context_len)


@triton.jit
def transposed(query_pos, key_pos, context_len):
    return (key_pos[:, None] <= query_pos[None, :]) & (key_pos[:, None] < context_len)


@triton.jit
def chunk_relative(query_pos, key_pos, context_len):  # positions counted from the chunk's first query
    return key_pos[None, :] <= query_pos[:, None] - tl.min(query_pos, 0)


@pytest.mark.parametrize(
    "fn, needle",
    [
        (sees_everything, "which keys may that query use"),
        (not_itself, "which keys may that query use"),
        (future_only, "case"),
        (transposed, "case"),
        (chunk_relative, "which keys may that query use"),
        (wrong_shape, "case"),
    ],
)
def test_wrong_masks_are_rejected(fn, needle):
    assert rejected(lesson08.check_causal_mask(fn), needle)
