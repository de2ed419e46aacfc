"""Lesson 06: when memory runs out - whom to preempt, and what recompute resets. The scheduler's defaults; a
learner's versions plug in (``FCFSScheduler(choose_victim=..., reset=...)``)."""

from __future__ import annotations

from dataclasses import dataclass

from lesson_utils.core.types import Sequence


def most_recently_admitted(running: list[Sequence]) -> Sequence:
    """vLLM's victim: the running sequence admitted last (the latest arrival loses). Reference for exercise 06-2."""
    return max(reversed(running), key=lambda s: -1 if s.admitted_step is None else s.admitted_step)


def reset_for_recompute(seq: Sequence) -> None:
    """Preempt by recompute: forget the cached K/V, keep every token (reference for exercise 06-3).

    The prompt and the tokens generated so far are prefilled again when the sequence is readmitted; its
    output so far, and how many tokens it has generated, do not change.
    """
    seq.num_computed = 0
    seq.preemptions += 1


@dataclass
class PreemptionEvent:
    step: int
    seq_id: int
    mode: str  # "swap" or "recompute"
    note: str = ""
