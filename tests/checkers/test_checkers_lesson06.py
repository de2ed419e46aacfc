"""Lesson 06's checkers reject plausible wrong implementations with a precise message."""

from __future__ import annotations

import pytest
from helpers import rejected

from lesson_utils.checks import lesson06
from lesson_utils.memory import swap
from lesson_utils.serving import scheduler as S

pytestmark = pytest.mark.usefixtures("not_strict")


def test_references_pass():
    assert lesson06.check_swap_mapping(swap.swap_mapping).passed
    assert lesson06.check_choose_victim(S.most_recently_admitted).passed
    assert lesson06.check_reset_for_recompute(S.reset_for_recompute).passed


def test_swap_mapping_mistakes():
    def copies_shared_twice(src, allocate, already):
        dst, copies = [], []
        for s in src:
            d = allocate()
            already[s] = d
            copies.append((s, d))
            dst.append(d)
        return dst, copies

    def forgets_copies(src, allocate, already):
        dst = []
        for s in src:
            if s not in already:
                already[s] = allocate()
            dst.append(already[s])
        return dst, []

    def reversed_copies(src, allocate, already):
        dst, copies = swap.swap_mapping(src, allocate, already)
        return dst, [(d, s) for s, d in copies]

    assert rejected(lesson06.check_swap_mapping(copies_shared_twice), "what does `already` tell you")
    assert rejected(lesson06.check_swap_mapping(forgets_copies), "which K/V would be lost")
    assert rejected(lesson06.check_swap_mapping(reversed_copies), "which block is copied from")


def test_choose_victim_mistakes():
    assert rejected(lesson06.check_choose_victim(lambda running: running[0]), "arrived in the batch most recently")
    assert rejected(lesson06.check_choose_victim(lambda running: running[-1]), "the newest is not last")
    assert rejected(lesson06.check_choose_victim(lambda running: max(running, key=lambda s: s.len)), "expected")
    assert rejected(
        lesson06.check_choose_victim(lambda running: max(running, key=lambda s: s.admitted_step)), "same step"
    )


def test_reset_mistakes():
    def clears_output(seq):
        seq.num_computed = 0
        seq.output_ids.clear()
        seq.num_generated = 0
        seq.preemptions += 1

    def keeps_cache(seq):
        seq.preemptions += 1

    def no_count(seq):
        seq.num_computed = 0

    assert rejected(lesson06.check_reset_for_recompute(clears_output), "keeps every token")
    assert rejected(lesson06.check_reset_for_recompute(keeps_cache), "still in the cache")
    assert rejected(lesson06.check_reset_for_recompute(no_count), "expected 3")

    def forgets_its_history(seq):  # as if it had never run: its TTFT would be measured from the readmission
        seq.num_computed, seq.preemptions = 0, seq.preemptions + 1
        seq.admitted_step, seq.first_token_step, seq.token_steps = None, None, []

    assert rejected(lesson06.check_reset_for_recompute(forgets_its_history), "first_token_step")
