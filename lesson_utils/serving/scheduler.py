"""A first-come-first-served, iteration-level scheduler: ``schedule() -> StepPlan``, then
``update_from_output(plan, output) -> finished``.

The scheduler knows nothing about *how* memory is laid out: it asks a memory manager
(:class:`~lesson_utils.core.types.MemoryManager`) whether a request fits, tells it when a sequence grows by a token and
when it finishes. Lesson 02 plugs in contiguous reservations (Max / Pow2 / Oracle), lesson 03 a block manager;
the same scheduler then drives either a real model (the engine) or the memory-accounting runner (the simulator).

Token accounting, the same everywhere: a sequence holds one slot for every prompt token from admission, and one
more for each token it generates, from the step that produces it. ``Sequence.num_computed`` counts the tokens whose K/V
are computed (vLLM's ``num_computed_tokens``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import MemoryManager, OutOfBlocks, Sequence, SequenceStatus, is_int
from lesson_utils.serving import sampling
from lesson_utils.serving.forks import fork_samples
from lesson_utils.serving.output import RunnerOutput, StepPlan
from lesson_utils.serving.preemption import PreemptionEvent, most_recently_admitted, reset_for_recompute
from lesson_utils.serving.token_budget import ChunkedPrefill, QueueView, TokenState, check_chunks, whole_prompts


def _positive(value, what: str) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{what} must be a positive int, got {value!r}")


class FCFSScheduler:
    """First come, first served, at iteration level (Orca's idea: a batch changes every step).

    One loop each step (:meth:`schedule`): sequences swapped out to CPU come back first, in the order they left,
    while their blocks fit (above the manager's watermark); then a token policy hands out the step's tokens and
    admits waiting requests through the memory manager, in arrival order, while the head one fits - a request
    that does not fit blocks those behind it (no overtaking). The policy is :func:`whole_prompts` (every running
    sequence computes what it has not, new requests prefill whole, within ``max_num_batched_tokens`` if given), or
    lesson 08's budgeted one with ``chunked=ChunkedPrefill(budget)``. Then room is made for the token every
    sequence that completes its tokens is about to get.

    If a sequence cannot grow because memory ran out (paging reserves nothing ahead), a victim is preempted - the
    most recently admitted sequence, as in vLLM, or a learner's ``choose_victim`` - in one of two modes:

    * ``"recompute"``: its blocks are freed; it goes back to the front of the queue keeping its tokens, to be
      prefilled again later (with prefix-cache hits where lesson 05's cache is on);
    * ``"swap"``: its blocks are copied to the CPU ``swap_space`` and freed on the GPU; it waits in the swapped
      queue. If the swap space cannot hold it, it is recomputed instead and the event says so.

    After the runner has computed the plan, :meth:`update_from_output` advances every computed count, samples and
    appends the due tokens (the one place a token is born), registers full computed blocks in the prefix cache,
    forks parallel samples, advances beam groups, and frees what finished - or, on lesson 09's prefill side
    (``hold_finished``), holds it until :meth:`release`, once its K/V have been sent.
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
        chunked: ChunkedPrefill | None = None,
        hold_finished: bool = False,
    ):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode is 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and swap_space is None:
            raise ValueError("preemption_mode='swap' needs a swap_space (lesson_utils.memory.swap.SwapSpace)")
        _positive(max_num_batched_tokens, "max_num_batched_tokens")
        _positive(max_num_seqs, "max_num_seqs")
        if chunked is not None and not isinstance(chunked, ChunkedPrefill):
            raise TypeError(f"chunked is a ChunkedPrefill(budget, plan_fn), got {type(chunked).__name__}")
        if chunked is not None and max_num_batched_tokens is not None:
            raise ValueError(
                "chunked prefill has its own budget: give ChunkedPrefill(budget), not max_num_batched_tokens"
            )
        if chunked is not None and preemption_mode != "recompute":
            raise ValueError("chunked prefill preempts by recompute here (preemption_mode='recompute')")
        self.manager, self.max_num_seqs = manager, max_num_seqs
        self.preemption_mode, self.swap_space = preemption_mode, swap_space
        self.chunked = chunked
        self.max_num_batched_tokens = chunked.budget if chunked else max_num_batched_tokens
        self.plan_fn: Callable = chunked.plan_fn if chunked else whole_prompts
        self.choose_victim, self.reset = choose_victim, reset
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.finished: list[Sequence] = []
        # lesson 09's prefill side (``hold_finished``): a finished sequence keeps its blocks here until release()
        self.hold_finished = hold_finished
        self.held: dict[int, Sequence] = {}
        self.events: list[PreemptionEvent] = []
        self.observe: Callable[[StepPlan], None] | None = None  # the simulator's hook: after the tokens, before frees
        self._step = 0
        self._next_id = 0

    def new_seq_id(self) -> int:
        """A sequence id no sequence of this scheduler has had (requests, forked samples, beams)."""
        self._next_id += 1
        return self._next_id - 1

    @property
    def num_preemptions(self) -> int:
        return len(self.events)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- requests in and out ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.manager.check_admissible(seq)
        seq.status = SequenceStatus.WAITING
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
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def release(self, seq_id: int) -> None:
        """Lesson 09's prefill side: give back the blocks of a finished sequence held since it finished (the
        scheduler was made with ``hold_finished``), once its K/V have been sent."""
        seq = self.held.pop(seq_id, None)
        if seq is None:
            raise ValueError(
                f"sequence {seq_id} is not held: a scheduler made with hold_finished keeps a finished sequence's "
                f"blocks until release(); held now: {sorted(self.held) or 'none'}"
            )
        self.manager.free(seq_id)

    def abort(self, seq: Sequence) -> None:
        """Cancel a sequence wherever it is (waiting, running or swapped) and give back all it holds.

        Raises ``ValueError`` for a sequence this scheduler does not hold (finished, or already cancelled)."""
        if seq.status is SequenceStatus.RUNNING and any(s is seq for s in self.running):
            self.running = [s for s in self.running if s is not seq]
            self.manager.free(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING and any(s is seq for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if s is not seq)
        elif seq.status is SequenceStatus.SWAPPED and any(s is seq for s in self.swapped):
            self.swapped = deque(s for s in self.swapped if s is not seq)
            self.swap_space.drop(seq.seq_id)
        else:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.value}: not waiting, running or swapped")
        seq.status = SequenceStatus.ABORTED

    # ---- the step's plan ----------------------------------------------------------------------------------
    def _room_for_another(self) -> bool:
        return self.max_num_seqs is None or len(self.running) < self.max_num_seqs

    def schedule(self, step: int) -> StepPlan:
        """One step's decisions: swapped sequences back first, then the token policy (admitting as it goes), then
        room for every token about to be sampled, preempting if memory is short. A plan the policy gets wrong is
        refused naming it, and its admissions are undone. Raises ``RuntimeError`` when nothing can run although
        requests wait: the head request does not fit even into an empty cache."""
        self._step = step
        swap_in, swap_out = [], []
        self._swap_out = swap_out
        if self.chunked is None and self.swapped:
            swap_in = self._swap_in(step, {})  # {cpu: gpu} this step's swap-ins moved: a shared block moves once
        admitted: list[Sequence] = []
        saved: dict[int, tuple[int, int | None]] = {}  # seq_id -> (num_computed, admitted_step) before admission

        def admit(seq_id: int) -> int | None:
            if not self.waiting or self.waiting[0].seq_id != seq_id:
                head = self.waiting[0].seq_id if self.waiting else None
                raise ValueError(
                    f"admit the waiting sequences in arrival order: asked for {seq_id}, the head is {head}"
                )
            seq = self.waiting[0]
            if not self._room_for_another() or not self.manager.can_allocate(seq):
                return None
            saved[seq.seq_id] = (seq.num_computed, seq.admitted_step)
            self.manager.allocate(seq)  # prefix-cache hits set seq.num_computed
            self.waiting.popleft()
            seq.admitted_step, seq.status = step, SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            return seq.num_computed

        state = [TokenState(s.seq_id, s.num_computed, s.len) for s in self.running]
        queue = QueueView([] if self.swapped else list(self.waiting))
        try:  # (swapped sequences come back before anyone new is admitted)
            chunks = self.plan_fn(state, queue, self.max_num_batched_tokens, admit)
            name = getattr(self.plan_fn, "__name__", type(self.plan_fn).__name__)
            budget = self.max_num_batched_tokens if self.chunked else None  # whole prompts may pass a budget alone
            seqs = check_chunks(chunks, self.running, (s.seq_id for s in self.waiting), budget, name)
        except BaseException:  # a refused (or crashing) plan leaves the scheduler as it found it
            self._undo_admissions(admitted, saved)
            raise
        if not self.running and (self.waiting or self.swapped):
            if self.held:
                raise RuntimeError(
                    f"nothing is running and the head request does not fit while finished sequences "
                    f"{sorted(self.held)} hold their blocks: release() them once sent"
                )
            raise RuntimeError(
                "nothing is running and the head request still does not fit: the cache is too small for it even when empty"
            )
        preempted = self._make_room([s for s, c in zip(seqs, chunks) if c.end == s.len], {})  # {gpu: cpu} swap-outs
        running = {id(r) for r in self.running}
        kept = [(s, c) for s, c in zip(seqs, chunks) if id(s) in running]
        sampling = [i for i, (s, c) in enumerate(kept) if c.end == s.len]  # all its tokens computed: a token is due
        return StepPlan(
            step,
            [s for s, _ in kept],
            [c.end - c.start for _, c in kept],
            [s for s in admitted if id(s) in running],
            preempted,
            swap_in,
            swap_out,
            self.manager.pop_copies(),
            sum(c.end - c.start for s, c in kept if not (c.end - c.start == 1 and s.num_generated)),
            sampling,
            [1] * len(sampling),
        )

    def _swap_in(self, step: int, moved: dict[int, int]) -> list[tuple[int, int]]:
        """Swapped sequences back, in the order they left, while their blocks (and the token budget) allow."""
        copies: list[tuple[int, int]] = []
        watermark = self.manager.watermark_blocks
        left = None if self.max_num_batched_tokens is None else self.max_num_batched_tokens - len(self.running)
        while self.swapped and self._room_for_another():
            seq = self.swapped[0]
            if left is not None and seq.len - seq.num_computed > left and self.running:
                break
            if not self.swap_space.can_swap_in(self.manager, seq.seq_id, watermark if self.running else 0):
                break
            copies += self.swap_space.swap_in(self.manager, seq.seq_id, moved)
            self.swapped.popleft()
            seq.admitted_step, seq.status = step, SequenceStatus.RUNNING
            self.running.append(seq)
            if left is not None:
                left -= seq.len - seq.num_computed
        return copies

    def _undo_admissions(self, admitted: list[Sequence], saved: dict[int, tuple[int, int | None]]) -> None:
        """Give back what this step's admissions took: blocks freed, each sequence back at the head of the queue
        in its old order, with the computed count and admission step it had."""
        for seq in reversed(admitted):
            self.manager.free(seq.seq_id)
            seq.num_computed, seq.admitted_step = saved[seq.seq_id]
            seq.status = SequenceStatus.WAITING
            self.running = [s for s in self.running if s is not seq]
            self.waiting.appendleft(seq)
        admitted.clear()

    def _make_room(self, samplers: list[Sequence], moved: dict[int, int]) -> list[Sequence]:
        """A slot for the token each of ``samplers`` is about to get, preempting while memory is short; returns
        the sequences preempted (a preempted sequence's chunk is dropped)."""
        preempted, i = [], 0
        while i < len(samplers):
            try:
                self.manager.append_slot(samplers[i])
                i += 1
            except OutOfBlocks as err:
                victim = self._victim()
                if victim.beam is not None:  # a beam cannot wait while its group goes on: the search fails
                    raise OutOfBlocks(
                        f"beam search ran out of blocks for its {len(victim.beam.beams)} beams: {err}"
                    ) from err
                self.running = [s for s in self.running if s is not victim]
                if any(s is victim for s in samplers[:i]):
                    i -= 1
                samplers = [s for s in samplers if s is not victim]
                self._preempt(victim, moved)
                preempted.append(victim)
                for b in [b for b in moved if self.manager.block_is_free(b)]:
                    del moved[b]  # freed: it may be handed out again this step, and then holds something else
        return preempted

    def _victim(self) -> Sequence:
        """The policy's victim among the running sequences, checked. With chunked prefill a sequence may need
        several steps before it samples anything, so a policy that kept preempting the same one would stop all
        progress (an oldest-first policy does): there the policy is never offered the earliest-arrived running
        sequence while another is running, so that one always goes on and finishes. Without chunking every
        admission computes a token, and the policy chooses among all of them."""
        candidates = list(self.running)
        if self.chunked is not None and len(candidates) > 1:
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

    def _preempt(self, victim: Sequence, moved: dict[int, int]) -> None:
        note = ""
        if self.preemption_mode == "swap":
            if self.swap_space.can_swap_out(self.manager, victim.seq_id, moved):
                self._swap_out += self.swap_space.swap_out(self.manager, victim.seq_id, moved)
                victim.preemptions += 1
                victim.status = SequenceStatus.SWAPPED
                self.swapped.append(victim)
                self.events.append(PreemptionEvent(self._step, victim.seq_id, "swap"))
                return
            note = (
                f"swap space full ({self.swap_space.num_free} of {self.swap_space.num_blocks} CPU blocks free): "
                f"fell back to recompute"
            )
        self.manager.free(victim.seq_id)
        self.reset(victim)
        victim.status = SequenceStatus.WAITING
        self.waiting.appendleft(victim)
        self.events.append(PreemptionEvent(self._step, victim.seq_id, "recompute", note))

    # ---- after the forward pass -----------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, output: RunnerOutput) -> list[Sequence]:
        """Settle the step with what the runner computed; returns the sequences that finished.

        Every scheduled sequence's computed count advances; full computed blocks enter the prefix cache (here, before
        a finished sequence frees them); a parent that has just prefilled forks its parallel samples (sharing its
        blocks); then ONE sampling call picks the next token of every sequence the plan says samples and of every
        new sample (from its parent's row), and appends them - beams excepted: their group chooses, keeping its
        best continuations; finished sequences free their memory."""
        for seq, n in zip(plan.scheduled, output.new_computed):
            seq.num_computed += n
        due = [plan.scheduled[i] for i in plan.sampling]
        for seq in plan.scheduled:
            self.manager.cache_computed(seq)
        children, parent_rows = [], []
        for j, seq in enumerate(due):
            if seq.pending_forks:
                kids = self._fork(seq)
                children += kids
                parent_rows += [j] * len(kids)
        logits = output.logits
        if logits is not None and children:
            logits = torch.cat([logits, logits[to_device(parent_rows, torch.long, logits.device)]])
        sampled = due + children
        tokens = [None] * len(sampled) if logits is None else sampling.next_tokens(sampled, logits)
        rows = {  # the beams' logits rows: their group chooses (None: a simulation)
            id(s): (None if logits is None else logits[j]) for j, s in enumerate(due) if s.beam is not None
        }
        for seq, token in zip(sampled, tokens):
            if seq.beam is None:
                seq.append_token(token, plan.step)
        if self.observe is not None:
            self.observe(plan)
        for group in list({id(s.beam): s.beam for s in self.running if s.beam is not None}.values()):
            if all(id(b) in rows for b in group.beams):
                group.advance([rows[id(b)] for b in group.beams], plan.step, self.manager, self.new_seq_id)
                # the group's beams run next step in the order chosen, after everyone else
                self.running = [s for s in self.running if s.beam is not group] + group.beams
        done = [s for s in self.running if s.is_finished]
        for seq in done:
            if self.hold_finished:  # its blocks are still to be sent (lesson 09): release() frees them
                self.held[seq.seq_id] = seq
            else:
                self.manager.free(seq.seq_id)
            seq.finished_step, seq.status = plan.step, SequenceStatus.FINISHED
            self.finished.append(seq)
        if done:
            self.running = [s for s in self.running if not s.is_finished]
        for group in {id(s.beam): s.beam for s in done if s.beam is not None}.values():
            group.best = max(zip(group.beams, group.scores), key=lambda b: b[1])[0]  # max keeps the first of equals
        return done

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling, after the parent's prefill: its n - 1 siblings share its blocks and join the running
        batch; each draws its first token in the step's one sampling call."""
        children = fork_samples(parent, self.manager, self.new_seq_id)
        self.running += children
        return children
