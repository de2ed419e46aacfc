"""Lesson 11's arithmetic against a direct simulation and by hand."""

import random

import pytest

from lesson_utils.lab.spec_math import (
    acceptance_by_position,
    expected_tokens_per_step,
    predicted_speedup,
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
    assert acceptance_by_position(verified, 4) == [2 / 3, 1 / 3, 1 / 2, None]
    assert tokens_per_verify_step(verified) == pytest.approx((4 + 2 + 1 + 1) / 4)
    with pytest.raises(ValueError, match="no verification was recorded"):
        tokens_per_verify_step([])
