"""Lesson 06 in the simulator: the scheduler's preemption promises over randomized workloads (every manager,
both modes, every swap-space size), the token budget, and the victim and return order - see
test_preemption_engine.py for the list of what both files prove."""

from __future__ import annotations

import pytest
from helpers.preemption import (
    FALLBACK,
    CheckedScheduler,
    CheckingRunner,
    assert_all_free,
    drive,
    make_manager,
    random_workload,
    run_workload,
)

from lesson_utils.core.types import Request, Sequence
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.serving.scheduler import most_recently_admitted

# ---------------------------------------------------------------------------------------------------
# 2. The simulator: randomized workloads, both modes, every manager, every swap-space size
# ---------------------------------------------------------------------------------------------------


SEEDS = range(400)
CHUNKS = 4


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_workloads_in_the_simulator(chunk):
    stats = dict.fromkeys(
        ["runs", "preempted", "swapped", "fell back", "prefix hits", "other victims", "shadow checked"], 0
    )
    for seed in SEEDS[chunk::CHUNKS]:
        try:
            out = run_workload(seed)
        except AssertionError as e:
            wl = random_workload(seed)
            desc = {k: v for k, v in wl.items() if k != "reqs"}
            raise AssertionError(f"seed {seed} ({desc}): {e}") from e
        stats["runs"] += 1
        stats["preempted"] += bool(out["events"])
        stats["swapped"] += any(e.mode == "swap" for e in out["events"])
        stats["fell back"] += any(FALLBACK in e.note for e in out["events"])
        stats["prefix hits"] += out["hits"] > 0
        stats["other victims"] += out["policy"] != "latest" and bool(out["events"])
        stats["shadow checked"] += out["verified"] > 0
    # the workloads really exercise what they are meant to
    assert stats["preempted"] >= 0.6 * stats["runs"], stats
    assert stats["swapped"] >= 0.15 * stats["runs"], stats
    assert stats["fell back"] >= 0.05 * stats["runs"], stats
    assert stats["prefix hits"] >= 0.1 * stats["runs"], stats
    assert stats["other victims"] >= 0.1 * stats["runs"], stats
    assert stats["shadow checked"] >= 0.25 * stats["runs"], stats


# ---------------------------------------------------------------------------------------------------
# 3. The token budget and swapped sequences
# ---------------------------------------------------------------------------------------------------


def test_admission_stops_at_the_token_budget():
    """Budget 10. Four 4-token prompts (3 new tokens each), a 7-token one, a 1-token one:
    step 0 admits two (8 tokens), step 1 two more (2 decodes + 8), step 2 nobody - the 7-token prompt does
    not fit beside 4 decodes, and the 1-token one, which would, does not overtake it - step 3 both (2 decodes
    + 7 + 1), once two have finished."""
    m = BlockManager(64, 4, watermark=0.0)
    sch = CheckedScheduler(m, max_num_batched_tokens=10)
    lens = [(4, 3)] * 4 + [(7, 2), (1, 1)]
    for i, (p, o) in enumerate(lens):
        sch.add(Sequence(Request(i, 0.0, p, o)))
    runner, admitted = CheckingRunner(sch), []  # the runner checks the budget every step
    for step in range(4):
        plan = sch.schedule(step)
        admitted.append([s.seq_id for s in plan.admitted])
        sch.update_from_output(plan, runner.execute(plan))
    assert admitted == [[0, 1], [2, 3], [], [4, 5]]
    assert [s.seq_id for s in sch.finished] == [0, 1, 2, 3, 5]


def test_a_sequence_swapped_out_before_its_prefill_counts_its_prompt_against_the_budget():
    """Budget 5, 11 one-token blocks. A (5 + 3 tokens) runs; B (4-token prompt) is admitted at step 1 and
    swapped out in the same step, before its prefill ran (A needs the block); it comes back at step 2 and is
    swapped out again. At step 3 A is done: B comes back with its whole prompt still to compute (4 tokens,
    not 1), so C (another 4) must wait a step - the budget holds every step (the runner checks)."""
    m = BlockManager(11, 1, watermark=0.0)
    sch = CheckedScheduler(m, preemption_mode="swap", swap_space=SwapSpace(64), max_num_batched_tokens=5)
    a, b, c = Sequence(Request(0, 0.0, 5, 3)), Sequence(Request(1, 0.0, 4, 1)), Sequence(Request(2, 0.0, 4, 1))
    log = drive(sch, {0: [a], 1: [b], 3: [c]}, 20)
    assert [(e.step, e.seq_id, e.mode) for e in sch.events] == [(1, 1, "swap"), (2, 1, "swap")]
    assert log[1]["admitted"] == [1] and log[1]["swapped"] == [1] and b.num_computed == 4
    assert log[3]["back"] == [1] and log[3]["admitted"] == [] and log[4]["admitted"] == [2]
    assert all(s.is_finished for s in (a, b, c)) and not sch.has_work
    assert_all_free(m, sch.swap_space)


def test_a_swapped_sequence_waits_for_the_budget_like_a_new_one():
    """Budget 7, 14 one-token blocks. R1 (3 + 7 tokens) runs from step 0. At step 5, R0 (a 5-token prompt, 2
    samples) and R2 (a 1-token prompt, 3 samples) are admitted (1 + 5 + 1 = 7 tokens), and both are swapped out
    before their prefill ran. R2 comes back at step 6 and forks: 3 samples decode. At step 7 there is memory
    for R0 again, but its 5 prompt tokens beside 3 decodes would make 8: R0 waits a step, as a new request
    would (the runner checks the budget in every step that prefills)."""
    m = make_manager("sharing", 14, 1)
    sch = CheckedScheduler(m, preemption_mode="swap", swap_space=SwapSpace(100), max_num_batched_tokens=7)
    r1 = Sequence(Request(1, 0.0, 3, 7, prompt_ids=[4, 5, 6]))
    r0 = Sequence(Request(0, 0.0, 5, 6, prompt_ids=[5] * 5, tags={"n": 2}))
    r2 = Sequence(Request(2, 0.0, 1, 2, prompt_ids=[6], tags={"n": 3}))
    log = drive(sch, {0: [r1], 5: [r0, r2]}, 40)
    assert [(e.step, e.seq_id, e.mode) for e in sch.events][:2] == [(5, 2, "swap"), (5, 0, "swap")]
    assert log[5]["admitted"] == [0, 2] and log[5]["swapped"] == [2, 0]
    assert log[6]["back"] == [2] and 1 in log[6]["running"]  # R1 runs its last step beside R2
    assert log[6]["running after"] == [2, 10_000, 10_001]  # R1 is done; R2 and its two forked samples decode
    assert log[7]["back"] == [] and log[7]["free_before"] >= 5 and log[7]["swapped"] == [0]
    assert log[8]["back"] == [0]
    assert len(sch.finished) == 1 + 2 + 3 and not sch.has_work
    assert_all_free(m, sch.swap_space)


# ---------------------------------------------------------------------------------------------------
# 4. Victim choice and the order of return
# ---------------------------------------------------------------------------------------------------


def test_most_recently_admitted_picks_the_latest_admission():
    seqs = [Sequence(Request(i, 0.0, 1, 1), admitted_step=a) for i, a in enumerate([0, 3, 1, 3, 2])]
    assert most_recently_admitted(seqs) is seqs[3]  # of the two admitted at step 3, the later in the batch
    assert most_recently_admitted(seqs[:3]) is seqs[1]
    assert most_recently_admitted(seqs[:1]) is seqs[0]
    shuffled = [seqs[4], seqs[1], seqs[0]]
    assert most_recently_admitted(shuffled) is seqs[1]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_latest_admitted_is_preempted_and_comes_back_before_anyone_new(mode):
    """10 one-token blocks. A, B, D (3-token prompts, ids 0, 1, 2) start together at step 0 and grow.

    Step 0: B cannot grow -> D, the latest admitted (a tie at step 0: the later in the batch), is preempted.
    Step 1: C (id 3, one token) arrives; 2 blocks are free, enough for C, but C waits: D is ahead of it
    (swapped: swapped sequences come back first; recompute: D heads the queue and nobody overtakes).
    Step 2: A cannot grow -> B, now the latest admitted, is preempted. A finishes.
    Step 3: the preempted come back - swapped ones in the order they left (D, B); recomputed ones from the
    queue's front (B, re-queued last, goes first) - and only then is C admitted.
    """
    m = BlockManager(10, 1, watermark=0.0)
    space = SwapSpace(16) if mode == "swap" else None
    sch = CheckedScheduler(m, preemption_mode=mode, swap_space=space)
    a, b, d = (Sequence(Request(i, 0.0, 3, n)) for i, n in ((0, 3), (1, 6), (2, 6)))
    c = Sequence(Request(3, 0.0, 1, 1))
    log = drive(sch, {0: [a, b, d], 1: [c]}, 60)
    assert [(e.step, e.seq_id, e.mode) for e in sch.events][:2] == [(0, 2, mode), (2, 1, mode)]
    assert log[0]["admitted"] == [0, 1, 2] and log[0]["running"] == [0, 1]
    assert log[1]["free_before"] >= 1 and log[1]["admitted"] == [] and 3 not in log[1]["running"]
    if mode == "swap":
        assert log[0]["swapped"] == [2] and log[1]["swapped"] == [2] and log[1]["waiting"] == [3]
        assert log[2]["swapped"] == [2, 1]
        assert log[3]["back"] == [2, 1] and log[3]["admitted"] == [3]
    else:
        assert log[1]["waiting"] == [2, 3] and log[2]["waiting"] == [1, 2, 3]
        assert log[3]["admitted"] == [1, 2, 3]
    assert all(s.is_finished for s in (a, b, c, d)) and not sch.has_work
    assert_all_free(m, space)
