"""Goodput: the share of requests served within latency targets (DistServe, Zhong et al., OSDI 2024).

A request meets its service-level objective (SLO) when its time to first token is at most ``ttft_s`` *and*
its mean time per output token after the first (DistServe's TPOT: the mean of its inter-token gaps) is at most
``tpot_s``. A request with a single token has no gaps: only its TTFT counts. Throughput counts every token;
goodput counts only the requests a user would call served well - the measure disaggregation is designed for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SLO:
    """Latency targets, in seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
                raise ValueError(f"an SLO's {name} must be a positive number of seconds, got {v!r}")

    def scaled(self, factor: float) -> "SLO":
        return SLO(self.ttft_s * factor, self.tpot_s * factor)


@dataclass(frozen=True)
class Goodput:
    """Which requests met the SLO. Invariant: ``met <= min(ttft_met, tpot_met) <= total``."""

    slo: SLO
    total: int
    met: int
    ttft_met: int
    tpot_met: int

    @property
    def share(self) -> float:
        return self.met / self.total if self.total else float("nan")

    def text(self) -> str:
        return (
            f"{self.met}/{self.total} requests ({self.share:.0%}) within TTFT <= {self.slo.ttft_s * 1e3:.0f} ms and "
            f"TPOT <= {self.slo.tpot_s * 1e3:.1f} ms (TTFT met by {self.ttft_met}, TPOT by {self.tpot_met})"
        )


def goodput(token_times: dict[int, list[float]], arrival_s: dict[int, float], slo: SLO) -> Goodput:
    """``token_times[r]``: the wall times of request ``r``'s tokens (the same clock as ``arrival_s[r]``).
    Every request of ``arrival_s`` is counted; one with no token recorded meets nothing."""
    ttft_ok = tpot_ok = both = 0
    for rid, arrived in arrival_s.items():
        times = token_times.get(rid, [])
        if not times:
            continue
        first = times[0] - arrived <= slo.ttft_s
        gaps = np.diff(times)
        steady = len(gaps) == 0 or float(np.mean(gaps)) <= slo.tpot_s
        ttft_ok += first
        tpot_ok += steady
        both += first and steady
    return Goodput(slo, len(arrival_s), both, ttft_ok, tpot_ok)
