"""Lesson 11's exercise 4: why the rejection rule keeps the target's distribution - for a proposer drafting from
``q``, the chance of each token being drafted and kept (``min(p, q)``) and of each being drawn after a rejection
(``max(0, p - q)``), checked on pairs of distributions with edge cases."""

from __future__ import annotations

import torch

from .core import CheckResult, check_function, passed, show_message, type_problem


def _mass_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(41)

    def dist(n, zeros=0):
        x = torch.rand(n, generator=g, dtype=torch.float64) + 0.05
        if zeros:
            x[torch.randperm(n, generator=g)[:zeros]] = 0
        return x / x.sum()

    p = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15], dtype=torch.float64)
    one_hot = torch.zeros(5, dtype=torch.float64)
    one_hot[1] = 1.0
    cases = [
        (p, one_hot),  # prompt lookup: all of q on the drafted token
        (p, p.clone()),  # the proposer is the target: nothing is ever rejected
        (p, torch.tensor([0.0, 0.0, 0.5, 0.0, 0.5], dtype=torch.float64)),  # q is zero where p is not
        (
            torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64),
            torch.tensor([0.0, 0.0, 0.5, 0.5], dtype=torch.float64),
        ),
    ]
    cases += [(dist(n), dist(n)) for n in (3, 8, 50)]
    cases += [(dist(12, zeros=3), dist(12, zeros=4)), (dist(6), dist(6, zeros=5))]
    cases.append((dist(7).float(), dist(7).float()))  # float32 in, float32 out
    return cases


def _mass_hint(case, expected, got) -> str:
    p, q = case
    if not (isinstance(got, tuple) and len(got) == 2):
        return "return a tuple (kept, replaced) of two tensors"
    kept, replaced = got
    if not all(isinstance(t, torch.Tensor) and t.shape == p.shape for t in got):
        return f"kept and replaced are tensors shaped like p ({tuple(p.shape)}): one probability per token"
    if any(t.dtype != p.dtype for t in got):
        return f"return tensors of p's dtype ({p.dtype}): build them from p and q"
    if not bool(torch.isfinite(kept).all() & torch.isfinite(replaced).all()):
        return "a NaN or inf came out: what is q(y) x min(1, p(y) / q(y)) where q(y) = 0, without dividing?"
    if not torch.allclose(kept.double(), expected[0].double(), atol=1e-6):
        return (
            "kept[y] is the chance that the proposer drafts y (q(y)) AND the rule keeps it (min(1, p(y) / q(y))): "
            "what is that product where q(y) > p(y), and where q(y) <= p(y)?"
        )
    if (
        torch.allclose(replaced.sum().double(), torch.tensor(1.0, dtype=torch.float64), atol=1e-6)
        and float(expected[1].sum()) < 1 - 1e-6
    ):
        return (
            "replaced[y] is the chance of a rejection AND y drawn after it: your values sum to 1 - how likely is a "
            "rejection at all?"
        )
    return "how likely is a rejection (one minus the chance that the draft is kept), and what is the residual's normalizer?"


def check_kept_and_replaced(fn) -> CheckResult:
    """Exercise 11-4: ``kept_and_replaced(p, q)`` - for a proposer drafting from ``q`` and the rejection rule, the
    chance of each token being drafted and kept, and of each being drawn after a rejection; tensors shaped and typed
    like ``p``, within 1e-6; ``p`` and ``q`` unchanged."""
    from lesson_utils.lab.spec_math import kept_and_replaced

    def close(expected, got) -> bool:
        return not type_problem(expected, got) and all(
            bool(torch.isfinite(g).all()) and torch.allclose(g.double(), e.double(), atol=1e-6, rtol=0)
            for e, g in zip(expected, got)
        )

    result = check_function(
        "kept_and_replaced",
        fn,
        kept_and_replaced,
        _mass_cases(),
        equal=close,
        explain=_mass_hint,
        arg_names=("p", "q"),
        quiet=True,
    )
    if result.passed:
        worst = max(
            float((kept_and_replaced(p, q)[0] + kept_and_replaced(p, q)[1] - p).abs().max()) for p, q in _mass_cases()
        )
        return passed(
            "kept_and_replaced",
            f"on {len(_mass_cases())} pairs of distributions (q one-hot as prompt lookup's, q = p, q zero where p is "
            f"not, disjoint supports, random) your kept and replaced match the rule's (within 1e-6), and kept + "
            f"replaced differs from p by at most {worst:.1e}: whatever the proposer drafts, each token comes out with "
            "the target's probability.",
            fn,
            next_line="That sum is the whole proof: kept takes min(p, q) of each token, a rejection gives back exactly "
            "the part of p that q did not cover.",
        )
    show_message(result.message)
    return result
