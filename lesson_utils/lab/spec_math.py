"""Lesson 11's arithmetic: what a verify step is worth, predicted from an acceptance rate and measured step costs,
and the acceptance a run actually saw (from the scheduler's record of every verification)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from lesson_utils.lab.t4_roofline import t4_step_roofline_s  # noqa: F401 - lesson 11 reads it here
from lesson_utils.serving.speculative import acceptance_rate  # noqa: F401 - one formula, the simulator's too


def expected_tokens_per_step(a: float, k: int) -> float:
    """Tokens a verify step of ``k`` drafts yields on average when each draft is accepted with probability ``a``,
    independently, until the first rejection: ``1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)`` (the target's own
    token after the kept drafts always comes)."""
    if not 0 <= a <= 1:
        raise ValueError(f"an acceptance rate is in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"k is at least 0, got {k}")
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def predicted_speedup(a: float, k: int, verify_cost: float, decode_cost: float) -> float:
    """Tokens per second with speculation over tokens per second without: a verify step of ``k`` drafts costs
    ``verify_cost`` and yields :func:`expected_tokens_per_step`; a decode step costs ``decode_cost`` and yields 1.
    (The proposer's own cost is left out: prompt lookup's is small beside a forward pass.)"""
    if verify_cost <= 0 or decode_cost <= 0:
        raise ValueError("step costs are positive")
    return expected_tokens_per_step(a, k) / verify_cost * decode_cost


def acceptance_by_position(verified: list[tuple[int, int, int, int]], k: int) -> list[float | None]:
    """From ``scheduler.verified`` - ``(step, seq_id, drafted, accepted)`` per verification - the share of drafts
    kept at each draft position ``1 .. k`` among the verifications that judged that position: it drafted that far
    and kept every draft before it (None where none did)."""
    judged, kept = [0] * k, [0] * k
    for _, _, drafted, accepted in verified:
        for i in range(min(drafted, accepted + 1, k)):
            judged[i] += 1
            kept[i] += i < accepted
    return [None if j == 0 else c / j for c, j in zip(kept, judged)]


def tokens_per_verify_step(verified: list[tuple[int, int, int, int]]) -> float:
    """Mean tokens a verification yielded (kept drafts plus the target's own token), over the run."""
    if not verified:
        raise ValueError("no verification was recorded: did the engine speculate?")
    return sum(a + 1 for *_, a in verified) / len(verified)


def pick_k(a: float, cost: dict[int, float]) -> tuple[int, float]:
    """Lesson 11's exercise 6: the number of drafts worth proposing. ``cost[n]`` is what a step feeding ``n`` tokens
    costs (``n = 1 .. K + 1``; ``cost[1]`` is a plain decode step). For each ``k`` in ``0 .. K`` the predicted speedup
    is :func:`expected_tokens_per_step` ``(a, k) x cost[1] / cost[k + 1]``; returns the best ``k`` (the smallest of
    equals: fewer lookahead slots for the same speed) and its predicted speedup."""
    best_k, best = 0, 1.0
    for k in range(1, max(cost)):
        s = expected_tokens_per_step(a, k) * cost[1] / cost[k + 1]
        if s > best:
            best_k, best = k, s
    return best_k, best


def replayed_speedup(verified: list[tuple[int, int, int, int]], undrafted: int, cost: dict[int, float]) -> float:
    """The speedup of a run's decode steps predicted from its own record instead of the independent model: every
    verification of ``d`` drafts that kept ``a`` yields ``a + 1`` tokens for ``cost[d + 1]``, each of the ``undrafted``
    decode steps (the proposer found nothing) one token for ``cost[1]``; plain decoding makes the same tokens at
    ``cost[1]`` each. Prefill steps, the same with and without speculation, are left out."""
    tokens = sum(a + 1 for *_, a in verified) + undrafted
    seconds = sum(cost[d + 1] for _, _, d, _ in verified) + undrafted * cost[1]
    if not seconds:
        raise ValueError("no decode step was recorded")
    return tokens * cost[1] / seconds


@dataclass
class RecordedProposer:
    """A proposer that notes every call: ``calls`` holds ``(asked, proposed)`` - the k it was given and how many
    tokens it returned - which is what :meth:`~lesson_utils.serving.speculative.SimulatedDrafts.fitted` needs."""

    propose: Callable[[list[int], int], list[int]]
    calls: list[tuple[int, int]] = field(default_factory=list)

    def __call__(self, token_ids: list[int], k: int) -> list[int]:
        draft = self.propose(token_ids, k)
        self.calls.append((k, len(draft) if isinstance(draft, (list, tuple)) else 0))
        return draft

    @property
    def undrafted(self) -> int:
        """Calls that proposed nothing: decode steps that were plain."""
        return sum(1 for _, n in self.calls if n == 0)

    @property
    def __name__(self) -> str:
        return getattr(self.propose, "__name__", "proposer")


@dataclass(frozen=True)
class GreedyReplay:
    """What greedy speculation with a proposer would record for one answer, without running the model: ``verified``
    in the scheduler's shape ``(step, seq_id, drafted, accepted)`` (``step`` counts decode steps from 0, ``seq_id``
    is 0) and ``undrafted``, the decode steps where the proposer found nothing."""

    verified: list[tuple[int, int, int, int]]
    undrafted: int


def replay_greedy(prompt: list[int], answer: list[int], propose, k: int, max_new_tokens: int) -> GreedyReplay:
    """Replay greedy speculation over a greedy ``answer`` already known (greedy speculation yields exactly it): the
    first token comes from the prefill; every decode step after it asks ``propose(context, room)`` - ``room`` is
    ``k``, or less near ``max_new_tokens`` as the engine asks - and keeps the drafts that agree with the answer, then
    the answer's next token. Agreement is known from the answer alone, so the replay equals the engine's record
    (``scheduler.verified``) except where a draft runs past an answer that ended at eos: there what the model would
    have said after eos is unknown and the replay counts only up to it (a lower bound)."""
    if not answer:
        raise ValueError("an answer has at least the token the prefill produced")
    verified, undrafted, g, step = [], 0, 1, 0
    while g < len(answer):
        room = min(k, max_new_tokens - g - 1)
        draft = list(propose(list(prompt) + list(answer[:g]), room)) if room > 0 else []
        if draft:
            rest = answer[g:]
            a = 0
            while a < len(draft) and a < len(rest) and draft[a] == rest[a]:
                a += 1
            verified.append((step, 0, len(draft), a))
            g += a + 1
        else:
            undrafted += 1
            g += 1
        step += 1
    return GreedyReplay(verified, undrafted)


def kept_and_replaced(p, q):
    """Why the rejection rule keeps the target's distribution, token by token. A proposer drafts ``x ~ q``; the rule
    keeps it with probability ``min(1, p(x) / q(x))`` and otherwise draws from ``max(0, p - q)`` normalized. Returns
    ``(kept, replaced)``: ``kept[y]`` = P(y was drafted and kept) = ``min(p(y), q(y))``; ``replaced[y]`` = P(a draft
    was rejected and y drawn instead) = P(reject) x ``max(0, p(y) - q(y)) / sum(max(0, p - q))``, and P(reject) is that
    same sum, so ``replaced = max(0, p - q)``. Their sum is ``p`` whatever ``q`` is (lesson 11's exercise 4). ``p`` and
    ``q`` are not changed."""
    import torch

    kept = torch.minimum(p, q)
    return kept, (p - kept).clamp_min(0)
