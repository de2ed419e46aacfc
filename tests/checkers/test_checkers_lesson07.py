"""Lesson 07's checkers reject an update that skips or misorders a piece of settling a step, and wrong capacity
predictions."""

from __future__ import annotations

import pytest
from helpers import rejected

from lesson_utils.checks import lesson07
from lesson_utils.lab.kv_math import Capacity, predict_capacity
from lesson_utils.serving import sampling

pytestmark = pytest.mark.usefixtures("not_strict")


@pytest.fixture(scope="module")
def w():
    from lesson_utils.core.env import Profile
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

    return OPTWeights.from_hf(load_model(profile=Profile(name="ci", device="cpu", device_name="test")).model)


def _settle(
    scheduler,
    plan,
    output,
    *,
    advance=True,
    by_all=False,
    every_row=False,
    register=True,
    register_after_finish=False,
    finish=True,
    returns=True,
    step_shift=0,
    finish_first=False,
):
    """The exercise's update with one switch per decision; all defaults: the right answer."""
    if advance:
        for seq, n in zip(plan.scheduled, output.new_computed):
            seq.num_computed = len(seq.token_ids) if by_all else seq.num_computed + n
    due = [plan.scheduled[i] for i in plan.sampling]
    if every_row:  # a token for every scheduled sequence, row i of the logits for scheduled[i]
        for i, seq in enumerate(plan.scheduled):
            seq.append_token(int(output.logits[i].argmax()), plan.step)
        due = []
    done = []
    if finish_first:  # looks for the finished before this step's tokens are appended: a step late
        done = [s for s in scheduler.running if s.is_finished]
        for seq in done:
            scheduler.finish(seq, plan.step)
    if register and not register_after_finish:
        for seq in plan.scheduled:
            if not seq.is_finished or seq in scheduler.running:
                scheduler.manager.cache_computed(seq)
    tokens = sampling.next_tokens(due, output.logits[: len(due)]) if due else []
    for seq, token in zip(due, tokens):
        seq.append_token(token, plan.step + step_shift)
    if not finish_first:
        done = [s for s in scheduler.running if s.is_finished]
        if finish:
            for seq in done:
                scheduler.finish(seq, plan.step)
    if register and register_after_finish:
        for seq in plan.scheduled:
            if any(s is seq for s in scheduler.running):
                scheduler.manager.cache_computed(seq)
    return done if returns else []


def test_the_reference_update_passes(w):
    assert lesson07.check_update_from_output(lesson07.reference_update, w).passed
    assert lesson07.check_update_from_output(_settle, w).passed  # the switches' defaults are a right answer


@pytest.mark.parametrize(
    "mistake, says",
    [
        (dict(advance=False), "computed count"),
        (dict(by_all=True), "per step): after step 0 request 0 has computed 14"),
        (dict(every_row=True), "chunk"),
        (dict(register=False), "prefix cache"),
        (dict(register_after_finish=True), "before a finished sequence"),
        (dict(finish=False), "leave the running batch"),
        (dict(returns=False), "as finished"),
        (dict(step_shift=1), "Which step produced"),
        (dict(finish_first=True), "finished once this step's tokens are in"),
    ],
)
def test_update_mistakes(w, mistake, says):
    def wrong(scheduler, plan, output):
        return _settle(scheduler, plan, output, **mistake)

    assert rejected(lesson07.check_update_from_output(wrong, w), says)


def _zip_scheduled(scheduler, plan, output):  # tokens zipped with every scheduled sequence, not plan.sampling
    for seq, n in zip(plan.scheduled, output.new_computed):
        seq.num_computed += n
    for seq in plan.scheduled:
        scheduler.manager.cache_computed(seq)
    for seq, token in zip(plan.scheduled, sampling.next_tokens(plan.scheduled[: len(output.logits)], output.logits)):
        seq.append_token(token, plan.step)
    done = [s for s in scheduler.running if s.is_finished]
    for seq in done:
        scheduler.finish(seq, plan.step)
    return done


def _row_by_scheduled_index(scheduler, plan, output):  # row i of the logits for scheduled[i]
    for seq, n in zip(plan.scheduled, output.new_computed):
        seq.num_computed += n
    for seq in plan.scheduled:
        scheduler.manager.cache_computed(seq)
    for i in plan.sampling:
        seq = plan.scheduled[i]
        seq.append_token(int(output.logits[min(i, len(output.logits) - 1)].argmax()), plan.step)
    done = [s for s in scheduler.running if s.is_finished]
    for seq in done:
        scheduler.finish(seq, plan.step)
    return done


def _tokens_in(scheduler, plan, output) -> None:
    """The update's first three parts, right: computed counts, the prefix cache, the due sequences' tokens."""
    for seq, n in zip(plan.scheduled, output.new_computed):
        seq.num_computed += n
    for seq in plan.scheduled:
        scheduler.manager.cache_computed(seq)
    due = [plan.scheduled[i] for i in plan.sampling]
    for seq, token in zip(due, sampling.next_tokens(due, output.logits) if due else []):
        seq.append_token(token, plan.step)


def _ignores_eos(scheduler, plan, output):  # finishes only at the length limit
    _tokens_in(scheduler, plan, output)
    done = [s for s in scheduler.running if s.num_generated >= s.request.output_len]
    for seq in done:
        scheduler.finish(seq, plan.step)
    return done


@pytest.mark.parametrize(
    "fn, says",
    [
        (_zip_scheduled, "a chunk at a time"),
        (_row_by_scheduled_index, "a chunk at a time"),
        (_ignores_eos, "end-of-sequence token"),
        (lambda s, p, o: [x.seq_id for x in lesson07.reference_update(s, p, o)], "return the Sequence objects"),
        (lambda s, p, o: None, "return the Sequence objects"),
    ],
)
def test_more_update_mistakes(w, fn, says):
    assert rejected(lesson07.check_update_from_output(fn, w), says)


def test_an_update_that_raises_or_is_unsolved_is_reported(w):
    def unsolved(scheduler, plan, output):
        raise NotImplementedError

    def crashes(scheduler, plan, output):
        return scheduler.no_such_method(plan)

    assert "not implemented" in lesson07.check_update_from_output(unsolved, w).message
    assert rejected(lesson07.check_update_from_output(crashes, w), "raised AttributeError")


def _capacity(budget, max_len, bs, held, *, blocks=None, budget_blocks=None, skip=False, of_held=False):
    """The reference with one thing changed (each keyword is one plausible mistake)."""
    for t in held:
        if not 1 <= t <= max_len:
            raise ValueError("impossible request")
    blocks = blocks or (lambda t: -(-t // bs))
    left = budget_blocks(budget, bs) if budget_blocks else budget // bs
    naive = min(len(held), budget // max_len)
    paged, taken = 0, []
    for t in held:
        if blocks(t) > left:
            if skip:
                continue
            break
        left -= blocks(t)
        paged += 1
        taken.append(t)
    denominator = sum(blocks(t) for t in taken) * bs if of_held else budget
    return Capacity(naive, sum(held[:naive]) / budget, paged, sum(taken) / max(denominator, 1))


def test_the_reference_prediction_passes():
    assert lesson07.check_predict_capacity(predict_capacity).passed
    assert lesson07.check_predict_capacity(lambda *a: tuple(predict_capacity(*a))).passed  # a plain tuple will do


def test_capacity_mistakes_are_caught():
    def floor_blocks(b, m, bs, h):
        return _capacity(b, m, bs, h, blocks=lambda t: t // bs)

    def true_division(b, m, bs, h):  # exact only where every length is a multiple of the block size
        return _capacity(b, m, bs, h, blocks=lambda t: t / bs, budget_blocks=lambda b_, bs_: b_ / bs_)

    def partial_block_counts(b, m, bs, h):
        return _capacity(b, m, bs, h, budget_blocks=lambda b_, bs_: -(-b_ // bs_))

    def overtakes(b, m, bs, h):
        return _capacity(b, m, bs, h, skip=True)

    def share_of_held(b, m, bs, h):
        return _capacity(b, m, bs, h, of_held=True)

    def sorts_the_line(b, m, bs, h):
        h.sort()
        return predict_capacity(b, m, bs, h)

    def float_counts(b, m, bs, h):
        c = predict_capacity(b, m, bs, h)
        return (b / m if b // m <= len(h) else float(len(h)), c[1], float(c[2]), c[3])

    def more_than_in_line(b, m, bs, h):
        c = predict_capacity(b, m, bs, h)
        return (b // m, sum(h[: b // m]) / b, c[2], c[3])

    def ignores_block_size_16(b, m, bs, h):  # right only when the block size is 16
        return predict_capacity(b, m, 16, h)

    def no_refusal(b, m, bs, h):
        return predict_capacity(b, m, bs, [min(max(t, 1), m) for t in h])

    def checks_only_the_first(b, m, bs, h):
        if h and not 1 <= h[0] <= m:
            raise ValueError("bad")
        return predict_capacity(b, m, bs, [min(max(t, 1), m) for t in h])

    def refuses_after_changing(b, m, bs, h):
        for i, t in enumerate(h):
            if not 1 <= t <= m:
                h[i] = 1
                raise ValueError("bad")
        return predict_capacity(b, m, bs, h)

    def three_values(b, m, bs, h):
        c = predict_capacity(b, m, bs, h)
        return c.naive_running, c.paged_running, c.paged_utilization

    for wrong, words in [
        (floor_blocks, "tokens take"),
        (true_division, "whole blocks"),
        (partial_block_counts, "whole blocks of"),
        (overtakes, "go first"),
        (share_of_held, "WHOLE budget"),
        (sorts_the_line, "changed its input `tokens_held`"),
        (float_counts, "whole number"),
        (more_than_in_line, "more requests than there are in line"),
        (ignores_block_size_16, "expected"),
        (no_refusal, "expected a ValueError"),
        (checks_only_the_first, "the fourth"),
        (refuses_after_changing, "changed `tokens_held` first"),
        (three_values, "four values"),
    ]:
        assert rejected(lesson07.check_predict_capacity(wrong), words), wrong.__name__


def test_an_unsolved_prediction_is_reported_politely():
    def stub(*_):
        raise NotImplementedError("predict_capacity")

    result = lesson07.check_predict_capacity(stub)
    assert not result.passed and not result.implemented and result.use is predict_capacity


def test_the_prediction_verdict_does_not_depend_on_reruns():
    def wrong(b, m, bs, h):
        return _capacity(b, m, bs, h, skip=True)

    first = lesson07.check_predict_capacity(wrong, quiet=True)
    again = lesson07.check_predict_capacity(wrong, quiet=True)
    assert first.message == again.message and not first.passed


def _frees_by_hand(scheduler, plan, output):
    """Everything right but the finish: blocks freed, step stamped and the running batch left by hand - the status
    stays RUNNING and the scheduler's finished list empty (lesson 07's later cells read both)."""
    _tokens_in(scheduler, plan, output)
    done = [s for s in scheduler.running if s.is_finished]
    for seq in done:
        scheduler.manager.free(seq.seq_id)
        seq.finished_step = plan.step
        scheduler.running = [s for s in scheduler.running if s is not seq]
    return done


def _finishes_but_forgets_the_list(scheduler, plan, output):
    done = _frees_by_hand(scheduler, plan, output)
    for seq in done:
        seq.status = type(seq.status).FINISHED
    return done


def test_an_update_that_finishes_by_hand_is_rejected(w):
    """Issue 43: status and the scheduler's finished list were never compared."""
    assert rejected(lesson07.check_update_from_output(_frees_by_hand, w), "status is RUNNING", "scheduler.finish")
    assert rejected(lesson07.check_update_from_output(_finishes_but_forgets_the_list, w), "finished list")
