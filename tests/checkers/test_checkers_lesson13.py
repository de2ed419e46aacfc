"""Lesson 13's checkers against the references and plausible wrong answers."""

from __future__ import annotations

import pytest
from helpers import rejected

from lesson_utils.api.cancel import LIVE, cancel_request
from lesson_utils.api.detokenizer import REPLACEMENT, safe_new_text
from lesson_utils.checks import lesson13


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lesson_utils.model.trained import trained_folder

    return AutoTokenizer.from_pretrained(trained_folder(show=False))


# ---- exercise 1: the text rule -------------------------------------------------------------------------------------
def sends_every_token(decode, ids, start, sent):
    return decode(ids[sent:]), sent, len(ids)


def never_holds_broken_text(decode, ids, start, sent):
    before, after = decode(ids[start:sent]), decode(ids[start:])
    return after[len(before) :], sent, len(ids)


def never_moves_the_window(decode, ids, start, sent):
    text, _, _ = safe_new_text(decode, ids, start, sent)
    return text, start, sent


def holds_everything(decode, ids, start, sent):
    return "", start, sent


def returns_a_list(decode, ids, start, sent):
    return list(safe_new_text(decode, ids, start, sent))


def strips_the_replacement(decode, ids, start, sent):
    text, start, sent = never_holds_broken_text(decode, ids, start, sent)
    return text.replace(REPLACEMENT, ""), start, sent


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (sends_every_token, "U+FFFD"),
        (never_holds_broken_text, "U+FFFD"),
        (never_moves_the_window, "window"),
        (holds_everything, "why hold it back"),
        (returns_a_list, "return (text, start, sent)"),
        (strips_the_replacement, "expected"),
    ],
)
def test_wrong_text_rules_are_rejected(tokenizer, wrong, needle):
    assert rejected(lesson13.check_safe_new_text(wrong, tokenizer), needle)


def test_the_text_rule_passes_the_reference(tokenizer):
    assert lesson13.check_safe_new_text(safe_new_text, tokenizer).passed


# ---- exercise 2: the cancel path -----------------------------------------------------------------------------------
def abort_request(engine, seq):
    engine.abort_request(seq)


def only_the_first_sample(engine, seq):
    if seq.status in LIVE:
        engine.scheduler.abort(seq)


def frees_by_hand(engine, seq):
    for s in seq.samples or [seq]:
        if s.status in LIVE:
            engine.manager.free(s.seq_id)


def marks_aborted(engine, seq):
    from lesson_utils.core.types import SequenceStatus

    for s in seq.samples or [seq]:
        s.status = SequenceStatus.ABORTED


def does_nothing(engine, seq):
    return None


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (abort_request, "A cancel never raises"),
        (only_the_first_sample, "still waiting, running or swapped"),
        (frees_by_hand, "A cancel never raises"),
        (marks_aborted, "get its blocks back now"),
        (does_nothing, "still waiting, running or swapped"),
    ],
)
def test_wrong_cancels_are_rejected(wrong, needle):
    assert rejected(lesson13.check_cancel_request(wrong), needle)


def test_the_cancel_passes_the_reference():
    assert lesson13.check_cancel_request(cancel_request).passed


# ---- what a learner trial found (issue 47) -------------------------------------------------------------------------
def decodes_only_the_new_tokens(decode, ids, start, sent):
    text = decode(ids[sent:])
    if not text or text.endswith(REPLACEMENT):
        return "", start, sent
    return text, sent, len(ids)


def floats_for_the_window(decode, ids, start, sent):
    text, start, sent = safe_new_text(decode, ids, start, sent)
    return text, float(start), float(sent)


def raises_on_long_pushes(decode, ids, start, sent):
    if len(ids) - sent > 1:
        raise RuntimeError("one token at a time")
    return safe_new_text(decode, ids, start, sent)


def holds_on_any_replacement_without_emptiness(decode, ids, start, sent):
    before, after = decode(ids[start:sent]), decode(ids[start:])
    if after[-1] == REPLACEMENT:
        return "", start, sent
    return after[len(before) :], sent, len(ids)


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (decodes_only_the_new_tokens, "depends on the token before"),
        (floats_for_the_window, "two ints"),
        (raises_on_long_pushes, "raised RuntimeError"),
        (holds_on_any_replacement_without_emptiness, "the window is not"),
    ],
)
def test_wrong_text_rules_a_learner_trial_found_are_rejected(tokenizer, wrong, needle):
    assert rejected(lesson13.check_safe_new_text(wrong, tokenizer), needle)


def runs_it_to_the_end(engine, seq):
    engine.run()


def steps_until_it_ends(engine, seq):
    while any(s.status in LIVE for s in seq.samples or [seq]):
        engine.step()


def finishes_by_hand(engine, seq):
    from lesson_utils.core.types import SequenceStatus

    for s in seq.samples or [seq]:
        if s.status in LIVE:
            engine.scheduler.abort(s)
            s.status = SequenceStatus.FINISHED


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (runs_it_to_the_end, "ran engine steps"),
        (steps_until_it_ends, "ran engine steps"),
        (finishes_by_hand, "some other way than being cancelled"),
        (does_nothing, "the sample you were given"),
    ],
)
def test_cancels_that_serve_instead_are_rejected(wrong, needle):
    assert rejected(lesson13.check_cancel_request(wrong), needle)


def skips_the_swapped(engine, seq):
    from lesson_utils.core.types import SequenceStatus

    for s in seq.samples or [seq]:
        if s.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
            engine.scheduler.abort(s)


def aborts_what_the_queues_hold(engine, seq):
    queued = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    for s in seq.samples or [seq]:
        if any(s is q for q in queued):
            engine.scheduler.abort(s)


def drops_the_swapped_from_the_line(engine, seq):
    from lesson_utils.core.types import SequenceStatus

    for s in seq.samples or [seq]:
        if s.status is SequenceStatus.SWAPPED:
            engine.scheduler.swapped.remove(s)  # forgets it, but its CPU copy stays held
            s.status = SequenceStatus.ABORTED
        elif s.status in LIVE:
            engine.scheduler.abort(s)


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (skips_the_swapped, "swapped out to CPU memory"),
        (aborts_what_the_queues_hold, "swapped out to CPU memory"),
        (drops_the_swapped_from_the_line, "swap memory"),
    ],
)
def test_cancels_that_forget_swapped_samples_are_rejected(wrong, needle):
    assert rejected(lesson13.check_cancel_request(wrong), needle)


def ignores_a_changed_context(decode, ids, start, sent):
    before, after = decode(ids[start:sent]), decode(ids[start:])
    if len(after) <= len(before) or after.endswith(REPLACEMENT):
        return "", start, sent
    return after[len(before) :], sent, len(ids)


def test_a_rule_that_ignores_a_changed_context_is_rejected(tokenizer):
    assert rejected(lesson13.check_safe_new_text(ignores_a_changed_context, tokenizer), "context's own text changed")
