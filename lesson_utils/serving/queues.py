"""Where a scheduler's sequences are: the one state its planning half (``scheduler.py``) and its settling half
(``settlement.py``) share.

Invariants: a sequence is in at most one of ``waiting``, ``running`` and ``swapped``, and its status says which; a
finished sequence is in ``finished``, and on lesson 09's prefill side also in ``held`` (by id) until its K/V have been
sent and :meth:`~lesson_utils.serving.scheduler.FCFSScheduler.release` frees its blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lesson_utils.core.types import Sequence


@dataclass
class Queues:
    waiting: deque[Sequence] = field(default_factory=deque)  # in arrival order (a recomputed victim at the head)
    running: list[Sequence] = field(default_factory=list)  # in the order they run (beams after everyone else)
    swapped: deque[Sequence] = field(default_factory=deque)  # in the order they left (lesson 06)
    finished: list[Sequence] = field(default_factory=list)  # in the order they finished
    held: dict[int, Sequence] = field(default_factory=dict)  # finished, blocks kept until sent (lesson 09)

    def remove_running(self, seq: Sequence) -> None:
        self.running = [s for s in self.running if s is not seq]


def in_queues(name: str) -> property:
    """A scheduler attribute that is one of its :class:`Queues` (``scheduler.running`` and the like), settable."""

    def get(self):
        return getattr(self.queues, name)

    def set_(self, value) -> None:
        setattr(self.queues, name, value)

    return property(get, set_, doc=f"The scheduler's ``{name}`` sequences (:class:`Queues`).")
