"""Lesson 08's checkers: the references pass; plausible wrong answers are rejected with the rule they break."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import rejected

from lesson_utils.cache import attention
from lesson_utils.checks import lesson08
from lesson_utils.serving.token_budget import Chunk, budgeted_schedule

pytestmark = pytest.mark.usefixtures("not_strict")


def test_the_references_pass():
    assert lesson08.check_budgeted_schedule(budgeted_schedule).passed
    assert lesson08.check_chunk_attention(attention.chunk_attention).passed


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


def scores_in_fp16(q, k_cache, v_cache, table, ctx, scale):  # right everywhere a q.k stays below 65504
    n = q.shape[0]
    k = attention.gather_kv(k_cache, table, ctx)
    v = attention.gather_kv(v_cache, table, ctx)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # in q's dtype: no upcast
    query_pos = torch.arange(n)[:, None] + ctx - n
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > query_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.float().softmax(dim=-1), v.float()).to(q.dtype)


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
        (scores_in_fp16, "fp16's largest value"),
        (blocks_in_order, "expected"),
        (no_scale, "expected"),
        (float32_out, "dtype"),
        (writes_the_cache, "changed its input `k_cache`"),
    ],
)
def test_wrong_chunk_attention_is_rejected(fn, needle):
    assert rejected(lesson08.check_chunk_attention(fn), needle)


# ---- 08-3 ---------------------------------------------------------------------------------------------------


def _starts(chunks):
    out = [0]
    for c in chunks:
        out.append(out[-1] + c.end - c.start)
    return out


def _meta(starts, lens, mq, device, dtype=torch.int32):
    return torch.tensor(starts, dtype=dtype, device=device), torch.tensor(lens, dtype=dtype, device=device), mq


def lens_as_context(chunks, device):  # the chunk's length where the sequence's length belongs
    return _meta(
        _starts(chunks), [c.end - c.start for c in chunks], max((c.end - c.start for c in chunks), default=0), device
    )


def starts_as_context(chunks, device):  # leaves out this step's own tokens
    return _meta(_starts(chunks), [c.start for c in chunks], max((c.end - c.start for c in chunks), default=0), device)


def no_leading_zero(chunks, device):
    return _meta(
        _starts(chunks)[1:], [c.end for c in chunks], max((c.end - c.start for c in chunks), default=0), device
    )


def int64(chunks, device):
    return _meta(
        _starts(chunks), [c.end for c in chunks], max((c.end - c.start for c in chunks), default=0), device, torch.long
    )


def total_as_max(chunks, device):
    return _meta(_starts(chunks), [c.end for c in chunks], sum(c.end - c.start for c in chunks), device)


def tensor_max(chunks, device):
    m = max((c.end - c.start for c in chunks), default=0)
    return _meta(_starts(chunks), [c.end for c in chunks], torch.tensor(m), device)


def positions_as_starts(chunks, device):  # query_start from the chunks' positions in their sequences
    return _meta(
        [c.start for c in chunks] + [chunks[-1].end if chunks else 0],
        [c.end for c in chunks],
        max((c.end - c.start for c in chunks), default=0),
        device,
    )


def lists(chunks, device):
    s, c, m = lens_as_context(chunks, device)
    return _starts(chunks), [c.end for c in chunks], max((c.end - c.start for c in chunks), default=0)


def test_the_step_metadata_reference_passes_and_matches_the_engines_own():
    from lesson_utils.cache.paged_metadata import step_metadata

    assert lesson08.check_step_metadata(step_metadata).passed


@pytest.mark.parametrize(
    "fn, needle",
    [
        (lens_as_context, "its cached tokens included"),
        (starts_as_context, "leave out this step's own tokens"),
        (no_leading_zero, "query starts"),
        (int64, "32-bit ints"),
        (total_as_max, "the longest chunk"),
        (tensor_max, "a Python int"),
        (positions_as_starts, "flat batch"),
        (lists, "tensors the kernel reads"),
        (
            lambda chunks, device: _meta(
                _starts(chunks), [c.end for c in chunks], max((c.end - c.start for c in chunks), default=1), device
            ),
            "longest of no chunks",
        ),
    ],
)
def test_wrong_step_metadata_is_rejected(fn, needle):
    assert rejected(lesson08.check_step_metadata(fn), needle)


def test_the_unified_cache_serves_with_a_learners_metadata(tiny):
    from lesson_utils.cache.paged_metadata import step_metadata
    from lesson_utils.cache.triton_paged import UnifiedTritonKVCache
    from lesson_utils.memory.sharing import SharingBlockManager
    from lesson_utils.serving.engine import Engine
    from lesson_utils.serving.token_budget import ChunkedPrefill

    _, w = tiny
    calls = []

    def spy(chunks, device):
        calls.append(list(chunks))
        return step_metadata(chunks, device)

    def serve(fn):
        cache = UnifiedTritonKVCache.for_model(
            w, manager=SharingBlockManager(16, 4, max_seq_len=w.max_positions), metadata_fn=fn
        )
        return Engine(w, cache, chunked_prefill=ChunkedPrefill(6)).generate([[1, 5, 6, 7, 8, 9, 10, 11], [1, 5, 6]], 2)

    assert serve(spy) == serve(None) and calls  # the learner's metadata is what the kernel reads
    assert any(c.start > 0 and c.end - c.start > 1 for step in calls for c in step)  # a chunk after cached tokens
    assert rejected_engine_metadata(serve)


def rejected_engine_metadata(serve):
    """A wrong context_lens changes what the kernel computes (so the hook is really used)."""
    try:
        return serve(lens_as_context) != serve(None)
    except Exception:  # noqa: BLE001 - the kernel may refuse the wrong lengths outright
        return True


def test_step_metadata_may_come_back_as_a_list():
    from lesson_utils.cache.paged_metadata import step_metadata

    assert lesson08.check_step_metadata(lambda chunks, device: list(step_metadata(chunks, device))).passed


def column_of_pairs(chunks, device):
    """The right values, as a column of a 2-D tensor: the kernel would read the pairs' first column too."""
    from lesson_utils.cache.paged_metadata import step_metadata

    qs, cl, mq = step_metadata(chunks, device)
    pairs = torch.stack([torch.full_like(cl, 99), cl], dim=1)
    return qs, pairs[:, 1], mq


def test_metadata_with_the_right_values_in_other_memory_is_rejected(not_strict):
    """Issue 43: the checker compared values only; a strided view passed, and the kernel then read other lengths."""
    assert rejected(lesson08.check_step_metadata(column_of_pairs), "strided view", "Build it as a tensor of its own")


def test_the_kernels_refuse_strided_metadata():
    from lesson_utils.kernels.paged_attention import paged_attention_decode
    from lesson_utils.kernels.unified_attention import unified_attention

    k = torch.randn(3, 4, 1, 8)
    q = torch.randn(2, 1, 8)
    tables = torch.tensor([[1, 0], [2, 0]], dtype=torch.int32)
    lens = torch.tensor([[9, 3], [9, 2]], dtype=torch.int32)[:, 1]
    with pytest.raises(ValueError, match="context_lens is a strided view"):
        paged_attention_decode(q, k, k, tables, lens)
    starts = torch.tensor([[0, 0], [9, 1], [9, 2]], dtype=torch.int32)[:, 1]
    with pytest.raises(ValueError, match="query_start is a strided view"):
        unified_attention(q, k, k, tables, starts, lens.contiguous(), 1)
