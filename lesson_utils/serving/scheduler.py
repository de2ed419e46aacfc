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
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from lesson_utils.serving import sampling
from lesson_utils.serving.token_budget import Chunk, TokenState, budgeted_schedule
from lesson_utils.types import MemoryManager, OutOfBlocks, Sequence


def most_recently_admitted(running: list[Sequence]) -> Sequence:
    """vLLM's victim: the running sequence admitted last (the latest arrival loses). Reference for exercise 06-2."""
    return max(reversed(running), key=lambda s: -1 if s.admitted_step is None else s.admitted_step)


def reset_for_recompute(seq: Sequence) -> None:
    """Preempt by recompute: forget the cached K/V, keep every token (reference for exercise 06-3).

    The prompt and the tokens generated so far are prefilled again when the sequence is readmitted; its
    output so far, and how many tokens it has generated, do not change.
    """
    seq.kv_len = 0
    seq.preemptions += 1


@dataclass
class StepPlan:
    """What one step will do, decided by the scheduler before the model runs (:meth:`FCFSScheduler.schedule`).

    ``scheduled``: the sequences that run this step (each has room for its next token); ``admitted``: those
    new to the cache this step (they prefill); ``preempted``: those pushed out to make room; ``swap_in`` and
    ``swap_out``: the block copies to make before the forward pass, ``(cpu, gpu)`` and ``(gpu, cpu)`` pairs,
    swap-ins first (a CPU block read in may be reused by a swap-out of the same step); ``copies``: the
    copy-on-write copies ``(src, dst)`` within the GPU cache, made after the swaps.
    """

    step: int
    scheduled: list[Sequence]
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    prefill_tokens: int = 0  # prompt tokens fed this step (sequences admitted this step, or prompt chunks)
    num_tokens: list[int] | None = None  # tokens each scheduled sequence feeds; None: all it has not computed

    def tokens_to_feed(self) -> list[int]:
        """How many tokens each scheduled sequence feeds this step (from ``kv_len``)."""
        if self.num_tokens is None:
            return [s.len - s.kv_len for s in self.scheduled]
        return list(self.num_tokens)


@dataclass
class PreemptionEvent:
    step: int
    seq_id: int
    mode: str  # "swap" or "recompute"
    note: str = ""


class FCFSScheduler:
    """First come, first served, at iteration level (Orca's idea: a batch changes every step).

    Each step: sequences swapped out to CPU come back first, in the order they left, while their blocks fit
    (above the manager's watermark); only when none is left waiting in swap are new requests admitted, in
    arrival order, while the memory manager says the head one fits and the step's token budget
    (``max_num_batched_tokens``: prefill tokens plus one per decoding sequence) allows. A request that
    does not fit blocks those behind it (no overtaking), which is what first-come-first-served means. Then
    room is made for the token every running sequence is about to generate.

    If a running sequence cannot grow because memory ran out (paging reserves nothing ahead), a victim is
    preempted - the most recently admitted sequence, as in vLLM - in one of two modes:

    * ``"recompute"``: its blocks are freed; it goes back to the front of the queue keeping its tokens, to
      be prefilled again later (with prefix-cache hits where lesson 05's cache is on);
    * ``"swap"``: its blocks are copied to the CPU ``swap_space`` and freed on the GPU; it waits in the
      swapped queue. If the swap space cannot hold it, it is recomputed instead and the event says so.

    :meth:`schedule` runs both phases (:meth:`admit`, then :meth:`reserve_next_slots`) and returns the step's
    :class:`StepPlan`, with the block copies the engine must make.
    """

    def __init__(
        self,
        manager: MemoryManager,
        max_num_seqs: int | None = None,
        *,
        preemption_mode: str = "recompute",
        swap_space=None,
        max_num_batched_tokens: int | None = None,
        choose_victim: Callable = most_recently_admitted,
        reset: Callable = reset_for_recompute,
        chunked_prefill: bool = False,
        plan_fn: Callable = budgeted_schedule,
    ):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode is 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and swap_space is None:
            raise ValueError("preemption_mode='swap' needs a swap_space (lesson_utils.memory.swap.SwapSpace)")
        if max_num_batched_tokens is not None and (
            isinstance(max_num_batched_tokens, bool)
            or not isinstance(max_num_batched_tokens, int)
            or max_num_batched_tokens < 1
        ):
            raise ValueError(f"max_num_batched_tokens must be a positive int, got {max_num_batched_tokens!r}")
        if chunked_prefill and max_num_batched_tokens is None:
            raise ValueError("chunked prefill fills a token budget: give max_num_batched_tokens")
        if chunked_prefill and preemption_mode != "recompute":
            raise ValueError("chunked prefill preempts by recompute here (preemption_mode='recompute')")
        if max_num_seqs is not None and (
            isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1
        ):
            raise ValueError(f"max_num_seqs must be a positive int (or None for no limit), got {max_num_seqs!r}")
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.preemption_mode = preemption_mode
        self.swap_space = swap_space
        self.max_num_batched_tokens = max_num_batched_tokens
        self.choose_victim, self.reset = choose_victim, reset
        self.chunked_prefill, self.plan_fn = chunked_prefill, plan_fn
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.finished: list[Sequence] = []
        self.events: list[PreemptionEvent] = []
        self._swap_in: list[tuple[int, int]] = []  # this step's copies, handed over in its StepPlan
        self._swap_out: list[tuple[int, int]] = []
        self._step = 0
        self._next_id = 0

    def new_seq_id(self) -> int:
        """A sequence id no sequence of this scheduler has had (requests, forked samples, beams)."""
        self._next_id += 1
        return self._next_id - 1

    @property
    def num_preemptions(self) -> int:
        return len(self.events)

    def add(self, seq: Sequence) -> None:
        self.manager.check_admissible(seq)
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Lesson 09: a sequence prefilled elsewhere, its blocks already adopted by this scheduler's manager, joins
        the running batch (it decodes from the next step). A finished sequence is refused: it is never decoded
        (its first token already ended it: hand it back as finished)."""
        if seq.is_finished:
            raise ValueError(
                f"sequence {seq.seq_id} has already finished ({seq.num_generated} of {seq.request.output_len} tokens"
                + (", ending in its eos" if seq.output_ids and seq.output_ids[-1] == seq.eos_token_id else "")
                + "): a finished sequence is never decoded"
            )
        if any(s is seq or s.seq_id == seq.seq_id for s in self.running):
            raise ValueError(f"sequence {seq.seq_id} is running already")
        self.manager.check_admissible(seq)
        self.running.append(seq)

    def _room_for_another(self) -> bool:
        return self.max_num_seqs is None or len(self.running) < self.max_num_seqs

    def schedule(self, step: int) -> StepPlan:
        """One step's decisions: admit (swapped sequences first), then make room for every running sequence's
        next token, preempting if memory is short. Raises ``RuntimeError`` when nothing can run although
        requests wait: the head request does not fit even into an empty cache.

        With ``chunked_prefill`` the step's tokens come from the token budget instead (lesson 08:
        :meth:`_schedule_chunks`)."""
        if self.chunked_prefill:
            return self._schedule_chunks(step)
        admitted = self.admit(step)
        if not self.running and (self.waiting or self.swapped):
            raise RuntimeError(
                "nothing is running and the head request still does not fit: the cache is too small for it even when empty"
            )
        preempted = self.reserve_next_slots()
        return StepPlan(
            step,
            list(self.running),
            admitted,
            preempted,
            self._swap_in,
            self._swap_out,
            self.manager.pop_copies(),
            sum(s.len - s.kv_len for s in self.running if s.admitted_step == step),
            [s.len - s.kv_len for s in self.running],
        )

    def _schedule_chunks(self, step: int) -> StepPlan:
        """Lesson 08: ``plan_fn`` (:func:`~lesson_utils.serving.token_budget.budgeted_schedule`) picks the step's
        token ranges within ``max_num_batched_tokens``, admitting through the memory manager as it goes (a
        prompt's blocks are all taken at admission; its chunks only spread the compute). Then room is made for
        the token each sequence that finishes its prompt (or decodes) is about to sample, preempting by
        recompute if memory is short; a preempted sequence's chunk is dropped."""
        self._step = step
        self._swap_in, self._swap_out = [], []
        admitted: list[Sequence] = []

        saved: dict[int, tuple[int, int | None]] = {}  # seq_id -> (kv_len, admitted_step) before admit()

        def admit(seq_id: int) -> int | None:
            if not self.waiting or self.waiting[0].seq_id != seq_id:
                head = self.waiting[0].seq_id if self.waiting else None
                raise ValueError(
                    f"admit the waiting sequences in arrival order: asked for {seq_id}, the head is {head}"
                )
            seq = self.waiting[0]
            if not self._room_for_another() or not self.manager.can_allocate(seq):
                return None
            saved[seq.seq_id] = (seq.kv_len, seq.admitted_step)
            self.manager.allocate(seq)  # prefix-cache hits set seq.kv_len
            self.waiting.popleft()
            seq.admitted_step = step
            self.running.append(seq)
            admitted.append(seq)
            return seq.kv_len

        state = [TokenState(s.seq_id, s.kv_len, s.len) for s in self.running]
        queue = [TokenState(s.seq_id, s.kv_len, s.len) for s in self.waiting]
        try:
            chunks = self.plan_fn(state, queue, self.max_num_batched_tokens, admit)
            seqs = self._check_chunks(chunks)
        except BaseException:  # a refused (or crashing) plan leaves the scheduler as it found it
            self._undo_admissions(admitted, saved)
            raise
        if not self.running and self.waiting:
            raise RuntimeError(
                "nothing is running and the head request still does not fit: the cache is too small for it even when empty"
            )
        preempted, i = [], 0
        sampling = [s for s, c in zip(seqs, chunks) if c.end == s.len]  # they need a slot for the token they sample
        while i < len(sampling):
            try:
                self.manager.append_slot(sampling[i])
                i += 1
            except OutOfBlocks:
                victim = self._victim()
                self.running = [s for s in self.running if s is not victim]
                if any(s is victim for s in sampling[:i]):
                    i -= 1
                sampling = [s for s in sampling if s is not victim]
                self._preempt(victim, {})
                preempted.append(victim)
        kept = [(s, c) for s, c in zip(seqs, chunks) if any(r is s for r in self.running)]
        return StepPlan(
            step,
            [s for s, _ in kept],
            [s for s in admitted if any(r is s for r in self.running)],
            preempted,
            copies=self.manager.pop_copies(),
            prefill_tokens=sum(c.end - c.start for s, c in kept if not (c.end - c.start == 1 and s.num_generated)),
            num_tokens=[c.end - c.start for _, c in kept],
        )

    def _undo_admissions(self, admitted: list[Sequence], saved: dict[int, tuple[int, int | None]]) -> None:
        """Give back what this step's admissions took: blocks freed, each sequence back at the head of the queue
        in its old order, with the computed count and admission step it had."""
        for seq in reversed(admitted):
            self.manager.free(seq)
            seq.kv_len, seq.admitted_step = saved[seq.seq_id]
            self.running = [s for s in self.running if s is not seq]
            self.waiting.appendleft(seq)
        admitted.clear()

    def _check_chunks(self, chunks) -> list[Sequence]:
        """The running sequence of every chunk, or a clear error (naming the plan function) for a plan the engine
        cannot run: the wrong type, a chunk for a sequence that is not running, a range that is not the next one."""
        name = getattr(self.plan_fn, "__name__", type(self.plan_fn).__name__)
        if not isinstance(chunks, (list, tuple)):
            raise TypeError(
                f"the plan function {name} must return a list of Chunk(seq_id, start, end), got {type(chunks).__name__}"
            )
        by_id = {s.seq_id: s for s in self.running}
        waiting = {s.seq_id for s in self.waiting}
        seqs, total, seen = [], 0, set()
        for i, c in enumerate(chunks):
            if not isinstance(c, Chunk):
                raise TypeError(
                    f"the plan function {name} returned {type(c).__name__} {c!r} as item {i}: each item is a "
                    "Chunk(seq_id, start, end) (lesson_utils.serving.token_budget.Chunk)"
                )
            if any(isinstance(v, bool) or not isinstance(v, int) for v in (c.seq_id, c.start, c.end)):
                raise TypeError(f"chunk {c} from {name}: seq_id, start and end are ints")
            if c.seq_id in seen:
                raise ValueError(f"chunk {c} from {name}: sequence {c.seq_id} has two chunks in one step")
            seen.add(c.seq_id)
            seq = by_id.get(c.seq_id)
            if seq is None:
                if c.seq_id in waiting:
                    raise ValueError(
                        f"chunk {c} from {name}: sequence {c.seq_id} is waiting, not running - it gets a chunk only "
                        f"after admit({c.seq_id}) returned a number"
                    )
                raise ValueError(f"chunk {c} from {name}: no sequence {c.seq_id} is running or waiting here")
            if not (c.start == seq.kv_len and c.start < c.end <= seq.len):
                raise ValueError(
                    f"chunk {c} from {name}: sequence {c.seq_id} has {seq.kv_len} of {seq.len} tokens computed, so "
                    f"its chunk runs from {seq.kv_len} to at most {seq.len}"
                )
            seqs.append(seq)
            total += c.end - c.start
        if total > self.max_num_batched_tokens:
            raise ValueError(
                f"the chunks from {name} hold {total} tokens, over the budget of {self.max_num_batched_tokens}"
            )
        return seqs

    def _victim(self) -> Sequence:
        """The policy's victim among the running sequences, checked. With chunked prefill a sequence may need
        several steps before it samples anything, so a policy that kept preempting the same one would stop all
        progress (an oldest-first policy does): there the policy is never offered the earliest-arrived running
        sequence while another is running, so that one always goes on and finishes. Without chunking every
        admission computes a token, and the policy chooses among all of them."""
        candidates = list(self.running)
        if self.chunked_prefill and len(candidates) > 1:
            first = min(candidates, key=lambda s: (s.request.arrival_s, s.seq_id))
            candidates = [s for s in candidates if s is not first]
        victim = self.choose_victim(candidates)
        if not any(s is victim for s in candidates):
            name = getattr(self.choose_victim, "__name__", type(self.choose_victim).__name__)
            raise ValueError(
                f"the victim policy {name} returned {victim!r}, which is not one of the {len(candidates)} running "
                "sequences it was given: it must return one of them"
            )
        return victim

    def admit(self, step: int) -> list[Sequence]:
        """Swap in, then admit what fits; returns the newly admitted (prefilling) sequences."""
        self._step = step
        self._swap_in, self._swap_out = [], []
        moved: dict[int, int] = {}
        watermark = self.manager.watermark_blocks
        # a running sequence feeds one token; one swapped out before its prefill ran feeds all it has not computed
        budget = None if self.max_num_batched_tokens is None else self.max_num_batched_tokens - len(self.running)
        while self.swapped and self._room_for_another():
            seq = self.swapped[0]
            if budget is not None and seq.len - seq.kv_len > budget and self.running:
                break
            if not self.swap_space.can_swap_in(self.manager, seq.seq_id, watermark if self.running else 0):
                break
            self._swap_in += self.swap_space.swap_in(self.manager, seq.seq_id, moved)
            self.swapped.popleft()
            seq.admitted_step = step
            self.running.append(seq)
            if budget is not None:
                budget -= seq.len - seq.kv_len
        if self.swapped:
            return []  # swapped sequences come back before anyone new is admitted
        admitted = []
        while self.waiting and self._room_for_another():
            seq = self.waiting[0]
            if budget is not None and seq.len - seq.kv_len > budget and (admitted or self.running):
                break  # over this step's token budget; it goes first next step
            if not self.manager.can_allocate(seq):
                break
            self.manager.allocate(seq)
            self.waiting.popleft()
            seq.admitted_step = step
            self.running.append(seq)
            admitted.append(seq)
            if budget is not None:
                budget -= seq.len - seq.kv_len
        return admitted

    def reserve_next_slots(self) -> list[Sequence]:
        """Room for one more token in every running sequence; returns the sequences preempted for it."""
        preempted, i = [], 0
        moved: dict[int, int] = {}  # GPU -> CPU blocks of this step's swap-outs: shared blocks go once
        while i < len(self.running):
            try:
                self.manager.append_slot(self.running[i])
                i += 1
            except OutOfBlocks as err:
                victim = self._victim()
                if victim.beam is not None:  # a beam cannot wait while its group goes on: the search fails
                    raise OutOfBlocks(
                        f"beam search ran out of blocks for its {len(victim.beam.beams)} beams: {err}"
                    ) from err
                index = next(k for k, s in enumerate(self.running) if s is victim)
                self.running.pop(index)
                if index < i:
                    i -= 1
                self._preempt(victim, moved)
                preempted.append(victim)
                for b in [b for b in moved if self.manager.allocator.is_free(b)]:
                    del moved[b]  # freed: it may be handed out again this step, and then holds something else
        return preempted

    def _preempt(self, victim: Sequence, moved: dict[int, int]) -> None:
        if self.preemption_mode == "swap":
            if self.swap_space.can_swap_out(self.manager, victim.seq_id, moved):
                self._swap_out += self.swap_space.swap_out(self.manager, victim.seq_id, moved)
                victim.preemptions += 1
                self.swapped.append(victim)
                self.events.append(PreemptionEvent(self._step, victim.seq_id, "swap"))
                return
            note = (
                f"swap space full ({self.swap_space.num_free} of {self.swap_space.num_blocks} CPU blocks free): "
                f"fell back to recompute"
            )
        else:
            note = ""
        self.manager.free(victim)
        self.reset(victim)
        self.waiting.appendleft(victim)
        self.events.append(PreemptionEvent(self._step, victim.seq_id, "recompute", note))

    def abort(self, seq: Sequence) -> None:
        """Cancel a sequence wherever it is (waiting, running or swapped) and give back all it holds.

        Raises ``ValueError`` for a sequence this scheduler does not hold (finished, or already cancelled)."""

        def holds(queue) -> bool:  # by identity: two sequences may compare equal field by field
            return any(s is seq for s in queue)

        if holds(self.running):
            self.running = [s for s in self.running if s is not seq]
            self.manager.free(seq)
        elif holds(self.waiting):
            self.waiting = deque(s for s in self.waiting if s is not seq)
        elif holds(self.swapped):
            self.swapped = deque(s for s in self.swapped if s is not seq)
            self.swap_space.drop(seq.seq_id)
        else:
            raise ValueError(
                f"sequence {seq.seq_id} is not waiting, running or swapped (finished or cancelled already)"
            )
        seq.aborted = True

    def retire_finished(self, step: int) -> list[Sequence]:
        """Settle the step, then free every running sequence that has generated all its tokens: a parent that
        has just prefilled forks its parallel samples (they share its blocks), beam groups keep their best
        continuations (forking the beams chosen twice, freeing the ones not chosen)."""
        # only sequences that sampled this step (a prompt chunk that stops short samples nothing yet)
        for seq in [s for s in self.running if s.pending_forks and s.last_logits is not None]:
            self._fork_samples(seq)
        for group in list({id(s.beam): s.beam for s in self.running if s.beam is not None}.values()):
            if all(b.last_logits is not None for b in group.beams):
                self._advance_beams(group, step)
        done = [s for s in self.running if s.is_finished]
        for seq in done:
            self.manager.free(seq)
            seq.finished_step = step
            self.finished.append(seq)
        if done:
            self.running = [s for s in self.running if not s.is_finished]
        for group in {id(s.beam): s.beam for s in done if s.beam is not None}.values():
            group.best = max(zip(group.beams, group.scores), key=lambda b: b[1])[0]  # max keeps the first of equals
        return done

    def _fork_samples(self, parent: Sequence) -> None:
        """After the parent's prefill: n - 1 siblings share its blocks and draw their own first token from
        its logits (each with its own generator: seeded from the parent's, so a seed repeats on any device)."""
        for i in range(parent.pending_forks):
            child = Sequence(
                replace(parent.request, req_id=self.new_seq_id()),
                num_generated=parent.num_generated - 1,
                admitted_step=parent.admitted_step,
                output_ids=list(parent.output_ids[:-1]),
                token_steps=list(parent.token_steps[:-1]),
                eos_token_id=parent.eos_token_id,
                kv_len=parent.kv_len,
                temperature=parent.temperature,
                added_at=parent.added_at,
            )
            if parent.temperature > 0:
                child.generator = torch.Generator().manual_seed(int(parent.generator.initial_seed()) + 1000 * (i + 1))
            self.manager.fork(parent.seq_id, child.seq_id)
            child.append_token(sampling.sample(child, parent.last_logits), parent.first_token_step)
            parent.samples.append(child)
            self.running.append(child)
        parent.pending_forks = 0
        parent.last_logits = None

    def _advance_beams(self, group, step: int) -> None:
        """Keep the group's ``width`` best continuations (see :mod:`lesson_utils.serving.beam_search`)."""
        chosen = group.choose()
        used: set[int] = set()
        beams = []
        for index, token, score in chosen:  # forks first: a fork copies its parent before it grows
            parent = group.beams[index]
            if index in used:
                child = Sequence(
                    replace(parent.request, req_id=self.new_seq_id()),
                    num_generated=parent.num_generated,
                    admitted_step=parent.admitted_step,
                    first_token_step=parent.first_token_step,
                    output_ids=list(parent.output_ids),
                    token_steps=list(parent.token_steps),
                    kv_len=parent.kv_len,
                    beam=group,
                )
                self.manager.fork(parent.seq_id, child.seq_id)
                beams.append((child, token, score))
            else:
                used.add(index)
                beams.append((parent, token, score))
        for index, seq in enumerate(group.beams):
            if index not in used:
                self.manager.free(seq)
        for seq, token, _ in beams:
            seq.last_logits = None
            seq.append_token(token, step)
        group.beams, group.scores = [b for b, _, _ in beams], [sc for _, _, sc in beams]
        logical, physical = self.manager.sharing()
        group.logical_blocks += logical
        group.physical_blocks += physical
        # the group's beams run next step in the order chosen, after everyone else
        self.running = [s for s in self.running if s.beam is not group] + group.beams

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)
