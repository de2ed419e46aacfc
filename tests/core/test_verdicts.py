"""verdicts.compare: the best median wins, and the win is called clear only when the ranges do not overlap."""

from __future__ import annotations

import pytest

from lesson_utils.lab.verdicts import Axis, compare

LATENCY = Axis("p99 ITL", "ms")
THROUGHPUT = Axis("throughput", "tok/s", higher_is_better=True, digits=1)


def test_the_lowest_median_wins_and_a_clear_win_needs_separate_ranges():
    v = compare(LATENCY, {"whole": [900, 1000, 1100], "chunked": [300, 310, 450], "small": [200, 260, 480]})
    assert v.ranking == ["small", "chunked", "whole"] and v.winner == "small" and v.runner_up == "chunked"
    assert not v.clear  # small's worst (480) is above chunked's best (300)
    assert "within this run's spread" in v.text() and "no winner can be named" in v.text()
    v = compare(LATENCY, {"whole": [900, 1000, 1100], "chunked": [300, 310, 450]})
    assert v.clear and "a clear win" in v.text() and v.text().startswith("p99 ITL: chunked lowest at 310 ms")


def test_higher_is_better_ranks_the_other_way():
    v = compare(THROUGHPUT, {"a": [30.0, 31.0, 32.0], "b": [35.0, 36.0, 40.0]})
    assert v.winner == "b" and v.clear and "highest" in v.text()
    v = compare(THROUGHPUT, {"a": [30.0, 31.0, 36.0], "b": [35.0, 36.0, 40.0]})
    assert v.winner == "b" and not v.clear  # b's worst (35) is below a's best (36)


def test_one_setup_and_bad_input():
    v = compare(LATENCY, {"only": [1.0]})
    assert v.clear and v.runner_up is None and v.text().startswith("p99 ITL: only")
    with pytest.raises(ValueError, match="at least one setup"):
        compare(LATENCY, {})
    with pytest.raises(ValueError, match="no samples"):
        compare(LATENCY, {"a": [1.0], "b": []})
