"""Checkers for lesson 02 (measuring fragmentation)."""

from __future__ import annotations

import random

import numpy as np

from lesson_utils.core.types import SlotKind
from lesson_utils.memory import reservation as R

from .core import CheckResult, check_function

_NAMES = {k.code: k.value for k in SlotKind}


def _allocation_cases() -> list[tuple]:
    rng = random.Random(0)
    cases = [
        (10, []),
        (10, [(0, 10, 10, 10)]),  # full and finished: all token states
        (12, [(2, 8, 3, 5)]),  # 3 used, 2 still to come, 3 never used
        (20, [(10, 8, 8, 8), (0, 4, 1, 4)]),  # not in address order: nothing says they are
    ]
    for _ in range(8):
        total, pos, allocs = 300, 0, []
        while True:
            pos += rng.randint(0, 10)
            reserved = rng.randint(1, 40)
            if pos + reserved > total:
                break
            final = rng.randint(1, reserved)
            allocs.append((pos, reserved, rng.randint(1, final), final))
            pos += reserved
        rng.shuffle(allocs)  # a function that sorts its input in place must show it
        cases.append((total, allocs))
    return cases


def _equal_kinds(expected, got) -> bool:
    return (
        isinstance(got, np.ndarray)
        and got.shape == expected.shape
        and np.issubdtype(got.dtype, np.integer)
        and bool((got == expected).all())
    )


def _explain_kinds(case, expected, got):
    if not isinstance(got, np.ndarray) or got.shape != expected.shape:
        return f"return a numpy array with one entry per slot (shape {expected.shape})"
    if not np.issubdtype(got.dtype, np.integer):
        return (
            f"the kinds are small integers (R.TOKEN, R.RESERVED, ...): expected an integer array, got dtype {got.dtype}"
        )
    bad = np.flatnonzero(got != expected)
    i = int(bad[0])
    total, allocs = case
    owner = next((a for a in allocs if a[0] <= i < a[0] + a[1]), None)
    where = (
        f"slot {i} is in the reservation {owner} (start, reserved, used, final)"
        if owner
        else f"slot {i} belongs to no reservation"
    )
    return f"{where}: expected {_NAMES.get(int(expected[i]), expected[i])}, got {_NAMES.get(int(got[i]), got[i])} ({len(bad)} slots differ)"


def check_classify_slots(fn) -> CheckResult:
    """Exercise 02-1: the kind of every slot in a contiguous arena."""

    def short_case(case):
        total, allocs = case
        text = str(allocs) if len(allocs) <= 3 else f"{allocs[:3]} ... ({len(allocs)} reservations)"
        return f"total_slots={total}, allocations={text}"

    return check_function(
        "classify_slots",
        fn,
        R.classify_slots,
        _allocation_cases(),
        equal=_equal_kinds,
        show_input=short_case,
        explain=_explain_kinds,
        arg_names=("total_slots", "allocations"),
    )


def _hole_cases() -> list[tuple]:
    rng = random.Random(1)
    cases = [([],), ([(0, 100)],), ([(60, 50), (0, 50)],), ([(20, 97), (0, 1), (9, 1), (5, 1)],)]
    for _ in range(8):
        holes = [(i * 100, rng.randint(1, 60)) for i in range(rng.randint(1, 8))]
        rng.shuffle(holes)  # unsorted: sorting the caller's list in place must show
        cases.append((holes,))
    return cases


def _explain_frag(case, expected, got):
    (holes,) = case
    if not holes and not (isinstance(got, float) and got == 0.0):
        return "with nothing free there is no fragmentation: return 0.0"
    if isinstance(got, (int, float)) and abs((1 - got) - expected) < 1e-9:
        return "upside down: 0 means free memory is one piece, close to 1 means it is all crumbs"
    return ""


def check_external_fragmentation(fn) -> CheckResult:
    """Exercise 02-2: how scattered free memory is."""
    return check_function(
        "external_fragmentation",
        fn,
        R.external_fragmentation,
        _hole_cases(),
        equal=lambda e, g: isinstance(g, (int, float, np.floating)) and not np.isnan(g) and abs(float(g) - e) < 1e-9,
        show_input=lambda c: f"holes={c[0]}",
        explain=_explain_frag,
        arg_names=("holes",),
    )
