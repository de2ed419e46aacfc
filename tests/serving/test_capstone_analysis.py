"""Lesson 07's analysis on degenerate measurements (``lab/capstone``, ``lab/sustained``, ``lab/timing``'s verdicts):
a server measured at zero, servers that tie, rounds noisier than the margin, servers that never saturate in the rate
sweep, zero or failed step-cost fits. Nothing printed or drawn holds 'inf' or 'nan', nothing undecided is 'met', and a
bar's label is its own height over the base's."""

from __future__ import annotations

import re

import numpy as np
import pytest

from lesson_utils.lab import capstone, timing
from lesson_utils.lab.sustained import compare_rates, sustained_rate
from lesson_utils.lab.timing import Measurement, Timing

NAMES = ["HF generate", "naive contiguous", "paged", "paged + prefix cache"]
UNDEFINED = re.compile(r"(?<![A-Za-z_])-?(inf|nan)(?![A-Za-z_])", re.IGNORECASE)


def _runs(samples: dict[str, list[float]]) -> Measurement:
    timings = {n: Timing(n, list(v), "tok/s") for n, v in samples.items()}
    rounds = len(next(iter(samples.values())))
    return Measurement(timings, rounds, 1, timing.alternating_order(list(samples), rounds), 0.0)


def _clean(text: str) -> str:
    assert not UNDEFINED.search(text), text
    return text


OFFLINE = {
    "HF measured zero": {
        "HF generate": [0.0, 0.0, 0.0],
        "naive contiguous": [5.0, 5.1, 4.9],
        "paged": [9.0, 9.2, 8.8],
        "paged + prefix cache": [9.5, 9.1, 9.3],
    },
    "equal servers": {n: [10.0, 10.0, 10.0] for n in NAMES},
    "noise larger than the effect": {
        "HF generate": [10.0, 2.0, 10.0],
        "naive contiguous": [5.0, 20.0, 5.0],
        "paged": [30.0, 8.0, 40.0],
        "paged + prefix cache": [30.0, 30.0, 30.0],
    },
    "a NaN sample": {
        "HF generate": [10.0, float("nan"), 10.0],
        "naive contiguous": [5.0, 5.0, 5.0],
        "paged": [8.0, 8.0, 8.0],
        "paged + prefix cache": [9.0, 9.0, 9.0],
    },
}


@pytest.mark.parametrize("case", list(OFFLINE))
def test_offline_goals_give_no_verdict_the_rounds_do_not_decide(case):
    runs = _runs(OFFLINE[case])
    text = _clean(capstone.offline_goals(runs))
    assert " met " not in text and not text.count("met (")
    if case == "HF measured zero":
        assert "undefined (HF generate measured 0 tok/s in 3 of 3 rounds)" in text and "no verdict" in text
    if case == "a NaN sample":
        assert "undefined (a sample of HF generate is not a finite number)" in text
    if case == "equal servers":
        assert text.count("missed by") == 2
    if case == "noise larger than the effect":
        assert text.count("not decided: the rounds span") == 2


def test_a_ratio_every_round_agrees_on_is_judged():
    runs = _runs(
        {
            "HF generate": [2.0, 2.1, 1.9],
            "naive contiguous": [4.0, 4.0, 4.0],
            "paged": [9.0, 9.4, 8.6],
            "paged + prefix cache": [9.0, 9.0, 9.0],
        }
    )
    assert _clean(capstone.offline_goals(runs)).count("met (") == 2


@pytest.mark.parametrize("case", list(OFFLINE))
def test_bar_labels_are_the_bars_own_heights_over_the_base(case):
    runs = _runs(OFFLINE[case])
    drawn = {n: runs[n].median for n in NAMES}
    labels = capstone.bar_labels(drawn)
    for n, label in labels.items():
        _clean(label)
        base = drawn["HF generate"]
        if timing.defined(base) and base > 0 and timing.defined(drawn[n]):
            assert label == f"{drawn[n] / base:.1f}x"
        else:
            assert label == "n/a"
    if case == "noise larger than the effect":  # the bars' heights order the labels (paired ratios would not)
        order = sorted(NAMES, key=lambda n: drawn[n])
        assert [float(labels[n][:-1]) for n in order] == sorted(float(labels[n][:-1]) for n in order)


RATES = np.geomspace(0.5, 20, 8)
CURVES = {
    "paged never saturates": {
        "HF generate": [1, 1, 1.5, 3, 6, 9, 12, 15],
        "naive contiguous": [1, 1, 1, 1.5, 2.5, 5, 9, 14],
        "paged": [1, 1, 1, 1, 1, 1.1, 1.2, 1.3],
        "paged + prefix cache": [1] * 8,
    },
    "nobody saturates": {n: [1, 1, 1, 1.1, 1.2, 1.3, 1.4, 1.5] for n in NAMES},
    "zero step costs": {n: [0.0] * 8 for n in NAMES},
    "a failed fit": {**{n: [1, 1, 2, 4, 8, 16, 32, 64] for n in NAMES}, "paged": [float("nan")] * 8},
    "equal servers": {n: [1, 1, 2, 4, 8, 16, 32, 64] for n in NAMES},
}


@pytest.mark.parametrize("case", list(CURVES))
def test_sustained_rates_say_what_the_sweep_cannot_decide(case):
    report = capstone.rate_report({n: [float(x) for x in v] for n, v in CURVES[case].items()}, RATES)
    texts = [report.legend(n) for n in NAMES] + [report.sentence(), report.key_line()]
    for t in texts:
        _clean(t)
    key = report.key_line()
    verdict = key.split("goal >= 2x ", 1)[1]
    if case == "paged never saturates":
        assert "above 20.00/s (never saturated in the sweep)" in report.legend("paged")
        assert "at least" in report.ratio("paged", "naive contiguous").text()
    if case in ("nobody saturates", "zero step costs", "a failed fit"):
        assert verdict.startswith("no verdict") or verdict.startswith("not decided"), key
    if case == "equal servers":
        assert report.ratio("paged", "naive contiguous").text() == "1.00x" and verdict.startswith("missed by")
    assert not verdict.startswith("met") or case == "paged never saturates"


def test_a_lower_bound_decides_only_when_it_reaches_the_goal():
    saturating = sustained_rate([1, 1, 3, 9], [1, 2, 4, 8])
    assert saturating.saturated and 2 < saturating.rate < 4
    never = sustained_rate([1, 1, 1, 1], [1, 2, 4, 8])
    assert not never.saturated and never.highest_swept == 8
    low_bar = compare_rates("paged", never, "naive", sustained_rate([1, 5, 9, 9], [1, 2, 4, 8]))
    assert low_bar.at_least and low_bar.verdict(2).startswith("met")  # 8 / (<2) >= 2 whatever the true rate
    close = compare_rates("paged", never, "naive", sustained_rate([1, 1, 1, 3], [1, 2, 4, 8]))
    assert close.at_least and close.value < 2 and close.verdict(2).startswith("not decided")
    with pytest.raises(ValueError, match="increasing"):
        sustained_rate([1, 2], [2, 1])


@pytest.mark.parametrize("value", [None, float("inf"), float("-inf"), float("nan")])
def test_goal_verdict_never_judges_an_undefined_value(value):
    text = timing.goal_verdict(value, 2, unit="x", why_undefined="the base measured 0")
    assert text.startswith("no verdict") and "the base measured 0" in text and _clean(text)


def test_capstone_errors_and_numbers_print_nothing_undefined():
    assert capstone.relative_error(1.0, 0.0) is None and capstone.relative_error(float("nan"), 1.0) is None
    assert capstone.relative_error(1.5, 1.0) == pytest.approx(0.5)
    assert capstone.worst_error([None, -0.3, 0.1]) == pytest.approx(0.3) and capstone.worst_error([None]) is None
    assert _clean(capstone.percent_text(None)).startswith("n/a")
    assert capstone.percent_text(0.123) == "+12 %" and capstone.percent_text(-0.2, sign=False) == "20 %"
    assert timing.number_text(float("inf"), 2, "x", "n/a") == "n/a" and timing.ratio_of(3, 0) is None


def test_a_gain_is_placed_against_the_papers_range_only_where_its_spread_decides():
    from lesson_utils.lab.capstone import against_paper_range

    assert against_paper_range(1.63, (1.61, 1.67)).startswith("below the paper's 2.7-8x")
    assert against_paper_range(3.1).startswith("inside")
    assert against_paper_range(9.0, (8.5, 9.5)).startswith("above")
    assert against_paper_range(2.8, (2.5, 3.0)).startswith("undecided")  # the spread crosses 2.7
    assert against_paper_range(None).startswith("no verdict")
    assert against_paper_range(float("nan")).startswith("no verdict")
    assert against_paper_range(1.5, at_least=True).startswith("undecided")  # a lower bound under the range
    assert against_paper_range(3.0, at_least=True).startswith("at least 3.00x")
