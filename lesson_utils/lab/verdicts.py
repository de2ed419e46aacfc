"""Which setup won on which axis - from repeated runs, with the spread deciding whether it may be said.

A verdict names the best setup by the median of its samples, and calls the win *clear* only when the winner's
worst sample still beats the runner-up's best one (their ranges do not overlap). Otherwise the text says the
two are within this run's spread, which is what an honest sentence about three noisy runs can say.
"""

from __future__ import annotations

from dataclasses import dataclass

from lesson_utils.lab.timing import Timing


@dataclass(frozen=True)
class Axis:
    """One thing a setup is judged on: its name, unit, and which direction is better."""

    name: str
    unit: str
    higher_is_better: bool = False
    digits: int = 0


@dataclass(frozen=True)
class AxisVerdict:
    """The setups' samples on one axis, ordered best first by median.

    Invariant: ``ranking[0]`` has the best median; ``clear`` is true only if its worst sample is better than
    the best sample of ``ranking[1]``."""

    axis: Axis
    timings: dict[str, Timing]
    ranking: list[str]
    clear: bool

    @property
    def winner(self) -> str:
        return self.ranking[0]

    @property
    def runner_up(self) -> str | None:
        return self.ranking[1] if len(self.ranking) > 1 else None

    def value(self, name: str) -> str:
        return self.timings[name].text(unit=self.axis.unit, digits=self.axis.digits)

    def text(self) -> str:
        a, best = self.axis, self.winner
        word = "highest" if a.higher_is_better else "lowest"
        if self.runner_up is None:
            return f"{a.name}: {best} {self.value(best)}"
        second = self.runner_up
        how = (
            "a clear win (the ranges do not overlap)"
            if self.clear
            else "within this run's spread of each other (the ranges overlap): no winner can be named"
        )
        return f"{a.name}: {best} {word} at {self.value(best)}, then {second} at {self.value(second)} - {how}"


def compare(axis: Axis, samples: dict[str, list[float]]) -> AxisVerdict:
    """The verdict on ``axis`` for ``samples`` (setup name -> one value per repeated run, in ``axis.unit``)."""
    if not samples:
        raise ValueError("compare needs at least one setup")
    for name, values in samples.items():
        if not values:
            raise ValueError(f"setup {name!r} has no samples")
    timings = {name: Timing(name, [float(v) for v in values], axis.unit) for name, values in samples.items()}
    sign = -1.0 if axis.higher_is_better else 1.0
    ranking = sorted(timings, key=lambda n: sign * timings[n].median)
    clear = True
    if len(ranking) > 1:
        best, second = timings[ranking[0]], timings[ranking[1]]
        clear = best.low > second.high if axis.higher_is_better else best.high < second.low
    return AxisVerdict(axis, timings, ranking, clear)
