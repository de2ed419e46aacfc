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
from typing import Callable

from lesson_utils.core.types import MemoryManager, OutOfBlocks, Sequence, SequenceStatus
from lesson_utils.serving.queues import Queues


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


class Preemption:
    """The scheduler's answer when memory runs out (lesson 06): a slot for every token about to be sampled, preempting
    while memory is short (:meth:`make_room`), and swapped sequences back first, in the order they left
    (:meth:`swap_in`). It shares the scheduler's :class:`~lesson_utils.serving.queues.Queues` and is handed the rest:
    the memory manager, the mode and swap space, the victim policy and the recompute reset; it keeps the
    :class:`PreemptionEvent` s. With chunked prefill (``protect_oldest``) the oldest running sequence is never offered
    as a victim (:func:`checked_victim`)."""

    def __init__(
        self,
        queues: Queues,
        manager: MemoryManager,
        mode: str,
        swap_space,
        choose_victim: Callable = most_recently_admitted,
        reset: Callable = reset_for_recompute,
        *,
        protect_oldest: bool = False,
    ):
        self.queues, self.manager, self.mode, self.swap_space = queues, manager, mode, swap_space
        self.choose_victim, self.reset, self.protect_oldest = choose_victim, reset, protect_oldest
        self.events: list[PreemptionEvent] = []

    def swap_in(self, step: int, moved: dict[int, int], has_room: Callable[[], bool], left: int | None):
        """Swapped sequences back, in the order they left, while their blocks fit (above the watermark while others
        run), ``has_room()`` (the sequence limit) and ``left`` (the step's tokens; None: no budget) allow. Returns the
        ``(cpu, gpu)`` copies; ``moved`` records the blocks moved (a shared block moves once)."""
        queues, copies = self.queues, []
        watermark = self.manager.watermark_blocks
        while queues.swapped and has_room():
            seq = queues.swapped[0]
            if left is not None and seq.len - seq.num_computed > left and queues.running:
                break
            if not self.swap_space.can_swap_in(self.manager, seq.seq_id, watermark if queues.running else 0):
                break
            copies += self.swap_space.swap_in(self.manager, seq.seq_id, moved)
            queues.swapped.popleft()
            seq.admitted_step, seq.status = step, SequenceStatus.RUNNING
            queues.running.append(seq)
            if left is not None:
                left -= seq.len - seq.num_computed
        return copies

    def make_room(self, samplers: list[Sequence], moved: dict[int, int], step: int, swap_out: list) -> list[Sequence]:
        """A slot for the token each of ``samplers`` is about to get (and its draft's), preempting while memory is
        short; returns the sequences preempted (a preempted sequence's chunk is dropped). A swap-out's ``(gpu, cpu)``
        copies are added to ``swap_out``."""
        preempted, i = [], 0
        while i < len(samplers):
            try:
                self.manager.append_slot(samplers[i], len(samplers[i].draft))
                i += 1
            except OutOfBlocks as err:
                if samplers[i].draft:  # speculation never preempts anyone: the draft goes first
                    samplers[i].draft = []
                    continue
                victim = checked_victim(self.queues.running, self.choose_victim, protect_oldest=self.protect_oldest)
                if victim.beam is not None:  # a beam cannot wait while its group goes on: the search fails
                    raise OutOfBlocks(
                        f"beam search ran out of blocks for its {len(victim.beam.beams)} beams: {err}"
                    ) from err
                self.queues.remove_running(victim)
                if any(s is victim for s in samplers[:i]):
                    i -= 1
                samplers = [s for s in samplers if s is not victim]
                self.preempt(victim, moved, step, swap_out)
                preempted.append(victim)
                for b in [b for b in moved if self.manager.view.block_is_free(b)]:
                    del moved[b]  # freed: it may be handed out again this step, and then holds something else
        return preempted

    def preempt(self, victim: Sequence, moved: dict[int, int], step: int, swap_out: list) -> None:
        """Push ``victim`` out: to the swap space, or back to the queue to be recomputed. Whatever this step reserved
        for it first goes back (its draft and the slots reserved for it, and for the token it was about to get): a
        swapped table holds exactly its ``len`` tokens' slots, as between steps."""
        victim.draft = []
        note = ""
        if self.mode == "swap":
            self.manager.trim(victim.seq_id, victim.len)  # (recompute frees the whole table below)
            if self.swap_space.can_swap_out(self.manager, victim.seq_id, moved):
                swap_out += self.swap_space.swap_out(self.manager, victim.seq_id, moved)
                victim.preemptions += 1
                victim.status = SequenceStatus.SWAPPED
                self.queues.swapped.append(victim)
                self.events.append(PreemptionEvent(step, victim.seq_id, "swap"))
                return
            note = (
                f"swap space full ({self.swap_space.num_free} of {self.swap_space.num_blocks} CPU blocks free): "
                f"fell back to recompute"
            )
        self.manager.free(victim.seq_id)
        self.reset(victim)
        victim.status = SequenceStatus.WAITING
        self.queues.waiting.appendleft(victim)
        self.events.append(PreemptionEvent(step, victim.seq_id, "recompute", note))
