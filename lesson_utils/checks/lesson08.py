"""Checkers for lesson 08 (chunked prefill and the unified kernel)."""

from __future__ import annotations

import copy
import math
import random

import torch

from lesson_utils.cache import attention
from lesson_utils.serving.token_budget import Chunk, TokenState, budgeted_schedule

from .core import (
    CheckResult,
    case_device,
    check_function,
    failed,
    not_implemented,
    passed,
    short,
    type_problem,
)

# ---- exercise 08-1: the token budget --------------------------------------------------------------------------


class _Admissions:
    """The memory manager's side of ``admit``: the answers of one case, and the calls made."""

    def __init__(self, waiting: list[TokenState], answers: dict[int, int | None]):
        self.order = [s.seq_id for s in waiting]
        self.answers, self.calls = answers, []

    def __call__(self, seq_id):
        self.calls.append(seq_id)
        return self.answers.get(seq_id, 0)


def _random_case(rng: random.Random):
    """Ids in no particular order (running order is admission order, not id order): a schedule that sorts, or
    sorts its input in place, must show."""
    running = []
    ids = rng.sample(range(10), 5)
    for i in ids[: rng.randint(0, 5)]:
        length = rng.randint(2, 60)
        computed = length - 1 if rng.random() < 0.6 else rng.randint(0, length - 2)  # a decode, or mid-prefill
        running.append(TokenState(i, computed, length))
    waiting = [TokenState(30 - i, 0, rng.randint(1, 70)) for i in range(rng.randint(0, 4))]
    answers = {}
    for s in waiting:
        r = rng.random()
        answers[s.seq_id] = None if r < 0.15 else (rng.randrange(0, max(1, s.length - 1), 4) if r < 0.4 else 0)
    return running, waiting, rng.choice([1, 2, 5, 16, 32, 100]), answers


_NAMED = [
    ("decodes first", [TokenState(0, 20, 30), TokenState(1, 9, 10)], [], 5, {}),
    ("decodes in running order", [TokenState(7, 4, 5), TokenState(2, 8, 9), TokenState(5, 2, 3)], [], 2, {}),
    ("the budget runs out inside a chunk", [TokenState(0, 0, 40)], [], 16, {}),
    ("more decodes than budget", [TokenState(i, 4, 5) for i in range(4)], [TokenState(9, 0, 3)], 2, {}),
    ("a new prompt after a prefix-cache hit", [], [TokenState(5, 0, 40)], 64, {5: 32}),
    ("no overtaking", [], [TokenState(5, 0, 4), TokenState(6, 0, 4), TokenState(7, 0, 4)], 64, {6: None}),
    ("nothing to do", [], [], 8, {}),
    ("budget left over", [TokenState(0, 9, 10)], [TokenState(3, 0, 2)], 100, {}),
]


def _describe(case) -> str:
    running, waiting, budget, answers = case
    show = lambda states: "[" + ", ".join(f"{s.seq_id}: {s.num_computed}/{s.length}" for s in states) + "]"  # noqa: E731
    told = {k: v for k, v in answers.items() if v is not None and v > 0}
    full = [k for k, v in answers.items() if v is None]
    return (
        f"running (id: computed/length) {show(running)}, waiting {show(waiting)}, budget {budget}"
        + (f", admit() says {told} tokens are cached" if told else "")
        + (f", sequence(s) {full} do not fit" if full else "")
    )


def _why(case, want: list[Chunk], got: list[Chunk], calls: list[int], want_calls: list[int]) -> str:
    """The rule a wrong schedule breaks, in words (never the code)."""
    running, waiting, budget, answers = case
    total = sum(c.end - c.start for c in got)
    if total > budget:
        return f"your chunks hold {total} tokens, over the budget of {budget}"
    state = {s.seq_id: s for s in running + waiting}
    for c in got:
        s = state.get(c.seq_id)
        if s is None:
            return f"{c} names a sequence that is neither running nor waiting"
        if c.end <= c.start or c.end > s.length:
            return f"{c}: a chunk is a non-empty token range within the sequence's {s.length} tokens"
    ids = [c.seq_id for c in got]
    if len(ids) != len(set(ids)):
        return "a sequence got two chunks: give each at most one range per step"
    decodes = [s.seq_id for s in running if s.length - s.num_computed == 1]
    got_decodes = [c.seq_id for c in got if c.seq_id in decodes]
    if got_decodes != decodes[: len(got_decodes)] or (len(got_decodes) < min(len(decodes), budget)):
        return (
            "every running sequence with one token left (a decode) runs first, in running order, while the budget lasts"
        )
    first_other = next((i for i, c in enumerate(got) if c.seq_id not in decodes), len(got))
    if any(c.seq_id in decodes for c in got[first_other:]):
        return "decodes come before any prompt chunk in the schedule"
    if calls != want_calls:
        if any(state[i] not in waiting for i in calls if i in state):
            return "admit() is for waiting sequences only; running ones already hold their memory"
        return (
            f"admit() was asked for {calls}, expected {want_calls}: ask in arrival order, only while budget is left, "
            "and stop at the first that does not fit (no overtaking)"
        )
    for c in got:
        s = state[c.seq_id]
        start = answers.get(c.seq_id, 0) if s in waiting else s.num_computed
        if c.start != start:
            return (
                f"{c} should start at token {start}: where the sequence's computed tokens end "
                "(for a new one, what admit() returned)"
            )
    if total < sum(c.end - c.start for c in want):
        return f"{budget - total} tokens of the budget were left unused while a prompt still had tokens to compute"
    return "the chunks differ from the course's schedule (order: decodes, running prompts, then new ones)"


def check_budgeted_schedule(fn) -> CheckResult:
    """Exercise 08-1: decodes first, then prompt chunks into what is left of the budget, FCFS admission."""
    name = "budgeted_schedule"
    rng = random.Random(8)
    cases = [(label, *rest) for label, *rest in _NAMED] + [("random", *_random_case(rng)) for _ in range(60)]
    for label, running, waiting, budget, answers in cases:
        case = (running, waiting, budget, answers)
        ref_admit = _Admissions(waiting, answers)
        want = budgeted_schedule(list(running), list(waiting), budget, ref_admit)
        admit = _Admissions(waiting, answers)
        before = copy.deepcopy((running, waiting))
        args_running, args_waiting = list(running), list(waiting)
        try:
            got = fn(args_running, args_waiting, budget, admit)
        except NotImplementedError:
            return not_implemented(name, budgeted_schedule)
        except Exception as err:  # noqa: BLE001 - any learner error becomes feedback
            return failed(
                name,
                f"case '{label}' ({_describe(case)}): your code raised {type(err).__name__}: {err}",
                budgeted_schedule,
            )
        if (args_running, args_waiting) != before:
            return failed(name, f"case '{label}': your code changed the running or waiting list", budgeted_schedule)
        if not isinstance(got, list) or not all(isinstance(c, Chunk) for c in got):
            return failed(
                name,
                f"case '{label}': return a list of Chunk(seq_id, start, end); got {short(got)}",
                budgeted_schedule,
            )
        if got != want or admit.calls != ref_admit.calls:
            return failed(
                name,
                f"case '{label}' ({_describe(case)}):\n    expected: {want}\n    got:      {got}\n    "
                f"{_why(case, want, got, admit.calls, ref_admit.calls)}",
                budgeted_schedule,
            )
    return passed(name, f"the same chunks and admissions as the course's scheduler on {len(cases)} cases.", fn)


# ---- exercise 08-2: attention for a chunk ---------------------------------------------------------------------


def _chunk_case(
    seed: int,
    n: int,
    ctx: int,
    *,
    block_size=4,
    heads=2,
    kv_heads=1,
    d=8,
    dtype=torch.float32,
    scale=None,
    spare=1,
    magnitude=1.0,
):
    """A chunk of ``n`` queries at the end of a ``ctx``-token context. The table holds ``spare`` blocks past the
    context (the engine keeps the next token's block there), filled with large values: reading them shows."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-ctx // block_size)
    num_blocks = blocks + spare + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = order[: blocks + spare]
    dev = case_device()
    kc = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    vc = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    for b in table[blocks:]:
        kc[b], vc[b] = 50.0, 50.0  # poison: a chunk that attends past its context gets these
    tail = ctx - (blocks - 1) * block_size  # the last block's slots past the context are poisoned too
    kc[table[blocks - 1], tail:], vc[table[blocks - 1], tail:] = 50.0, 50.0
    q = (torch.randn(n, heads, d, generator=g) * magnitude).to(dtype).to(dev)
    kc = kc * magnitude  # large keys and queries: q.k passes fp16's largest value (65504) unless scored in fp32
    return (q, kc.to(dtype).to(dev), vc.to(dtype).to(dev), table, ctx, 1 / math.sqrt(d) if scale is None else scale)


def _close(expected, got) -> bool:
    if type_problem(expected, got):
        return False
    tol = 1e-2 if expected.dtype in (torch.float16, torch.bfloat16) else 1e-5
    return bool(torch.allclose(expected.float(), got.float(), atol=tol, rtol=1e-3))


def _chunk_hint(case, expected, got) -> str:
    """The mistake a wrong output matches, recomputed the wrong ways (the question, never the code)."""
    q, kc, vc, table, ctx, scale = case
    if not torch.isfinite(got.float()).all():
        if q.dtype == torch.float16 and q.float().abs().max() * kc.float().abs().max() * q.shape[-1] > 65504:
            return (
                "the output has inf/nan values, and this case's q.k can pass fp16's largest value (65504): in which "
                "dtype do you compute the scores?"
            )
        return "the output has inf/nan values: does every query see at least one key (its own)?"
    n, block_size = q.shape[0], kc.shape[1]
    qpos = torch.arange(n, device=q.device)[:, None] + ctx - n

    def attend(keys: int, mask, interleave: bool = True):
        k = attention.gather_kv(kc, table, keys).float()
        v = attention.gather_kv(vc, table, keys).float()
        group = q.shape[1] // k.shape[1]
        if interleave:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        else:
            k, v = k.repeat(1, group, 1), v.repeat(1, group, 1)
        s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
        kpos = torch.arange(keys, device=q.device)[None, :]
        if mask is not None:
            s = s.masked_fill(~mask(kpos), -math.inf)
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    whole = len(table) * block_size
    variants = [
        ("every query sees every key: which keys lie in a query's future?", ctx, None, True),
        (
            "your queries sit at the start of the sequence: where are the newest n tokens?",
            ctx,
            lambda kp: kp <= torch.arange(n, device=q.device)[:, None],
            True,
        ),
        ("a query may also use its own key: it is in the cache already", ctx, lambda kp: kp < qpos, True),
        ("each query sees one key too many: count the positions again", ctx, lambda kp: kp <= qpos + 1, True),
        (
            "your keys run past context_len: the table's last block is only partly filled, and may be followed by "
            "a block that holds no tokens yet",
            whole,
            lambda kp: kp <= torch.arange(n, device=q.device)[:, None] + whole - n,
            True,
        ),
        (
            "the query heads read the wrong K/V heads: which K/V head does query head h use when heads are grouped?",
            ctx,
            lambda kp: kp <= qpos,
            False,
        ),
    ]
    for why, keys, mask, interleave in variants:
        if keys > whole or (not interleave and q.shape[1] == kc.shape[2]):
            continue
        out = attend(keys, mask, interleave)
        if torch.isfinite(out).all() and torch.allclose(out, got.float(), atol=1e-3):
            return why
    return ""


def check_chunk_attention(fn) -> CheckResult:
    """Exercise 08-2: a chunk's queries attend to the cached K/V and causally within the chunk."""
    cases = [
        _chunk_case(1, 1, 9),  # a decode is a chunk of one
        _chunk_case(2, 5, 5),  # a whole prompt
        _chunk_case(3, 3, 11),  # a chunk after cached tokens, starting and ending inside blocks
        _chunk_case(4, 6, 14, kv_heads=2, heads=4),  # grouped heads
        _chunk_case(5, 8, 16, block_size=8, heads=3, kv_heads=1),
        _chunk_case(6, 4, 10, dtype=torch.float16),
        _chunk_case(7, 4, 13, scale=0.7),  # a scale that is not 1/sqrt(head_dim): use the one given
        _chunk_case(8, 5, 17, block_size=3, scale=0.05, spare=2),  # blocks of 3
        _chunk_case(9, 3, 7, dtype=torch.float16, magnitude=150.0),  # fp16 scores overflow unless computed in fp32
    ]
    return check_function(
        "chunk_attention",
        fn,
        attention.chunk_attention,
        cases,
        equal=_close,
        show_input=lambda c: (
            f"a chunk of {c[0].shape[0]} queries at the end of a {c[4]}-token context, "
            f"{c[0].shape[1]} heads, table {c[3]}, {str(c[0].dtype).replace('torch.', '')}"
        ),
        explain=_chunk_hint,
        arg_names=("q", "k_cache", "v_cache", "block_table", "context_len", "scale"),
    )


from .step_metadata import check_step_metadata  # noqa: E402, F401 - exercise 08-3, checked in its own module
