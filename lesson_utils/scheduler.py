"""Sequences, the memory-manager interface, and a first-come-first-served iteration-level scheduler.

The scheduler knows nothing about *how* memory is laid out: it asks a memory manager whether a request
fits, tells it when a sequence grows by a token and when it finishes. Lesson 02 plugs in contiguous
reservations (Max / Pow2 / Oracle), lesson 03 a block manager; the same scheduler then drives either a
real model (the engine) or the memory-accounting runner (the simulator).

Token accounting, the same everywhere: a sequence holds one slot for every prompt token from admission,
and one more for each token it generates, from the step that produces it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from .block_allocator import OutOfBlocks
from .workloads import Request


@dataclass(eq=False)
class Sequence:
    """A request being served. ``len`` = prompt tokens + tokens generated so far.

    ``kv_len`` counts the tokens whose K/V are in the cache (the real engine's runner feeds
    ``token_ids[kv_len:]`` next step); a preempted sequence drops back to 0 and is prefilled again.
    ``eos_token_id`` ends the sequence early when generated (real runs only; simulations know lengths).
    """

    request: Request
    num_generated: int = 0
    admitted_step: int | None = None
    first_token_step: int | None = None
    finished_step: int | None = None
    output_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    kv_len: int = 0
    preemptions: int = 0
    temperature: float = 0.0  # 0 = greedy
    generator: object = None  # a torch.Generator for sampling
    pending_forks: int = 0  # parallel sampling: siblings still to fork after the prefill
    last_logits: object = None
    samples: list = field(default_factory=list)
    added_at: float = 0.0
    first_token_s: float | None = None  # time to first token, seconds (real runs)

    @property
    def seq_id(self) -> int:
        return self.request.req_id

    @property
    def len(self) -> int:
        return self.request.prompt_len + self.num_generated

    @property
    def final_len(self) -> int:
        """Length once finished (known to the simulator; only the Oracle policy may use it)."""
        return self.request.prompt_len + self.request.output_len

    @property
    def is_finished(self) -> bool:
        if self.num_generated >= self.request.output_len:
            return True
        return self.eos_token_id is not None and bool(self.output_ids) and self.output_ids[-1] == self.eos_token_id

    @property
    def token_ids(self) -> list[int]:
        """Prompt then generated ids (real runs only)."""
        return list(self.request.prompt_ids or []) + self.output_ids


class MemoryManager(Protocol):
    """What the scheduler asks of a KV memory manager (contiguous in lesson 02, paged in lesson 03)."""

    total_slots: int

    def check_admissible(self, seq: Sequence) -> None:
        """Raise ``NeverFits`` if ``seq`` could not run even in an empty cache."""

    def can_allocate(self, seq: Sequence) -> bool:
        """Would :meth:`allocate` succeed now?"""

    def allocate(self, seq: Sequence) -> None:
        """Admit ``seq``: give it memory for its prompt (and whatever the policy reserves)."""

    def append_slot(self, seq: Sequence) -> None:
        """``seq`` is about to grow by one token: make sure that token has a slot."""

    def free(self, seq: Sequence) -> None:
        """``seq`` finished: take all of its memory back."""

    def breakdown(self) -> dict[str, int]:
        """Slots by kind: token states, reserved, internal fragmentation, free (sums to total_slots)."""


class FCFSScheduler:
    """First come, first served, at iteration level (Orca's idea: a batch changes every step).

    Each step admits waiting requests in arrival order while the memory manager says the head one fits,
    then makes room for the token every running sequence is about to generate. A request that does not
    fit blocks those behind it (no overtaking), which is what first-come-first-served means.

    If a running sequence cannot grow because memory ran out (possible with paging, which reserves
    nothing ahead), the most recently admitted sequence is preempted: its memory is freed and it goes
    back to the front of the queue, keeping its tokens, to be prefilled again later ("recompute").
    Lesson 06 studies preemption properly; here it only keeps the server from getting stuck.
    """

    def __init__(self, manager: MemoryManager, max_num_seqs: int | None = None):
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.manager.check_admissible(seq)
        self.waiting.append(seq)

    def admit(self, step: int) -> list[Sequence]:
        """Move waiting sequences that fit into the running batch; returns the newly admitted."""
        admitted = []
        while self.waiting and (self.max_num_seqs is None or len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if not self.manager.can_allocate(seq):
                break
            self.manager.allocate(seq)
            self.waiting.popleft()
            seq.admitted_step = step
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def reserve_next_slots(self) -> list[Sequence]:
        """Room for one more token in every running sequence; returns the sequences preempted for it."""
        preempted, i = [], 0
        while i < len(self.running):
            try:
                self.manager.append_slot(self.running[i])
                i += 1
            except OutOfBlocks:
                victim = self.running.pop()  # the most recently admitted
                self.manager.free(victim)
                victim.kv_len = 0
                victim.preemptions += 1
                self.num_preemptions += 1
                self.waiting.appendleft(victim)
                preempted.append(victim)
        return preempted

    def retire_finished(self, step: int) -> list[Sequence]:
        """Free every running sequence that has generated all its tokens."""
        done = [s for s in self.running if s.is_finished]
        for seq in done:
            self.manager.free(seq)
            seq.finished_step = step
            self.finished.append(seq)
        if done:
            self.running = [s for s in self.running if not s.is_finished]
        return done

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
