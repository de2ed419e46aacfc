"""Lesson 02: workloads match the paper's means, reservation policies, the simulator's accounting."""

from __future__ import annotations

import numpy as np
import pytest

from lesson_utils.core.types import NeverFits, Sequence, SlotKind
from lesson_utils.lab import kv_math, workloads
from lesson_utils.memory import reservation
from lesson_utils.serving import simulator
from lesson_utils.serving.scheduler import FCFSScheduler


@pytest.mark.parametrize("profile", [workloads.SHAREGPT, workloads.ALPACA])
def test_stream_means_match_the_paper_after_filtering(profile):
    p, o = workloads.sample_lengths(profile, 20000, seed=5)
    assert abs(p.mean() / profile.prompt_mean - 1) < 0.05
    assert abs(o.mean() / profile.output_mean - 1) < 0.05
    assert p.min() >= 4 and o.min() >= 4 and p.max() <= 1024 and (p + o).max() <= 2048


def test_streams_are_seeded_and_poisson():
    a = workloads.sharegpt_like(500, rate_per_s=10, seed=3)
    b = workloads.sharegpt_like(500, rate_per_s=10, seed=3)
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in a] == [
        (r.prompt_len, r.output_len, r.arrival_s) for r in b
    ]
    gaps = np.diff([r.arrival_s for r in a])
    assert np.all(gaps >= 0) and abs(gaps.mean() - 0.1) < 0.02


def test_shared_system_prompt_stream():
    reqs = workloads.shared_system_prompt_stream(20, system_prompt_len=30, seed=1)
    first = reqs[0].prompt_ids[:30]
    assert all(r.prompt_ids[:30] == first and r.shared_prefix_len == 30 for r in reqs)
    assert all(len(r.prompt_ids) == r.prompt_len for r in reqs)
    assert min(min(r.prompt_ids) for r in reqs) >= 4


@pytest.mark.parametrize("bad", [dict(n=0), dict(n=5, rate_per_s=0)])
def test_bad_workload_arguments(bad):
    with pytest.raises(ValueError):
        workloads.sharegpt_like(**bad)


def test_reservation_sizes():
    assert reservation.reservation_slots("max", 100) == 2048
    assert reservation.reservation_slots("pow2", 100) == 128
    assert reservation.reservation_slots("pow2", 128) == 128
    assert reservation.reservation_slots("oracle", 100) == 100
    with pytest.raises(NeverFits):
        reservation.reservation_slots("oracle", 3000)
    with pytest.raises(ValueError, match="unknown policy"):
        reservation.reservation_slots("best", 10)


def test_request_larger_than_cache_fails_before_simulating():
    reqs = [workloads.Request(0, 0.0, 100, 100)]
    with pytest.raises(NeverFits, match="more than the whole cache"):
        simulator.simulate(reqs, reservation.ContiguousReservationManager(1000, "max"), progress=False)


@pytest.mark.parametrize("policy", reservation.POLICIES)
def test_simulation_accounts_every_slot_and_frees_everything(policy):
    reqs = workloads.sharegpt_like(200, rate_per_s=50, seed=2)
    m = reservation.ContiguousReservationManager(20_000, policy)
    res = simulator.simulate(reqs, m, step_time_s=0.02, progress=False, map_every=10)
    total = sum(res.kinds[k] for k in simulator.KINDS)
    assert np.all(total == 20_000)
    assert len(res.finished) == 200 and all(s.num_generated == s.request.output_len for s in res.finished)
    assert m.view.breakdown()[SlotKind.FREE] == m.view.total_slots == 20_000
    if policy == "oracle":
        assert res.kinds["internal fragmentation"].max() == 0
    # FCFS: requests are admitted in arrival order
    admitted = sorted(res.finished, key=lambda s: s.admitted_step)
    assert [s.seq_id for s in admitted] == sorted(s.seq_id for s in admitted) or all(
        a.admitted_step <= b.admitted_step for a, b in zip(admitted, admitted[1:])
    )
    assert res.maps and res.maps[0][1].shape[0] <= 512


def test_max_policy_runs_exactly_budget_over_2048_at_t4_scale():
    slots = kv_math.t4_slots_for_opt125m()
    reqs = workloads.sharegpt_like(400, rate_per_s=1000, seed=0)
    res = simulator.simulate(
        reqs, reservation.ContiguousReservationManager(slots, "max"), max_steps=200, progress=False
    )
    assert res.running.max() == slots // 2048


def test_policies_order_as_in_the_paper():
    """Token-state share: Max < Pow2 < Oracle (the paper's Fig. 2 ordering)."""
    slots = 40_000
    reqs = workloads.sharegpt_like(1500, rate_per_s=300, seed=0)
    share = {}
    for policy in reservation.POLICIES:
        res = simulator.simulate(
            reqs, reservation.ContiguousReservationManager(slots, policy), max_steps=900, progress=False
        )
        share[policy] = res.mean_breakdown(after_step=300)["token states"]
    assert share["max"] < share["pow2"] < share["oracle"]


def test_scheduler_is_fcfs_head_of_line():
    m = reservation.ContiguousReservationManager(3000, "oracle")
    s = FCFSScheduler(m)
    big, small = workloads.Request(0, 0, 1500, 500), workloads.Request(1, 0, 10, 10)
    filler = workloads.Request(2, 0, 1000, 10)
    s.add(Sequence(filler))
    s.schedule(0)
    s.add(Sequence(big))
    s.add(Sequence(small))
    assert s.schedule(1).admitted == []  # the big one does not fit, and the small one may not overtake it


def test_kv_budget_accounting():
    from transformers import OPTConfig

    b = kv_math.kv_budget(OPTConfig(), dtype_bytes=2)
    assert b.bytes_per_token == 36864
    assert b.weight_bytes == 125_239_296 * 2
    assert b.tokens == (int(15 * 2**30 * 0.9) - b.weight_bytes) // 36864
    with pytest.raises(ValueError):
        kv_math.kv_budget(OPTConfig(), utilization=0)
