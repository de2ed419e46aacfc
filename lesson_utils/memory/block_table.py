"""Lesson 03: block tables - a sequence's logical blocks mapped onto physical blocks.

Token ``p`` of a sequence lives in logical block ``p // block_size``, at offset ``p % block_size``;
the block table says which physical block that logical block is, so the token's *slot* in the flat
cache is ``table[p // block_size] * block_size + p % block_size``. Physical blocks can be anywhere, in
any order: that indirection is all PagedAttention needs to stop reserving memory ahead of time.

The functions here are the references for lesson 03's exercises and for lesson 04's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from lesson_utils.core.state import Record


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def grow_block_table(block_table: list[int], num_tokens: int, block_size: int, allocate: Callable[[], int]) -> None:
    """Make room for one more token in a sequence that holds ``num_tokens`` tokens now.

    A new physical block is allocated only when the new token starts a logical block, i.e. when
    ``num_tokens`` is a multiple of ``block_size``. ``block_table`` is extended in place.
    """
    if num_tokens % block_size == 0:
        block_table.append(allocate())


@dataclass
class BlockTable(Record):
    """One sequence's blocks. Invariant: ``len(blocks) == blocks_needed(num_tokens, block_size)``."""

    block_size: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def last_block_waste(self) -> int:
        """Empty slots in the last block: the only internal fragmentation paging leaves."""
        return self.capacity - self.num_tokens

    def slot(self, position: int) -> int:
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} is outside this sequence's {self.num_tokens} tokens")
        return self.blocks[position // self.block_size] * self.block_size + position % self.block_size
