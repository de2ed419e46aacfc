"""The plan is the message (issue 44): an engine's :class:`StepPlan` carries, per scheduled sequence, the tokens to feed
(drafts included) and where its K/V live; the model runner and the cache read nothing else - no live sequence, no
memory manager - so a plan that went through ``pickle`` (as it would to another process) runs the same step."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from lesson_utils.lab.engine_kinds import engine_kind
from lesson_utils.serving.speculative import Speculation
from lesson_utils.serving.step import StepResult


class _NoManager:
    def __getattr__(self, name):
        raise AssertionError(f"the cache read its manager ({name}) while a step ran")


def _as_a_message(scheduler, runner, step):
    """The step with the runner handed a plan that crossed ``pickle`` and names no live sequence, and the cache's
    manager out of reach while it runs."""
    plan = scheduler.schedule(step)
    message = replace(plan, scheduled=[None] * len(plan.scheduled), admitted=[], preempted=[])
    message = pickle.loads(pickle.dumps(message))
    cache = runner.cache
    manager, cache.manager = cache.manager, _NoManager()
    try:
        output = runner.execute(message)
    finally:
        cache.manager = manager
    return StepResult(plan, scheduler.update_from_output(plan, output))


@pytest.mark.parametrize("kind", ["prefix cache", "swap", "naive", "chunked (gather)", "int8"])
def test_a_plan_that_crossed_pickle_runs_the_same_step(tiny, kind):
    _, w = tiny
    prompts = [[2, 40, 41, 40, 41, 40], [2, 40, 41, 7], [2, 9, 10, 11, 12, 13, 14]]
    make = lambda **kw: engine_kind(kind).build(  # noqa: E731
        w, num_blocks=40, short_blocks=7, max_seq_len=24, stop_at_eos=False, speculation=Speculation(3), **kw
    )
    want = make().generate(prompts, 8)
    engine = make(step_fn=_as_a_message)
    assert engine.generate(prompts, 8) == want
    assert engine.scheduler.verified, "drafts were verified: the plan carried them"
    if engine_kind(kind).short:
        assert engine.scheduler.num_preemptions > 0


def test_a_plan_without_feeds_is_refused_by_the_model_runner(tiny):
    _, w = tiny
    engine = engine_kind("paged").build(w)
    engine.add_request([2, 5, 6], 2)
    plan = engine.scheduler.schedule(0)
    with pytest.raises(ValueError, match="needs an engine's plan"):
        engine.runner.execute(replace(plan, feeds=[]))
