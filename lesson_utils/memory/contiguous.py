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

from lesson_utils.core.types import NeverFits, OutOfSlots

Hole = tuple[int, int]  # (start, length)


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
