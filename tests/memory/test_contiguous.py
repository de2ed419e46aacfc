"""Lesson 01's arena: first-fit allocator invariants (hypothesis), the cache against the dense
reference, and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import step_beside_dense
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lesson_utils.cache import contiguous as contiguous_cache
from lesson_utils.cache.dense import DenseKVCache
from lesson_utils.cache.seam import StepBatch
from lesson_utils.core.types import NeverFits, OutOfSlots
from lesson_utils.memory import contiguous
from lesson_utils.memory.contiguous import FirstFitAllocator


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / free sequences; the allocator's invariants hold after every step."""

    def __init__(self):
        super().__init__()
        self.n = 64
        self.a = FirstFitAllocator(self.n)
        self.owned: dict[int, int] = {}

    @rule(size=st.integers(1, 24))
    def allocate(self, size):
        if self.a.can_allocate(size):
            start = self.a.allocate(size)
            assert all(start + size <= s or s + l <= start for s, l in self.owned.items())
            self.owned[start] = size
        else:
            with pytest.raises(OutOfSlots, match="largest hole"):
                self.a.allocate(size)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data):
        start = data.draw(st.sampled_from(sorted(self.owned)))
        self.a.free(start)
        del self.owned[start]
        with pytest.raises(ValueError, match="already freed, or never allocated"):
            self.a.free(start)

    @invariant()
    def holes_are_sorted_merged_and_account_for_every_slot(self):
        holes = self.a.holes
        assert all(length > 0 for _, length in holes)
        assert all(s1 + l1 < s2 for (s1, l1), (s2, _) in zip(holes, holes[1:]))  # sorted, never touching
        assert self.a.free_slots + sum(self.owned.values()) == self.n
        taken = [False] * self.n
        for s, l in list(self.owned.items()) + holes:
            for i in range(s, s + l):
                assert not taken[i], f"slot {i} is both free and allocated, or allocated twice"
                taken[i] = True
        assert all(taken)


TestAllocator = AllocatorMachine.TestCase


def test_first_fit_picks_first_not_best():
    assert contiguous.first_fit([(0, 40), (50, 30)], 30) == (0, [(30, 10), (50, 30)])
    assert contiguous.first_fit([(0, 10)], 10) == (0, [])
    assert contiguous.first_fit([(0, 10)], 11) is None


def test_release_merges_both_sides_and_refuses_double_free():
    assert contiguous.release([(0, 10), (15, 5)], 10, 5) == [(0, 20)]
    with pytest.raises(ValueError, match="overlap"):
        contiguous.release([(0, 10)], 5, 2)


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_reservation_sizes(bad):
    with pytest.raises(ValueError, match="positive number of slots"):
        FirstFitAllocator(8).allocate(bad)


def test_reservation_larger_than_arena_never_fits():
    with pytest.raises(NeverFits, match="can never fit"):
        FirstFitAllocator(8).allocate(9)


def test_external_fragmentation_refuses_although_enough_is_free():
    a = FirstFitAllocator(256)
    starts = [a.allocate(n) for n in (64, 48, 64, 48, 32)]
    a.free(starts[1]), a.free(starts[3])
    assert a.free_slots == 96 and a.largest_hole == 48
    with pytest.raises(OutOfSlots, match="96 slots are free in total"):
        a.allocate(64)


def test_contiguous_cache_matches_dense_reference():
    """Same K/V in, same attention out, step after step, for sequences of different lengths."""
    gen = torch.Generator().manual_seed(0)
    layers, heads, dim = 2, 3, 8
    ours = contiguous_cache.ContiguousKVCache(layers, 128, heads, dim, default_reservation=32)
    ref = DenseKVCache(layers)
    lens = {0: 0, 1: 0, 2: 0}
    for _ in range(5):
        step_beside_dense(ours, ref, gen, lens, heads, dim, prompt_most=5, then_most=5)
    for sid in lens:
        ours.free(sid)
    assert ours.usage()["free"] == 128
    with pytest.raises(ValueError, match="already freed, or never admitted"):
        ours.free(0)


def test_sequence_outgrowing_its_reservation_is_an_error_not_corruption():
    cache = contiguous_cache.ContiguousKVCache(1, 16, 1, 4, default_reservation=4)
    with pytest.raises(NeverFits, match="reserved only 4"):
        cache.prepare(StepBatch.build([0], [[1, 2, 3, 4, 5]], [0]))


def test_slot_mapping_is_region_start_plus_position():
    b = StepBatch.build([0, 1], [[5, 6], [7]], [0, 9])
    assert contiguous_cache.slot_mapping(b, [100, 0]).tolist() == [100, 101, 9]
