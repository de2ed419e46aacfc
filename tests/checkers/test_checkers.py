"""Every checker: the reference passes, plausible wrong implementations are rejected with a message
that names the difference, an unsolved exercise is reported politely, and strict mode raises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import merge_unchecked, rejected

from lesson_utils.cache import attention, paged
from lesson_utils.cache import contiguous as contiguous_cache
from lesson_utils.checks import ExerciseFailed, lesson00, lesson01, lesson02
from lesson_utils.lab import decoding, kv_math
from lesson_utils.memory import contiguous
from lesson_utils.memory import reservation as R

pytestmark = pytest.mark.usefixtures("not_strict")


def unsolved(*args):
    raise NotImplementedError("Exercise 'x' is not solved yet")


def test_unsolved_is_reported_and_reference_used(capsys):
    result = lesson00.check_kv_bytes_per_token(unsolved)
    assert not result.passed and not result.implemented
    assert result.use is kv_math.kv_bytes_per_token
    assert "not implemented yet" in capsys.readouterr().out


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("COURSE_STRICT", "1")
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        lesson01.check_first_fit(unsolved)
    with pytest.raises(ExerciseFailed, match="expected"):
        lesson02.check_external_fragmentation(lambda holes: 0.5)
    assert lesson01.check_first_fit(contiguous.first_fit).passed  # a right answer does not raise


def test_learner_exception_is_feedback_not_crash():
    def broken(config, dtype_bytes):
        return config.no_such_field

    assert rejected(lesson00.check_kv_bytes_per_token(broken), "AttributeError", "no_such_field")


# ---- lesson 00 ------------------------------------------------------------------------------------


def test_kv_bytes_per_token_checker():
    assert lesson00.check_kv_bytes_per_token(kv_math.kv_bytes_per_token).passed

    def no_value(cfg, b):  # forgets that V is stored too
        return kv_math.kv_bytes_per_token(cfg, b) // 2

    def ignores_gqa(cfg, b):
        return 2 * cfg.num_hidden_layers * cfg.hidden_size * b

    def elements(cfg, b):
        return kv_math.kv_bytes_per_token(cfg, 1)

    assert rejected(
        lesson00.check_kv_bytes_per_token(no_value), "expected: 73728", "got:      36864", "both the key and the value"
    )
    assert rejected(lesson00.check_kv_bytes_per_token(elements), "how many bytes does one element take")
    assert rejected(lesson00.check_kv_bytes_per_token(ignores_gqa), "num_key_value_heads")


def test_opt125m_is_36_kib():
    from transformers import OPTConfig

    assert kv_math.kv_bytes_per_token(OPTConfig(), 2) == 36 * 1024


@pytest.fixture(scope="module")
def tiny_weights():
    from lesson_utils.core.env import Profile
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

    loaded = load_model(profile=Profile(name="ci", device="cpu", device_name="test"))
    return OPTWeights.from_hf(loaded.model)


def test_decode_with_cache_checker(tiny_weights):
    w = tiny_weights
    assert lesson00.check_decode_with_cache(decoding.decode_with_cache, w).passed

    def refeeds_everything(step, prompt, n):
        seq, out = list(prompt), []
        for _ in range(n):
            out.append(int(torch.argmax(step(seq))))
            seq.append(out[-1])
        return out

    def one_step_too_many(step, prompt, n):
        logits, out = step(prompt), []
        for _ in range(n):
            out.append(int(torch.argmax(logits)))
            logits = step([out[-1]])
        return out

    def one_token_short(step, prompt, n):
        return (
            decoding.decode_with_cache(step, prompt, n)[:-1] if n > 1 else decoding.decode_with_cache(step, prompt, n)
        )

    assert rejected(lesson00.check_decode_with_cache(refeeds_everything, w), "expected")
    assert rejected(lesson00.check_decode_with_cache(one_step_too_many, w), "never needs to go through the model")
    assert rejected(lesson00.check_decode_with_cache(one_token_short, w), "asked for 5 new tokens, got 4")


# ---- lesson 01 ------------------------------------------------------------------------------------


def test_first_fit_checker():
    assert lesson01.check_first_fit(contiguous.first_fit).passed

    def best_fit(holes, n):
        fits = [i for i, (_, l) in enumerate(holes) if l >= n]
        if not fits:
            return None
        i = min(fits, key=lambda j: holes[j][1])
        s, l = holes[i]
        return s, holes[:i] + ([(s + n, l - n)] if l > n else []) + holes[i + 1 :]

    def strict_greater(holes, n):  # off by one: an exact fit is refused
        for i, (s, l) in enumerate(holes):
            if l > n:
                return s, holes[:i] + [(s + n, l - n)] + holes[i + 1 :]
        return None

    def keeps_empty_hole(holes, n):
        for i, (s, l) in enumerate(holes):
            if l >= n:
                return s, holes[:i] + [(s + n, l - n)] + holes[i + 1 :]
        return None

    assert rejected(lesson01.check_first_fit(best_fit), "*first* fit")
    assert rejected(lesson01.check_first_fit(strict_greater), "exactly n slots here")
    assert rejected(lesson01.check_first_fit(keeps_empty_hole), "length 0")


def test_release_checker():
    assert lesson01.check_release(contiguous.release).passed

    def no_merge(holes, start, length):
        return sorted(holes + [(start, length)])

    no_double_free_check = merge_unchecked

    def unsorted(holes, start, length):
        return contiguous.release(holes, start, length)[::-1]

    assert rejected(lesson01.check_release(no_merge), "do any of them touch")
    assert rejected(lesson01.check_release(no_double_free_check), "double free", "expected a ValueError")
    assert rejected(lesson01.check_release(unsorted), "what order does the hole list keep")


def test_slot_mapping_checker():
    assert lesson01.check_slot_mapping(contiguous_cache.slot_mapping).passed

    def no_region_start(batch, starts):
        return batch.positions.clone()

    def index_in_step(batch, starts):
        return torch.cat([torch.arange(n) + s for n, s in zip(batch.query_lens, starts)])

    assert rejected(lesson01.check_slot_mapping(no_region_start), "where does each sequence's reservation begin")
    assert rejected(lesson01.check_slot_mapping(index_in_step), "start of its sequence")


# ---- lesson 02 ------------------------------------------------------------------------------------


def test_classify_slots_checker():
    assert lesson02.check_classify_slots(R.classify_slots).passed

    def swapped(total, allocs):  # reserved and internal the wrong way round
        kinds = R.classify_slots(total, allocs)
        out = kinds.copy()
        out[kinds == R.RESERVED], out[kinds == R.INTERNAL] = R.INTERNAL, R.RESERVED
        return out

    def off_by_one(total, allocs):
        return R.classify_slots(total, [(s, r, max(0, u - 1), f) for s, r, u, f in allocs])

    assert rejected(lesson02.check_classify_slots(swapped), "expected reserved, got internal")
    assert rejected(lesson02.check_classify_slots(off_by_one), "expected token states, got reserved")


def test_external_fragmentation_checker():
    assert lesson02.check_external_fragmentation(R.external_fragmentation).passed

    def inverted(holes):
        return 1.0 - R.external_fragmentation(holes) if holes else 0.0

    def nan_when_empty(holes):
        return R.external_fragmentation(holes) if holes else float("nan")

    def uses_count(holes):  # share of holes that are not the biggest: a different measure
        return 0.0 if not holes else 1 - 1 / len(holes)

    assert rejected(lesson02.check_external_fragmentation(inverted), "upside down")
    assert rejected(lesson02.check_external_fragmentation(nan_when_empty), "return 0.0")
    assert rejected(lesson02.check_external_fragmentation(uses_count), "expected")


def test_classify_matches_manager_breakdown():
    """The exercise's classification and the simulator's counts agree on a live manager."""
    from lesson_utils.core.types import Sequence
    from lesson_utils.lab import workloads
    from lesson_utils.serving.scheduler import FCFSScheduler

    m = R.ContiguousReservationManager(4096, "pow2", max_seq_len=512)
    s = FCFSScheduler(m)
    for r in workloads.alpaca_like(20, seed=3):
        s.add(Sequence(r))
    s.schedule(0)  # admits what fits, and reserves every admitted sequence's next token
    for seq in s.running:
        seq.num_generated += 1
    kinds = m.view.slot_kinds()
    counts = np.bincount(kinds, minlength=4)
    br = m.view.breakdown()
    assert counts.tolist() == [br["token states"], br["reserved"], br["internal fragmentation"], br["free"]]


# ---- lesson 03 ------------------------------------------------------------------------------------

from lesson_utils.checks import lesson03  # noqa: E402
from lesson_utils.memory import block_table as bt  # noqa: E402
from lesson_utils.memory.block_allocator import BlockAllocator  # noqa: E402


def test_block_allocator_checker():
    assert lesson03.check_block_allocator(BlockAllocator).passed

    class Unsolved(BlockAllocator):
        def allocate(self):
            raise NotImplementedError

    class NoOutOfBlocks(BlockAllocator):
        def allocate(self):
            b = self._free_queue.popleft()  # IndexError when empty
            self._is_free[b] = 0
            return b

    class NoDoubleFreeCheck(BlockAllocator):
        def free(self, block_id):
            self._check_id(block_id)
            self._is_free[block_id] = 1
            self._free_queue.append(block_id)

    class NoRangeCheck(BlockAllocator):
        def free(self, block_id):
            if self._is_free[block_id]:
                raise ValueError("already free")
            self._is_free[block_id] = 1
            self._free_queue.append(block_id)

    class HandsOutHeldBlocks(BlockAllocator):
        def allocate(self):
            if not self._free_queue:
                from lesson_utils.core.types import OutOfBlocks

                raise OutOfBlocks("empty")
            return self._free_queue[0]  # forgets to remove it

    assert not lesson03.check_block_allocator(Unsolved).implemented
    assert rejected(lesson03.check_block_allocator(NoOutOfBlocks), "expected OutOfBlocks", "IndexError")
    assert rejected(lesson03.check_block_allocator(NoDoubleFreeCheck), "twice", "expected ValueError")
    assert rejected(lesson03.check_block_allocator(NoRangeCheck), "free(-1)", "expected ValueError")
    assert rejected(lesson03.check_block_allocator(HandsOutHeldBlocks), "each once")


def test_grow_block_table_checker():
    assert lesson03.check_grow_block_table(bt.grow_block_table).passed

    def off_by_one(table, n, bs, allocate):
        if n % bs == 1 or bs == 1:
            table.append(allocate())

    def every_token(table, n, bs, allocate):
        table.append(allocate())

    def late(table, n, bs, allocate):
        if (n + 1) % bs == 0:
            table.append(allocate())

    assert rejected(lesson03.check_grow_block_table(off_by_one), "which token is the first to need a new block")
    assert rejected(lesson03.check_grow_block_table(every_token), "how many tokens does one block hold")
    assert rejected(lesson03.check_grow_block_table(late), "expected table")


def test_paged_slot_mapping_checker():
    assert lesson03.check_slot_mapping(paged.slot_mapping).passed

    def positions_only(batch, tables, bs):
        return batch.positions.clone()

    def logical_index(batch, tables, bs):  # uses the logical block number instead of the physical one
        return torch.tensor(
            [
                (p // bs) * bs + p % bs + 0 * len(t)
                for t, s, n in zip(tables, batch.starts, batch.query_lens)
                for p in batch.positions[s : s + n].tolist()
            ]
        )

    def forgets_block_size(batch, tables, bs):
        return torch.tensor(
            [
                t[p // bs] + p % bs
                for t, s, n in zip(tables, batch.starts, batch.query_lens)
                for p in batch.positions[s : s + n].tolist()
            ]
        )

    assert rejected(lesson03.check_slot_mapping(positions_only), "where does the block table come in")
    assert rejected(lesson03.check_slot_mapping(logical_index), "expected")
    assert rejected(lesson03.check_slot_mapping(forgets_block_size), "work out by hand")


def test_gather_kv_checker():
    assert lesson03.check_gather_kv(attention.gather_kv).passed

    def no_truncation(cache, table, ctx):
        return cache[torch.tensor(table)].reshape(-1, cache.shape[2], cache.shape[3])

    def sorted_blocks(cache, table, ctx):
        return attention.gather_kv(cache, sorted(table), ctx)

    def ignores_table(cache, table, ctx):
        return cache[: len(table)].reshape(-1, cache.shape[2], cache.shape[3])[:ctx]

    assert rejected(lesson03.check_gather_kv(no_truncation), "more tokens than context_len")
    assert rejected(lesson03.check_gather_kv(sorted_blocks), "in what order do the blocks")
    assert rejected(lesson03.check_gather_kv(ignores_table), "in what order do the blocks")


def test_first_difference_names_the_first_index_and_the_largest_gap():
    import torch

    from lesson_utils.checks.core import first_difference

    want = torch.zeros(2, 3)
    got = want.clone()
    got[1, 2], got[0, 1] = 5.0, 0.5
    line = first_difference(want, got)
    assert "index (0, 1): expected 0, got 0.5" in line and "2 of 6 values differ; largest |difference| 5" in line
    assert first_difference(want, want.clone()) == ""  # equal: nothing to say
    nan = torch.tensor([float("nan"), 1.0])
    assert first_difference(nan, nan.clone()) == ""  # NaN where NaN is expected is not a difference
    assert first_difference(want, torch.zeros(3, 2)) == "" and first_difference([1], [2]) == ""  # shapes / types
