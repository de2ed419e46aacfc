"""The course's shared vocabulary: what every layer of the engine speaks, defined once, on the ground floor.

* the errors: :class:`OutOfBlocks` / :class:`OutOfSlots` (no room *now*: schedulers catch them, then wait or
  preempt) and :class:`NeverFits` (no room ever: refused at the door);
* the four slot kinds of the paper's Fig. 2 (:class:`SlotKind`; their codes ``TOKEN`` .. ``FREE`` in memory maps);
* :class:`Request` (what arrives) and :class:`Sequence` (a request being served);
* :class:`MemoryManager`, the protocol between the scheduler and any KV memory manager.

``lesson_utils.memory`` and ``lesson_utils.serving`` both stand on this module and never on each other: the
scheduler reaches a memory manager only through :class:`MemoryManager`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol


# ---- errors ------------------------------------------------------------------------------------------
class OutOfBlocks(RuntimeError):
    """No free block right now. Not a crash: schedulers catch it and wait or preempt."""


class OutOfSlots(RuntimeError):
    """No hole is large enough *right now*; the request may fit later. Schedulers catch this."""


class NeverFits(ValueError):
    """The request is larger than the whole cache (or the model's context): waiting will never help."""


# ---- slot kinds (one byte per slot in memory maps) -----------------------------------------------------
class SlotKind(str, Enum):
    """The four kinds of KV slot of the paper's Fig. 2, in memory-map order (``code``: the byte a map stores).

    A str enum: a breakdown keyed by kinds also answers to their names (``breakdown()["token states"]``).
    Free slots are *external fragmentation* in a contiguous arena while requests wait (lesson 02)."""

    TOKEN = "token states"  # K/V of real tokens
    RESERVED = "reserved"  # reserved for tokens still to be generated
    INTERNAL = "internal fragmentation"  # over-provisioned: never used (or the unfilled tail of a last block)
    FREE = "free"

    @property
    def code(self) -> int:
        return list(SlotKind).index(self)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


TOKEN, RESERVED, INTERNAL, FREE = (k.code for k in SlotKind)


# ---- requests and sequences ---------------------------------------------------------------------------
class SequenceStatus(Enum):
    """Where a sequence is in its life (the scheduler sets it on every move; vLLM's ``RequestStatus``)."""

    WAITING = "waiting"  # queued, holding no memory (new, or preempted by recompute)
    RUNNING = "running"  # holds memory and is scheduled every step
    SWAPPED = "swapped"  # preempted by swap: its blocks wait in CPU memory
    FINISHED = "finished"  # generated all its tokens (or its end of sequence); its memory is free
    ABORTED = "aborted"  # cancelled before it finished; its memory is free
    DROPPED = "dropped"  # a beam its group did not keep; its memory is free


@dataclass(frozen=True)
class Chunk:
    """Tokens ``start .. end - 1`` of sequence ``seq_id`` run this step (``end - start`` of the step's token budget:
    lesson 08's scheduler hands a step out as chunks, and its kernel reads them as ``query_start`` / ``context_lens``)."""

    seq_id: int
    start: int
    end: int


@dataclass
class Request:
    """One request: when it arrives, how long its prompt is, how many tokens it will generate.

    ``prompt_ids`` is filled only for runs through a real model; ``shared_prefix_len`` counts the leading
    prompt tokens shared with other requests (a system prompt), 0 when none.
    """

    req_id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_ids: list[int] | None = None
    shared_prefix_len: int = 0
    tags: dict = field(default_factory=dict)
    cache_salt: str | None = None  # lesson 13: a tenant's prefix-cache blocks are found only under the same salt

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def is_int(value) -> bool:
    """An integer (Python's or NumPy's) and not a bool: ``True`` is an int to Python, and no count, id or size in the
    course is ever meant as one - the one check every argument that must be a whole number goes through."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(eq=False)
class Sequence:
    """A request being served. ``len`` = prompt tokens + tokens generated so far.

    ``num_computed`` counts the tokens whose K/V are in the cache - vLLM calls it ``num_computed_tokens`` (the runner
    feeds ``token_ids[num_computed:]`` next); a preempted sequence drops back to 0 and is prefilled again.
    ``eos_token_id`` ends the sequence early when generated (real runs only; simulations know lengths).
    ``status`` says where it is (:class:`SequenceStatus`); only the scheduler changes it.
    """

    request: Request
    num_generated: int = 0
    admitted_step: int | None = None
    first_token_step: int | None = None
    finished_step: int | None = None
    output_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    num_computed: int = 0
    preemptions: int = 0
    temperature: float = 0.0  # 0 = greedy
    generator: object = None  # a torch.Generator for sampling
    pending_forks: int = 0  # parallel sampling: siblings still to fork after the prefill
    samples: list = field(default_factory=list)
    added_at: float = 0.0
    first_token_s: float | None = None  # time to first token, seconds (real runs)
    finished_s: float | None = None  # time from arrival to the last token, seconds (real runs)
    beam: object = None  # the serving.beam_search.BeamGroup this sequence is a beam of, if any
    token_steps: list[int] = field(default_factory=list)  # the step that produced each generated token
    status: SequenceStatus = SequenceStatus.WAITING
    # lesson 11: tokens a proposer drafted for the step being planned, fed after the newest token and verified in
    # the same forward pass; set by the scheduler's schedule(), emptied by update_from_output (never token_ids)
    draft: list[int] = field(default_factory=list)

    @property
    def aborted(self) -> bool:
        """Cancelled before it finished (its memory was given back at once)."""
        return self.status is SequenceStatus.ABORTED

    def append_token(self, token: int | None, step: int) -> None:
        """The one place a sequence grows (the scheduler's ``update_from_output`` calls it): ``token`` generated
        at ``step`` (None in a simulation, which knows lengths, not ids). Its K/V are computed next step."""
        if token is not None:
            self.output_ids.append(token)
        self.num_generated += 1
        self.token_steps.append(step)
        if self.first_token_step is None:
            self.first_token_step = step

    def fork(self, new_id: int) -> "Sequence":
        """A copy of this sequence under sequence id ``new_id`` (parallel sampling's siblings, beam search's beams):
        the same request otherwise, its tokens, counts and timings so far (lists copied, never shared), running.
        What belongs to one sequence alone starts fresh: no generator (the caller seeds its own), no samples or
        pending forks, no preemptions. Its blocks are the memory manager's business (``manager.fork``)."""
        return replace(
            self,
            request=replace(self.request, req_id=new_id),
            output_ids=list(self.output_ids),
            token_steps=list(self.token_steps),
            generator=None,
            samples=[],
            pending_forks=0,
            preemptions=0,
            draft=[],
            status=SequenceStatus.RUNNING,
        )

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


# ---- where a sequence's K/V live, as a step's plan carries it ------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where one sequence's K/V live, copied out of its memory manager into a step's plan, so the cache reads no
    manager while the step runs: the physical blocks of its table (paged memory), or the first slot and the length of
    its reservation (lessons 01-02's contiguous memory)."""

    blocks: tuple[int, ...] | None = None
    first_slot: int | None = None
    reserved: int | None = None


# ---- the scheduler / memory-manager protocol ----------------------------------------------------------
class AccountingView(Protocol):
    """The read-only accounting a memory manager shows (``manager.view``: ``lesson_utils.memory.doors.ManagerView``):
    what the engine records, the simulator plots and the lessons read. The members serving/ reads are these."""

    name: str
    total_slots: int
    can_fork: bool  # True where sequences can share blocks (fork for parallel sampling and beam search)

    def breakdown(self) -> dict[str, int]:
        """Slots by kind: token states, reserved, internal fragmentation, free (sums to total_slots)."""

    def slot_kinds(self):
        """Every slot's kind, for memory maps (a numpy array)."""

    def external_fragmentation(self) -> float:
        """How scattered free memory is (nan where it cannot be: paged memory has no holes)."""

    def sharing(self) -> tuple[int, int]:
        """Blocks the tables would hold without sharing, and distinct blocks held."""

    def block_is_free(self, block_id: int) -> bool:
        """(Block managers) Whether ``block_id`` is free now (a swap's moves forget blocks that were freed)."""


class MemoryManager(Protocol):
    """The scheduler's door to a KV memory manager (contiguous in lesson 02, paged in lesson 03, sharing in lesson 05):
    what the scheduler, the engine and the simulator ask of it. Every manager has every member: one that has nothing
    to do for a hook does nothing (no ``getattr`` probing by its callers). Its accounting is behind ``view`` (read-
    only); a block manager's single-block door for the swap space and the hand-over is ``blocks``."""

    watermark_blocks: int  # free blocks kept back from admission (0 where there are no blocks)

    @property
    def num_free_blocks(self) -> int | None:
        """Free blocks now; None for a manager without blocks (contiguous reservations)."""

    @property
    def view(self) -> AccountingView:
        """The accounting, read-only."""

    def check_admissible(self, seq: Sequence) -> None:
        """Raise ``NeverFits`` if ``seq`` could not run even in an empty cache."""

    def can_allocate(self, seq: Sequence) -> bool:
        """Would :meth:`allocate` succeed now?"""

    def allocate(self, seq: Sequence) -> None:
        """Admit ``seq``: give it memory for its prompt (and whatever the policy reserves)."""

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        """``seq`` is about to grow by one token: make sure that token has a slot (and ``lookahead`` more after it:
        lesson 11's drafted tokens, verified in the same step)."""

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Lesson 11's rollback: ``seq_id`` keeps its first ``num_tokens`` tokens' slots; memory that only rejected
        draft tokens used goes back (a manager that reserves ahead keeps its reservation)."""

    def placement(self, seq_id: int) -> Placement:
        """Where ``seq_id``'s K/V live now (its blocks, or its reservation), a copy for the step's plan."""

    def free(self, seq_id: int):
        """Sequence ``seq_id`` finished, was aborted or preempted: take all of its memory back (THE release)."""

    def cache_computed(self, seq: Sequence) -> None:
        """After a forward pass: register ``seq``'s full, computed blocks in the prefix cache (if any)."""

    def pop_copies(self) -> list[tuple[int, int]]:
        """Block copies ``(src, dst)`` this step's reservations need before its writes (copy-on-write of
        shared blocks), handed over once; ``[]`` where nothing is shared."""

    def fork(self, parent_id: int, child_id: int) -> None:
        """(Sharing managers: ``view.can_fork``) Give ``child_id`` the parent's blocks, shared, without copying."""

    def snapshot(self):
        """Its whole state now, to put back with ``.restore()`` if the step under way is refused; the snapshot's
        ``blocks_to_protect()`` names the blocks handed out since that held data then (``memory/snapshot.py``)."""


class KVQuantError(ValueError):
    """Lesson 10: a K/V vector an int8 cache cannot hold (NaN or inf); the message names where it is."""


def check_finite(x, where: str = "") -> None:
    """Refuse NaN/inf in ``x`` ``[..., heads, head_dim]``, naming the first bad (token, head). One read-back.
    Here, on the ground floor, so lesson 10's plain-torch reference and its Triton kernels both use it."""
    bad = ~x.isfinite()
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        raise KVQuantError(
            f"{where}a K/V vector holds {x[tuple(index)].item()} at token {token_of(index[:-2])}, head {index[-2]}: "
            "int8 with a scale cannot store NaN or inf (the model produced it: check its inputs)"
        )


def token_of(leading: list[int]) -> int | list[int]:
    """How a message names a token from its leading indices: one int, or the list when there are several axes."""
    leading = leading or [0]
    return leading[0] if len(leading) == 1 else leading
