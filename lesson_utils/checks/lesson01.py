"""Checkers for lesson 01 (naive contiguous cache)."""

from __future__ import annotations

import random

import torch

from lesson_utils.cache import contiguous as contiguous_cache
from lesson_utils.cache.seam import StepBatch
from lesson_utils.memory import contiguous

from .core import CheckResult, case_device, check_function, expect_error, failed, passed


def _random_holes(rng: random.Random, total: int = 200) -> list[tuple[int, int]]:
    holes, pos = [], rng.randint(0, 5)
    while pos < total:
        length = rng.randint(1, 20)
        holes.append((pos, length))
        pos += length + rng.randint(1, 15)  # leave an allocated gap so holes never touch
    return holes


def _first_fit_cases() -> list[tuple]:
    rng = random.Random(0)
    cases = [
        ([(0, 100)], 100),  # exact fit: the hole disappears
        ([(0, 100)], 30),
        ([(0, 10), (20, 50)], 30),  # first hole too small
        ([(0, 40), (50, 30)], 30),  # first fit, not best fit
        ([(0, 10), (20, 10)], 11),  # nothing fits
        ([], 1),
        ([(5, 1)], 1),
    ]
    for _ in range(12):
        holes = _random_holes(rng)
        cases.append((holes, rng.randint(1, 25)))
    return cases


def _explain_first_fit(case, expected, got):
    holes, n = case
    if expected is not None and got is None and any(length == n for _, length in holes):
        return "there is a hole of exactly n slots here: does it count as large enough in your code?"
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], list):
        if any(length == 0 for _, length in got[1]):
            return "a hole of length 0 is left in the list: is it still a hole?"
        if expected is not None and got[0] != expected[0]:
            return "another hole than the expected one was used: which hole does *first* fit take?"
    return ""


def check_first_fit(fn) -> CheckResult:
    """Exercise 01-1a: first-fit allocation from a hole list."""
    return check_function(
        "first_fit",
        fn,
        contiguous.first_fit,
        _first_fit_cases(),
        show_input=lambda c: f"holes={c[0]}, n={c[1]}",
        explain=_explain_first_fit,
        arg_names=("holes", "n"),
    )


def _release_cases() -> list[tuple]:
    rng = random.Random(1)
    cases = [
        ([], 0, 10),  # everything was allocated
        ([(10, 5)], 0, 10),  # touches the hole on its right
        ([(0, 10)], 10, 5),  # touches the hole on its left
        ([(0, 10), (15, 5)], 10, 5),  # fills the gap: three become one
        ([(0, 5), (30, 5)], 10, 5),  # touches nothing
        ([(20, 5)], 0, 5),  # goes before every hole
    ]
    for _ in range(12):
        holes = _random_holes(rng)
        gaps = [(s + l, holes[i + 1][0] - (s + l)) for i, (s, l) in enumerate(holes[:-1])]
        g_start, g_len = rng.choice(gaps)
        start = g_start + rng.randint(0, g_len - 1)
        length = rng.randint(1, g_start + g_len - start)
        cases.append((holes, start, length))
    return cases


def _explain_release(case, expected, got):
    if isinstance(got, list):
        if len(got) > len(expected) and sum(l for _, l in got) == sum(l for _, l in expected):
            return "the free slots are right but there are more holes than needed: do any of them touch?"
        if sorted(got) == expected:
            return "the right holes, in another order: what order does the hole list keep?"
    return ""


def check_release(fn) -> CheckResult:
    """Exercise 01-1b: freeing a reservation, with merging and a double-free error."""
    name = "release"
    result = check_function(
        name,
        fn,
        contiguous.release,
        _release_cases(),
        show_input=lambda c: f"holes={c[0]}, start={c[1]}, length={c[2]}",
        explain=_explain_release,
        quiet=True,
        arg_names=("holes", "start", "length"),
    )
    if not result.passed:
        print(result.message)
        return result
    for holes, start, length, what in [
        ([(0, 10)], 0, 10, "freeing [0, 10) when it is already the free hole [0, 10) (a double free)"),
        ([(0, 10)], 5, 10, "freeing [5, 15), which overlaps the free hole [0, 10)"),
        ([(10, 5)], 8, 4, "freeing [8, 12), which starts before the free hole [10, 15) and runs into it"),
        ([(0, 4), (20, 5)], 3, 30, "freeing [3, 33), which covers the free hole [20, 25) and more"),
    ]:
        kept = list(holes)
        bad = expect_error(name, fn, (holes, start, length), ValueError, what, contiguous.release, quiet=False)
        if bad is not None:
            return bad
        if holes != kept:
            return failed(
                name,
                f"{what}: your code raised ValueError, but it had already changed the hole list to "
                f"{holes}; a refused call must leave everything as it was",
                contiguous.release,
            )
    return passed(
        name, f"{len(_release_cases())} frees merge like the reference, and double frees raise ValueError.", fn
    )


def _batches() -> list[tuple[StepBatch, list[int]]]:
    rng = random.Random(2)
    dev = case_device()  # as in the lesson's cache: a slot mapping made on the host fails here, not on a GPU later
    out = [
        (StepBatch.build([0], [[5, 6, 7]], [0], device=dev), [100]),  # a prefill
        (StepBatch.build([0, 1], [[9], [4]], [3, 7], device=dev), [100, 0]),  # two decodes
        (StepBatch.build([3, 1, 2], [[1, 2], [8], [5, 5, 5, 5]], [0, 12, 0], device=dev), [64, 0, 200]),  # mixed
    ]
    for _ in range(5):
        k = rng.randint(1, 4)
        news = [[rng.randint(4, 99) for _ in range(rng.choice([1, 1, rng.randint(1, 6)]))] for _ in range(k)]
        before = [rng.randint(0, 20) for _ in range(k)]
        out.append(
            (StepBatch.build(list(range(k)), news, before, device=dev), [rng.randrange(0, 500, 32) for _ in range(k)])
        )
    return out


def check_slot_mapping(fn) -> CheckResult:
    """Exercise 01-2: the arena slot of every new token in a step."""

    def show(case):
        b, starts = case
        return f"region_starts={starts}, query_lens={b.query_lens}, context_lens={b.context_lens}, positions={b.positions.tolist()}"

    def explain(case, expected, got):
        b, starts = case
        if not isinstance(got, torch.Tensor):
            return "return a torch.LongTensor with one slot per new token"
        if got.shape == expected.shape and torch.equal(got, b.positions):
            return "these are the positions alone: where does each sequence's reservation begin?"
        in_step = torch.cat([torch.arange(n) for n in b.query_lens]).to(got.device)
        if got.shape == expected.shape and torch.equal(got - expected, -(b.positions - in_step)):
            return "a token's position counts from the start of its sequence, not of this step"
        return ""

    return check_function(
        "slot_mapping",
        fn,
        contiguous_cache.slot_mapping,
        _batches(),
        show_input=show,
        explain=explain,
        arg_names=("batch", "region_starts"),
    )


def check_reservation_errors(cache_cls=contiguous_cache.ContiguousKVCache) -> None:
    """Not an exercise: shows the arena's errors (used in the notebook's 'bad input' section)."""
    cache = cache_cls(1, 16, 1, 4, default_reservation=8)
    for what, call in [
        ("a reservation larger than the arena", lambda: cache.reserve(0, 32)),
        ("a reservation of zero slots", lambda: cache.reserve(1, 0)),
        ("freeing a sequence that was never admitted", lambda: cache.free(99)),
    ]:
        try:
            call()
        except (ValueError, RuntimeError) as err:
            print(f"{what:45s} -> {type(err).__name__}: {err}")
        else:  # pragma: no cover - would be a course bug
            print(f"{what:45s} -> no error (unexpected)")
