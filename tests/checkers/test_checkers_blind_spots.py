"""Wrong answers that used to slip past the checkers, one kind at a time (issue 20), per lesson:

* an input mutated in a way sorted inputs hide (sorting a list in place);
* an order the spec states that no case observed (the free queue's first in, first out; decodes in running order);
* arithmetic exact only for the sizes the cases used (bit tricks with power-of-two blocks; a softmax scale that
  is always 1/sqrt(d));
* a read past a sequence's blocks that padding with valid data hid;
* a step that skips part of the plan (copy-on-write copies) on a workload that never needed it.
(Lesson 09's kinds - conversions no case required, refusals checked only on the first item - are in
``test_checkers_lesson09.py``; lesson 07's prediction in ``test_checkers_lesson07.py``.)
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import rejected

from lesson_utils.cache import attention, paged
from lesson_utils.checks import lesson02, lesson03, lesson04, lesson08
from lesson_utils.core.types import OutOfBlocks
from lesson_utils.memory import reservation as R
from lesson_utils.memory.block_allocator import BlockAllocator
from lesson_utils.serving.token_budget import budgeted_schedule

pytestmark = pytest.mark.usefixtures("not_strict")


# ---- lesson 02: inputs that sorted cases hid ------------------------------------------------------------------
def classify_sorting_in_place(total, allocations):
    allocations.sort()
    return R.classify_slots(total, allocations)


def fragmentation_sorting_in_place(holes):
    holes.sort()
    return R.external_fragmentation(holes)


def test_lesson02_a_function_that_sorts_its_input_in_place_is_caught():
    assert rejected(lesson02.check_classify_slots(classify_sorting_in_place), "changed its input `allocations`")
    assert rejected(lesson02.check_external_fragmentation(fragmentation_sorting_in_place), "changed its input `holes`")


# ---- lesson 03: the free queue's order; block sizes that are not powers of two --------------------------------
class LastInFirstOut(BlockAllocator):
    def allocate(self):
        if not self._free_queue:
            raise OutOfBlocks("none left")
        block_id = self._free_queue.pop()  # the wrong end
        self._is_free[block_id] = 0
        return block_id


class FreesToTheFront(BlockAllocator):
    def free(self, block_id):
        super().free(block_id)
        self._free_queue.remove(block_id)
        self._free_queue.appendleft(block_id)  # a stack after all


def bitmask_slots(batch, block_tables, block_size):
    shift = block_size.bit_length() - 1  # log2, right only for powers of two
    slots = []
    for table, q, c in zip(block_tables, batch.query_lens, batch.context_lens):
        for p in range(c - q, c):
            slots.append(table[p >> shift] * block_size + (p & (block_size - 1)))
    return torch.tensor(slots, dtype=torch.long, device=batch.positions.device)


def test_lesson03_order_and_arithmetic():
    assert rejected(lesson03.check_block_allocator(LastInFirstOut), "taken from the left")
    assert rejected(lesson03.check_block_allocator(FreesToTheFront), "First in, first out")
    assert rejected(lesson03.check_slot_mapping(bitmask_slots), "block_size=3")
    assert lesson03.check_slot_mapping(paged.slot_mapping).passed


# ---- lesson 04: the block lookup with block sizes that are not powers of two -----------------------------------
@triton.jit
def bitmask_block_slots(block_table_row_ptr, start, context_len, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = start + tl.arange(0, TILE)
    token_mask = token < context_len
    block = tl.load(block_table_row_ptr + (token >> 3), mask=token_mask, other=0)  # exact for blocks of 8 only
    return block * BLOCK_SIZE + (token & (BLOCK_SIZE - 1)), token_mask


def test_lesson04_a_lookup_exact_only_for_powers_of_two_is_caught():
    assert rejected(lesson04.check_block_slots(bitmask_block_slots), "block size")


# ---- lesson 08: order, scale and the blocks past the context ----------------------------------------------------
def sorts_the_running(running, waiting, budget, admit):
    return budgeted_schedule(sorted(running, key=lambda s: s.seq_id), waiting, budget, admit)


def sorts_in_place(running, waiting, budget, admit):
    running.sort(key=lambda s: s.seq_id)
    return budgeted_schedule(running, waiting, budget, admit)


def fixed_scale(q, k_cache, v_cache, table, ctx, scale):
    return attention.chunk_attention(q, k_cache, v_cache, table, ctx, 1 / math.sqrt(q.shape[-1]))


def attends_past_the_context(q, k_cache, v_cache, table, ctx, scale):
    """Gathers every slot of every block in the table - the spare block past the context included."""
    k = attention.gather_kv(k_cache, table, len(table) * k_cache.shape[1]).float()
    v = attention.gather_kv(v_cache, table, len(table) * k_cache.shape[1]).float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    qpos = torch.arange(ctx - q.shape[0], ctx, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > qpos + k.shape[0], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def test_lesson08_order_scale_and_padding():
    assert rejected(lesson08.check_budgeted_schedule(sorts_the_running), "in running order")
    assert rejected(lesson08.check_budgeted_schedule(sorts_in_place), "changed the running or waiting list")
    assert rejected(lesson08.check_chunk_attention(fixed_scale), "expected")
    assert rejected(lesson08.check_chunk_attention(attends_past_the_context), "expected")
