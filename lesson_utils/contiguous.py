"""Lesson 01: the naive contiguous KV cache.

One arena of token slots per layer; every request reserves one contiguous run of slots, sized for the
longest it may become, the moment it is admitted (what Orca-style systems and HF's static cache do).
Holes are found first-fit. This is the baseline whose waste lessons 02-03 measure and remove.

Free space is a sorted list of ``(start, length)`` holes. Invariants of :class:`FirstFitAllocator`:
holes are sorted, non-empty, never overlap and never touch (neighbours are merged); every slot is in
exactly one hole or one allocation, so ``free_slots + allocated_slots == num_slots``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .kv_cache import AttentionMetadata, StepBatch, fused_attention_over_context

Hole = tuple[int, int]  # (start, length)


class OutOfSlots(RuntimeError):
    """No hole is large enough *right now*; the request may fit later. Schedulers catch this."""


class NeverFits(ValueError):
    """The request is larger than the whole cache (or the model's context): waiting will never help."""


def first_fit(holes: list[Hole], n: int) -> tuple[int, list[Hole]] | None:
    """Take ``n`` slots from the first hole that has room.

    Returns ``(start, new_holes)``, or ``None`` when no single hole has ``n`` slots. ``holes`` is not
    modified; in ``new_holes`` the used hole shrinks from its front, or disappears when used up.
    """
    for i, (start, length) in enumerate(holes):
        if length >= n:
            rest = [(start + n, length - n)] if length > n else []
            return start, holes[:i] + rest + holes[i + 1 :]
    return None


def release(holes: list[Hole], start: int, length: int) -> list[Hole]:
    """Give ``[start, start + length)`` back: insert it in order and merge it with touching holes.

    Raises ``ValueError`` if the range overlaps a hole (it is already free: a double free).
    """
    end = start + length
    for h_start, h_len in holes:
        if start < h_start + h_len and h_start < end:
            raise ValueError(f"slots [{start}, {end}) overlap the free hole [{h_start}, {h_start + h_len})")
    merged: list[Hole] = []
    for h in sorted(holes + [(start, length)]):
        if merged and merged[-1][0] + merged[-1][1] == h[0]:
            merged[-1] = (merged[-1][0], merged[-1][1] + h[1])
        else:
            merged.append(h)
    return merged


class FirstFitAllocator:
    """Contiguous runs of slots out of ``num_slots``, first fit.

    ``first_fit_fn`` and ``release_fn`` are pluggable so a learner's versions can drive the same class.
    """

    def __init__(
        self,
        num_slots: int,
        first_fit_fn: Callable = first_fit,
        release_fn: Callable = release,
    ):
        if num_slots < 1:
            raise ValueError(f"an arena needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.holes: list[Hole] = [(0, num_slots)]
        self.allocations: dict[int, int] = {}  # start -> length
        self._first_fit, self._release = first_fit_fn, release_fn

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self.holes)

    @property
    def allocated_slots(self) -> int:
        return sum(self.allocations.values())

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.holes), default=0)

    def can_allocate(self, n: int) -> bool:
        return 0 < n <= self.largest_hole

    def allocate(self, n: int) -> int:
        """Reserve ``n`` contiguous slots; returns the first slot's index."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"a reservation must be a positive number of slots, got {n!r}")
        if n > self.num_slots:
            raise NeverFits(f"a reservation of {n} slots can never fit in an arena of {self.num_slots} slots")
        found = self._first_fit(self.holes, n)
        if found is None:
            raise OutOfSlots(
                f"no hole of {n} slots: {self.free_slots} slots are free in total, "
                f"but the largest hole has {self.largest_hole} (external fragmentation)"
            )
        start, self.holes = found
        self.allocations[start] = n
        return start

    def free(self, start: int) -> None:
        """Give back the reservation that starts at ``start``."""
        if start not in self.allocations:
            raise ValueError(
                f"slot {start} does not start a reservation (already freed, or never allocated); "
                f"reservations start at {sorted(self.allocations)[:8]}"
            )
        self.holes = self._release(self.holes, start, self.allocations.pop(start))


def slot_mapping(batch: StepBatch, region_starts: list[int]) -> torch.Tensor:
    """Arena slot of every new token in ``batch``: its sequence's region start plus its position.

    ``region_starts[i]`` is where sequence ``batch.seq_ids[i]``'s reservation begins. Returns a ``torch.long``
    tensor on the batch's device. Computed from the batch's host-side lengths (the new tokens of a sequence sit
    at positions ``context_len - query_len .. context_len - 1``) and moved to the device once: reading
    ``batch.positions`` back would make the host wait for the GPU every step.
    """
    slots = [start + p for start, positions in zip(region_starts, batch.new_positions()) for p in positions]
    return torch.tensor(slots, dtype=torch.long, device=batch.positions.device)


class ContiguousKVCache:
    """A naive KV cache: one preallocated arena, one contiguous reservation per sequence.

    ``k``/``v`` have shape ``[num_layers, num_slots, num_kv_heads, head_dim]``. A sequence's tokens live
    in slots ``start .. start + reservation - 1``; token at position ``p`` sits in slot ``start + p``.
    A sequence is reserved ``default_reservation`` slots at its first step unless :meth:`reserve` was
    called for it first (a request that states its own maximum length, as in the paper's Fig. 3).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        default_reservation: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        allocator: FirstFitAllocator | None = None,
        slot_mapping_fn: Callable = slot_mapping,
    ):
        self.allocator = allocator or FirstFitAllocator(num_slots)
        if self.allocator.num_slots != num_slots:
            raise ValueError("the allocator must manage exactly num_slots slots")
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.default_reservation = default_reservation
        self.start: dict[int, int] = {}  # seq_id -> first slot
        self.reserved: dict[int, int] = {}  # seq_id -> slots reserved
        self.length: dict[int, int] = {}  # seq_id -> tokens written
        self._slot_mapping = slot_mapping_fn

    @classmethod
    def for_model(cls, w, num_slots: int, default_reservation: int, **kw) -> "ContiguousKVCache":
        """An arena sized for the geometry of ``w`` (an ``OPTWeights``), on its device and in its dtype unless
        ``device=`` / ``dtype=`` say otherwise."""
        kw.setdefault("dtype", w.dtype)
        kw.setdefault("device", w.device)
        return cls(w.num_layers, num_slots, w.num_kv_heads, w.head_dim, default_reservation=default_reservation, **kw)

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.k.shape[0] * self.k.shape[2] * self.k.shape[3] * self.k.element_size()

    def reserve(self, seq_id: int, num_slots: int) -> int:
        """Reserve ``num_slots`` for a new sequence; raises ``OutOfSlots`` / ``NeverFits``."""
        if seq_id in self.start:
            raise ValueError(f"sequence {seq_id} already holds a reservation")
        start = self.allocator.allocate(num_slots)
        self.start[seq_id], self.reserved[seq_id], self.length[seq_id] = start, num_slots, 0
        return start

    def prepare(self, batch: StepBatch) -> None:
        for sid, clen in zip(batch.seq_ids, batch.context_lens):
            if sid not in self.start:
                self.reserve(sid, self.default_reservation)
            if clen > self.reserved[sid]:
                raise NeverFits(
                    f"sequence {sid} needs {clen} slots but reserved only {self.reserved[sid]}: "
                    f"a contiguous cache cannot grow a reservation in place"
                )
        batch.meta = AttentionMetadata(self._slot_mapping(batch, [self.start[s] for s in batch.seq_ids]))
        for sid, clen in zip(batch.seq_ids, batch.context_lens):
            self.length[sid] = clen

    def write(self, layer, batch, k, v):
        slots = batch.meta.slots
        self.k[layer, slots] = k.to(self.k.dtype)
        self.v[layer, slots] = v.to(self.v.dtype)

    def attend(self, layer, batch, q, scale):
        out = torch.empty_like(q)
        for sid, start, n, ctx in zip(batch.seq_ids, batch.starts, batch.query_lens, batch.context_lens):
            first = self.start[sid]
            out[start : start + n] = fused_attention_over_context(
                q[start : start + n], self.k[layer, first : first + ctx], self.v[layer, first : first + ctx], scale
            )
        return out

    def free(self, seq_id: int) -> None:
        if seq_id not in self.start:
            raise ValueError(f"sequence {seq_id} holds no reservation (already freed, or never admitted)")
        self.allocator.free(self.start.pop(seq_id))
        del self.reserved[seq_id], self.length[seq_id]

    def usage(self) -> dict[str, int]:
        """Slots by kind right now: used (tokens written), reserved-but-unused, free."""
        used = sum(self.length.values())
        reserved = sum(self.reserved.values())
        return {"used": used, "reserved_unused": reserved - used, "free": self.allocator.free_slots}
