"""Checkers for lesson 07: the capstone's engine step (07-1) and the capacity prediction (07-2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.progress import busy
from lesson_utils.core.types import OutOfBlocks
from lesson_utils.lab.kv_math import predict_capacity
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.model_runner import ModelRunner
from lesson_utils.serving.step import serve_step

from .core import (
    CheckResult,
    check_function,
    expect_error,
    failed,
    not_implemented,
    passed,
    same_value,
    show_message,
)

MAX_STEPS = 400


class _LogitsRunner(ModelRunner):
    """The model runner, keeping every step's logits: a wrong step can leave the tokens of the tiny ci model
    unchanged (its argmax rarely moves) while the computation under them is wrong."""

    def __init__(self, w, cache):
        super().__init__(w, cache)
        self.logged: list[tuple[list[int], torch.Tensor]] = []

    def logits(self, seqs, counts=None):
        out = super().logits(seqs, counts)
        self.logged.append(([s.seq_id for s in seqs], out.float().cpu()))
        return out


@dataclass
class _Run:
    outputs: list[list[int]]
    finished_per_step: list[list[int]]  # seq ids returned as finished, step by step
    hits: int  # prompt tokens served from the prefix cache
    registered: set  # hashes of the blocks registered in the prefix cache
    logits: list[tuple[list[int], torch.Tensor]]
    copies: int  # copy-on-write copies the run made


def _run(w, step_fn, prompts, max_new, num_blocks, forks: bool = False) -> _Run:
    manager = SharingBlockManager(num_blocks, 4, max_seq_len=w.max_positions)
    cache = PagedKVCache.for_model(w, manager=manager)
    engine = Engine(w, cache, step_fn=step_fn)
    engine.runner = runner = _LogitsRunner(w, cache)
    seqs = [engine.add_request(p, max_new) for p in prompts]  # the later prompts share the first's prefix
    if forks:  # two samples of one prompt share its last, partly filled block: their first writes need
        # copy-on-write copies, which the plan carries - a step that drops part of the plan shows here
        seqs.append(engine.add_request(prompts[0][:7], max_new, n=2))
    finished = []
    while engine.scheduler.has_work:
        finished.append(sorted(s.seq_id for s in engine.step()))
        if len(finished) > MAX_STEPS:
            raise TimeoutError(f"still running after {MAX_STEPS} steps")
    outputs = [list(x.output_ids) for s in seqs for x in (s.samples or [s])]
    return _Run(
        outputs, finished, manager.cached_prompt_tokens, set(manager.pool.block_of), runner.logged, manager.num_cow
    )


def check_engine_step(fn, w) -> CheckResult:
    """Exercise 07-1: schedule (admit, make room), execute (the forward pass), update (tokens, prefix cache, frees)."""
    name = "engine_step"
    g = torch.Generator().manual_seed(7)
    shared = [w.bos_token_id] + torch.randint(4, w.vocab_size, (12,), generator=g).tolist()
    prompts = [shared + torch.randint(4, w.vocab_size, (n,), generator=g).tolist() for n in (1, 3, 6, 2)]
    try:
        with busy("checking your step: the course's engine, then yours, on one workload"):
            ref = _run(w, serve_step, prompts, 6, 12)
            got = _run(w, fn, prompts, 6, 12)
    except NotImplementedError:
        return not_implemented(name, serve_step)
    except TimeoutError as err:
        return failed(
            name,
            f"{err}: does every step end with the scheduler's update (the tokens, and freeing what finished)?",
            serve_step,
        )
    except OutOfBlocks as err:
        return failed(
            name,
            f"the model ran out of blocks ({err}): was there room for every running sequence's next "
            "token before the model ran? (the scheduler can make it, preempting if memory is short)",
            serve_step,
        )
    except Exception as err:  # noqa: BLE001
        return failed(name, f"your step raised {type(err).__name__}: {err}", serve_step)
    if got.outputs != ref.outputs:
        bad = next(i for i, (a, b) in enumerate(zip(got.outputs, ref.outputs)) if a != b)
        return failed(name, f"request {bad} generated {got.outputs[bad]}; expected {ref.outputs[bad]}", serve_step)
    if got.hits != ref.hits or got.registered != ref.registered:
        return failed(
            name,
            f"outputs are right, but the prefix cache served {got.hits} prompt tokens (expected "
            f"{ref.hits}) and holds {len(got.registered)} registered blocks (expected {len(ref.registered)}): "
            "does every step hand the runner's output to the scheduler's update (it registers computed blocks)?",
            serve_step,
        )
    if len(got.finished_per_step) > len(ref.finished_per_step):
        return failed(
            name,
            f"serving took {len(got.finished_per_step)} steps instead of {len(ref.finished_per_step)}: "
            "in which step is a new request prefilled with your order of phases?",
            serve_step,
        )
    if got.finished_per_step != ref.finished_per_step:
        step = next(i for i, (a, b) in enumerate(zip(got.finished_per_step, ref.finished_per_step)) if a != b)
        return failed(
            name,
            f"at step {step} your step returned sequences {got.finished_per_step[step]} as finished; "
            f"expected {ref.finished_per_step[step]} (what should a step return?)",
            serve_step,
        )
    for (ids, g), (ref_ids, r) in zip(got.logits, ref.logits):
        if ids != ref_ids or g.shape != r.shape or not torch.allclose(g, r, atol=1e-4, rtol=1e-4):
            return failed(
                name,
                "same tokens, but the model computed other logits along the way: is every step "
                "running the model once, over the right sequences?",
                serve_step,
            )
    ref_forks = _run(w, serve_step, prompts, 6, 16, forks=True)
    try:
        got_forks = _run(w, fn, prompts, 6, 16, forks=True)
    except Exception as err:  # noqa: BLE001
        return failed(name, f"with two samples of one prompt, your step raised {type(err).__name__}: {err}", serve_step)
    if got_forks.outputs != ref_forks.outputs:
        return failed(
            name,
            "right on single requests, but two samples of one prompt (sharing its last block) generate "
            f"{got_forks.outputs[-2:]} instead of {ref_forks.outputs[-2:]}: does every part of the plan reach the "
            "runner - the block copies too?",
            serve_step,
        )
    return passed(
        name,
        f"same outputs, logits, finished sequences per step, {len(got.finished_per_step)} steps and "
        f"prefix-cache hits as the course's engine, and {ref_forks.copies} copy-on-write copy for two samples of one prompt.",
        fn,
    )


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
