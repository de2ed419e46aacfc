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

from lesson_utils.core.types import MemoryManager, Sequence, SequenceStatus, SlotKind, is_int
from lesson_utils.serving.output import RunnerOutput, SeqFeed, StepPlan
from lesson_utils.serving.preemption import Preemption, PreemptionEvent, most_recently_admitted, reset_for_recompute
from lesson_utils.serving.queues import Queues, in_queues
from lesson_utils.serving.settlement import Settlement
from lesson_utils.serving.speculative import Speculation
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

    If a sequence cannot grow because memory ran out (paging reserves nothing ahead), a victim is preempted, by
    ``"recompute"`` or ``"swap"`` (:mod:`~lesson_utils.serving.preemption`); lesson 11's drafts go before anyone.

    After the runner has computed the plan, :meth:`update_from_output` settles it (its :class:`Settlement`): every
    computed count advances, the due tokens are sampled and appended (the one place a token is born), full computed
    blocks enter the prefix cache, parallel samples fork, beam groups advance, and what finished is freed - or, on
    lesson 09's prefill side (``hold_finished``), held until :meth:`release`, once its K/V have been sent. The two
    halves share the :class:`~lesson_utils.serving.queues.Queues` and nothing else.
    """

    waiting = in_queues("waiting")
    running = in_queues("running")
    swapped = in_queues("swapped")
    finished = in_queues("finished")
    held = in_queues("held")

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
        speculation: Speculation | None = None,
        vocab_size: int | None = None,
        plan_feeds: bool = False,
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
        self.queues = Queues()
        self.preemption = Preemption(
            self.queues, manager, preemption_mode, swap_space, choose_victim, reset, protect_oldest=chunked is not None
        )
        self.chunked = chunked
        self.max_num_batched_tokens = chunked.budget if chunked else max_num_batched_tokens
        self.plan_fn: Callable = chunked.plan_fn if chunked else whole_prompts
        if speculation is not None and not isinstance(speculation, Speculation):
            raise TypeError(f"speculation is a Speculation(k, propose), got {type(speculation).__name__}")
        budget = chunked.budget if chunked else max_num_batched_tokens
        if speculation is not None and budget is not None and speculation.k + 1 > budget:
            raise ValueError(
                f"speculation's k = {speculation.k} drafts need k + 1 = {speculation.k + 1} tokens of a step for one "
                f"sequence, over the token budget of {budget}: lower k or raise the budget"
            )
        self.speculation = speculation  # lesson 11: drafts verified in the step (None: one token per decode)
        _positive(vocab_size, "vocab_size")
        self.vocab_size = vocab_size  # the verifying model's vocabulary: a draft's ids must be in it (None: unchecked)
        # an engine's plans carry what the model runner feeds (SeqFeed); a simulation's, counts only
        self.plan_feeds = plan_feeds
        self._next_id = 0
        # lesson 09's prefill side (``hold_finished``): a finished sequence keeps its blocks until release()
        self.settlement = Settlement(self.queues, manager, self.new_seq_id, speculation, hold_finished=hold_finished)

    # ---- the settling half (serving/settlement.py) --------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, output: RunnerOutput) -> list[Sequence]:
        """Settle the step with what the runner computed (:meth:`Settlement.settle`); returns the sequences that
        finished."""
        return self.settlement.settle(plan, output)

    def finish(self, seq: Sequence, step: int) -> None:
        """``seq`` finished at ``step`` (:meth:`Settlement.finish`): it leaves ``running`` for ``finished`` and its
        memory is freed, or held on lesson 09's prefill side. Lesson 07's exercise calls it."""
        self.settlement.finish(seq, step)

    @property
    def hold_finished(self) -> bool:
        return self.settlement.hold_finished

    @property
    def verified(self) -> list[tuple[int, int, int, int]]:
        """Lesson 11: ``(step, seq_id, drafted, accepted)`` per verification so far."""
        return self.settlement.verified

    @property
    def observe(self) -> Callable[[StepPlan], None] | None:
        """The simulator's hook, called with each settled plan after its tokens are in, before anything is freed."""
        return self.settlement.observe

    @observe.setter
    def observe(self, hook: Callable[[StepPlan], None] | None) -> None:
        self.settlement.observe = hook

    def stateful_parts(self) -> list:
        """Every object whose attributes hold this scheduler's state (what a step checkpoint captures)."""
        return [self, self.queues, self.settlement, self.preemption]

    def new_seq_id(self) -> int:
        """A sequence id no sequence of this scheduler has had (requests, forked samples, beams)."""
        self._next_id += 1
        return self._next_id - 1

    @property
    def events(self) -> list[PreemptionEvent]:
        """Every preemption so far (:class:`~lesson_utils.serving.preemption.Preemption`)."""
        return self.preemption.events

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
        swap_in, swap_out = [], []
        if self.chunked is None and self.swapped:  # {cpu: gpu} this step's swap-ins moved: a shared block moves once
            left = None if self.max_num_batched_tokens is None else self.max_num_batched_tokens - len(self.running)
            swap_in = self.preemption.swap_in(step, {}, self._room_for_another, left)
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

        self._draft()
        state = [TokenState(s.seq_id, s.num_computed, s.len + len(s.draft)) for s in self.running]
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
        for s, c in zip(seqs, chunks):
            if s.draft and c.end < s.len + len(s.draft):  # a budget that cuts a draft verifies what fits
                del s.draft[max(0, c.end - s.len) :]
        samplers = [s for s, c in zip(seqs, chunks) if c.end == s.len + len(s.draft)]
        preempted = self.preemption.make_room(samplers, {}, step, swap_out)
        running = {id(r) for r in self.running}
        # (a draft dropped for want of memory shortens its chunk: what is fed ends at the planned length)
        kept = [(s, c.start, min(c.end, s.len + len(s.draft))) for s, c in zip(seqs, chunks) if id(s) in running]
        # all its tokens computed (a verifying sequence's drafts too): tokens are due, one per fed position
        sampling = [i for i, (s, _, end) in enumerate(kept) if end == s.len + len(s.draft)]
        feeds = self._feeds(kept, set(sampling)) if self.plan_feeds else []
        return StepPlan(
            step,
            [s for s, _, _ in kept],
            [end - start for _, start, end in kept],
            [s for s in admitted if id(s) in running],
            preempted,
            swap_in,
            swap_out,
            self.manager.pop_copies(),
            sum(end - start for s, start, end in kept if not (start == s.len - 1 and s.num_generated)),
            sampling,
            [1 + len(kept[i][0].draft) for i in sampling],
            self._held_slots(),
            feeds,
        )

    def _feeds(self, kept: list[tuple[Sequence, int, int]], sampling: set[int]) -> list[SeqFeed]:
        """What the runner feeds each scheduled sequence (tokens ``start .. end - 1`` of its tokens and drafts), and
        where its K/V live - copied now, so the runner and the cache read nothing live while the step runs."""
        feeds = []
        for i, (s, start, end) in enumerate(kept):
            tokens = s.token_ids + s.draft
            feeds.append(
                SeqFeed(
                    s.seq_id,
                    tuple(tokens[start:end]),
                    start,
                    self.manager.placement(s.seq_id),
                    tuple(s.draft),
                    1 + len(s.draft) if i in sampling else 0,
                )
            )
        return feeds

    def _held_slots(self) -> int:
        """Slots the memory manager holds or reserves now (every kind but free)."""
        br = self.manager.view.breakdown()
        return sum(br.values()) - br[SlotKind.FREE]

    def _draft(self) -> None:
        """Lesson 11: each decoding sequence's draft for this step, within the token budget left after one token
        for every running sequence (none without speculation)."""
        for s in self.running:
            s.draft = []
        if self.speculation is not None:
            left = None
            if self.max_num_batched_tokens is not None:
                left = self.max_num_batched_tokens - sum(s.len - s.num_computed for s in self.running)
            self.speculation.draft_running(self.running, left, self.vocab_size)

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
