"""Lesson 11's arithmetic against a direct simulation and by hand."""

import random

import pytest

from lesson_utils.lab.spec_math import (
    RecordedProposer,
    acceptance_by_position,
    acceptance_rate,
    expected_tokens_per_step,
    pick_k,
    predicted_speedup,
    replayed_speedup,
    t4_step_roofline_s,
    tokens_per_verify_step,
)


@pytest.mark.parametrize("a, k", [(0.0, 4), (0.5, 1), (0.7, 4), (0.9, 8), (1.0, 3)])
def test_the_expected_tokens_per_step_match_a_simulation(a, k):
    rng = random.Random(0)
    trials, total = 20000, 0
    for _ in range(trials):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        total += n + 1
    assert expected_tokens_per_step(a, k) == pytest.approx(total / trials, rel=0.02)


def test_the_speedup_and_its_refusals():
    assert predicted_speedup(0.5, 1, verify_cost=1.0, decode_cost=1.0) == pytest.approx(1.5)
    assert predicted_speedup(0.0, 4, verify_cost=2.0, decode_cost=1.0) == pytest.approx(0.5)  # drafts never kept
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)
    with pytest.raises(ValueError):
        predicted_speedup(0.5, 2, 0.0, 1.0)


def test_acceptance_is_counted_by_position():
    verified = [(0, 1, 3, 3), (0, 2, 3, 1), (1, 1, 2, 0), (2, 2, 0, 0)]
    # position 2 is judged only where position 1 was kept; position 3 only where 1 and 2 were
    assert acceptance_by_position(verified, 4) == [2 / 3, 1 / 2, 1.0, None]
    assert tokens_per_verify_step(verified) == pytest.approx((4 + 2 + 1 + 1) / 4)
    with pytest.raises(ValueError, match="no verification was recorded"):
        tokens_per_verify_step([])


def test_the_acceptance_rate_counts_only_judged_drafts():
    verified = [(0, 1, 3, 3), (0, 2, 3, 1), (1, 1, 2, 0)]  # judged 3, 2 and 1 drafts; kept 3, 1, 0
    assert acceptance_rate(verified) == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="no draft was judged"):
        acceptance_rate([])


def test_pick_k_takes_the_best_predicted_speedup_and_the_smallest_of_equals():
    cost = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 1.8}
    k, s = pick_k(0.5, cost)
    speedups = {k: expected_tokens_per_step(0.5, k) / cost[k + 1] for k in range(1, 5)}
    assert k == max(speedups, key=speedups.get) and s == pytest.approx(speedups[k])
    assert pick_k(0.0, {1: 1.0, 2: 1.0, 3: 1.0}) == (0, 1.0)  # nothing kept: speculation cannot pay
    assert pick_k(1.0, {1: 1.0, 2: 1.0, 3: 1.0}) == (2, 3.0)  # every draft kept, free: the most drafts
    assert pick_k(0.9, {1: 1.0}) == (0, 1.0)  # only a decode step measured


def test_a_replayed_speedup_uses_the_runs_own_drafts():
    cost = {1: 1.0, 2: 2.0, 3: 2.0}
    # one verification of 2 drafts keeping 1 (2 tokens for 2.0), two undrafted steps (1 token for 1.0 each)
    assert replayed_speedup([(0, 1, 2, 1)], 2, cost) == pytest.approx(4 / 4.0)
    assert replayed_speedup([(0, 1, 1, 1)], 0, cost) == pytest.approx(2 / 2.0)
    with pytest.raises(ValueError):
        replayed_speedup([], 0, cost)


def test_a_recorded_proposer_notes_every_call_and_keeps_its_name():
    def lookup(ids, k):
        return ids[:k]

    rec = RecordedProposer(lookup)
    assert rec([5, 6, 7], 2) == [5, 6] and rec([], 3) == []
    assert rec.calls == [(2, 2), (3, 0)] and rec.undrafted == 1 and rec.__name__ == "lookup"


def test_the_t4_roofline_is_read_bound_for_a_small_model_at_few_tokens():
    read_s, math_s = t4_step_roofline_s(125_000_000, 9)
    assert read_s == pytest.approx(2 * 125e6 / 320e9) and math_s == pytest.approx(2 * 125e6 * 9 / 65e12)
    assert math_s < read_s


def test_the_t4_decode_prediction_adds_up():
    from lesson_utils.lab.t4_roofline import T4_BYTES_PER_S, compute_bound_from_tokens, t4_decode

    p = t4_decode(125_000_000, 36_864, 16, 40, operators=500)
    assert p.weights_s == pytest.approx(250e6 / T4_BYTES_PER_S)
    assert p.kv_s == pytest.approx(16 * 40 * 36_864 / T4_BYTES_PER_S)
    assert p.break_even_launch_s == pytest.approx(p.weights_s / 500)
    assert p.bound_s == pytest.approx(p.weights_s + p.kv_s)  # 16 tokens: far below the compute-bound crossing
    assert 190 < compute_bound_from_tokens() < 210
    big = t4_decode(125_000_000, 36_864, 1000, 1, operators=500)
    assert big.bound_s == pytest.approx(big.flops_s)  # 1000 tokens fed: the multiply-adds dominate
    assert "PREDICTED for a T4" in p.text() and "not measured" in p.text()


@pytest.mark.parametrize("prefer", ["earliest", "latest"])
def test_the_greedy_replay_equals_the_engines_record(prefer):
    """Greedy speculation's verdicts are fixed by the greedy answer: replaying a proposer over the answer gives the
    scheduler's own record, step for step (a tiny random model repeats itself, so drafts are both kept and refused)."""
    from functools import partial

    import torch

    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.lab.spec_math import replay_greedy
    from lesson_utils.model import weights_from_hf
    from lesson_utils.model.catalog import random_causal_lm, tiny_config
    from lesson_utils.serving.engine import Engine
    from lesson_utils.serving.speculative import Speculation, prompt_lookup

    w = weights_from_hf(random_causal_lm(tiny_config("llama"), 3).to(torch.float32))
    propose = partial(prompt_lookup, prefer=prefer)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 40) for _ in range(rng.randrange(4, 20))] * 2 for _ in range(4)]
    eng = Engine(w, PagedKVCache.for_model(w, 64, 4), stop_at_eos=False, speculation=Speculation(3, propose))
    answers = eng.generate(prompts, 17)
    seq_ids = sorted({sid for _, sid, _, _ in eng.scheduler.verified})
    kept_some = refused_some = False
    for sid, prompt, answer in zip(seq_ids, prompts, answers):
        engine_record = [(d, a) for _, s, d, a in eng.scheduler.verified if s == sid]
        replay = replay_greedy(prompt, answer, propose, 3, 17)
        assert [(d, a) for _, _, d, a in replay.verified] == engine_record
        kept_some |= any(a for _, a in engine_record)
        refused_some |= any(a < d for d, a in engine_record)
    assert kept_some and refused_some  # the case tests both verdicts


def test_the_replay_refuses_an_empty_answer_and_asks_no_more_than_the_request_allows():
    from lesson_utils.lab.spec_math import replay_greedy

    with pytest.raises(ValueError, match="prefill"):
        replay_greedy([1, 2], [], lambda ids, k: [], 4, 8)
    asked = []
    replay_greedy([1, 2, 1, 2], [1, 2, 1, 2, 1], lambda ids, k: asked.append(k) or [], 4, 5)
    assert asked == [3, 2, 1]  # 5 tokens at most: the room shrinks; with one token left nothing is asked
