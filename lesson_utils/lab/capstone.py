"""Lesson 07's comparisons of its four servers, as text: bar labels, the offline goals and the sustained rates.

Each function turns measurements into the words and numbers a cell prints or draws, and each keeps the honesty rules
when the measurements are degenerate (a server measured at 0 tok/s, servers that tie, rounds noisier than the margin,
a server that never saturated in the rate sweep): an undefined number is printed as what it is, never as 'inf' or
'nan', and a goal is judged only where the measurements decide it (:func:`~lesson_utils.lab.timing.goal_verdict`).
``tests/serving/test_capstone_analysis.py`` feeds them such inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lesson_utils.lab.sustained import RateComparison, SustainedRate, compare_rates, sustained_rate
from lesson_utils.lab.timing import Measurement, number_text, ratio_of, ratio_verdict

BASE, NAIVE, PAGED, PREFIX = "HF generate", "naive contiguous", "paged", "paged + prefix cache"


def bar_labels(drawn: dict[str, float], base: str = BASE, digits: int = 1) -> dict[str, str]:
    """Each bar's label: the value the bar draws over the value ``base``'s bar draws, so a label never contradicts
    the heights beside it ('n/a' where ``base`` drew 0 or a value is undefined)."""
    return {n: number_text(ratio_of(v, drawn[base]), digits, "x", "n/a") for n, v in drawn.items()}


def offline_goals(runs: Measurement) -> str:
    """The offline goals, each with its ratio round by round and its verdict: paged / HF static >= 3.5x, paged /
    naive >= 1.8x."""
    vs_hf, vs_naive = runs.ratio(PAGED, BASE), runs.ratio(PAGED, NAIVE)
    return (
        f"offline paged / HF static = {vs_hf}: goal >= 3.5x {ratio_verdict(vs_hf, 3.5)}; "
        f"paged / naive = {vs_naive}: goal >= 1.8x {ratio_verdict(vs_naive, 1.8)}"
    )


@dataclass(frozen=True)
class RateReport:
    """Every server's sustained rate on one simulated sweep, and the comparisons lesson 07 prints."""

    knee: dict[str, SustainedRate]

    def legend(self, name: str) -> str:
        return f"{name} (sustains {self.knee[name].text()})"

    def ratio(self, a: str, b: str) -> RateComparison:
        return compare_rates(a, self.knee[a], b, self.knee[b])

    def sentence(self) -> str:
        return (
            f"sustained rate, paged / naive = {self.ratio(PAGED, NAIVE).text()}; paged / HF static = "
            f"{self.ratio(PAGED, BASE).text()}; paged + prefix / paged = {self.ratio(PREFIX, PAGED).text()} (simulated)"
        )

    def key_line(self) -> str:
        knee = self.ratio(PAGED, NAIVE)
        return (
            "sustained rate (simulated from measured step costs): "
            + ", ".join(f"{n} {r.text()}" for n, r in self.knee.items())
            + f"; paged / naive = {knee.text()}: goal >= 2x {knee.verdict(2)}"
        )


def rate_report(curves: dict[str, list[float]], rates) -> RateReport:
    """Each server's sustained rate from its simulated latency curve over ``rates``."""
    return RateReport({n: sustained_rate(lat, rates) for n, lat in curves.items()})


PAPER_PAGING_GAIN = (2.7, 8.0)  # vLLM's sustained request rate over Orca (Max)'s, ShareGPT (§6.2)


def against_paper_range(
    value: float | None,
    spread: tuple[float, float] | None = None,
    *,
    at_least: bool = False,
    paper: tuple[float, float] = PAPER_PAGING_GAIN,
) -> str:
    """Where a gain lies against a published range ('inside', 'below', 'above' the paper's 2.7-8x), judged on its
    whole ``spread`` (min, max) when one is given: a spread that crosses an edge of the range decides nothing. A
    lower bound (``at_least``) can only be placed above an edge it already passed. No verdict when undefined."""
    lo, hi = paper
    rng = f"the paper's {lo:g}-{hi:g}x"
    if value is None or not np.isfinite(value):
        return f"no verdict against {rng} (undefined)"
    a, b = spread if spread is not None else (value, value)
    if at_least:
        if a > hi:
            return f"above {rng}"
        return (
            f"at least {value:.2f}x: inside or above {rng}" if a >= lo else f"undecided against {rng} (a lower bound)"
        )
    if b < lo:
        return f"below {rng}"
    if a > hi:
        return f"above {rng}"
    if lo <= a and b <= hi:
        return f"inside {rng}"
    return f"undecided against {rng}: its spread crosses an edge of the range"


# ---- the cost model against real runs ---------------------------------------------------------------------------
def relative_error(model: float, measured: float) -> float | None:
    """``model / measured - 1``, or None when the measurement is zero or either value is undefined."""
    r = ratio_of(model, measured)
    return None if r is None else r - 1


def worst_error(errors) -> float | None:
    """The largest absolute error among the defined ones; None when none is defined."""
    return max((abs(e) for e in errors if e is not None), default=None)


def percent_text(error: float | None, *, sign: bool = True) -> str:
    """``'+12 %'`` (or ``'12 %'`` without ``sign``), or ``'n/a (a measured value is zero)'`` for an undefined error."""
    if error is None:
        return "n/a (a measured value is zero)"
    return number_text(100 * abs(error), 0, " %") if not sign else f"{100 * error:+.0f} %"
