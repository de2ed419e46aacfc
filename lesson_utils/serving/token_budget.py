"""Lesson 08: scheduling tokens, not phases - one step's token budget, decodes first, prompt chunks after.

vLLM v1's scheduler gives each step ``max_num_batched_tokens`` tokens. Running sequences that decode take one
each, first; what is left goes to prompts, a chunk at a time: sequences still part-way through their prompt,
then new requests in arrival order. A sequence's *computed* count (its K/V in the cache: ``Sequence.kv_len``)
catches up with its length chunk by chunk; only the step that computes its last prompt token samples a token.
A long prompt then no longer makes one step long: its cost moves to its own time to first token.

:func:`budgeted_schedule` is the policy (exercise 08-1); :class:`~lesson_utils.serving.scheduler.FCFSScheduler`
with ``chunked_prefill=True`` runs it every step and does the rest: admission through the memory manager,
room for the tokens about to be sampled, preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class TokenState:
    """A sequence as the token budget sees it: ``computed`` tokens have K/V in the cache, of ``length``."""

    seq_id: int
    computed: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """Tokens ``start .. end - 1`` of sequence ``seq_id`` run this step (``end - start`` of the budget)."""

    seq_id: int
    start: int
    end: int


def budgeted_schedule(
    running: list[TokenState], waiting: list[TokenState], budget: int, admit: Callable[[int], int | None]
) -> list[Chunk]:
    """One step's token ranges, at most ``budget`` tokens in all. Reference for exercise 08-1.

    1. every running sequence with one token left to compute (a decode) gets it, in running order, while the
       budget lasts;
    2. running sequences still part-way through their prompt get the next chunk of it, in order, as much as
       the budget has left;
    3. waiting sequences, in arrival order, while budget is left: ``admit(seq_id)`` asks the memory manager for
       room and returns how many of its tokens are already computed (prefix-cache hits; the last prompt token
       never is), or None if it does not fit now - then it and everyone behind it waits (no overtaking). An
       admitted sequence gets a chunk from its first uncomputed token.
    """
    chunks: list[Chunk] = []
    left = budget
    for s in running:
        if left and s.length - s.computed == 1:
            chunks.append(Chunk(s.seq_id, s.computed, s.length))
            left -= 1
    for s in running:
        if left and s.length - s.computed > 1:
            n = min(left, s.length - s.computed)
            chunks.append(Chunk(s.seq_id, s.computed, s.computed + n))
            left -= n
    for s in waiting:
        if not left:
            break
        computed = admit(s.seq_id)
        if computed is None:
            break
        n = min(left, s.length - computed)
        chunks.append(Chunk(s.seq_id, computed, computed + n))
        left -= n
    return chunks
