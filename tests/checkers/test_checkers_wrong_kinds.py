"""Wrong answers of every kind the grading-loop review found getting through (or crashing) the checkers.

Each test feeds one plausible wrong implementation to a checker and expects "try again" with a message that
names the property that failed - never "passed", never an exception out of the checker. Kinds: the type of
what is returned, in place vs returned, inputs that must not change, refused operations that must change
nothing, missing edge cases, side effects on shared state, lesson 07's step beyond its outputs, and checker
crashes on strange return values.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import merge_unchecked, rejected

from lesson_utils.cache import contiguous as contiguous_cache
from lesson_utils.cache import paged
from lesson_utils.checks import lesson00, lesson01, lesson03, lesson05, lesson06
from lesson_utils.lab import decoding, kv_math
from lesson_utils.memory import block_table as bt
from lesson_utils.memory import contiguous, sharing, swap
from lesson_utils.memory.block_allocator import BlockAllocator
from lesson_utils.memory.block_table import BlockTable
from lesson_utils.serving import scheduler as S

pytestmark = pytest.mark.usefixtures("not_strict")


@pytest.fixture(scope="module")
def w():
    from lesson_utils.core.env import Profile
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

    return OPTWeights.from_hf(load_model(profile=Profile(name="ci", device="cpu", device_name="test")).model)


# ---- types -----------------------------------------------------------------------------------------


def test_a_float_slot_mapping_is_rejected_for_its_dtype():
    def float_slots(batch, starts):
        return contiguous_cache.slot_mapping(batch, starts).float()

    def float_paged(batch, tables, block_size):
        return paged.slot_mapping(batch, tables, block_size).to(torch.float64)

    assert rejected(lesson01.check_slot_mapping(float_slots), "expected dtype torch.int64, got torch.float32")
    assert rejected(lesson03.check_slot_mapping(float_paged), "expected dtype torch.int64, got torch.float64")


def test_a_byte_count_that_is_a_float_is_rejected():
    assert rejected(
        lesson00.check_kv_bytes_per_token(lambda cfg, b: float(kv_math.kv_bytes_per_token(cfg, b))), "expected an int"
    )


def test_token_ids_as_tensors_are_rejected_without_a_crash(w):
    def tensor_tokens(step, prompt, n):
        return [torch.tensor(t) for t in decoding.decode_with_cache(step, prompt, n)]

    assert rejected(lesson00.check_decode_with_cache(tensor_tokens, w), "list of ints")


# ---- in place, and inputs that must not change -----------------------------------------------------------


def test_a_block_table_grown_into_a_new_list_is_rejected():
    def returns_new(table, n, block_size, allocate):
        return table + [allocate()] if n % block_size == 0 else list(table)

    assert rejected(lesson03.check_grow_block_table(returns_new), "in place")


def test_a_first_fit_that_edits_the_callers_holes_is_rejected():
    def edits_holes(holes, n):
        for i, (start, length) in enumerate(holes):
            if length >= n:
                if length > n:
                    holes[i] = (start + n, length - n)
                else:
                    del holes[i]
                return start, holes
        return None

    assert rejected(lesson01.check_first_fit(edits_holes), "changed its input `holes`")


# ---- refused operations change nothing --------------------------------------------------------------


def test_a_double_free_that_requeues_before_raising_is_rejected():
    class RequeuesFirst(BlockAllocator):
        def free(self, block_id):
            self._check_id(block_id)
            self._free_queue.append(block_id)  # the damage is done before the check
            if self._is_free[block_id]:
                raise ValueError("already free")
            self._is_free[block_id] = 1

    assert rejected(lesson03.check_block_allocator(RequeuesFirst), "change nothing")


def test_a_release_that_edits_the_holes_before_refusing_is_rejected():
    def edits_then_refuses(holes, start, length):
        holes.append((start, length))
        holes.sort()
        for (s1, l1), (s2, _) in zip(holes, holes[1:]):
            if s1 + l1 > s2:
                raise ValueError("overlap")
        holes.remove((start, length))
        return contiguous.release(holes, start, length)

    assert rejected(lesson01.check_release(edits_then_refuses), "leave everything as it was")


# ---- edge cases -------------------------------------------------------------------------------------


def test_a_negative_block_id_is_refused_while_every_block_is_held():
    class WrapsAround(BlockAllocator):
        def free(self, block_id):
            if block_id >= self.num_blocks:
                raise ValueError("out of range")
            if self._is_free[block_id]:  # -1 is the last block: held, so this "frees" it a second time
                raise ValueError("already free")
            self._is_free[block_id] = 1
            self._free_queue.append(block_id)

    assert rejected(lesson03.check_block_allocator(WrapsAround), "free(-1) while every block of 4 is held")


def test_an_explicit_head_dim_is_used():
    def hidden_over_heads(cfg, b):
        cfg = SimpleNamespace(**{k: v for k, v in vars(cfg).items() if k != "head_dim"})
        return kv_math.kv_bytes_per_token(cfg, b)

    assert rejected(lesson00.check_kv_bytes_per_token(hidden_over_heads), "explicit head_dim", "states its head_dim")


def test_decoding_that_stops_at_end_of_sequence_is_rejected(w):
    def stops_at_eos(step, prompt, n):
        logits, out = step(prompt), []
        while len(out) < n:
            out.append(int(torch.argmax(logits)))
            if out[-1] == w.eos_token_id or len(out) == n:
                break
            logits = step([out[-1]])
        return out

    assert rejected(lesson00.check_decode_with_cache(stops_at_eos, w), "end-of-sequence is just a token here")


def test_a_freed_range_running_into_a_hole_is_a_double_free():
    def checks_only_the_start(holes, start, length):
        for h_start, h_len in holes:
            if h_start <= start < h_start + h_len:
                raise ValueError("already free")
        return merge_unchecked(holes, start, length)

    assert rejected(
        lesson01.check_release(checks_only_the_start), "starts before the free hole [10, 15) and runs into it"
    )


def test_copy_on_write_at_a_block_that_is_not_the_last():
    def always_the_last(table, index, pool):
        return sharing.copy_on_write(table, len(table.blocks) - 1, pool)

    assert rejected(lesson05.check_copy_on_write(always_the_last), "index 0")


def test_a_table_holding_the_spare_block_for_the_next_token():
    def counts_from_the_end(batch, tables, block_size):  # assumes the table's last block holds the last token
        slots = []
        for table, q, c in zip(tables, batch.query_lens, batch.context_lens):
            last_logical = (c - 1) // block_size
            for p in range(c - q, c):
                slots.append(table[len(table) - 1 - (last_logical - p // block_size)] * block_size + p % block_size)
        return torch.tensor(slots, dtype=torch.long, device=batch.positions.device)

    assert rejected(lesson03.check_slot_mapping(counts_from_the_end), "expected")


def test_destination_block_zero_in_a_swap_mapping():
    def falsy_zero(src_blocks, allocate_dst, already):
        dst, copies = [], []
        for src in src_blocks:
            if not already.get(src):  # block 0 looks "not moved yet"
                already[src] = allocate_dst()
                copies.append((src, already[src]))
            dst.append(already[src])
        return dst, copies

    assert rejected(lesson06.check_swap_mapping(falsy_zero), "0 is a block id like any other")


def test_a_victim_tie_where_the_earlier_sequence_is_the_longer():
    assert rejected(
        lesson06.check_choose_victim(lambda running: max(running, key=lambda s: (s.admitted_step, s.len))),
        "the earlier one is the longer",
    )


def test_a_preemption_count_that_does_not_start_at_zero():
    def sets_one(seq):
        seq.num_computed = 0
        seq.preemptions = 1

    assert rejected(lesson06.check_reset_for_recompute(sets_one), "expected 3")


def test_a_fork_with_its_own_block_size():
    def sixteen(parent, pool):
        for b in parent.blocks:
            pool.incref(b)
        return BlockTable(16, list(parent.blocks), parent.num_tokens)

    assert rejected(lesson05.check_fork_table(sixteen), "block size")


# ---- side effects on shared state ------------------------------------------------------------------------


def test_a_prefix_lookup_that_takes_its_hits_is_rejected():
    def increfs(pool, tokens, block_size, hash_fn):
        hits = sharing.prefix_hits(pool, tokens, block_size, hash_fn)
        for b in hits:
            pool.incref(b)
        return hits

    assert rejected(lesson05.check_prefix_hits(increfs), "changed the pool")


def test_a_victim_choice_that_removes_the_victim_is_rejected():
    def pops(running):
        return running.pop(max(range(len(running)), key=lambda i: (running[i].admitted_step, i)))

    assert rejected(lesson06.check_choose_victim(pops), "the running list changed")


# ---- the checker never crashes -----------------------------------------------------------------------------


def test_strange_return_values_are_feedback_not_crashes():
    assert rejected(lesson05.check_prefix_hits(lambda pool, tokens, bs, h: None), "list of block ids")
    assert rejected(lesson05.check_prefix_hits(lambda pool, tokens, bs, h: [1.5]), "list of block ids")

    def raises_when_shared(table, index, pool):
        if pool.ref_count[table.blocks[index]] > 1:
            raise RuntimeError("not written yet")
        return None

    assert rejected(lesson05.check_copy_on_write(raises_when_shared), "raised RuntimeError")
    assert rejected(lesson01.check_first_fit(lambda holes, n: "nope"), "expected a tuple")
    assert rejected(lesson03.check_gather_kv(lambda cache, table, ctx: [1, 2]), "expected a torch.Tensor")
    assert rejected(
        lesson06.check_swap_mapping(lambda src, alloc, already: None), "return (destination_blocks, copies)"
    )


def test_every_reference_passes_the_stricter_checkers(w):
    assert lesson00.check_kv_bytes_per_token(kv_math.kv_bytes_per_token).passed
    assert lesson00.check_decode_with_cache(decoding.decode_with_cache, w).passed
    assert lesson01.check_first_fit(contiguous.first_fit).passed
    assert lesson01.check_release(contiguous.release).passed
    assert lesson03.check_block_allocator(BlockAllocator).passed
    assert lesson03.check_grow_block_table(bt.grow_block_table).passed
    assert lesson05.check_fork_table(sharing.fork_table).passed
    assert lesson05.check_copy_on_write(sharing.copy_on_write).passed
    assert lesson06.check_swap_mapping(swap.swap_mapping).passed
    assert lesson06.check_choose_victim(S.most_recently_admitted).passed
    assert lesson06.check_reset_for_recompute(S.reset_for_recompute).passed


def test_inputs_of_the_other_checkers_must_not_change(w):
    def appends_to_prompt(step, prompt, n):
        out = decoding.decode_with_cache(step, prompt, n)
        prompt.extend(out)
        return out

    def consumes_table(src_blocks, allocate_dst, already):
        out = swap.swap_mapping(list(src_blocks), allocate_dst, already)
        src_blocks.clear()
        return out

    assert rejected(lesson00.check_decode_with_cache(appends_to_prompt, w), "prompt", "leave it as it was")
    assert rejected(lesson06.check_swap_mapping(consumes_table), "must not change them")
