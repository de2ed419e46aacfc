"""Lesson 04's checkers reject plausible wrong kernels (wrong block index, missing mask, softmax without
the running max, no rescaling) with a message naming the case, and accept the reference."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl
from helpers import rejected

from lesson_utils.checks import lesson04
from lesson_utils.kernels import paged_attention as K

pytestmark = pytest.mark.usefixtures("not_strict")


@triton.jit
def logical_as_physical(block_table_row_ptr, start, context_len, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = start + tl.arange(0, TILE)
    token_mask = token < context_len
    return token, token_mask  # forgets the block table


@triton.jit
def no_mask(block_table_row_ptr, start, context_len, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = start + tl.arange(0, TILE)
    token_mask = token >= 0
    block = tl.load(block_table_row_ptr + token // BLOCK_SIZE)
    return block * BLOCK_SIZE + token % BLOCK_SIZE, token_mask


@triton.jit
def unmasked_table_load(block_table_row_ptr, start, context_len, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The right mask returned, but the block ids loaded for every lane: lanes past the context read past the
    table's end (on a GPU, out of bounds when the row ends)."""
    token = start + tl.arange(0, TILE)
    token_mask = token < context_len
    block = tl.load(block_table_row_ptr + token // BLOCK_SIZE)
    return block * BLOCK_SIZE + token % BLOCK_SIZE, token_mask


@triton.jit
def float_block_index(block_table_row_ptr, start, context_len, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Block and offset from a float division: exact for some block sizes, not for 6 or 12."""
    token = start + tl.arange(0, TILE)
    token_mask = token < context_len
    q = token.to(tl.float32) / BLOCK_SIZE
    logical = q.to(tl.int32)
    offset = ((q - logical.to(tl.float32)) * BLOCK_SIZE).to(tl.int32)
    block = tl.load(block_table_row_ptr + logical, mask=token_mask, other=0)
    return block * BLOCK_SIZE + offset, token_mask


@triton.jit
def wrong_block_index(block_table_row_ptr, start, context_len, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = start + tl.arange(0, TILE)
    token_mask = token < context_len
    block = tl.load(block_table_row_ptr + token % BLOCK_SIZE, mask=token_mask, other=0)
    return block * BLOCK_SIZE + token % BLOCK_SIZE, token_mask


@triton.jit
def no_running_max(m_i, l_i, acc, scores, v):
    p = tl.exp(scores)
    return m_i, l_i + tl.sum(p, 0), acc + tl.sum(p[:, None] * v, 0)


@triton.jit
def no_rescale(m_i, l_i, acc, scores, v):
    m_new = tl.maximum(m_i, tl.max(scores, 0))
    p = tl.exp(scores - m_new)
    return m_new, l_i + tl.sum(p, 0), acc + tl.sum(p[:, None] * v, 0)


@triton.jit
def unsolved_update(m_i, l_i, acc, scores, v):
    raise NotImplementedError("Exercise 'online_softmax_update' is not solved yet")


def test_reference_blocks_pass():
    assert lesson04.check_block_slots(K.block_slots).passed
    assert lesson04.check_online_softmax_update(K.online_softmax_update).passed


def test_wrong_lookups_are_rejected():
    assert rejected(lesson04.check_block_slots(logical_as_physical), "probe kernel", "got slot")
    assert rejected(lesson04.check_block_slots(no_mask), "which tokens of the tile exist")
    assert rejected(lesson04.check_block_slots(wrong_block_index), "probe kernel")
    assert rejected(lesson04.check_block_slots(unmasked_table_load), "past its end", "lanes whose token does not exist")
    assert rejected(lesson04.check_block_slots(float_block_index), "which logical block and offset")


def test_wrong_softmax_updates_are_rejected():
    assert rejected(lesson04.check_online_softmax_update(no_running_max), "large scores", "inf/nan")
    assert rejected(lesson04.check_online_softmax_update(no_rescale), "many tiles", "rescale")


def test_unsolved_kernel_exercise_is_reported(capsys):
    result = lesson04.check_online_softmax_update(unsolved_update)
    assert not result.implemented and result.use is K.online_softmax_update
    assert "not implemented yet" in capsys.readouterr().out


@triton.jit
def wild_slots(block_table_row_ptr, start, context_len, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = start + tl.arange(0, TILE)
    token_mask = token < context_len
    block = tl.load(block_table_row_ptr + token, mask=token_mask, other=0)  # indexes the table by token
    return block * 1000003 + token, token_mask  # slots far outside any cache: a full kernel would read wild memory


@triton.jit
def unsolved_slots(block_table_row_ptr, start, context_len, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    raise NotImplementedError("Exercise 'block_slots' is not solved yet")


def test_a_lookup_that_would_read_outside_the_cache_is_caught_by_the_probe():
    """The probe runs the learner's lookup alone: the full kernel never gets slots that point outside the cache
    (under the interpreter such a read can kill the notebook's kernel process instead of giving feedback)."""
    assert rejected(lesson04.check_block_slots(wild_slots), "probe kernel", "expected")
    assert rejected(lesson04.check_block_slots(no_mask), "probe kernel", "mask")


def test_an_unsolved_lookup_is_reported_as_unsolved():
    result = lesson04.check_block_slots(unsolved_slots)
    assert not result.passed and not result.implemented
