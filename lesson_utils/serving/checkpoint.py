"""A step is all or nothing: what the engine takes before each step, and puts back if the step is refused.

Whatever refuses a step - non-finite logits (``sampling.next_tokens`` names the sequences), a learner's plan or
step function, an error inside the forward pass, an interrupt - the engine restores this checkpoint before the
error reaches its caller, so every sequence, queue, block table, reference count, free queue, prefix-cache entry,
swap-space table and counter is as it was before the step. The caller can then abort the sequence the error names
and serve on: the others continue exactly as they would have without it.

Bookkeeping is captured with :func:`~lesson_utils.core.state.capture` (the scheduler, every sequence it holds and their
beam groups) and by the memory manager's and swap space's own ``snapshot()``. K/V *data* needs care only where the
step hands out a block that held a token at the checkpoint (a preempted sequence's block given to another in the
same step, a cached prefix evicted, a CPU block a swap-in freed and a swap-out reuses): the runner calls
:meth:`StepCheckpoint.protect` before it writes anything, and those blocks - every kind of per-slot data the cache
keeps (``cache.slot_tensors``) - are copied aside. Writes anywhere else land in slots the restored state does not
count as computed, and are written again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from lesson_utils.core.state import Captured, capture


@dataclass
class _Saved:
    where: object  # the cache (GPU blocks) or its host blocks (CPU): both have save_blocks / restore_blocks
    blocks: list[int]
    data: list[torch.Tensor]


@dataclass
class StepCheckpoint:
    """The engine's state before one step (:meth:`take`), restored when the step is refused (:meth:`restore`)."""

    captured: list[Captured]
    memory: object  # the manager's snapshot (lesson_utils.memory.snapshot.MemorySnapshot)
    swap: object | None  # the swap space's snapshot, where there is one
    cache: object
    host_blocks: object | None  # the swap space's data (lesson_utils.cache.host_blocks.HostBlocks)
    generators: list[tuple[torch.Generator, torch.Tensor]]
    saved: list[_Saved] = field(default_factory=list)

    @classmethod
    def take(cls, scheduler, cache, host_blocks=None) -> "StepCheckpoint":
        seqs: dict[int, object] = {}
        groups: dict[int, object] = {}
        for seq in chain(scheduler.waiting, scheduler.running, scheduler.swapped):
            for s in [seq, *seq.samples, *(seq.beam.beams if seq.beam is not None else [])]:
                seqs.setdefault(id(s), s)
            if seq.beam is not None:
                groups.setdefault(id(seq.beam), seq.beam)
        space = scheduler.swap_space
        return cls(
            [*map(capture, scheduler.stateful_parts()), *map(capture, seqs.values()), *map(capture, groups.values())],
            scheduler.manager.snapshot(),
            space.snapshot() if space is not None else None,
            cache,
            host_blocks,
            [(s.generator, s.generator.get_state()) for s in seqs.values() if s.generator is not None],
        )

    def protect(self) -> None:
        """Before the step writes: copy aside the blocks it has handed out that held data at the checkpoint.
        Called by the runner before its block copies and before its forward pass (twice is harmless)."""
        done = {(id(s.where), b) for s in self.saved for b in s.blocks}
        sides = [(self.cache, self.memory)]
        if self.swap is not None and self.host_blocks is not None:
            sides.append((self.host_blocks, self.swap))
        for where, snap in sides:
            blocks = [b for b in snap.blocks_to_protect() if (id(where), b) not in done]
            if blocks:
                self.saved.append(_Saved(where, blocks, where.save_blocks(blocks)))

    def restore(self) -> None:
        """Everything back as it was at :meth:`take`: the saved blocks' data first, then every table and count."""
        for s in reversed(self.saved):
            s.where.restore_blocks(s.blocks, s.data)
        self.memory.restore()
        if self.swap is not None:
            self.swap.restore()
        for part in self.captured:
            part.restore()
        for gen, state in self.generators:
            gen.set_state(state)
