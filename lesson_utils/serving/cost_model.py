"""What a step costs: the work it does (:class:`StepWork`) and a cost model fitted to measured steps (:class:`StepCost`).

A step's time is modelled as ``fixed + per_decode x decodes + per_prefill_token x prefill tokens +
per_context_token x context tokens``: a part every step pays (on a GPU above all reading the weights once; on
a CPU the weight matmuls and the framework's per-operation overhead), a part per sequence that decodes, a
part per prompt token fed, and a part per cached token attended over. :meth:`StepCost.fit` finds the four
coefficients from a server's own measured steps (least squares, none negative); the simulator
(:func:`lesson_utils.serving.simulator.simulate` with ``step_cost=``) then advances its clock by the modelled
cost of each step it plans, so a rate sweep that would take hours of real serving on a CPU takes seconds -
and says it is a model, checked against the real run at the rate that ran. :class:`RowBucketCost` is the
same model with its fixed part looked up per bucket of rows (tokens fed): on a CPU a step's time jumps with its
row count, and lesson 07's step profile measures by how much. Anything with ``cost(work) -> seconds`` can clock the
simulator (:class:`StepCostModel`).

:class:`ChunkCost` is lesson 08's view of the same steps: ``fixed + per_decode x decodes + per_prompt_token x
prompt tokens + per_token_squared x (tokens in the step)^2``. The squared term is there because on a CPU a
step's cost per token is not constant: a 900-token step costs more per token than a 128-token one (lesson 08
measures it). Causal attention scores the same query-key pairs however a prompt is cut, so what grows is the
size of one step's work, not the work in total.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np
from scipy.optimize import nnls

FEATURES = ("fixed", "per decode", "per prefill token", "per context token")


@dataclass(frozen=True)
class StepWork:
    """The work of one step: sequences that decoded (one newest token each), prompt tokens fed, K/V tokens attended
    over (summed over the step's sequences, their new tokens included), and lesson 11's drafted tokens fed after the
    newest tokens of verifying sequences (0 without speculation)."""

    decodes: int
    prefill_tokens: int
    context_tokens: int
    drafted: int = 0

    @classmethod
    def of_plan(cls, plan) -> "StepWork":
        """The work of a :class:`~lesson_utils.serving.scheduler.StepPlan` once it has run (each scheduled
        sequence's ``num_computed`` then counts the tokens its last token attended over)."""
        fed = sum(plan.num_tokens)
        drafted = sum(n - 1 for n in plan.sample_counts)  # a sampler's logits rows beyond its first: its drafts
        return cls(
            fed - plan.prefill_tokens - drafted,
            plan.prefill_tokens,
            sum(s.num_computed for s in plan.scheduled),
            drafted,
        )

    def features(self) -> np.ndarray:
        """Lesson 07's features (:class:`StepCost`): a drafted token counts as a decode."""
        return np.array([1.0, self.decodes + self.drafted, self.prefill_tokens, self.context_tokens])

    @property
    def rows(self) -> int:
        """Tokens the step feeds the model: the rows of its matrix products."""
        return self.decodes + self.drafted + self.prefill_tokens

    def verify_features(self) -> np.ndarray:
        """Lesson 11's features (:class:`VerifyCost`): drafted tokens apart from the decodes, and whether the step
        feeds more than one row."""
        return np.array(
            [1.0, self.decodes, self.drafted, self.prefill_tokens, self.context_tokens, float(self.rows > 1)]
        )

    def chunk_features(self) -> np.ndarray:
        """Lesson 08's features (:class:`ChunkCost`)."""
        tokens = self.decodes + self.drafted + self.prefill_tokens
        return np.array([1.0, self.decodes + self.drafted, self.prefill_tokens, tokens * tokens])


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (SciPy's Lawson-Hanson). Columns are scaled to a largest entry of 1
    first: a count of context tokens runs to thousands where a bucket's indicator is 0 or 1."""
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    x, _ = nnls(a / scale, b, maxiter=50 * a.shape[1])
    return x / scale


def _fit(a: np.ndarray, seconds) -> tuple[np.ndarray, float]:
    """Non-negative least squares of ``seconds`` on the feature rows ``a``; the coefficients and the median
    relative error of the fitted steps."""
    y = np.asarray(seconds, dtype=float)
    if len(a) != len(y):
        raise ValueError(f"{len(a)} steps of work but {len(y)} timings")
    if len(y) < a.shape[1]:
        raise ValueError(f"fitting {a.shape[1]} coefficients needs at least {a.shape[1]} measured steps, got {len(y)}")
    x = _nonnegative_least_squares(a, y)
    err = np.abs(a @ x - y) / np.maximum(y, 1e-12)
    return x, float(np.median(err))


class _LinearCost:
    """What the cost models share: seconds = their ``num_coefficients`` coefficients (the dataclass's first fields)
    dotted with ``_features(work)``, fitted by non-negative least squares. A subclass is a frozen dataclass with
    those fields, then ``num_steps`` and ``median_error``, and names its features."""

    num_coefficients = 4

    @staticmethod
    def _features(work: StepWork) -> np.ndarray:  # pragma: no cover - every subclass names its own
        raise NotImplementedError

    def __call__(self, work: StepWork) -> float:
        return float(self.coefficients() @ self._features(work))

    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)[: self.num_coefficients]])

    @classmethod
    def fit(cls, works: list[StepWork], seconds: list[float]):
        """The least-squares fit (no coefficient negative) to measured steps; needs at least as many as it has
        coefficients."""
        n = cls.num_coefficients
        x, err = _fit(np.stack([cls._features(w) for w in works]) if works else np.zeros((0, n)), seconds)
        return cls(*map(float, x), num_steps=len(works), median_error=err)


@dataclass(frozen=True)
class StepCost(_LinearCost):
    """Seconds a step costs, as a linear function of its :class:`StepWork` (module docstring)."""

    fixed_s: float
    per_decode_s: float
    per_prefill_token_s: float
    per_context_token_s: float
    num_steps: int = 0  # how many measured steps the fit used
    median_error: float = float("nan")  # median |predicted - measured| / measured over those steps

    _features = staticmethod(StepWork.features)

    def describe(self) -> str:
        return (
            f"{self.fixed_s * 1e3:.1f} ms + {self.per_decode_s * 1e3:.2f} ms per decode + "
            f"{self.per_prefill_token_s * 1e3:.3f} ms per prompt token + {self.per_context_token_s * 1e6:.2f} µs "
            f"per context token (fitted to {self.num_steps} steps; median step error {100 * self.median_error:.0f} %)"
        )


@dataclass(frozen=True)
class ChunkCost(_LinearCost):
    """Seconds a step costs as lesson 08 models it: fixed + per decode + per prompt token + per (tokens in the
    step)^2 (module docstring). With ``per_token_squared_s > 0`` a prompt costs less in chunks than whole."""

    fixed_s: float
    per_decode_s: float
    per_prompt_token_s: float
    per_token_squared_s: float
    num_steps: int = 0
    median_error: float = float("nan")

    _features = staticmethod(StepWork.chunk_features)

    def per_prompt_token_at(self, chunk: int, decodes: int) -> float:
        """What one prompt token adds to a step that computes ``chunk`` prompt tokens beside ``decodes`` decodes:
        (cost of that step - cost of the decodes alone) / chunk."""
        return (self(StepWork(decodes, chunk, 0)) - self(StepWork(decodes, 0, 0))) / chunk

    def describe(self) -> str:
        return (
            f"{self.fixed_s * 1e3:.1f} ms + {self.per_decode_s * 1e3:.2f} ms per decode + "
            f"{self.per_prompt_token_s * 1e3:.3f} ms per prompt token + {self.per_token_squared_s * 1e6:.3f} µs x "
            f"(tokens in the step)² (fitted to {self.num_steps} steps; median step error {100 * self.median_error:.0f} %)"
        )


@dataclass(frozen=True)
class VerifyCost(_LinearCost):
    """Lesson 11's step cost: lesson 07's model with drafted tokens priced apart from the sequences that decode, and
    a step that feeds more than one row priced apart from a one-row step. On a CPU a one-row step runs its weights
    as matrix-vector products and any more rows as matrix-matrix ones, which cost a step-sized jump more (lesson 11
    measures it: on 2 CPU cores a 2-token step cost 1.7-1.8x a 1-token one); where one row costs what two do the fit
    leaves that coefficient near 0."""

    fixed_s: float
    per_decode_s: float
    per_draft_token_s: float
    per_prefill_token_s: float
    per_context_token_s: float
    multi_row_s: float
    num_steps: int = 0
    median_error: float = float("nan")

    num_coefficients = 6
    _features = staticmethod(StepWork.verify_features)

    def describe(self) -> str:
        return (
            f"{self.fixed_s * 1e3:.1f} ms + {self.per_decode_s * 1e3:.2f} ms per decode + "
            f"{self.per_draft_token_s * 1e3:.2f} ms per drafted token + {self.per_prefill_token_s * 1e3:.3f} ms per "
            f"prompt token + {self.per_context_token_s * 1e6:.2f} µs per context token + {self.multi_row_s * 1e3:.1f} "
            f"ms for a step of more than one row (fitted to {self.num_steps} steps; median step error "
            f"{100 * self.median_error:.0f} %)"
        )


ROW_BUCKET_STARTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


class StepCostModel(Protocol):
    """What the simulator needs of a cost model: the seconds a step's work costs."""

    def __call__(self, work: StepWork) -> float: ...


@dataclass(frozen=True)
class RowBucketCost:
    """Lesson 07's step cost with its fixed part looked up by the step's rows (tokens fed):

    ``seconds = bucket_s[bucket of work.rows] + per_decode_s x decodes + per_prefill_token_s x prompt tokens +
    per_context_token_s x context tokens``.

    Why buckets: on a CPU a matrix product's time is not a straight line in its rows. One row runs as matrix-vector
    products; from two rows on the library picks its matrix-matrix kernels by shape, and a product of 10 rows can
    cost more than one of 16. A single fixed part (:class:`StepCost`) averages those jumps over the batch sizes that
    ran, and then misprices the small steps a lightly loaded server runs. Here each bucket of row counts gets its own
    fixed part; the per-decode, per-prompt-token and per-context-token parts are shared.

    Invariants: ``bucket_starts`` rises strictly; bucket ``i`` holds the row counts from ``bucket_starts[i]`` up to
    ``bucket_starts[i + 1] - 1`` (the first also every count below it, the last every count above); ``bucket_s`` has
    one entry per bucket and no coefficient is negative. A fit keeps only buckets that held at least ``min_steps``
    measured steps: a sparser bucket joins the one below it (or, the lowest, the one above).
    """

    bucket_starts: tuple[int, ...]
    bucket_s: tuple[float, ...]
    per_decode_s: float
    per_prefill_token_s: float
    per_context_token_s: float
    num_steps: int = 0
    median_error: float = float("nan")

    def __post_init__(self):
        if len(self.bucket_s) != len(self.bucket_starts) or not self.bucket_starts:
            raise ValueError(f"{len(self.bucket_starts)} bucket starts but {len(self.bucket_s)} bucket costs")
        if any(b >= c for b, c in zip(self.bucket_starts, self.bucket_starts[1:])):
            raise ValueError(f"bucket starts must rise strictly, got {self.bucket_starts}")

    def bucket_of(self, rows: int) -> int:
        return max(0, bisect_right(self.bucket_starts, rows) - 1)

    def bucket_label(self, i: int) -> str:
        lo = self.bucket_starts[i]
        if i == len(self.bucket_starts) - 1:
            return f"{lo}+"
        hi = self.bucket_starts[i + 1] - 1
        return str(lo) if hi == lo else f"{lo}-{hi}"

    def _features(self, work: StepWork) -> np.ndarray:
        onehot = np.zeros(len(self.bucket_starts))
        onehot[self.bucket_of(work.rows)] = 1.0
        return np.concatenate([onehot, work.features()[1:]])

    def __call__(self, work: StepWork) -> float:
        coefficients = [*self.bucket_s, self.per_decode_s, self.per_prefill_token_s, self.per_context_token_s]
        return float(np.dot(coefficients, self._features(work)))

    @classmethod
    def fit(
        cls,
        works: list[StepWork],
        seconds: list[float],
        starts: tuple[int, ...] = ROW_BUCKET_STARTS,
        min_steps: int = 5,
    ) -> "RowBucketCost":
        """The least-squares fit (no coefficient negative) to measured steps, on the buckets of ``starts`` that held
        at least ``min_steps`` of them (class docstring)."""
        if len(works) != len(seconds):
            raise ValueError(f"{len(works)} steps of work but {len(seconds)} timings")
        probe = cls(tuple(starts), (0.0,) * len(starts), 0.0, 0.0, 0.0)
        counts = np.bincount([probe.bucket_of(w.rows) for w in works], minlength=len(starts))
        merged: list[list[int]] = []  # [start, steps]
        for start, n in zip(starts, counts):
            if merged and (n < min_steps or merged[-1][1] < min_steps):
                merged[-1][1] += int(n)
            else:
                merged.append([int(start), int(n)])
        kept = tuple(start for start, _ in merged)
        shape = cls(kept, (0.0,) * len(kept), 0.0, 0.0, 0.0)
        a = np.stack([shape._features(w) for w in works]) if works else np.zeros((0, len(kept) + 3))
        x, err = _fit(a, seconds)
        b = len(kept)
        return cls(kept, tuple(map(float, x[:b])), *map(float, x[b:]), num_steps=len(works), median_error=err)

    def describe(self) -> str:
        fixed = ", ".join(f"{self.bucket_label(i)}: {s * 1e3:.1f}" for i, s in enumerate(self.bucket_s))
        return (
            f"fixed ms by rows in the step ({fixed}) + {self.per_decode_s * 1e3:.2f} ms per decode + "
            f"{self.per_prefill_token_s * 1e3:.3f} ms per prompt token + {self.per_context_token_s * 1e6:.2f} µs per "
            f"context token (fitted to {self.num_steps} steps; median step error {100 * self.median_error:.0f} %)"
        )


@dataclass
class MeasuredSteps:
    """Measured step times grouped by the work they did - ``(decodes, prompt tokens)`` - for the steps a fit
    is checked against. Invariant: every group holds at least one sample."""

    groups: dict[tuple[int, int], list[float]]

    @classmethod
    def of(cls, works: list[StepWork], seconds: list[float]) -> "MeasuredSteps":
        if len(works) != len(seconds):
            raise ValueError(f"{len(works)} steps of work but {len(seconds)} timings")
        groups: dict[tuple[int, int], list[float]] = {}
        for w, s in zip(works, seconds):
            groups.setdefault((w.decodes, w.prefill_tokens), []).append(float(s))
        return cls(groups)

    def samples(self, decodes: int, prompt_tokens: int) -> list[float]:
        return list(self.groups.get((decodes, prompt_tokens), []))

    def median(self, decodes: int, prompt_tokens: int, min_samples: int = 3) -> float | None:
        """The median time of the steps that did exactly this work, or None with fewer than ``min_samples``."""
        s = self.samples(decodes, prompt_tokens)
        return float(np.median(s)) if len(s) >= min_samples else None

    def prompt_sizes(self, decodes: int, min_samples: int = 3) -> list[int]:
        """The prompt-token counts measured beside ``decodes`` decodes often enough, ascending (0 included)."""
        return sorted(k for (d, k), s in self.groups.items() if d == decodes and len(s) >= min_samples)
