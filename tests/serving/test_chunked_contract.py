"""Lesson 08's plug-ins, as a learner's mistakes reach them: a plan function of the wrong kind is refused with what
was expected and leaves the scheduler as it was; and chunked prefill makes progress whatever victim policy of
lesson 06 is plugged in (an oldest-first policy used to preempt the same prompt mid-chunk forever)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lesson_utils.core.types import Request, Sequence
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving import simulator
from lesson_utils.serving.scheduler import FCFSScheduler, most_recently_admitted
from lesson_utils.serving.step import serve_step
from lesson_utils.serving.token_budget import Chunk, ChunkedPrefill, QueueView, TokenState, budgeted_schedule


# ---- victim policies a learner may plug in (lesson 06's exercise and its plausible wrong answers) --------------
def oldest_admitted(running):
    return min(running, key=lambda s: -1 if s.admitted_step is None else s.admitted_step)


def first_in_the_batch(running):
    return running[0]


def last_in_the_batch(running):
    return running[-1]


def longest(running):
    return max(running, key=lambda s: s.len)


def shortest(running):
    return min(running, key=lambda s: s.len)


_rng = random.Random(0)


def at_random(running):
    return _rng.choice(running)


POLICIES = [
    most_recently_admitted,
    oldest_admitted,
    first_in_the_batch,
    last_in_the_batch,
    longest,
    shortest,
    at_random,
]


def _serve(reqs, num_blocks, block_size, budget, policy, sharing=False, max_steps=20_000):
    cls = SharingBlockManager if sharing else BlockManager
    manager = cls(num_blocks, block_size, watermark=0.0)
    sch = FCFSScheduler(manager, chunked=ChunkedPrefill(budget), choose_victim=policy)
    res = simulator.simulate(reqs, manager, scheduler=sch, progress=False, max_steps=max_steps)
    return res, manager


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.__name__)
def test_the_tight_workload_that_livelocked_finishes(policy):
    """Eight requests, long prompts, a cache that holds about two of them and a small budget: with
    oldest_admitted this made over 2,000 preemptions in 3,000 steps and finished 1 of 8."""
    reqs = [Request(i, 0.0, 40 + 7 * i, 12, prompt_ids=None) for i in range(8)]
    res, manager = _serve(reqs, num_blocks=14, block_size=8, budget=16, policy=policy, max_steps=3_000)
    assert len(res.finished) == 8, (
        f"{policy.__name__}: {len(res.finished)} of 8 finished, {res.num_preemptions} preemptions"
    )
    assert not manager.view.tables() and manager.num_free_blocks == 14
    assert res.steps[-1] < 1_000


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(1, 80), st.integers(1, 20)), min_size=1, max_size=10),
    budget=st.integers(1, 48),
    spare=st.integers(0, 20),
    block_size=st.sampled_from([1, 3, 4, 8, 16]),
    policy=st.sampled_from(POLICIES),
    sharing=st.booleans(),
)
def test_every_victim_policy_makes_progress_under_chunking(lens, budget, spare, block_size, policy, sharing):
    longest_blocks = max(-(-(p + o) // block_size) for p, o in lens)
    num_blocks = longest_blocks + spare  # every request fits an empty cache, some barely
    rng = random.Random(len(lens) + budget)
    reqs = [
        Request(i, 0.0, p, o, prompt_ids=[rng.choice([4, 5]) for _ in range(p)] if sharing else None)
        for i, (p, o) in enumerate(lens)
    ]
    total = sum(p + o for p, o in lens)
    res, manager = _serve(reqs, num_blocks, block_size, budget, policy, sharing, max_steps=50 * total + 200)
    assert sorted(s.seq_id for s in res.finished) == list(range(len(reqs))), (
        f"{policy.__name__}: {len(res.finished)} of {len(reqs)} finished in {len(res.steps)} steps"
    )
    assert not manager.view.tables() and manager.num_free_blocks == num_blocks


def test_a_policy_that_names_no_running_sequence_is_refused():
    manager = BlockManager(6, 4, watermark=0.0)
    sch = FCFSScheduler(manager, chunked=ChunkedPrefill(64), choose_victim=lambda running: None)
    reqs = [Request(i, 0.0, 8, 8) for i in range(3)]
    with pytest.raises(ValueError, match="victim policy <lambda> returned None"):
        simulator.simulate(reqs, manager, scheduler=sch, progress=False)


# ---- the plan function's contract ------------------------------------------------------------------------------
def _scheduler(plan_fn, sharing=False):
    manager = (SharingBlockManager if sharing else BlockManager)(16, 4, watermark=0.0)
    sch = FCFSScheduler(manager, chunked=ChunkedPrefill(12, plan_fn))
    ids = [2, 7, 7, 7, 7, 7, 7, 7, 9, 9]
    for i in range(3):
        sch.add(Sequence(Request(i, 0.0, 10, 3, prompt_ids=list(ids))))
    return sch, manager


def _state(sch, manager):
    return (
        [s.seq_id for s in sch.waiting],
        [s.seq_id for s in sch.running],
        [(s.num_computed, s.admitted_step) for s in sch.waiting],
        manager.num_free_blocks,
        dict(manager.view.tables()),
    )


def _admits_then(result):
    def plan(running, waiting, budget, admit):
        for s in waiting[:2]:
            admit(s.seq_id)
        return result(running, waiting) if callable(result) else result

    plan.__name__ = "my_plan"
    return plan


@pytest.mark.parametrize("sharing", [False, True])
@pytest.mark.parametrize(
    "plan, error, words",
    [
        (_admits_then(None), TypeError, "my_plan must return a list of Chunk"),
        (_admits_then([(0, 0, 4)]), TypeError, r"returned tuple \(0, 0, 4\) as item 0"),
        (_admits_then(lambda r, w: [Chunk(2, 0, 4)]), ValueError, "sequence 2 is waiting, not running"),
        (_admits_then(lambda r, w: [Chunk(7, 0, 4)]), ValueError, "no sequence 7 is running or waiting"),
        (_admits_then(lambda r, w: [Chunk(0, 0, 4.0)]), TypeError, "are ints"),
        (_admits_then(lambda r, w: [Chunk(0, 0, 10), Chunk(1, 0, 10)]), ValueError, "over the budget of 12"),
    ],
)
def test_a_wrong_plan_is_refused_and_changes_nothing(plan, error, words, sharing):
    sch, manager = _scheduler(plan, sharing)
    before = _state(sch, manager)
    with pytest.raises(error, match=words):
        sch.schedule(0)
    assert _state(sch, manager) == before
    sch.plan_fn = budgeted_schedule  # and the engine goes on serving: nothing leaked
    runner, step = simulator.AccountingRunner(), 0
    while sch.has_work and step < 500:
        serve_step(sch, runner, step)
        step += 1
    assert len(sch.finished) == 3 and not manager.view.tables() and manager.num_free_blocks == 16


def test_a_plan_that_raises_leaves_the_scheduler_as_it_was():
    def crashes(running, waiting, budget, admit):
        admit(waiting[0].seq_id)
        raise ZeroDivisionError("the learner's plan divided by zero")

    sch, manager = _scheduler(crashes)
    before = _state(sch, manager)
    with pytest.raises(ZeroDivisionError):
        sch.schedule(0)
    assert _state(sch, manager) == before


def test_the_plan_reads_the_waiting_queue_through_a_list_like_view():
    seqs = [Sequence(Request(i, 0.0, 3 + i, 2, prompt_ids=[5] * (3 + i))) for i in range(4)]
    view = QueueView(seqs)
    states = [TokenState(i, 0, 3 + i) for i in range(4)]
    assert len(view) == 4 and view[1] == states[1] and view[-1] == states[-1] and view[1:3] == states[1:3]
    assert list(view) == states and view == states and view.copy() == states
    assert [TokenState(9, 0, 1)] + view == [TokenState(9, 0, 1)] + states and view + [] == states
    with pytest.raises(TypeError):
        view[0] = states[0]  # read-only
    assert "QueueView" in repr(view)


def test_a_step_reads_only_the_head_of_a_long_queue(monkeypatch):
    """A saturated stream keeps thousands waiting; one step must cost what it admits, not the queue's length
    (counted: the token states built for the plan)."""
    made = []
    init = TokenState.__init__

    def counting_init(self, *args, **kwargs):
        made.append(args)
        init(self, *args, **kwargs)

    monkeypatch.setattr(TokenState, "__init__", counting_init)
    reqs = [Request(i, 0.0, 30, 4) for i in range(5000)]
    manager = BlockManager(16, 4, watermark=0.0)  # room for two of them
    simulator.simulate(reqs, manager, step_time_s=0.01, max_steps=3, progress=False)
    assert len(made) < 50, f"the plan built {len(made)} token states for a queue of 5000 in 3 steps"
