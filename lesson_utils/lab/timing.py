"""The course's one protocol for a timing a learner can trust (every timed ``KEY:`` line uses it).

:func:`measure` runs each variant once to warm up (caches, allocator, lazy imports: never timed), then
``repeats`` times, the order of the variants alternated from round to round (A B C, C B A, A B C, ...) so
that a machine that slows down or speeds up during the measurement favours none of them. It keeps every
sample. A :class:`Timing` reports the median and the spread (min - max) with the number of repeats; a ratio
of two variants is taken round by round, so it too has a spread (:meth:`Measurement.ratio`).

A shared machine distorts a timing silently. While it measures, :func:`measure` reads how much CPU time the
*other* processes of the machine used (``/proc/stat`` minus this process's own ``os.times()``; on a
system without ``/proc`` it falls back to the load average). When they took more than
:data:`CONTENTION_WARNING` of the machine, :meth:`Measurement.warning` says so, and :meth:`Measurement.report`
prints that warning before the numbers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from lesson_utils.core.progress import ticking
from lesson_utils.core.types import is_int

CONTENTION_WARNING = 0.25  # other processes' share of all cores' time above which a measurement is flagged


# ---- how busy is the machine? --------------------------------------------------------------------------
def _proc_stat() -> tuple[float, float] | None:
    """(busy seconds, total seconds) of all cores since boot, from ``/proc/stat``; None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return (total - idle) / hz, total / hz


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def contention_warning(share: float, how: str) -> str:
    """The warning a timed cell prints when other processes used more than :data:`CONTENTION_WARNING` of the
    machine ('' otherwise)."""
    if share <= CONTENTION_WARNING:
        return ""
    return (
        f"WARNING: other processes used {100 * share:.0f} % of this machine's CPU time while these timings were "
        f"taken ({how}): they are slower and noisier than on an idle machine. Close other work and re-run this "
        "cell to trust them."
    )


@dataclass
class ContentionProbe:
    """Measures what share of the machine's CPU time other processes used between :meth:`start` and
    :meth:`stop` (0 = the machine was ours; 0.5 = half of all cores' time went to someone else)."""

    _start: tuple[float, float, float] | None = None
    share: float = 0.0
    how: str = ""

    def start(self) -> "ContentionProbe":
        stat = _proc_stat()
        self._start = None if stat is None else (*stat, _own_cpu_seconds())
        self._load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> float:
        stat = _proc_stat()
        if self._start is not None and stat is not None:
            busy = stat[0] - self._start[0]
            total = stat[1] - self._start[1]
            own = _own_cpu_seconds() - self._start[2]
            self.share = max(0.0, (busy - own) / total) if total > 0 else 0.0
            self.how = "other processes' share of all cores' time (/proc/stat)"
        elif self._load0 is not None:
            cores = os.cpu_count() or 1
            load = max(self._load0, os.getloadavg()[0])
            self.share = max(0.0, (load - 1.0) / cores)  # this process accounts for about one runnable thread
            self.how = "load average beyond this process, per core"
        return self.share

    def warning(self) -> str:
        """After :meth:`stop`: the warning to print, or ''."""
        return contention_warning(self.share, self.how)


# ---- timings -------------------------------------------------------------------------------------------
def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        if value < 1e-3:
            return f"{value * 1e6:.1f} µs"
        if value < 1:
            return f"{value * 1e3:.1f} ms"
        return f"{value:.2f} s"
    return f"{value:.3g} {unit}".rstrip()


@dataclass
class Timing:
    """Every sample of one variant (seconds, or whatever ``value=`` measured), in the order taken."""

    name: str
    samples: list[float]
    unit: str = "s"
    results: list[Any] = field(default_factory=list, repr=False)  # what each timed call returned

    @property
    def repeats(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return float(np.median(self.samples))

    @property
    def low(self) -> float:
        return float(min(self.samples))

    @property
    def high(self) -> float:
        return float(max(self.samples))

    @property
    def relative_spread(self) -> float:
        """(max - min) / median."""
        return (self.high - self.low) / self.median if self.median else float("nan")

    def text(self, scale: float = 1.0, unit: str | None = None, digits: int = 1) -> str:
        """``'12.3 (median of 5, 11.9-13.1) ms'`` - the samples times ``scale``, in ``unit``."""
        if unit is None:
            if scale != 1.0:
                raise ValueError("give the unit of the scaled values")
            return f"{_fmt(self.median, self.unit)} (median of {self.repeats}, {_fmt(self.low, self.unit)} - {_fmt(self.high, self.unit)})"
        m, lo, hi = self.median * scale, self.low * scale, self.high * scale
        return f"{m:.{digits}f} {unit} (median of {self.repeats}, {lo:.{digits}f}-{hi:.{digits}f})"

    def __str__(self) -> str:
        return f"{self.name}: {self.text()}"


@dataclass(frozen=True)
class Ratio:
    """A ratio of two variants, round by round: its median and spread. ``defined`` is False when a round divided by
    zero or met an undefined sample: the ratio then has no value to print or judge, and :meth:`text` says why."""

    median: float
    low: float
    high: float
    repeats: int
    why_undefined: str = ""

    @property
    def defined(self) -> bool:
        return not self.why_undefined and all(np.isfinite(x) for x in (self.median, self.low, self.high))

    def text(self, digits: int = 2) -> str:
        if not self.defined:
            return f"undefined ({self.why_undefined or 'a round had no finite value'})"
        return (
            f"{self.median:.{digits}f}x (median of {self.repeats} rounds, {self.low:.{digits}f}-{self.high:.{digits}f})"
        )

    def __str__(self) -> str:
        return self.text()


@dataclass
class Measurement:
    """What :func:`measure` found: one :class:`Timing` per variant, the protocol it followed, and how busy the
    machine was meanwhile."""

    timings: dict[str, Timing]
    repeats: int
    warmup: int
    order: list[list[str]]  # the order of the variants in each round
    contention: float  # other processes' share of the machine while measuring (see ContentionProbe)
    contention_how: str = ""

    def __getitem__(self, name: str) -> Timing:
        return self.timings[name]

    def ratio(self, a: str, b: str) -> Ratio:
        """``a / b`` round by round (sample ``i`` of ``a`` over sample ``i`` of ``b``); undefined (saying why) when a
        round of ``b`` is zero or a sample is not a finite number."""
        num, den = np.array(self.timings[a].samples, float), np.array(self.timings[b].samples, float)
        why = ""
        if not (np.isfinite(num).all() and np.isfinite(den).all()):
            why = f"a sample of {a if not np.isfinite(num).all() else b} is not a finite number"
        elif (den == 0).any():
            why = f"{b} measured 0 {self.timings[b].unit} in {int((den == 0).sum())} of {len(den)} rounds"
        if why:
            return Ratio(float("nan"), float("nan"), float("nan"), len(den), why)
        r = num / den
        return Ratio(float(np.median(r)), float(r.min()), float(r.max()), len(r))

    @property
    def contended(self) -> bool:
        return self.contention > CONTENTION_WARNING

    def warning(self) -> str:
        """A visible warning when the machine was shared while measuring ('' when it was not)."""
        return contention_warning(self.contention, self.contention_how)

    def protocol(self) -> str:
        """One line: how the numbers were taken."""
        return (
            f"{self.warmup} warm-up run(s) each, then {self.repeats} repeats in alternating order; median and "
            f"min-max; other processes used {100 * self.contention:.0f} % of the machine meanwhile"
        )

    def report(self, scale: float = 1.0, unit: str | None = None, digits: int = 1) -> str:
        lines = [self.warning()] if self.contended else []
        lines += [f"{t.name}: {t.text(scale, unit, digits)}" for t in self.timings.values()]
        lines.append(f"({self.protocol()})")
        return "\n".join(lines)


def alternating_order(names: list[str], rounds: int) -> list[list[str]]:
    """A B C, C B A, A B C, ...: each variant is as often early as it is late."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def measure(
    variants: dict[str, Callable[[], Any]],
    *,
    repeats: int = 5,
    warmup: int = 1,
    value: Callable[[Any, float], float] | None = None,
    unit: str = "s",
    warmup_variants: dict[str, Callable[[], Any]] | None = None,
    sync: Callable[[], None] | None = None,
    progress: str | None = None,
) -> Measurement:
    """Time every variant ``repeats`` times after ``warmup`` untimed calls each, alternating their order.

    ``variants`` maps a name to a call with no arguments. Each sample is the call's wall time in seconds, or
    ``value(result, seconds)`` when given (e.g. tokens per second from a serving run's own result; its unit is
    then ``unit``). ``warmup_variants`` replaces the calls used to warm up (a short workload instead of the
    whole one). ``sync`` is called before the clock starts and before it stops (``torch.cuda.synchronize`` on
    a GPU: the clock then measures the device's work, not the launch). ``progress`` labels a bar that moves
    once per call.
    """
    if not variants:
        raise ValueError("measure needs at least one variant")
    if not is_int(repeats) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if not is_int(warmup) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    names = list(variants)
    warm = warmup_variants or variants
    if set(warm) != set(names):
        raise ValueError(f"warmup_variants must name the same variants as variants: {sorted(names)}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(names) * (repeats + warmup), desc=progress, leave=False)
    with ticking(bar):  # its clock moves between runs seconds apart (a redraw a second: nothing measurable)
        for _ in range(warmup):
            for name in names:
                warm[name]()
                if bar is not None:
                    bar.update(1)
        order = alternating_order(names, repeats)
        timings = {name: Timing(name, [], unit if value is not None else "s") for name in names}
        probe = ContentionProbe().start()
        for round_names in order:
            for name in round_names:
                if sync is not None:
                    sync()
                t0 = time.perf_counter()
                result = variants[name]()
                if sync is not None:
                    sync()
                seconds = time.perf_counter() - t0
                timings[name].samples.append(float(value(result, seconds)) if value is not None else seconds)
                timings[name].results.append(result)
                if bar is not None:
                    bar.update(1)
        probe.stop()
    if bar is not None:
        bar.close()
    return Measurement(timings, repeats, warmup, order, probe.share, probe.how)


def defined(value) -> bool:
    """A number that can be printed, compared and judged: not None, not NaN, not infinite."""
    try:
        return value is not None and bool(np.isfinite(float(value)))
    except (TypeError, ValueError):
        return False


def ratio_of(a, b) -> float | None:
    """``a / b``, or None when it is undefined (``b`` zero, either one missing or not finite)."""
    if not (defined(a) and defined(b)) or float(b) == 0:
        return None
    return float(a) / float(b)


def number_text(value, digits: int = 2, unit: str = "", undefined: str = "undefined") -> str:
    """``value`` as printed text (``'2.41x'``), or ``undefined`` (say why, e.g. ``'n/a (HF measured 0 tok/s)'``) when it
    is None, NaN or infinite: no 'inf' or 'nan' ever reaches a printed line or a label."""
    return f"{float(value):.{digits}f}{unit}" if defined(value) else undefined


def goal_verdict(
    value,
    goal: float,
    *,
    higher_is_better: bool = True,
    unit: str = "",
    digits: int = 2,
    spread: tuple[float, float] | None = None,
    why_undefined: str = "",
) -> str:
    """'met (2.41x >= 2x)' or 'missed by 0.30x (1.70x < 2x)': a printed goal always carries its verdict.

    There is no verdict on an undefined value (None, NaN, infinite: 'no verdict: ...'), and none when ``spread``
    (the lowest and highest value over repeated rounds) lies on both sides of the goal: the noise is larger than what
    the verdict would say ('not decided: ...')."""
    g = f"{goal:g}{unit}"
    if not defined(value):
        return f"no verdict: the value is undefined ({why_undefined or 'a zero, missing or infinite measurement'})"
    ok = value >= goal if higher_is_better else value <= goal
    v = f"{value:.{digits}f}{unit}"
    if spread is not None:
        low, high = spread
        if not (defined(low) and defined(high)):
            return f"no verdict: its spread is undefined ({why_undefined or 'a round had no finite value'})"
        if low < goal <= high if higher_is_better else low <= goal < high:
            return (
                f"not decided: the rounds span {low:.{digits}f}-{high:.{digits}f}{unit}, on both sides of {g} "
                f"(median {v}); the noise is larger than the margin"
            )
    if ok:
        return f"met ({v} {'>=' if higher_is_better else '<='} {g})"
    return f"missed by {abs(value - goal):.{digits}f}{unit} ({v} {'<' if higher_is_better else '>'} {g})"


def ratio_verdict(ratio: Ratio, goal: float, *, digits: int = 2) -> str:
    """:func:`goal_verdict` for a ratio taken round by round: judged on its median, decided only when every round
    lies on the same side of the goal, no verdict when it is undefined."""
    return goal_verdict(
        ratio.median if ratio.defined else None,
        goal,
        unit="x",
        digits=digits,
        spread=(ratio.low, ratio.high) if ratio.defined else None,
        why_undefined=ratio.why_undefined,
    )
