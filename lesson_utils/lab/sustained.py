"""The request rate a server sustains, read off a latency-vs-rate sweep (lesson 07's Fig. 12 shape), and how two
servers compare - with the cases a sweep cannot decide said as such, never as an infinite number.

A server *sustains* a rate while its normalized latency stays within ``factor`` (2x) of its value at the lowest rate
swept; the sustained rate is where the curve crosses that limit (log-interpolated between the two rates around the
crossing). A server whose curve never crosses it kept up over the whole sweep: its sustained rate is only known to be
above the highest rate swept. A curve with a zero, negative or non-finite latency (a zero or failed step-cost fit)
has no sustained rate at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lesson_utils.lab.timing import goal_verdict


@dataclass(frozen=True)
class SustainedRate:
    """``rate`` requests/s where the curve crossed ``factor`` times its first latency; None when it did not cross
    (``saturated`` False: it kept up to ``highest_swept``) or when the curve is undefined (``why_undefined``)."""

    rate: float | None
    highest_swept: float
    why_undefined: str = ""

    @property
    def saturated(self) -> bool:
        return self.rate is not None

    @property
    def defined(self) -> bool:
        return not self.why_undefined

    def text(self, digits: int = 2) -> str:
        if not self.defined:
            return f"undefined ({self.why_undefined})"
        if self.rate is None:
            return f"above {self.highest_swept:.{digits}f}/s (never saturated in the sweep)"
        return f"{self.rate:.{digits}f}/s"


def sustained_rate(latencies, rates, factor: float = 2.0) -> SustainedRate:
    """The sustained rate of a curve: ``latencies[i]`` at ``rates[i]`` (increasing, positive)."""
    lat, r = np.asarray(latencies, float), np.asarray(rates, float)
    if len(lat) != len(r) or len(r) < 2:
        raise ValueError(
            f"a sweep needs two or more rates, one latency each (got {len(r)} rates, {len(lat)} latencies)"
        )
    if not (np.isfinite(r).all() and (r > 0).all() and (np.diff(r) > 0).all()):
        raise ValueError("the swept rates must be positive, finite and increasing")
    highest = float(r[-1])
    if not (np.isfinite(lat).all() and (lat > 0).all()):
        return SustainedRate(
            None, highest, "a simulated latency is zero or not finite: the step-cost fit is zero or failed"
        )
    limit = factor * lat[0]
    for i in range(1, len(r)):
        if lat[i] > limit:
            f = (np.log(limit) - np.log(lat[i - 1])) / (np.log(lat[i]) - np.log(lat[i - 1]))
            return SustainedRate(float(np.exp(np.log(r[i - 1]) + f * (np.log(r[i]) - np.log(r[i - 1])))), highest)
    return SustainedRate(None, highest)


@dataclass(frozen=True)
class RateComparison:
    """``a``'s sustained rate over ``b``'s: a number when both saturated, a lower bound when only ``b`` did (``a``
    kept up past the whole sweep), undefined when ``b`` never saturated or either curve is undefined."""

    a: str
    b: str
    value: float | None  # the ratio, or its lower bound when ``at_least``
    at_least: bool = False
    why_undefined: str = ""

    def text(self, digits: int = 2) -> str:
        if self.value is None:
            return f"undefined ({self.why_undefined})"
        return f"{'at least ' if self.at_least else ''}{self.value:.{digits}f}x"

    def verdict(self, goal: float, digits: int = 2) -> str:
        """A verdict only where the sweep decides it: a ratio, or a lower bound already at or above the goal."""
        if self.value is None:
            return goal_verdict(None, goal, unit="x", why_undefined=self.why_undefined)
        if self.at_least and self.value < goal:
            return (
                f"not decided: {self.a} never saturated, so the ratio is only known to be at least "
                f"{self.value:.{digits}f}x (< {goal:g}x); sweep higher rates to decide"
            )
        return goal_verdict(self.value, goal, unit="x", digits=digits)


def compare_rates(a: str, rate_a: SustainedRate, b: str, rate_b: SustainedRate) -> RateComparison:
    """``a`` / ``b`` by their sustained rates (see :class:`RateComparison`)."""
    for name, r in ((a, rate_a), (b, rate_b)):
        if not r.defined:
            return RateComparison(a, b, None, why_undefined=f"{name}'s curve: {r.why_undefined}")
    if not rate_b.saturated:
        return RateComparison(
            a,
            b,
            None,
            why_undefined=f"{b} never saturated up to {rate_b.highest_swept:.2f}/s: its sustained rate is unknown",
        )
    if not rate_a.saturated:
        return RateComparison(a, b, rate_a.highest_swept / rate_b.rate, at_least=True)
    return RateComparison(a, b, rate_a.rate / rate_b.rate)
