"""Lesson 07's cost model: the work of a step, the fit to measured steps, and the simulator driven by it - which
must make the real engine's decisions step for step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.cache.reserved import ReservedKVCache
from lesson_utils.core.types import Request, Sequence
from lesson_utils.lab import benchmark, workloads
from lesson_utils.memory import reservation
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving import simulator
from lesson_utils.serving.cost_model import ChunkCost, MeasuredSteps, StepCost, StepWork
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.scheduler import FCFSScheduler


def test_the_fit_recovers_the_coefficients_of_a_linear_cost():
    rng = np.random.default_rng(0)
    works = [StepWork(int(d), int(p), int(c)) for d, p, c in rng.integers(0, 200, (40, 3))]
    truth = StepCost(0.05, 0.002, 0.001, 1e-5)
    fit = StepCost.fit(works, [truth(w) for w in works])
    assert np.allclose(fit.coefficients(), truth.coefficients(), rtol=1e-6)
    assert fit.num_steps == 40 and fit.median_error < 1e-9


def test_the_chunk_fit_recovers_its_coefficients_and_prices_a_whole_prompt_above_its_chunks():
    rng = np.random.default_rng(1)
    works = [StepWork(int(d), int(n), 0) for d, n in rng.integers(0, 300, (40, 2))]
    truth = ChunkCost(0.03, 0.007, 0.0015, 2e-6)
    fit = ChunkCost.fit(works, [truth(w) for w in works])
    assert np.allclose(fit.coefficients(), truth.coefficients(), rtol=1e-6)
    assert fit.num_steps == 40 and fit.median_error < 1e-9
    # a 900-token prompt beside 8 decodes: whole in one step, or in chunks of 100 over nine steps
    whole = truth(StepWork(8, 900, 0)) - truth(StepWork(8, 0, 0))
    chunks = 9 * (truth(StepWork(8, 100, 0)) - truth(StepWork(8, 0, 0)))
    assert whole > chunks
    assert truth.per_prompt_token_at(900, 8) == pytest.approx(whole / 900)
    assert truth.per_prompt_token_at(100, 8) == pytest.approx(chunks / 900)
    linear = ChunkCost(0.03, 0.007, 0.0015, 0.0)  # without the squared term, cutting a prompt changes nothing
    assert linear.per_prompt_token_at(900, 8) == pytest.approx(linear.per_prompt_token_at(100, 8))


def test_measured_steps_group_by_work_and_need_enough_samples():
    works = [StepWork(8, 0, 0)] * 3 + [StepWork(8, 120, 0)] * 2 + [StepWork(7, 0, 0)] * 4
    seconds = [0.1, 0.3, 0.2, 1.0, 2.0, 0.5, 0.5, 0.5, 0.7]
    m = MeasuredSteps.of(works, seconds)
    assert m.median(8, 0) == pytest.approx(0.2)
    assert m.median(8, 120) is None and m.median(8, 120, min_samples=2) == pytest.approx(1.5)
    assert m.median(8, 999) is None
    assert m.prompt_sizes(8) == [0] and m.prompt_sizes(8, min_samples=2) == [0, 120] and m.prompt_sizes(7) == [0]
    with pytest.raises(ValueError, match="timings"):
        MeasuredSteps.of(works, seconds[:-1])


def test_no_coefficient_is_negative():
    works = [StepWork(d, 0, 0) for d in range(1, 20)]
    seconds = [1.0 - 0.01 * d for d in range(1, 20)]  # "more work, less time": the fit may not say so
    fit = StepCost.fit(works, seconds)
    assert (fit.coefficients() >= 0).all()
    assert fit.per_decode_s == 0 and fit.fixed_s == pytest.approx(np.mean(seconds))


def test_fit_refuses_too_little_or_mismatched_data():
    with pytest.raises(ValueError, match="at least 4 measured steps"):
        StepCost.fit([StepWork(1, 0, 1)] * 3, [0.1] * 3)
    with pytest.raises(ValueError, match="timings"):
        StepCost.fit([StepWork(1, 0, 1)] * 5, [0.1] * 4)


def test_the_work_of_a_plan():
    mgr = BlockManager(64, 4)
    sch = FCFSScheduler(mgr)
    seqs = [Sequence(Request(i, 0.0, n, 5, prompt_ids=[5] * n)) for i, n in enumerate((3, 6))]
    for s in seqs:
        sch.add(s)
    runner = simulator.AccountingRunner()
    plan = sch.schedule(0)
    sch.update_from_output(plan, runner.execute(plan))
    assert StepWork.of_plan(plan) == StepWork(0, 9, 9)  # two prefills, every prompt token attended once
    plan = sch.schedule(1)
    sch.update_from_output(plan, runner.execute(plan))
    assert StepWork.of_plan(plan) == StepWork(2, 0, 4 + 7)  # two decodes over 4 and 7 tokens


def test_a_simulated_clock_follows_the_cost_model():
    reqs = [Request(0, 0.0, 4, 3), Request(1, 10.0, 4, 2)]  # the second arrives long after the first is done
    res = simulator.simulate(reqs, BlockManager(16, 4), step_cost=StepCost(0.5, 0.0, 0.0, 0.0), progress=False)
    assert list(res.step_end_s) == [0.5, 1.0, 1.5, 10.5, 11.0]  # idle until the arrival, then two more steps
    assert res.e2e_s() == {0: 1.5, 1: 1.0}
    assert res.normalized_latency() == pytest.approx(np.mean([1.5 / 3, 1.0 / 2]))
    assert res.wall_s() == 11.0
    plain = simulator.simulate(reqs, BlockManager(16, 4), progress=False)
    with pytest.raises(ValueError, match="step_cost"):
        plain.e2e_s()


def _manager(kind, budget, block_size=8):
    if kind == "naive":
        return reservation.ContiguousReservationManager(budget, "max", max_seq_len=64)
    cls = BlockManager if kind == "paged" else SharingBlockManager
    return cls(budget // block_size, block_size, max_seq_len=64)


def _engine(w, kind, budget):
    mgr = _manager(kind, budget)
    cache = ReservedKVCache.for_model(w, mgr) if kind == "naive" else PagedKVCache.for_model(w, manager=mgr)
    return Engine(w, cache, stop_at_eos=False), mgr


@pytest.mark.parametrize("kind", ["naive", "paged", "prefix"])
def test_offline_the_simulator_makes_the_engines_decisions_step_for_step(tiny, kind):
    """All requests at time 0: the simulator's steps are the engine's (who ran, who was preempted), whatever the
    clock, so a cost model fitted to the engine replays the engine's run."""
    _, w = tiny
    reqs = workloads.system_prompt_stream(
        12, float("inf"), max_model_len=64, system_prompt_len=15, vocab_size=w.vocab_size, bos_token_id=2, scale=0.03
    )
    engine, _ = _engine(w, kind, 192)
    res = benchmark.serve_engine(kind, engine, reqs, progress=False)
    assert engine.scheduler.num_preemptions > 0 or kind == "naive"  # the budget is tight enough to matter
    fit = StepCost.fit([wk for wk, _ in res.steps], [s for _, s in res.steps])
    sim = simulator.simulate(reqs, _manager(kind, 192), step_cost=fit, progress=False)
    assert list(sim.running) == [st.running for st in engine.stats]
    assert sim.num_preemptions == engine.scheduler.num_preemptions
    finished = {s.seq_id: s.finished_step for s in engine.scheduler.finished}
    assert {s.seq_id: s.finished_step for s in sim.finished} == finished
    assert sim.wall_s() == pytest.approx(sum(fit(st.work) for st in engine.stats))  # the same steps, costed alike


def test_engine_statistics_carry_the_work(tiny):
    _, w = tiny
    engine, _ = _engine(w, "paged", 256)
    out = engine.generate([[2, 5, 6, 7], [2, 9, 9]], 4)
    assert all(len(o) == 4 for o in out)
    first, second = engine.stats[0], engine.stats[1]
    assert (first.prefill_tokens, first.decodes, first.context_tokens) == (7, 0, 7)
    assert (second.prefill_tokens, second.decodes, second.context_tokens) == (0, 2, 5 + 4)
    assert all(st.tokens == st.decodes + st.prefill_tokens for st in engine.stats)
    assert all(st.kv_held >= st.kv_tokens for st in engine.stats)


def test_offline_sweep_stream_replace():
    # the notebook's "all at time 0" copy of a stream keeps everything but the arrival
    reqs = workloads.sharegpt_like(5, rate_per_s=3, seed=1)
    off = [replace(r, arrival_s=0.0) for r in reqs]
    assert [r.prompt_len for r in off] == [r.prompt_len for r in reqs] and all(r.arrival_s == 0 for r in off)


def test_a_verify_cost_recovers_drafts_and_the_multi_row_jump():
    from lesson_utils.serving.cost_model import VerifyCost

    rng = np.random.default_rng(3)
    truth = VerifyCost(0.05, 0.004, 0.002, 0.0015, 2e-6, 0.04)
    works = [StepWork(int(d), int(p), int(c), int(k)) for d, p, c, k in rng.integers(0, 30, (60, 4))]
    works += [StepWork(1, 0, 20, 0)] * 3 + [StepWork(1, 0, 21, 1)] * 3  # batch 1: a decode, and a 1-draft verify
    fit = VerifyCost.fit(works, [truth(w) for w in works])
    assert np.allclose(fit.coefficients(), truth.coefficients(), rtol=1e-6, atol=1e-9)
    assert fit(StepWork(1, 0, 21, 1)) - fit(StepWork(1, 0, 20, 0)) == pytest.approx(0.04 + 0.002 + 2e-6)
    assert "more than one row" in fit.describe() and fit.num_steps == 66


def test_a_speculative_plan_counts_its_drafts_apart_from_its_decodes():
    from lesson_utils.serving.speculative import SimulatedDrafts, Speculation

    mgr = BlockManager(64, 4)
    sch = FCFSScheduler(mgr, speculation=Speculation.for_simulation(3, SimulatedDrafts(1.0, [3], 0.0)))
    for i, n in enumerate((3, 6)):
        sch.add(Sequence(Request(i, 0.0, n, 8)))
    runner = simulator.AccountingRunner()
    for step in range(3):
        plan = sch.schedule(step)
        sch.update_from_output(plan, runner.execute(plan))
    work = StepWork.of_plan(plan)  # step 2: both verify 3 drafts after their newest token
    assert (work.decodes, work.drafted, work.prefill_tokens) == (2, 6, 0) and work.rows == 8
    assert list(work.features())[:3] == [1.0, 8, 0]  # lesson 07's model: a draft counts as a decode


def _cpu_like_seconds(work):
    """A step cost with the jumps a CPU shows: one row far cheaper than two, and 10 rows dearer than 16."""
    jumps = {1: 0.040, 2: 0.075, 3: 0.078, 10: 0.110, 16: 0.090}
    fixed = jumps.get(work.rows, 0.08 + 0.001 * work.rows)
    return fixed + 0.002 * work.decodes + 0.0005 * work.prefill_tokens + 2e-6 * work.context_tokens


def test_a_row_bucket_fit_recovers_a_bucketed_cost_and_beats_one_straight_line():
    from lesson_utils.serving.cost_model import RowBucketCost

    rng = np.random.default_rng(3)
    works = [
        StepWork(int(d), 0, int(d) * int(c))
        for d, c in zip(rng.choice([1, 2, 3, 10, 16], 200), rng.integers(5, 60, 200))
    ]
    seconds = [_cpu_like_seconds(w) for w in works]
    fit = RowBucketCost.fit(works, seconds, starts=(1, 2, 3, 4, 10, 11, 16))
    assert fit.bucket_starts == (1, 2, 3, 10, 16)  # the empty buckets 4-9 and 11-15 joined the ones below
    assert fit.median_error < 1e-6
    for w, s in zip(works, seconds):
        assert fit(w) == pytest.approx(s, rel=1e-6)
    assert [fit.bucket_label(i) for i in range(5)] == ["1", "2", "3-9", "10-15", "16+"]
    line = StepCost.fit(works, seconds)
    assert line.median_error > 0.05  # the straight line cannot follow the jumps
    assert fit(StepWork(1, 0, 30)) < fit(StepWork(2, 0, 60)) and fit(StepWork(16, 0, 16)) < fit(StepWork(10, 0, 10))


def test_row_buckets_merge_sparse_ones_and_look_up_every_row_count():
    from lesson_utils.serving.cost_model import RowBucketCost

    works = [StepWork(1, 0, 5)] * 2 + [StepWork(2, 0, 5)] * 6 + [StepWork(5, 0, 9)] * 3 + [StepWork(40, 0, 9)] * 6
    fit = RowBucketCost.fit(works, [0.1] * len(works), starts=(1, 2, 4, 8, 32), min_steps=5)
    # 1 row held 2 steps: the lowest bucket absorbs the next; 4-7 held 3: joins the bucket below; 8-31 held none
    assert fit.bucket_starts == (1, 32)
    assert [fit.bucket_of(r) for r in (0, 1, 31, 32, 10_000)] == [0, 0, 0, 1, 1]
    assert (np.array([*fit.bucket_s, fit.per_decode_s, fit.per_prefill_token_s, fit.per_context_token_s]) >= 0).all()
    with pytest.raises(ValueError, match="timings"):
        RowBucketCost.fit(works, [0.1] * 3)
    with pytest.raises(ValueError, match="at least"):
        RowBucketCost.fit(works[:3], [0.1] * 3, starts=(1,), min_steps=1)
    with pytest.raises(ValueError, match="rise strictly"):
        RowBucketCost((1, 1), (0.1, 0.2), 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="bucket costs"):
        RowBucketCost((1, 2), (0.1,), 0.0, 0.0, 0.0)
    assert "1-31" in fit.describe() and "32+" in fit.describe()


def test_the_simulator_runs_on_a_row_bucket_clock():
    from lesson_utils.serving.cost_model import RowBucketCost

    reqs = [Request(0, 0.0, 4, 6), Request(1, 0.0, 3, 2)]  # steps of 7 rows (both prompts), 2, then 1 row
    rows = []
    cost = RowBucketCost((1, 2), (0.5, 1.0), 0.0, 0.0, 0.0)
    res = simulator.simulate(
        reqs,
        BlockManager(16, 4),
        step_cost=cost,
        progress=False,
        on_step=lambda plan: rows.append(sum(plan.num_tokens)),
    )
    assert 1 in rows and 2 in rows
    assert res.wall_s() == pytest.approx(sum(0.5 if n == 1 else 1.0 for n in rows))
