"""An event-driven serving simulator that accounts memory instead of running a model.

Time advances in iterations ("steps"). Each step: requests that have arrived join the waiting queue; the
scheduler admits what the memory manager accepts; every running sequence computes what the plan gives it and,
once its tokens are all computed, generates one token (the *accounting runner*: no model, just bookkeeping);
finished sequences free their memory.
Steps in which nothing is running and nobody waits are skipped (jump to the next arrival).

Because the scheduler and memory managers are the same objects the real engine uses, experiments at
T4 scale (OPT-125m geometry, a 15 GiB T4's KV budget) need no GPU: they are exact byte accounting.

Time, two ways. By default every step lasts ``step_time_s`` (memory experiments: only the ratio of arrival
rate to step rate matters). With ``step_cost=`` (a :class:`~lesson_utils.serving.cost_model.StepCostModel` fitted to a
real engine's steps) each step lasts what that model says its work costs, and the result carries every
request's latency: a rate sweep of the real engine's decisions at the real engine's speed, in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from lesson_utils.core.types import MemoryManager, Request, Sequence, SlotKind
from lesson_utils.serving.cost_model import StepCostModel, StepWork
from lesson_utils.serving.output import RunnerOutput, StepPlan
from lesson_utils.serving.scheduler import FCFSScheduler
from lesson_utils.serving.step import serve_step

KINDS = tuple(SlotKind)  # the breakdown's keys, in memory-map order


class AccountingRunner:
    """Stands in for the model: each scheduled sequence "computes" the tokens the plan gives it (the scheduler has
    already made room for them). There is no K/V, so the plan's block copies cost nothing, and no logits: the
    scheduler's update appends a token (None: a simulation knows lengths, not ids) to every sequence the plan says
    samples."""

    def execute(self, plan: StepPlan) -> RunnerOutput:
        return RunnerOutput(plan.tokens_to_feed(), None)


@dataclass
class SimResult:
    """What a simulation recorded, step by step."""

    manager_name: str
    total_slots: int
    step_time_s: float
    steps: np.ndarray  # step index of each record
    running: np.ndarray
    waiting: np.ndarray
    kinds: dict[str, np.ndarray]  # slot counts per kind, per record
    ext_frag: np.ndarray  # external-fragmentation measure per record (nan where not defined)
    maps: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (step, slot kinds, strided)
    map_stride: int = 1
    finished: list[Sequence] = field(default_factory=list)
    num_preemptions: int = 0
    tokens: np.ndarray | None = None  # tokens computed in each recorded step (prompt tokens and decodes)
    step_end_s: np.ndarray | None = None  # with a step cost: the clock at the end of each step (steps 0, 1, ...)

    def e2e_s(self) -> dict[int, float]:
        """(With a step cost) each finished request's arrival-to-last-token latency, seconds."""
        if self.step_end_s is None:
            raise ValueError("latencies need a clock: simulate with step_cost=")
        return {s.seq_id: float(self.step_end_s[s.finished_step]) - s.request.arrival_s for s in self.finished}

    def normalized_latency(self) -> float:
        """(With a step cost) the paper's measure: mean over requests of end-to-end latency / output tokens."""
        e2e = self.e2e_s()
        return float(np.mean([e2e[s.seq_id] / s.num_generated for s in self.finished]))

    def wall_s(self) -> float:
        """(With a step cost) the clock when the last step ended."""
        if self.step_end_s is None:
            raise ValueError("a wall time needs a clock: simulate with step_cost=")
        return float(self.step_end_s[-1]) if len(self.step_end_s) else 0.0

    @property
    def saturated(self) -> np.ndarray:
        """Records in which a request was waiting for memory: the server was memory-bound."""
        return self.waiting > 0

    def _mask(self, only_saturated: bool, after_step: int) -> np.ndarray:
        mask = self.steps >= after_step
        if only_saturated and (mask & self.saturated).any():
            mask &= self.saturated
        return mask

    def mean_breakdown(self, only_saturated: bool = True, after_step: int = 0) -> dict[str, float]:
        """Average share (%) of the KV budget per kind.

        Averaged over memory-bound records (someone waiting) from ``after_step`` on - pass about one
        request lifetime to skip the warm-up, when the cache is still filling with fresh requests.
        """
        mask = self._mask(only_saturated, after_step)
        return {k: float(100.0 * self.kinds[k][mask].mean() / self.total_slots) for k in KINDS}

    def mean_running(self, only_saturated: bool = True, after_step: int = 0) -> float:
        return float(self.running[self._mask(only_saturated, after_step)].mean())

    @property
    def seconds(self) -> np.ndarray:
        return self.steps * self.step_time_s


def simulate(
    requests: list[Request],
    manager: MemoryManager,
    *,
    step_time_s: float = 0.02,
    max_num_seqs: int | None = None,
    max_steps: int | None = None,
    map_every: int = 0,
    map_columns: int = 512,
    progress: bool = True,
    scheduler: FCFSScheduler | None = None,
    runner: AccountingRunner | None = None,
    step_cost: StepCostModel | None = None,
    on_step: Callable[[StepPlan], None] | None = None,
) -> SimResult:
    """Serve ``requests`` (arrival times in seconds) with ``manager``; record memory every step.

    ``step_time_s`` converts arrival times to steps (only the ratio of arrival rate to step rate matters
    for memory); ``step_cost`` replaces it with a model of each step's time (module docstring). ``on_step(plan)`` is
    called at the moment memory is recorded (the step's tokens are in, finished sequences not yet gone). ``map_every > 0`` keeps a strided memory map (``map_columns`` slots wide) every that
    many steps, for pictures. ``max_steps`` stops early (the rest stay unserved).

    Long on purpose: the loop and what it records each step (memory maps, slot breakdowns, events) in one place."""
    scheduler = scheduler or FCFSScheduler(manager, max_num_seqs=max_num_seqs)
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.req_id))
    arrival_step = [math.ceil(r.arrival_s / step_time_s - 1e-9) for r in pending]
    for r in pending:
        scheduler.manager.check_admissible(Sequence(r))  # fail fast, before simulating anything

    stride = max(1, manager.view.total_slots // map_columns)
    rec_steps, rec_running, rec_waiting, rec_frag, rec_tokens = [], [], [], [], []
    rec_kinds: dict[str, list[int]] = {k: [] for k in KINDS}
    maps: list[tuple[int, np.ndarray]] = []

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pending), desc=f"simulating {manager.view.name}", unit="req", leave=False)

    def record(plan: StepPlan) -> None:  # memory after the step's tokens are in, before finished sequences leave
        step = plan.step
        br = scheduler.manager.view.breakdown()
        rec_steps.append(step)
        rec_tokens.append(sum(plan.num_tokens))
        rec_running.append(len(scheduler.running))
        rec_waiting.append(len(scheduler.waiting))
        for k in KINDS:
            rec_kinds[k].append(br[k])
        rec_frag.append(scheduler.manager.view.external_fragmentation())
        if map_every and step % map_every == 0:
            kinds = scheduler.manager.view.slot_kinds()
            if kinds is not None:
                maps.append((step, kinds[::stride][:map_columns].copy()))
        if on_step is not None:
            on_step(plan)

    runner = runner or AccountingRunner()
    scheduler.observe = record  # called by the scheduler's update once the step's tokens are in
    step, nxt, clock, step_end = 0, 0, 0.0, []
    while nxt < len(pending) or scheduler.has_work:
        if step_cost is None:
            if not scheduler.has_work and arrival_step[nxt] > step:
                step = arrival_step[nxt]  # idle: jump to the next arrival
            while nxt < len(pending) and arrival_step[nxt] <= step:
                scheduler.add(Sequence(pending[nxt]))
                nxt += 1
        else:  # the real engine's loop: whatever has arrived by now joins, an idle server waits for the next
            if not scheduler.has_work and pending[nxt].arrival_s > clock:
                clock = pending[nxt].arrival_s
            while nxt < len(pending) and pending[nxt].arrival_s <= clock:
                scheduler.add(Sequence(pending[nxt]))
                nxt += 1

        plan, done = serve_step(scheduler, runner, step)
        if step_cost is not None:
            clock += step_cost(StepWork.of_plan(plan))
            step_end.append(clock)
        if bar is not None and done:
            bar.update(len(done))
        step += 1
        if max_steps is not None and step >= max_steps:
            break
    if bar is not None:
        bar.close()

    return SimResult(
        manager_name=manager.view.name,
        total_slots=manager.view.total_slots,
        step_time_s=step_time_s,
        steps=np.array(rec_steps),
        running=np.array(rec_running),
        waiting=np.array(rec_waiting),
        kinds={k: np.array(v) for k, v in rec_kinds.items()},
        ext_frag=np.array(rec_frag, dtype=float),
        maps=maps,
        map_stride=stride,
        finished=scheduler.finished,
        num_preemptions=scheduler.num_preemptions,
        tokens=np.array(rec_tokens),
        step_end_s=None if step_cost is None else np.array(step_end),
    )


def saturating_rate(requests: list[Request], total_slots: int, step_time_s: float, overload: float = 2.0) -> float:
    """Arrival rate (requests/s) that keeps even an exact-fit (Oracle) server ``overload`` x over-full.

    Little's law: a request holds about ``prompt + output / 2`` slots on average for ``output`` steps, so
    ``total_slots / mean(occupancy x lifetime)`` requests per step fill the cache.
    """
    occupancy_steps = np.mean([(r.prompt_len + r.output_len / 2) * r.output_len for r in requests])
    return overload * total_slots / occupancy_steps / step_time_s
