"""A memory manager's (or swap space's) state at one moment, to put back when a step is refused.

A step changes block tables, reference counts, the free queue and the prefix cache before the forward pass, and
may hand a block freed in it (a preempted sequence's) to someone else, who then writes into it. Putting the
bookkeeping back is :func:`~lesson_utils.core.state.capture`'s job; the *data* such a block held must be saved before
it is overwritten, so a snapshot also says which blocks those are (:meth:`BlockSnapshot.blocks_to_protect`).

Invariant: after ``restore()``, every table, count, free queue and cached hash is what it was at the snapshot; the
data of every block that held a token then is the caller's to have saved (the blocks this module names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from lesson_utils.core.state import Captured


@dataclass
class MemorySnapshot:
    """The captured parts of a manager (its own attributes, its allocator's); nothing a step writes needs saving."""

    parts: list[Captured]

    def restore(self) -> None:
        for part in self.parts:
            part.restore()

    def blocks_to_protect(self) -> list[int]:
        """Blocks taken since the snapshot whose data the snapshot's state still needs (none here)."""
        return []


def taken_blocks_holding_data(
    tables_then: dict[int, list[int]],
    tables_now: dict[int, list[int]],
    hashed_then: dict[int, int],
    hashed_now: dict[int, int],
) -> list[int]:
    """Blocks some table has taken since ``tables_then`` that held data worth keeping then: a block another table
    held then (freed and handed out again since), or a cached free block whose hash was evicted since. A block
    still cached under the same hash is a prefix-cache hit: full, computed, never written - not listed."""
    held_then: set[int] | None = None
    found: dict[int, None] = {}
    for sid, blocks in tables_now.items():
        before = tables_then.get(sid, [])
        if len(blocks) >= len(before) and blocks[: len(before)] == before:
            new = blocks[len(before) :]
        else:
            kept = set(before)
            new = [b for b in blocks if b not in kept]
        for b in new:
            if b in hashed_then:
                if hashed_now.get(b) != hashed_then[b]:
                    found[b] = None
                continue
            if held_then is None:
                held_then = {x for t in tables_then.values() for x in t}
            if b in held_then:
                found[b] = None
    return list(found)


@dataclass
class BlockSnapshot(MemorySnapshot):
    """A block manager's snapshot: it also knows which blocks held data then, to name those a step overwrites."""

    tables_then: dict[int, list[int]] = field(default_factory=dict)
    hashed_then: dict[int, int] = field(default_factory=dict)
    now: Callable[[], tuple[dict[int, list[int]], dict[int, int]]] | None = None  # (tables, hashes) at the time asked

    def blocks_to_protect(self) -> list[int]:
        tables_now, hashed_now = self.now()
        return taken_blocks_holding_data(self.tables_then, tables_now, self.hashed_then, hashed_now)
