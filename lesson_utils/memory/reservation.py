"""Lesson 02: contiguous reservation policies, as the paper's Orca baselines (§6.1).

* **Max** reserves the maximum sequence length (2048) for every request.
* **Pow2** reserves the true final length rounded up to a power of two: at most 2x what is needed.
* **Oracle** knows the true output length and reserves exactly prompt + output.

:class:`ContiguousReservationManager` is a memory manager for :class:`~lesson_utils.serving.scheduler.FCFSScheduler`:
it places each reservation first-fit in one arena and accounts every slot as one of four kinds
(the paper's Fig. 2 breakdown):

* token states - slots holding K/V of a token that exists now;
* reserved - slots set aside for tokens the request will still generate;
* internal fragmentation - slots reserved beyond the request's final length: never used;
* free - slots in no reservation. While requests are waiting for memory, these are external
  fragmentation (and other idle memory): the paper's fourth category.
"""

from __future__ import annotations

import numpy as np

from lesson_utils.core.state import capture
from lesson_utils.core.types import FREE, INTERNAL, RESERVED, TOKEN, NeverFits, Placement, Sequence, SlotKind
from lesson_utils.memory.contiguous import FirstFitAllocator
from lesson_utils.memory.doors import ManagerView, NoPrefixCache
from lesson_utils.memory.snapshot import MemorySnapshot

POLICIES = ("max", "pow2", "oracle")


def reservation_slots(policy: str, final_len: int, max_seq_len: int = 2048) -> int:
    """How many slots ``policy`` reserves for a request whose final length is ``final_len``."""
    if final_len < 1:
        raise ValueError(f"a request needs at least one token, got final length {final_len}")
    if final_len > max_seq_len:
        raise NeverFits(f"a request of {final_len} tokens exceeds the maximum sequence length {max_seq_len}")
    if policy == "max":
        return max_seq_len
    if policy == "pow2":
        return min(max_seq_len, 1 << (final_len - 1).bit_length())
    if policy == "oracle":
        return final_len
    raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")


def classify_slots(total_slots: int, allocations: list[tuple[int, int, int, int]]) -> np.ndarray:
    """Kind of every slot (TOKEN / RESERVED / INTERNAL / FREE) as a uint8 array of ``total_slots``.

    ``allocations``: one ``(start, reserved, used, final)`` per request - where its reservation starts,
    how many slots it reserved, how many tokens it holds now, and how long it will be when finished
    (``used <= final <= reserved``).
    """
    kinds = np.full(total_slots, FREE, dtype=np.uint8)
    for start, reserved, used, final in allocations:
        kinds[start : start + used] = TOKEN
        kinds[start + used : start + final] = RESERVED
        kinds[start + final : start + reserved] = INTERNAL
    return kinds


def external_fragmentation(holes: list[tuple[int, int]]) -> float:
    """1 - largest hole / all free slots: 0 when free memory is one piece, near 1 when it is crumbs.

    Defined as 0 when nothing is free.
    """
    total = sum(length for _, length in holes)
    if total == 0:
        return 0.0
    return 1.0 - max(length for _, length in holes) / total


class ContiguousReservationManager(NoPrefixCache):
    """Orca-style memory manager: one contiguous reservation per request, sized by ``policy``."""

    def __init__(self, total_slots: int, policy: str, max_seq_len: int = 2048, allocator=None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
        self.total_slots = total_slots
        self.policy = policy
        self.max_seq_len = max_seq_len
        self.allocator = allocator or FirstFitAllocator(total_slots)
        self.start: dict[int, int] = {}
        self.reserved: dict[int, int] = {}
        self.seqs: dict[int, Sequence] = {}

    watermark_blocks = 0  # no blocks
    num_free_blocks = None  # slots, not blocks: see the view's breakdown()
    # what its view (ManagerView) reads: contiguous memory has no blocks, shares nothing, caches no prefix
    _can_fork = False
    _num_cow = _prompt_tokens = _cached_prompt_tokens = 0
    _num_blocks = _block_size = None

    @property
    def view(self) -> ManagerView:
        """The accounting, read-only (:class:`~lesson_utils.memory.doors.ManagerView`)."""
        return ManagerView(self)

    @property
    def name(self) -> str:
        return {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}[self.policy]

    _name = name

    @property
    def _total_slots(self) -> int:
        return self.total_slots

    @property
    def _max_seq_len(self) -> int:
        return self.max_seq_len

    def _holds(self, seq_id: int) -> bool:
        return seq_id in self.start

    def _no_blocks(self, *args):
        raise ValueError(
            "contiguous reservations have no blocks (a block table, a swap, a hand-over need a block manager)"
        )

    _block_table = _block_is_free = _free_queue = _ref_count = _no_blocks

    def _tables_now(self) -> dict[int, tuple[list[int], int]]:
        return {}  # no block tables

    def _utilization(self) -> float:
        br = self.breakdown()
        held = self.total_slots - br[SlotKind.FREE]
        return br[SlotKind.TOKEN] / held if held else 1.0

    def _check_invariants(self) -> None:
        assert set(self.start) == set(self.reserved) == set(self.seqs), "a reservation lost its bookkeeping"
        assert self.allocator.free_slots + sum(self.reserved.values()) == self.total_slots, "a slot was lost"

    def _slots_for(self, seq: Sequence) -> int:
        return reservation_slots(self.policy, seq.final_len, self.max_seq_len)

    def check_admissible(self, seq: Sequence) -> None:
        need = self._slots_for(seq)
        if need > self.total_slots:
            raise NeverFits(
                f"request {seq.seq_id} needs a reservation of {need} slots, more than the whole cache "
                f"({self.total_slots} slots)"
            )

    def can_allocate(self, seq: Sequence) -> bool:
        return self.allocator.can_allocate(self._slots_for(seq))

    def allocate(self, seq: Sequence) -> None:
        n = self._slots_for(seq)
        self.start[seq.seq_id] = self.allocator.allocate(n)
        self.reserved[seq.seq_id] = n
        self.seqs[seq.seq_id] = seq

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        if seq.len + 1 + lookahead > self.reserved[seq.seq_id]:
            raise NeverFits(f"request {seq.seq_id} outgrew its reservation of {self.reserved[seq.seq_id]} slots")

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Nothing to give back: a reservation holds its slots until the request ends."""

    def placement(self, seq_id: int) -> Placement:
        """``seq_id``'s reservation (its first slot and length), for a step's plan."""
        if seq_id not in self.start:
            raise ValueError(f"request {seq_id} holds no reservation (never admitted, or freed already)")
        return Placement(first_slot=self.start[seq_id], reserved=self.reserved[seq_id])

    def free(self, seq_id: int) -> None:
        if seq_id not in self.start:
            raise ValueError(f"request {seq_id} holds no reservation (freed twice, or never admitted)")
        self.allocator.free(self.start.pop(seq_id))
        del self.reserved[seq_id], self.seqs[seq_id]

    def cache_computed(self, seq: Sequence) -> None:
        """Nothing to register: contiguous reservations have no prefix cache."""

    def snapshot(self) -> MemorySnapshot:
        """Every reservation and hole now, to put back if the step under way is refused. A step never hands out a
        region it freed (reservations never run short mid-step: nothing is preempted), so no data needs saving."""
        return MemorySnapshot([capture(self), capture(self.allocator)])

    def pop_copies(self) -> list[tuple[int, int]]:
        return []  # nothing is shared

    def fork(self, parent_id: int, child_id: int) -> None:
        raise ValueError("contiguous reservations cannot be shared: this manager cannot fork")

    def sharing(self) -> tuple[int, int]:
        return len(self.seqs), len(self.seqs)

    def _sharing(self) -> tuple[int, int]:
        return self.sharing()

    def _breakdown(self) -> dict[str, int]:
        return self.breakdown()

    def _slot_kinds(self) -> np.ndarray:
        return self.slot_kinds()

    def _external_fragmentation(self) -> float:
        return self.external_fragmentation()

    def breakdown(self) -> dict[str, int]:
        token = reserved = internal = 0
        for sid, seq in self.seqs.items():
            token += seq.len
            reserved += seq.final_len - seq.len
            internal += self.reserved[sid] - seq.final_len
        return {
            SlotKind.TOKEN: token,
            SlotKind.RESERVED: reserved,
            SlotKind.INTERNAL: internal,
            SlotKind.FREE: self.total_slots - token - reserved - internal,
        }

    def allocations(self) -> list[tuple[int, int, int, int]]:
        return [(self.start[s], self.reserved[s], q.len, q.final_len) for s, q in self.seqs.items()]

    def slot_kinds(self) -> np.ndarray:
        return classify_slots(self.total_slots, self.allocations())

    def external_fragmentation(self) -> float:
        return external_fragmentation(self.allocator.holes)
