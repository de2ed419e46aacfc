"""The serving step: one iteration of every engine in the course, model or no model.

The engine runs it with the model runner (:class:`~lesson_utils.serving.model_runner.ModelRunner`: a real
forward pass), the simulator with the accounting runner
(:class:`~lesson_utils.serving.simulator.AccountingRunner`: every sequence "computes" what it was given). Same
scheduler, same memory manager, same decisions: what the simulator measures about memory is what the engine
does. Lesson 07's exercise writes this function; an engine given ``step_fn=`` runs the learner's instead.
"""

from __future__ import annotations

from typing import NamedTuple

from lesson_utils.core.types import Sequence
from lesson_utils.serving.output import StepPlan


class StepResult(NamedTuple):
    """What a step returns: the scheduler's plan for it and the sequences that finished in it."""

    plan: StepPlan
    finished: list[Sequence]


def serve_step(scheduler, runner, step: int) -> StepResult:
    """THE step (vLLM v1's ``EngineCore.step``): the scheduler decides, the runner computes, the scheduler updates.

    1. ``scheduler.schedule(step)`` -> :class:`~lesson_utils.serving.output.StepPlan` (admit, make room, preempt);
    2. ``runner.execute(plan)`` -> :class:`~lesson_utils.serving.output.RunnerOutput` (block copies, forward pass);
    3. ``scheduler.update_from_output(plan, output)`` -> the finished sequences (tokens, prefix cache, forks and
       beams, frees).
    """
    plan = scheduler.schedule(step)
    output = runner.execute(plan)
    return StepResult(plan, scheduler.update_from_output(plan, output))
