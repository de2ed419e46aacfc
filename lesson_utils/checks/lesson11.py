"""Checkers for lesson 11 (speculative decoding): the proposer, greedy verification, rejection sampling (checked by
the distribution of what it returns, not by one seed's tokens), the rollback (:mod:`.rollback`) and choosing k."""

from __future__ import annotations

import random

import torch

from lesson_utils.core.types import is_int
from lesson_utils.serving.speculative import accept_greedy, accept_sampled, prompt_lookup

from .core import (
    CheckResult,
    call_learner,
    check_function,
    failed,
    not_implemented,
    passed,
    short,
)
from .rejection_mass import check_kept_and_replaced  # noqa: F401 - exercise 11-4, checked in its own module
from .rollback import check_keep_verified  # noqa: F401 - exercise 11-5, checked in its own module


def _tails_at_different_places() -> list[int]:
    """A context whose 3-, 2- and 1-token tails each occur first at a different place (each followed by other
    tokens), the 3-token tail again later, and the 4-token tail at that later place: only the longest tail of at
    most 3 tokens, searched from the start, gives the reference's continuation."""
    a, b, c = 1207, 305, 88  # the tail
    return [c, 61, 62, 63, b, c, 51, 52, 53, 7, a, b, c, 41, 42, 43, 8, 63, a, b, c, 71, 72, 73, 9, 63, a, b, c]


def _lookup_cases() -> list[tuple]:
    cases = [
        ([5, 6, 7, 9, 5, 6, 8, 1, 5, 6], 2),  # two earlier matches: the earliest wins
        ([1, 2, 3, 4, 2, 3], 3),  # the longest suffix that occurs earlier
        ([9, 2, 3, 7, 3, 1, 2, 3], 2),  # "2 3" occurred, and "3" later: the longer match first
        ([1, 2, 3, 4], 3),  # no earlier occurrence: nothing to propose
        ([4, 4], 5),  # fewer tokens than k follow the match
        ([7, 8, 7], 0),  # k = 0
        ([3], 2),  # one token: nothing before it
        ([1, 2, 1, 2, 1, 2], 4),  # the match's continuation runs into the suffix itself
        (_tails_at_different_places(), 3),
        # ids of several digits: "1 2" is not a match inside "11 2" or "1 23" (ids are compared as ids, not as text)
        ([11, 2, 5, 1, 23, 7, 1, 2], 3),
        ([4, 112, 9, 12, 6, 30, 1, 12], 2),
        # the same 3-token tail and k with different continuations: the answer depends on the whole context
        ([5, 1, 2, 3, 9, 1, 2, 3], 2),
        ([1, 2, 3, 7, 7, 1, 2, 3], 2),
        # a long context whose only earlier match is far back: the search looks over all of it
        ([40, 41, 42, 43] + [100 + i for i in range(70)] + [41, 42], 3),
    ]
    rng = random.Random(11)
    for _ in range(20):
        ids = [rng.randrange(3) for _ in range(rng.randrange(2, 16))]
        cases.append((ids, rng.randrange(0, 6)))
    for _ in range(8):  # ids whose digits overlap, long contexts
        alphabet = [1, 2, 11, 12, 21, 112, 121, 1000 + rng.randrange(1000)]
        ids = [rng.choice(alphabet) for _ in range(rng.randrange(20, 90))]
        cases.append((ids, rng.randrange(1, 6)))
    return cases


def _lookup_hint(case, expected, got) -> str:
    ids, k = case
    if not isinstance(got, list):
        return "return a list of token ids (a list, even when it is empty)"
    if len(got) > k:
        return f"at most k = {k} tokens"
    if expected and not got:
        return "the context's last tokens do occur earlier (look over the whole context): what followed them there?"
    if got and got == expected[: len(got)]:
        return (
            f"you returned {len(got)} of the {len(expected)} tokens that follow the match: may the continuation run "
            "into the tail you matched?"
        )
    if got and not expected:
        return "does the context's last token occur anywhere before it (as the same id, not as digits of another)?"
    return (
        "with several earlier matches, which one does prompt lookup use? And which match length is tried first "
        "(at most 3 tokens)? Compare ids as ids, over the whole context"
    )


def check_prompt_lookup(fn) -> CheckResult:
    """Exercise 11-1: ``propose(token_ids, k)`` - up to k tokens after the earliest occurrence of the longest
    matching suffix (3 tokens down to 1), ``[]`` without one; the context is not changed."""
    return check_function(
        "prompt_lookup",
        fn,
        prompt_lookup,
        _lookup_cases(),
        explain=_lookup_hint,
        arg_names=("token_ids", "k"),
    )


def _greedy_cases() -> list[tuple]:
    cases = [
        ([4, 5, 6], [4, 5, 6, 7]),  # every draft agrees: k + 1 tokens
        ([4, 5, 6], [4, 9, 6, 7]),  # the second disagrees: the target's token there, nothing after it
        ([4, 5, 6], [1, 5, 6, 7]),  # the first disagrees, later ones agree by chance
        ([], [3]),  # no draft: a plain decode step
        ([2, 2], [2, 3, 2]),
    ]
    rng = random.Random(12)
    for _ in range(20):
        d = rng.randrange(0, 6)
        draft = [rng.randrange(3) for _ in range(d)]
        cases.append((draft, [rng.randrange(3) for _ in range(d + 1)]))
    for _ in range(10):  # real vocabularies: ids above 256 (equal ids are equal values, not the same object)
        d = rng.randrange(1, 6)
        base = [rng.randrange(3) for _ in range(d + 1)]
        draft = [50000 + x for x in base[:d]]
        targets = [50000 + x if rng.random() < 0.8 else 50000 + rng.randrange(3) for x in base]
        cases.append((draft, targets))
    return cases


def _greedy_hint(case, expected, got) -> str:
    draft, targets = case
    if not isinstance(got, list):
        return "return a list of token ids"
    if len(got) == len(expected) - 1 and got == expected[:-1]:
        return "after the kept drafts the target has computed one more token: it comes for free"
    if len(got) > len(expected):
        return "after the first draft the target disagrees with, are the later drafts still valid?"
    if len(got) < len(expected) and max(draft + targets, default=0) > 256:
        return "the ids agree where your code stopped: compare token ids by value (==), not identity (is)"
    return "at the first disagreement, whose token is right: the draft's or the target's?"


def check_accept_greedy(fn) -> CheckResult:
    """Exercise 11-2: ``accept(draft, targets)`` - the longest agreeing prefix of the draft, then the target's token."""
    return check_function(
        "accept_greedy", fn, accept_greedy, _greedy_cases(), explain=_greedy_hint, arg_names=("draft", "targets")
    )


# the rejection rule: a distribution test over a 5-token vocabulary
_ROWS = torch.tensor(  # the target's distribution after the newest token, after draft 1, 2, 3
    [[0.1, 0.4, 0.05, 0.3, 0.15], [0.3, 0.05, 0.2, 0.35, 0.1], [0.05, 0.15, 0.5, 0.1, 0.2], [0.2, 0.2, 0.1, 0.1, 0.4]]
)
# drafts of every length prompt lookup proposes (a bonus row hard-wired for one length fails another); a likely
# first token and an unlikely one; [1, 3] keeps every draft in 14 % of trials
_DRAFTS = ([1, 3], [2, 3], [1], [3, 3, 2])
_P = _ROWS[0]
_TRIALS = 3000
_Z = 4.5  # standard errors: a correct sampler fails a case about once in 10^5 runs


def _sample_many(fn, draft: list[int], probs: torch.Tensor, seed: int):
    """Per output position, the counts of each token and how many outputs reached it; or a problem."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(draft) + 1, len(_P))
    for _ in range(_TRIALS):
        given = probs.clone()
        out, err = call_learner(fn, list(draft), given, g)
        if err is not None:
            return None, f"raised {type(err).__name__}: {err}"
        if not torch.equal(given, probs):
            return None, "changed `probs`; it must leave the target's probabilities as they were"
        if not isinstance(out, list) or not out or not all(is_int(t) and 0 <= t < len(_P) for t in out):
            return None, f"returned {short(out)}: a non-empty list of token ids (0 .. {len(_P) - 1})"
        if len(out) > len(draft) + 1:
            return None, f"returned {len(out)} tokens for a draft of {len(draft)}: at most {len(draft) + 1}"
        if out[: len(out) - 1] != draft[: len(out) - 1]:
            return None, f"returned {out} for the draft {draft}: only the last token may differ from it"
        for i, t in enumerate(out):
            counts[i, t] += 1
    return counts, None


def _off(freqs: torch.Tensor, p: torch.Tensor, n: int) -> int | None:
    """The token whose frequency is furthest outside ``_Z`` standard errors of ``p``, or None."""
    se = (p * (1 - p) / max(n, 1)).sqrt()
    excess = (freqs - p).abs() - _Z * se - 1e-9
    worst = int(excess.argmax())
    return worst if float(excess[worst]) > 0 else None


def _why(i: int, draft: list[int]) -> str:
    """The question for a wrong output token ``i`` of a draft."""
    if i == len(draft):
        return "when every draft is kept, where does the last token come from?"
    if i == 0:
        return "when the draft is rejected, which distribution is the replacement drawn from?"
    return f"is draft {i + 1} judged with row {i + 1} of probs?"


def check_accept_sampled(fn) -> CheckResult:
    """Exercise 11-3: ``accept(draft, probs, generator)`` - the rejection rule for a deterministic proposer. Checked by
    distribution: over many seeded trials the first token must be distributed as the target's ``p``, whichever token
    was drafted, and the token after a kept draft too; ``probs`` must come back unchanged."""
    name = "accept_sampled"
    probs = _ROWS[:3].clone()  # [len(draft) + 1, vocab]
    before = probs.clone()
    try:
        out, err = call_learner(fn, [1, 3], probs, torch.Generator().manual_seed(0))
    except NotImplementedError:
        return not_implemented(name, accept_sampled)
    if err is None and not torch.equal(probs, before):
        return failed(
            name, "your code changed `probs`; it must leave the target's probabilities as they were", accept_sampled
        )
    runs = []
    for _ in range(2):  # the same seed twice: the same tokens, or the generator given was not the one used
        g = torch.Generator().manual_seed(7)
        try:
            runs.append([short(call_learner(fn, [1, 3], _ROWS[:3].clone(), g)[0]) for _ in range(20)])
        except NotImplementedError:
            return not_implemented(name, accept_sampled)
    if runs[0] != runs[1]:
        return failed(
            name,
            "called twice with generators seeded alike, your code returned different tokens: draw every random "
            "number from the `generator` given (torch.rand(1, generator=generator), torch.multinomial(..., "
            "generator=generator)), so each sequence's sampling is reproducible from its own seed",
            accept_sampled,
        )
    for draft in _DRAFTS:
        rows = _ROWS[: len(draft) + 1]
        try:
            counts, problem = _sample_many(fn, draft, rows.clone(), seed=sum(draft) + len(draft))
        except NotImplementedError:
            return not_implemented(name, accept_sampled)
        if problem:
            return failed(name, f"drafting {draft}: your code {problem}", accept_sampled)

        reached = counts.sum(dim=1).tolist()
        for i, n in enumerate(reached):
            token = _off(counts[i] / max(n, 1), rows[i], int(n)) if n else None
            if token is not None:
                return failed(
                    name,
                    f"drafting {draft} over {_TRIALS} seeded trials, output token {i + 1} (reached {int(n)} times) "
                    f"was {token} in {float(counts[i, token]) / n:.1%} of them; the target's probability there is "
                    f"{float(rows[i, token]):.1%}. Speculative sampling gives every token the target's probability: "
                    + _why(i, draft),
                    accept_sampled,
                )
        for i, n in enumerate(reached):  # position i is reached when drafts 0 .. i-1 were all kept
            p_reach = float(torch.prod(torch.tensor([float(rows[j, draft[j]]) for j in range(i)]))) if i else 1.0
            mean, sd = _TRIALS * p_reach, (_TRIALS * p_reach * (1 - p_reach)) ** 0.5
            if abs(n - mean) > _Z * sd + 0.5:
                kept = "every draft was kept" if i == len(draft) else f"the first {i} draft(s) were kept"
                return failed(
                    name,
                    f"drafting {draft} over {_TRIALS} seeded trials, your code returned an output token {i + 1} "
                    f"{int(n)} times; it comes whenever {kept}, which the target's probabilities make about "
                    f"{mean:.0f} times. "
                    + (
                        _why(i, draft)
                        if i == len(draft)
                        else "each draft is kept with probability p(draft) at its position"
                    ),
                    accept_sampled,
                )
    return passed(
        name,
        f"over {len(_DRAFTS) * _TRIALS} seeded trials (drafts of 1, 2 and 3 tokens) every output token is distributed "
        f"as the target's and each position is reached as often as the drafts before it are kept (within {_Z} "
        "standard errors), whichever token was drafted.",
        fn,
        next_line=(
            "Nothing later in this notebook runs it: its engines decode greedily. To sample with it, hand it to an engine "
            "as Speculation(k, propose, sampled_rule=use_accept_sampled) and give the requests a temperature."
        ),
    )


# ---- choosing k from a prediction -----------------------------------------------------------------------------
def _pick_cases() -> list[tuple[float, dict[int, float]]]:
    costs = [
        {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 1.85, 6: 2.1, 7: 2.3, 8: 2.5, 9: 2.7},  # a CPU: grows with tokens fed
        {1: 1.0, 2: 1.0, 3: 1.01, 4: 1.02, 5: 1.03, 6: 1.05, 7: 1.1, 8: 1.4, 9: 1.8},  # flat until compute-bound
        {n: float(n) for n in range(1, 10)},  # every token fed costs a whole step
        {1: 1.0, 2: 1.3, 3: 1.25, 4: 1.5, 5: 1.45},  # not monotone (a CPU's row buckets)
        {1: 0.02, 2: 0.021},  # only k = 1 measured, in seconds
        {1: 1.0, 2: 1.0, 3: 1.0},  # free drafts
        {1: 0.02},  # only a plain decode step measured: no k > 0 can be predicted
        {4: 1.6, 2: 1.2, 5: 1.85, 1: 1.0, 3: 1.4},  # measured in another order: a cost is found by its token count
        {3: 1.01, 1: 1.0, 2: 1.0},
        {1: 1.0, 2: 0.98, 3: 1.02},  # noise on a flat curve: k = 1 pays even when no draft is ever kept
    ]
    cases = [(a, c) for c in costs for a in (0.0, 0.3, 0.6, 0.85, 1.0)]
    rng = random.Random(15)
    for i in range(20):
        steps = [rng.uniform(0.0, 0.5) for _ in range(rng.randrange(1, 9))]
        c, total = {1: rng.uniform(0.01, 0.1)}, 0.0
        for n, s in enumerate(steps, start=2):
            total += s
            c[n] = c[1] * (1 + total)
        if i % 2:  # every other case lists its measurements out of order
            keys = list(c)
            rng.shuffle(keys)
            c = {n: c[n] for n in keys}
        cases.append((round(rng.random(), 3), c))
    return cases


def check_pick_k(fn) -> CheckResult:
    """Exercise 11-6: ``pick_k(a, cost)`` - ``(k, predicted speedup)`` for the k in ``0 .. max(cost) - 1`` that
    maximizes tokens per verify step x ``cost[1] / cost[k + 1]``, the smallest of equals; ``cost`` not changed."""
    from lesson_utils.lab.spec_math import expected_tokens_per_step, pick_k

    name = "pick_k"
    for a, cost in _pick_cases():
        given = dict(cost)
        try:
            out, err = call_learner(fn, a, given)
        except NotImplementedError:
            return not_implemented(name, pick_k)
        where = f"for a = {a} and step costs {short(cost)}"
        if err is not None:
            hint = " What does (1 - a^(k+1)) / (1 - a) become when every draft is kept?" if a == 1 else ""
            return failed(name, f"{where} your code raised {type(err).__name__}: {err}.{hint}", pick_k)
        if given != cost:
            return failed(name, f"{where} your code changed `cost`: leave the measurements as they were", pick_k)
        if not (isinstance(out, tuple) and len(out) == 2 and is_int(out[0]) and isinstance(out[1], (int, float))):
            return failed(name, f"{where} your code returned {short(out)}: return (k, predicted speedup)", pick_k)
        k, speedup = out
        want_k, want = pick_k(a, cost)
        if not 0 <= k < max(cost):
            return failed(name, f"{where} your k = {k} is outside 0 .. {max(cost) - 1}: which k were measured?", pick_k)
        theirs = 1.0 if k == 0 else expected_tokens_per_step(a, k) * cost[1] / cost[k + 1]
        if not abs(float(speedup) - theirs) <= 1e-6 * max(1.0, theirs):  # a NaN prediction fails too
            return failed(
                name,
                f"{where} you predict {float(speedup):.4g}x for k = {k}: a verify step of k drafts yields how many "
                "tokens on average (the target's own token included), and costs what next to a decode step?"
                + (
                    " (`cost` lists its measurements out of order: find each by its token count)"
                    if list(cost) != sorted(cost)
                    else ""
                ),
                pick_k,
            )
        if k != want_k:
            if abs(theirs - want) <= 1e-9 * max(1.0, want):
                return failed(
                    name, f"{where} several k predict the same speedup: which needs fewer lookahead slots?", pick_k
                )
            return failed(
                name,
                f"{where} k = {k} predicts {theirs:.3g}x; is it the best? Compare every k that was measured (k = 0: "
                "no speculation, 1x)",
                pick_k,
            )
    return passed(
        name,
        f"on {len(_pick_cases())} acceptance rates and step-cost curves (a CPU's, a GPU's, not monotone, a = 0 and 1) "
        "your k and predicted speedup match.",
        fn,
    )
