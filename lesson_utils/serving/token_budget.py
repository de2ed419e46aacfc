"""Token policies: which tokens of which sequences run in one step (lesson 08 makes this the scheduler's core).

The scheduler has one loop (as vLLM v1's): every step a *policy* hands out token ranges (:class:`Chunk`) - a
decode gets one token, a prompt gets a chunk - and admits waiting requests through the memory manager as it goes.

* :func:`whole_prompts` - lessons 02-07: every running sequence gets all the tokens it has not computed (one, for
  a decode), then waiting requests are admitted in arrival order, a whole prompt each, while the optional token
  budget allows;
* :func:`budgeted_schedule` - lesson 08's chunked prefill (exercise 08-1): vLLM v1 gives each step
  ``max_num_batched_tokens`` tokens. Running sequences that decode take one each, first; what is left goes to
  prompts, a chunk at a time: sequences still part-way through their prompt, then new requests in arrival order.
  A sequence's computed count (``num_computed``, vLLM's ``num_computed_tokens``) catches up with its length
  chunk by chunk; only the step that computes its last prompt token samples a token. A long prompt then no longer
  makes one step long: its cost moves to its own time to first token.

:class:`ChunkedPrefill` is how an engine turns the second on: ``Engine(..., chunked_prefill=ChunkedPrefill(128))``.
"""

from __future__ import annotations

from collections import abc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

from lesson_utils.core.types import Chunk, is_int


@dataclass(frozen=True)
class TokenState:
    """A sequence as the token budget sees it: ``num_computed`` tokens have K/V in the cache, of ``length``."""

    seq_id: int
    num_computed: int
    length: int


class QueueView(abc.Sequence):
    """The waiting queue as a plan function reads it: a list of :class:`TokenState` made on access.

    A saturated stream keeps thousands of requests waiting while a step admits a few; building every one's
    ``TokenState`` each step made the simulator's steps cost the queue's length. The view holds a snapshot of
    the queue (admissions during the step do not shift it) and reads like a list: indexing, slices, ``len``,
    iteration, ``+`` with a list, ``copy()``. It cannot be changed."""

    def __init__(self, seqs: list):
        self._seqs = seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._state(s) for s in self._seqs[i]]
        return self._state(self._seqs[i])

    def __iter__(self):
        return (self._state(s) for s in self._seqs)

    @staticmethod
    def _state(seq) -> TokenState:
        return TokenState(seq.seq_id, seq.num_computed, seq.len)

    def copy(self) -> list[TokenState]:
        return list(self)

    def __add__(self, other) -> list[TokenState]:
        return list(self) + list(other)

    def __radd__(self, other) -> list[TokenState]:
        return list(other) + list(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, QueueView)) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"QueueView({list(self)!r})" if len(self) <= 8 else f"QueueView(<{len(self)} waiting>)"


def whole_prompts(
    running: list[TokenState], waiting: list[TokenState], budget: int | None, admit: Callable[[int], int | None]
) -> list[Chunk]:
    """Every running sequence's uncomputed tokens (a decode: one), then whole prompts of waiting sequences in arrival
    order while ``admit`` finds room and the budget (None: no limit) has room; a prompt over what is left of the
    budget goes first next step, unless nothing else runs (a prompt larger than the budget must still run)."""
    chunks = [Chunk(s.seq_id, s.num_computed, s.length) for s in running]
    left = None if budget is None else budget - sum(s.length - s.num_computed for s in running)
    for s in waiting:
        if left is not None and s.length - s.num_computed > left and chunks:
            break
        computed = admit(s.seq_id)
        if computed is None:
            break
        chunks.append(Chunk(s.seq_id, computed, s.length))
        if left is not None:
            left -= s.length - computed  # prefix-cache hits are not fed
    return chunks


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
        if left and s.length - s.num_computed == 1:
            chunks.append(Chunk(s.seq_id, s.num_computed, s.length))
            left -= 1
    for s in running:
        if left and s.length - s.num_computed > 1:
            n = min(left, s.length - s.num_computed)
            chunks.append(Chunk(s.seq_id, s.num_computed, s.num_computed + n))
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


@dataclass(frozen=True)
class ChunkedPrefill:
    """Chunked prefill for an engine or scheduler: ``budget`` tokens per step (vLLM's ``max_num_batched_tokens``),
    handed out by ``plan_fn`` (:func:`budgeted_schedule`, or a learner's version of it)."""

    budget: int
    plan_fn: Callable = budgeted_schedule

    def __post_init__(self):
        if not is_int(self.budget) or self.budget < 1:
            raise ValueError(f"the token budget of chunked prefill must be a positive int, got {self.budget!r}")
        if not callable(self.plan_fn):
            raise TypeError(
                f"plan_fn must be a function (running, waiting, budget, admit) -> chunks, got {self.plan_fn!r}"
            )


def check_chunks(chunks, running: list, waiting_ids: Iterable[int], budget: int | None, name: str) -> list:
    """The running sequence of every chunk of a plan, or a clear error naming the plan function ``name`` for a plan
    the engine cannot run: not a list of :class:`Chunk`, a chunk for a sequence that is not running (or does not
    exist), two chunks for one sequence, a range that is not the next one, more tokens than ``budget``."""
    if not isinstance(chunks, (list, tuple)):
        raise TypeError(
            f"the plan function {name} must return a list of Chunk(seq_id, start, end), got {type(chunks).__name__}"
        )
    by_id = {s.seq_id: s for s in running}
    seqs, total, seen = [], 0, set()
    for i, c in enumerate(chunks):
        if not isinstance(c, Chunk):
            raise TypeError(
                f"the plan function {name} returned {type(c).__name__} {c!r} as item {i}: each item is a "
                "Chunk(seq_id, start, end) (lesson_utils.serving.token_budget.Chunk)"
            )
        if not (type(c.seq_id) is int and type(c.start) is int and type(c.end) is int) and any(
            not is_int(v) for v in (c.seq_id, c.start, c.end)
        ):  # (the fast test first: a plan holds every running sequence, hundreds in a simulation)
            raise TypeError(f"chunk {c} from {name}: seq_id, start and end are ints")
        if c.seq_id in seen:
            raise ValueError(f"chunk {c} from {name}: sequence {c.seq_id} has two chunks in one step")
        seen.add(c.seq_id)
        seq = by_id.get(c.seq_id)
        if seq is None:
            if c.seq_id in set(waiting_ids):  # read only here: the queue can be long
                raise ValueError(
                    f"chunk {c} from {name}: sequence {c.seq_id} is waiting, not running - it gets a chunk only "
                    f"after admit({c.seq_id}) returned a number"
                )
            raise ValueError(f"chunk {c} from {name}: no sequence {c.seq_id} is running or waiting here")
        num_computed, length = seq.num_computed, seq.len + len(seq.draft)  # (lesson 11: its drafted tokens too)
        if not (c.start == num_computed and c.start < c.end <= length):
            raise ValueError(
                f"chunk {c} from {name}: sequence {c.seq_id} has {seq.num_computed} of {length} tokens computed, so "
                f"its chunk runs from {seq.num_computed} to at most {length}"
            )
        seqs.append(seq)
        total += c.end - c.start
    if budget is not None and total > budget:
        raise ValueError(f"the chunks from {name} hold {total} tokens, over the budget of {budget}")
    return seqs
