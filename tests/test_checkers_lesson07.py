"""Lesson 07's checker rejects engine steps that forget a piece or put them in the wrong order."""

from __future__ import annotations

import pytest
from helpers import rejected

from lesson_utils.checks import lesson07
from lesson_utils.serving.scheduler import StepPlan
from lesson_utils.serving.step import serve_step

pytestmark = pytest.mark.usefixtures("not_strict")


@pytest.fixture(scope="module")
def w():
    from lesson_utils.env import Profile
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

    return OPTWeights.from_hf(load_model(profile=Profile(name="ci", device="cpu", device_name="test")).model)


def test_reference_passes(w):
    assert lesson07.check_engine_step(serve_step, w).passed


def test_mistakes(w):
    def no_retire(s, r, m, step):
        plan = s.schedule(step)
        r.execute(plan)
        for q in plan.scheduled:
            m.cache_computed(q)
        return plan, []

    def no_room(s, r, m, step):  # admits, but never makes room for the next token
        s.admit(step)
        plan = StepPlan(step, list(s.running))
        r.execute(plan)
        for q in plan.scheduled:
            m.cache_computed(q)
        return plan, s.retire_finished(step)

    def run_then_admit(s, r, m, step):
        s.reserve_next_slots()
        plan = StepPlan(step, list(s.running))
        r.execute(plan)
        for q in plan.scheduled:
            m.cache_computed(q)
        done = s.retire_finished(step)
        s.admit(step)
        return plan, done

    def no_cache(s, r, m, step):
        plan = s.schedule(step)
        r.execute(plan)
        return plan, s.retire_finished(step)

    def returns_only_the_finished(s, r, m, step):
        plan = s.schedule(step)
        r.execute(plan)
        for q in plan.scheduled:
            m.cache_computed(q)
        return s.retire_finished(step)

    assert rejected(lesson07.check_engine_step(no_retire, w), "leave the batch")
    assert rejected(lesson07.check_engine_step(no_room, w), "reserve them first")
    assert rejected(lesson07.check_engine_step(returns_only_the_finished, w), "a step returns (plan, finished)")
    assert rejected(lesson07.check_engine_step(run_then_admit, w), "in which step is a new request prefilled")
    assert rejected(lesson07.check_engine_step(no_cache, w), "when are computed blocks registered")
