"""Shared by the paged-memory tests: sequences, a manager's state, a scrambled free queue."""

from __future__ import annotations

import random

from lesson_utils.core.types import Request, Sequence
from lesson_utils.memory.block_allocator import BlockAllocator
from lesson_utils.memory.block_manager import BlockManager


def make_seq(seq_id: int, prompt_len: int, output_len: int = 1000) -> Sequence:
    return Sequence(Request(seq_id, 0.0, prompt_len, output_len))


def snapshot(m: BlockManager):
    """Everything a failed operation must leave untouched: every table, and which ids are free."""
    tables = {sid: (tuple(t.blocks), t.num_tokens) for sid, t in m.view.tables().items()}
    return tables, tuple(m.view.block_is_free(b) for b in range(m.view.num_blocks)), m.num_free_blocks


def scramble_free_queue(allocator: BlockAllocator, seed: int) -> None:
    """Take every block and give them back in random order, so later tables are non-monotonic."""
    ids = [allocator.allocate() for _ in range(allocator.num_blocks)]
    random.Random(seed).shuffle(ids)
    for b in ids:
        allocator.free(b)


def brute_force_slots(table: list[int], block_size: int) -> dict[int, int]:
    """position -> flat slot, by walking the table block by block (no // or % on positions)."""
    slots, pos = {}, 0
    for block in table:
        for offset in range(block_size):
            slots[pos] = block * block_size + offset
            pos += 1
    return slots
