"""The serving step: one iteration of every engine in the course, model or no model.

The engine runs it with the model runner (:class:`~lesson_utils.serving.engine.ModelRunner`: a real forward pass), the
simulator with the accounting runner (:class:`~lesson_utils.serving.simulator.AccountingRunner`: every running sequence
"generates" a token). Same scheduler, same memory manager, same decisions: what the simulator measures about
memory is what the engine does.
"""

from __future__ import annotations

from lesson_utils.serving.scheduler import StepPlan
from lesson_utils.types import Sequence


def serve_step(scheduler, runner, step: int, *, after_run=None) -> tuple[StepPlan, list[Sequence]]:
    """THE step, shared by the engine (model runner) and the simulator (accounting runner):

    1. the scheduler decides (admit, make room, preempt) and returns the :class:`StepPlan`;
    2. the runner makes the plan's block copies, then runs every scheduled sequence one token further;
    3. the memory manager registers the blocks just computed (lesson 05's prefix cache);
    4. ``after_run()`` - the engine forks parallel samples here, the simulator records memory;
    5. finished sequences retire and give their memory back.

    Returns the plan and the sequences that finished this step.
    """
    plan = scheduler.schedule(step)
    runner.apply(plan)
    runner.execute(scheduler.running, step)  # the scheduled sequences (the running list itself)
    for seq in list(scheduler.running):
        scheduler.manager.cache_computed(seq)
    if after_run is not None:
        after_run()
    return plan, scheduler.retire_finished(step)
