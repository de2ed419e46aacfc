"""Lesson 06: when memory runs out - whom to preempt, and what recompute resets. The scheduler's defaults; a
learner's versions plug in (``FCFSScheduler(choose_victim=..., reset=...)``).

The victim - the most recently admitted sequence, as in vLLM, or a learner's ``choose_victim`` - is preempted in
one of two modes:

* ``"recompute"``: its blocks are freed; it goes back to the front of the queue keeping its tokens, to be prefilled
  again later (with prefix-cache hits where lesson 05's cache is on);
* ``"swap"``: its blocks are copied to the CPU swap space and freed on the GPU; it waits in the swapped queue. If the
  swap space cannot hold it, it is recomputed instead and the event says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from lesson_utils.core.types import Sequence


def most_recently_admitted(running: list[Sequence]) -> Sequence:
    """vLLM's victim: the running sequence admitted last (the latest arrival loses). Reference for exercise 06-2."""
    return max(reversed(running), key=lambda s: -1 if s.admitted_step is None else s.admitted_step)


def checked_victim(running: list[Sequence], choose_victim, *, protect_oldest: bool) -> Sequence:
    """``choose_victim``'s pick among ``running``, checked. With chunked prefill (``protect_oldest``) a sequence may
    need several steps before it samples anything, so a policy that kept preempting the same one would stop all
    progress (an oldest-first policy does): there the policy is never offered the earliest-arrived running sequence
    while another is running, so that one always goes on and finishes. Without chunking every admission computes a
    token, and the policy chooses among all of them."""
    candidates = list(running)
    if protect_oldest and len(candidates) > 1:
        first = min(candidates, key=lambda s: (s.request.arrival_s, s.seq_id))
        candidates = [s for s in candidates if s is not first]
    victim = choose_victim(candidates)
    if not any(s is victim for s in candidates):
        name = getattr(choose_victim, "__name__", type(choose_victim).__name__)
        raise ValueError(
            f"the victim policy {name} returned {victim!r}, which is not one of the {len(candidates)} running "
            "sequences it was given: it must return one of them"
        )
    return victim


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
