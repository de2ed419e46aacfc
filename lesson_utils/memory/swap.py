"""Lesson 06: swapping KV blocks to CPU memory and back.

When the GPU runs out of blocks, a running sequence can be *preempted* without losing its work: its blocks
are copied to a bounded **swap space** in CPU memory and freed on the GPU; later they are copied back into
whatever GPU blocks are free then - the block table makes their new addresses irrelevant.

:class:`SwapSpace` is the CPU side's bookkeeping: a pool of ``num_blocks`` CPU block ids (reference-counted, so
blocks that several swapped sequences share - forked samples - are swapped out once) and each swapped sequence's CPU
table; swap-out and swap-in return the ``(gpu, cpu)`` / ``(cpu, gpu)`` copies to make. Block ids only: the data lives
in the cache layer's :class:`~lesson_utils.cache.host_blocks.HostBlocks`, which the model runner copies into and out
of (vLLM v0's block manager and ``CacheEngine``). It works with both lesson 03's
:class:`~lesson_utils.memory.block_manager.BlockManager` and lesson 05's sharing manager.

Invariants: a swapped sequence holds no GPU block and ``cpu_tables[seq]`` CPU blocks; a CPU block's count
equals the number of CPU tables holding it; swap-out then swap-in restores the sequence's K/V exactly.
"""

from __future__ import annotations

from typing import Callable

from lesson_utils.core.state import capture
from lesson_utils.memory.block_pool import BlockPool
from lesson_utils.memory.block_table import BlockTable
from lesson_utils.memory.snapshot import BlockSnapshot


def swap_mapping(
    src_blocks: list[int], allocate_dst: Callable[[], int], already: dict[int, int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Where each of a sequence's blocks goes, and which copies that takes (reference for exercise 06-1).

    For every source block: if ``already`` maps it (another sequence of this swap moved it), reuse that
    destination - a shared block is copied once; otherwise allocate a destination block, record the copy
    ``(src, dst)`` and remember it in ``already``. Returns the destination blocks in table order and the
    new copies.
    """
    dst_blocks, copies = [], []
    for src in src_blocks:
        if src not in already:
            already[src] = allocate_dst()
            copies.append((src, already[src]))
        dst_blocks.append(already[src])
    return dst_blocks, copies


class SwapSpace:
    """Bounded CPU memory for preempted sequences' blocks."""

    def __init__(self, num_blocks: int, mapping_fn: Callable = swap_mapping):
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"a swap space needs a non-negative number of blocks, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.pool = BlockPool(max(num_blocks, 1), enable_caching=False)
        if num_blocks == 0:
            self.pool.allocate()  # a zero-block swap space: its only block is never available
        self.cpu_tables: dict[int, BlockTable] = {}
        self._mapping = mapping_fn
        self.blocks_out = self.blocks_in = 0

    def snapshot(self) -> BlockSnapshot:
        """The CPU tables and blocks now, to put back if the step under way is refused; names the CPU blocks the
        step then hands out that held a swapped sequence's data now (:meth:`save_blocks` keeps them)."""
        return BlockSnapshot(
            [capture(self), capture(self.pool)],
            {sid: list(t.blocks) for sid, t in self.cpu_tables.items()},
            {},
            lambda: ({sid: t.blocks for sid, t in self.cpu_tables.items()}, {}),
        )

    @property
    def num_free(self) -> int:
        return self.pool.num_free if self.num_blocks else 0

    def distinct_new_blocks(self, gpu_blocks: list[int], already: dict[int, int]) -> int:
        return len({b for b in gpu_blocks if b not in already})

    def can_swap_out(self, manager, seq_id: int, already: dict[int, int]) -> bool:
        return self.distinct_new_blocks(manager.view.block_table(seq_id), already) <= self.num_free

    def swap_out(self, manager, seq_id: int, already: dict[int, int]) -> list[tuple[int, int]]:
        """Move a sequence's table to the CPU; returns the (gpu, cpu) copies to make. Its GPU blocks go back
        through the manager (``free``: a block still held by another sequence stays on the GPU for it)."""
        # a block the victim copied-on-write this step is filled only in the forward, after the swap copies:
        # copy its contents from the copy's source (still held by another table) instead
        pending = {dst: src for src, dst in manager.blocks.pending_copies()}
        table = manager.free(seq_id)
        fresh = len(already)
        cpu_blocks, copies = self._mapping(table.blocks, self.pool.allocate, already)
        copies = [(pending.get(gpu, gpu), cpu) for gpu, cpu in copies]
        # every CPU block gets one reference per table holding it (new ones were allocated with count 1)
        counted: set[int] = {cpu for _, cpu in copies}
        for cpu in cpu_blocks:
            if cpu in counted:
                counted.discard(cpu)
            else:
                self.pool.incref(cpu)
        self.cpu_tables[seq_id] = BlockTable(table.block_size, cpu_blocks, table.num_tokens)
        self.blocks_out += len(already) - fresh
        return copies

    def drop(self, seq_id: int) -> None:
        """Forget a swapped sequence (its request was cancelled): its CPU blocks lose one reference each."""
        if seq_id not in self.cpu_tables:
            raise ValueError(f"sequence {seq_id} is not in the swap space")
        for cpu in self.cpu_tables.pop(seq_id).blocks:
            self.pool.decref(cpu)

    def can_swap_in(self, manager, seq_id: int, watermark_blocks: int = 0) -> bool:
        need = len(set(self.cpu_tables[seq_id].blocks))
        return need + watermark_blocks <= manager.num_free_blocks

    def swap_in(self, manager, seq_id: int, already: dict[int, int]) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into free GPU blocks; returns the (cpu, gpu) copies to make."""
        cpu_table = self.cpu_tables.pop(seq_id)
        fresh = len(already)
        gpu_blocks, copies = self._mapping(cpu_table.blocks, manager.blocks.allocate_block, already)
        counted: set[int] = {gpu for _, gpu in copies}
        for gpu in gpu_blocks:
            if gpu in counted:
                counted.discard(gpu)
            else:
                manager.blocks.share_block(gpu)  # another returning sequence brought it back this step
        for cpu in cpu_table.blocks:
            self.pool.decref(cpu)
        manager.blocks.adopt(seq_id, gpu_blocks, cpu_table.num_tokens)
        self.blocks_in += len(already) - fresh
        return copies
