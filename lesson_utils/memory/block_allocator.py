"""Lesson 03: fixed-size KV blocks, handed out and taken back in O(1).

GPU memory for the KV cache is cut into ``num_blocks`` blocks of ``block_size`` token slots each, once,
at start-up. The allocator only tracks which block ids are free.

Invariants (checked by a hypothesis state machine in the tests): every block id in
``[0, num_blocks)`` is either in the free queue exactly once or held, never both, never lost, so
``num_free + num_used == num_blocks``. Freed blocks go to the back of the queue (first in, first out),
which is what a later prefix cache wants: the longest-free blocks are reused first.
"""

from __future__ import annotations

from collections import deque

from lesson_utils.core.types import OutOfBlocks, is_int


class BlockIds:
    """The ids ``0 .. num_blocks - 1`` of a cache's blocks, checked: what lesson 03's allocator and lesson 05's pool
    share. Each keeps its own free queue; ``num_free`` is theirs, ``num_used`` follows from it."""

    def __init__(self, num_blocks: int):
        if not is_int(num_blocks) or num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {num_blocks!r}")
        self.num_blocks = num_blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            raise TypeError(f"a block id is an int, got {type(block_id).__name__}")
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(
                f"block id {block_id} is out of range: this cache has {self.num_blocks} blocks "
                f"(0..{self.num_blocks - 1})"
            )


class BlockAllocator(BlockIds):
    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._free_queue: deque[int] = deque(range(num_blocks))
        self._is_free = bytearray([1]) * num_blocks  # O(1) membership test for the free queue

    @property
    def num_free(self) -> int:
        return len(self._free_queue)

    def is_free(self, block_id: int) -> bool:
        self._check_id(block_id)
        return bool(self._is_free[block_id])

    def free_order(self) -> list[int]:
        """The free blocks in the order the next allocations take them (a copy)."""
        return list(self._free_queue)

    def allocate(self) -> int:
        """Take a free block; raises :class:`OutOfBlocks` when none is left."""
        if not self._free_queue:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        block_id = self._free_queue.popleft()
        self._is_free[block_id] = 0
        return block_id

    def free(self, block_id: int) -> None:
        """Give a block back; freeing a free block or an unknown id is an error, never ignored."""
        self._check_id(block_id)
        if self._is_free[block_id]:
            raise ValueError(f"block {block_id} is already free (freed twice?)")
        self._is_free[block_id] = 1
        self._free_queue.append(block_id)
