"""Lesson 06's swap space, data side: CPU copies of a cache's blocks (vLLM v0's ``CacheEngine`` beside its block
manager).

The bookkeeping - which CPU block holds which swapped sequence's block, reference counts, free CPU blocks - is the
memory layer's :class:`~lesson_utils.memory.swap.SwapSpace`, block ids only. The data lives here: for each kind of
per-slot data the cache keeps (``cache.slot_tensors``: K/V values, an int8 cache's scales), one host tensor
``[2 (K, V), layers, num_blocks, block_size, ...]``, pinned when the cache is on CUDA so copies to and from it can
run asynchronously. The cache's ``swap_out`` / ``swap_in`` move blocks between the two (one gather and one copy each
way per kind), applying the ``(gpu, cpu)`` mapping the scheduler's swap space decided.

Invariant: CPU block ``b`` of ``HostBlocks`` is the data of ``SwapSpace``'s CPU block ``b``; every kind a cache keeps
has its host tensor here (a cache of other kinds is refused).
"""

from __future__ import annotations

import torch

from lesson_utils.cache.block_copy import SlotTensors
from lesson_utils.core.host_copy import wants_pinned
from lesson_utils.core.types import is_int


class HostBlocks:
    """``num_blocks`` CPU blocks shaped like a cache's, every kind of per-slot data it keeps."""

    def __init__(self, kinds: tuple[SlotTensors, ...], num_blocks: int):
        if not is_int(num_blocks) or num_blocks < 0:
            raise ValueError(f"a swap space needs a non-negative number of blocks, got {num_blocks!r}")
        pin = wants_pinned(kinds[0].k[0].device)
        self.names = tuple(kind.name for kind in kinds)
        self.num_blocks = num_blocks
        self.tensors = [
            torch.zeros(
                (2, len(kind.k), num_blocks) + tuple(kind.k[0].shape[1:]), dtype=kind.k[0].dtype, pin_memory=pin
            )
            for kind in kinds
        ]

    @classmethod
    def for_cache(cls, cache, num_blocks: int) -> "HostBlocks":
        """Host blocks for every kind ``cache`` keeps (the Engine makes one beside a ``SwapSpace`` of as many blocks)."""
        return cls(cache.slot_tensors, num_blocks)

    def check_kinds(self, kinds: tuple[SlotTensors, ...]) -> None:
        """Refuse a cache whose per-slot kinds are not the ones these host blocks were made for."""
        names = tuple(kind.name for kind in kinds)
        if names != self.names:
            raise ValueError(
                f"these host blocks hold {', '.join(self.names)} per slot, but the cache keeps {', '.join(names)}: "
                "make them for this cache (HostBlocks.for_cache(cache, num_blocks)), as the Engine does"
            )

    def save_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        """A copy of CPU ``blocks``, every kind (a refused step's swap-out is about to overwrite them)."""
        index = torch.tensor(blocks, dtype=torch.long)
        return [t[:, :, index].clone() for t in self.tensors]

    def restore_blocks(self, blocks: list[int], saved: list[torch.Tensor]) -> None:
        index = torch.tensor(blocks, dtype=torch.long)
        for t, copy in zip(self.tensors, saved, strict=True):
            t[:, :, index] = copy
