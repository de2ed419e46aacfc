"""Checkers for lesson 07: the update that settles a step (07-1, in :mod:`.settle`) and the capacity prediction (07-2)."""

from __future__ import annotations

import torch

from lesson_utils.lab.kv_math import predict_capacity

from .core import (
    CheckResult,
    check_function,
    expect_error,
    failed,
    passed,
    same_value,
    show_message,
)
from .settle import check_update_from_output, reference_update

__all__ = ["check_predict_capacity", "check_update_from_output", "reference_update"]


# ---- exercise 07-2: predict what the budget holds ------------------------------------------------------------
def _capacity_cases() -> list[tuple]:
    """Every parameter varied (block sizes that are not powers of two, budgets that are not multiples of a block
    or of the length limit), lines that are not sorted (sorting them in place would show), a small request
    behind one that does not fit, fewer requests than reservations, exact multiples of the block size."""
    g = torch.Generator().manual_seed(72)
    cases = [
        (512, 128, 16, [40, 17, 16, 33, 1, 64]),
        (500, 128, 16, [100, 90, 80, 3, 2, 1, 70, 60]),  # 500 slots: 31 whole blocks; 3 whole reservations
        (100, 64, 7, [20, 50, 3, 6, 7, 8, 14]),  # 14 whole blocks of 7
        (100, 64, 10, [30, 60, 20, 5]),  # the 20 does not fit and stops the line, although the 5 would
        (50, 64, 8, [8, 8, 8, 8, 8, 8, 8, 3]),  # 50 slots hold 6 whole blocks of 8, not 7
        (1000, 256, 12, [25, 13, 12, 200]),  # fewer requests than the budget could hold
        (96, 128, 32, [5, 5]),  # the budget is smaller than one reservation
        (64, 32, 16, []),  # nobody in line
        (300, 100, 1, [50, 60, 99, 100, 1]),
        (257, 64, 5, [64, 63, 62, 5, 10, 1, 1]),
    ]
    for _ in range(6):
        max_len = int(torch.randint(16, 300, (1,), generator=g))
        bs = int(torch.randint(1, 40, (1,), generator=g))
        budget = int(torch.randint(max_len // 2, 6 * max_len, (1,), generator=g))
        n = int(torch.randint(1, 25, (1,), generator=g))
        held = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
        cases.append((budget, max_len, bs, held))
    return cases


def _capacity_equal(expected, got) -> bool:
    if not isinstance(got, (tuple, list)) or len(got) != 4:
        return False
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (got[0], got[2]))
    nums = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (got[1], got[3]))
    return (
        ints
        and nums
        and got[0] == expected[0]
        and got[2] == expected[2]
        and abs(got[1] - expected[1]) <= 1e-9
        and abs(got[3] - expected[3]) <= 1e-9
    )


def _paged_running(budget: int, bs: int, held: list[int], blocks, budget_blocks, overtake: bool) -> int:
    left, running = budget_blocks(budget, bs), 0
    for t in held:
        if blocks(t, bs) > left:
            if overtake:
                continue
            break
        left -= blocks(t, bs)
        running += 1
    return running


def _capacity_hint(case, expected, got) -> str:
    """A question aimed at the likely mistake, found by recomputing the paged count the wrong ways."""
    budget, max_len, bs, held = case
    if not isinstance(got, (tuple, list)) or len(got) != 4:
        return "return four values in order: naive running, naive utilization, paged running, paged utilization"
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (got[0], got[2])):
        return "a number of requests is a whole number: is one of your counts a float?"
    if got[0] != expected[0]:
        if got[0] > len(held):
            return "can an engine run more requests than there are in line?"
        return f"how many whole reservations of {max_len} slots fit in {budget} slots?"
    if got[2] != expected[2]:
        ceil, floor = (lambda t, b: -(-t // b)), (lambda t, b: t // b)
        whole, partial = (lambda n, b: n // b), (lambda n, b: -(-n // b))
        if got[2] == _paged_running(budget, bs, held, floor, whole, False):
            return f"how many blocks of {bs} slots do {bs + 1} tokens take?"
        if got[2] == _paged_running(budget, bs, held, ceil, partial, False):
            return f"how many whole blocks of {bs} slots are there in {budget} slots?"
        if got[2] == _paged_running(budget, bs, held, ceil, whole, True):
            return "once a request does not fit, may the one behind it go first?"
        return (
            f"how many whole blocks of {bs} slots does the budget hold, and how many does a request of "
            f"{bs + 1} tokens take? And once a request does not fit, may the one behind it go first?"
        )
    if any(isinstance(x, (int, float)) and x > 1 for x in (got[1], got[3])):
        return "a share of the budget is at most 1: what did you divide by?"
    return (
        "the counts are right: utilization is the share of the WHOLE budget that holds token states "
        "(not of the slots held or reserved)"
    )


def check_predict_capacity(fn, quiet: bool = False) -> CheckResult:
    """Exercise 07-2: what each server holds at one moment, from lesson 01's and lesson 03's arithmetic."""
    name = "predict_capacity"
    result = check_function(
        name,
        fn,
        predict_capacity,
        _capacity_cases(),
        equal=_capacity_equal,
        explain=_capacity_hint,
        quiet=True,
        arg_names=("budget_slots", "max_model_len", "block_size", "tokens_held"),
    )
    if not result.passed:
        if not quiet:
            show_message(result.message)
        return result
    for held, what in (
        ([10, 20, 30, 0, 5], "a request in line holding 0 tokens (the fourth)"),
        ([10, 20, 30, 129, 5], "a request in line holding more than max_model_len=128 tokens (the fourth)"),
    ):
        before = list(held)
        problem = expect_error(name, fn, (512, 128, 16, held), ValueError, f"for {what}", predict_capacity, quiet)
        if problem is not None:
            return problem
        if not same_value(before, held):
            return failed(
                name, f"for {what} your code raised, but changed `tokens_held` first", predict_capacity, quiet
            )
    return passed(
        name,
        f"all {len(_capacity_cases())} cases match (block sizes and budgets of every kind, lines that stop at a "
        "request that does not fit), inputs unchanged, impossible requests refused.",
        fn,
        quiet,
    )
