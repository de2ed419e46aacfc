"""Lesson 11's checkers: the references pass; plausible wrong proposers and acceptance rules are rejected with the
property they break."""

from __future__ import annotations

import pytest
import torch
from helpers import rejected

from lesson_utils.checks import lesson11
from lesson_utils.serving.speculative import accept_greedy, accept_sampled, prompt_lookup

pytestmark = pytest.mark.usefixtures("not_strict")


def test_the_references_pass():
    assert lesson11.check_prompt_lookup(prompt_lookup).passed
    assert lesson11.check_accept_greedy(accept_greedy).passed
    assert lesson11.check_accept_sampled(accept_sampled).passed


def test_unsolved_exercises_say_so():
    def stub(*args):
        raise NotImplementedError

    for check in (lesson11.check_prompt_lookup, lesson11.check_accept_greedy, lesson11.check_accept_sampled):
        result = check(stub)
        assert not result.passed and not result.implemented


# ---- wrong proposers ------------------------------------------------------------------------------------------
def earliest_match(ids, k):
    for n in range(min(3, len(ids) - 1), 0, -1):
        for start in range(0, len(ids) - n):
            if ids[start : start + n] == ids[-n:]:
                return ids[start + n : start + n + k]
    return []


def shortest_first(ids, k):
    for n in range(1, min(3, len(ids) - 1) + 1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == ids[-n:]:
                return ids[start + n : start + n + k]
    return []


def includes_the_match(ids, k):
    out = prompt_lookup(ids, k + 1)
    return out[:k] if not out else ([ids[-1]] + out)[:k]


def pads_to_k(ids, k):
    out = prompt_lookup(ids, k)
    return out + [0] * (k - len(out))


def eats_the_context(ids, k):
    out = prompt_lookup(ids, k)
    ids.append(0)
    return out


def a_tuple(ids, k):
    return tuple(prompt_lookup(ids, k))


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (earliest_match, "which one does prompt lookup use"),
        (shortest_first, "which match length is tried first"),
        (includes_the_match, "expected"),
        (pads_to_k, "expected"),
        (eats_the_context, "changed its input `token_ids`"),
        (a_tuple, "list"),
    ],
)
def test_wrong_proposers_are_rejected(wrong, needle):
    assert rejected(lesson11.check_prompt_lookup(wrong), needle)


# ---- wrong greedy acceptance --------------------------------------------------------------------------------------
def no_bonus(draft, targets):
    return accept_greedy(draft, targets)[:-1]


def counts_matches_anywhere(draft, targets):
    kept = [d for d, t in zip(draft, targets) if d == t]
    return kept + [targets[len(kept)]]


def keeps_the_draft_at_the_mismatch(draft, targets):
    out = accept_greedy(draft, targets)
    a = len(out) - 1
    return out[:-1] + [draft[a]] if a < len(draft) else out


def bonus_from_the_wrong_row(draft, targets):
    out = accept_greedy(draft, targets)
    return out[:-1] + [targets[-1]]


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (no_bonus, "comes for free"),
        (counts_matches_anywhere, "expected"),
        (keeps_the_draft_at_the_mismatch, "whose token is right"),
        (bonus_from_the_wrong_row, "expected"),
    ],
)
def test_wrong_greedy_acceptance_is_rejected(wrong, needle):
    assert rejected(lesson11.check_accept_greedy(wrong), needle)


# ---- wrong rejection sampling ------------------------------------------------------------------------------------
def always_keeps(draft, probs, g):
    return list(draft) + [int(torch.multinomial(probs[len(draft)], 1, generator=g))]


def resamples_from_p(draft, probs, g):
    """On a rejection, draws from p itself rather than p without the rejected token."""
    out = []
    for i, x in enumerate(draft):
        if float(torch.rand(1, generator=g)) < float(probs[i, x]):
            out.append(x)
            continue
        out.append(int(torch.multinomial(probs[i], 1, generator=g)))
        return out
    return out + [int(torch.multinomial(probs[len(draft)], 1, generator=g))]


def judges_every_draft_with_the_first_row(draft, probs, g):
    return accept_sampled(draft, torch.stack([probs[0]] * len(probs)), g)


def greedy_bonus(draft, probs, g):
    out = accept_sampled(draft, probs, g)
    if len(out) == len(draft) + 1:
        out[-1] = int(probs[len(draft)].argmax())
    return out


def changes_probs(draft, probs, g):
    probs[0, draft[0]] = 0
    return accept_sampled(draft, probs, g)


def returns_a_tensor(draft, probs, g):
    return torch.tensor(accept_sampled(draft, probs, g))


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (always_keeps, "which distribution is the replacement drawn from"),
        (resamples_from_p, "which distribution is the replacement drawn from"),
        (judges_every_draft_with_the_first_row, "second row of probs"),
        (greedy_bonus, "where does the last token come from"),
        (changes_probs, "changed `probs`"),
        (returns_a_tensor, "a non-empty list of token ids"),
    ],
)
def test_wrong_rejection_sampling_is_rejected(wrong, needle):
    assert rejected(lesson11.check_accept_sampled(wrong), needle)
