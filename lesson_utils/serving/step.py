"""The serving step: one iteration of every engine in the course, model or no model.

The engine runs it with the model runner (:class:`~lesson_utils.serving.model_runner.ModelRunner`: a real
forward pass), the simulator with the accounting runner
(:class:`~lesson_utils.serving.simulator.AccountingRunner`: every running sequence "generates" a token). Same
scheduler, same memory manager, same decisions: what the simulator measures about memory is what the engine
does. Lesson 07's exercise writes this function; an engine given ``step_fn=`` runs the learner's instead.
"""

from __future__ import annotations

from typing import NamedTuple

from lesson_utils.serving.scheduler import StepPlan
from lesson_utils.types import MemoryManager, Sequence


class StepResult(NamedTuple):
    """What a step returns: the scheduler's plan for it and the sequences that finished in it."""

    plan: StepPlan
    finished: list[Sequence]


def serve_step(scheduler, runner, manager: MemoryManager, step: int) -> StepResult:
    """THE step:

    1. the scheduler decides who runs (admit, make room, preempt) and returns the :class:`StepPlan`;
    2. the runner makes the plan's block copies, then runs every scheduled sequence one token further;
    3. the memory manager registers the blocks just computed (lesson 05's prefix cache);
    4. the scheduler settles the step: forked samples and chosen beams join, finished sequences leave.
    """
    plan = scheduler.schedule(step)
    runner.execute(plan)
    for seq in plan.scheduled:
        manager.cache_computed(seq)
    return StepResult(plan, scheduler.retire_finished(step))
