"""Lesson 11's arithmetic: what a verify step is worth, predicted from an acceptance rate and measured step costs,
and the acceptance a run actually saw (from the scheduler's record of every verification)."""

from __future__ import annotations


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
    kept at each draft position ``1 .. k`` among verifications that drafted that far (None where none did)."""
    reached, kept = [0] * k, [0] * k
    for _, _, drafted, accepted in verified:
        for i in range(min(drafted, k)):
            reached[i] += 1
            kept[i] += i < accepted
    return [None if r == 0 else c / r for c, r in zip(kept, reached)]


def tokens_per_verify_step(verified: list[tuple[int, int, int, int]]) -> float:
    """Mean tokens a verification yielded (kept drafts plus the target's own token), over the run."""
    if not verified:
        raise ValueError("no verification was recorded: did the engine speculate?")
    return sum(a + 1 for *_, a in verified) / len(verified)
