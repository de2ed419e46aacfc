"""Lesson 03: the block manager - PagedAttention's memory manager.

It owns the :class:`~lesson_utils.memory.block_allocator.BlockAllocator` and one
:class:`~lesson_utils.memory.block_table.BlockTable` per sequence, and speaks the scheduler's
:class:`~lesson_utils.core.types.MemoryManager` interface, so the very same object serves the real
engine (through :class:`~lesson_utils.cache.paged.PagedKVCache`) and the memory-accounting simulator.

Invariants: a block is held by at most one table (sharing arrives in lesson 05); the blocks held by all
tables plus the free blocks are exactly all blocks; every table holds ``blocks_needed(num_tokens)``
blocks - memory is taken one block at a time, when a token needs it, and given back the moment a
sequence finishes.

Admission keeps a *watermark* of free blocks back (1 % by default, as vLLM): admitting a request that
would leave no room for the running sequences to grow would only force a preemption a step later.

The door, by who comes through it (everything else is private or accounting for plots and checkers):

* the scheduler: ``check_admissible``, ``can_allocate``, ``allocate``, ``append_slot``, ``cache_computed``,
  ``pop_copies``, ``block_is_free``, ``fork`` (forks and beams), and ``free`` - THE release, for a finished,
  aborted or preempted sequence;
* the caches: ``table_of`` (a sequence's table and token count, to build a step's slots);
* lesson 06's swap space: ``block_table``, ``allocate_block``, ``share_block``, ``pending_copies``, and
  ``adopt`` - THE install of a table of blocks already written;
* lesson 09's hand-over: ``allocate_block`` / ``free_block`` (the transfer plan), ``adopt``;
* a refused step: ``snapshot``; the engine's and the simulator's records: ``breakdown``, ``slot_kinds``,
  ``external_fragmentation``, ``sharing``, ``num_cow``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from lesson_utils.core.state import capture
from lesson_utils.core.types import (
    FREE,
    INTERNAL,
    TOKEN,
    NeverFits,
    OutOfBlocks,
    Placement,
    Sequence,
    SlotKind,
    is_int,
)
from lesson_utils.memory.block_allocator import BlockAllocator
from lesson_utils.memory.block_table import BlockTable, blocks_needed, grow_block_table
from lesson_utils.memory.doors import BlockDoor, ManagerView, NoPrefixCache
from lesson_utils.memory.snapshot import BlockSnapshot


def _lookahead(n) -> int:
    if not is_int(n) or n < 0:
        raise ValueError(f"lookahead is the number of drafted tokens, an int >= 0, got {n!r}")
    return n


class BlockManager(NoPrefixCache):
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        watermark: float = 0.01,
        max_seq_len: int | None = None,
        allocator: BlockAllocator | None = None,
        grow_fn: Callable = grow_block_table,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark is a fraction of the blocks in [0, 1), got {watermark}")
        self._allocator = allocator or BlockAllocator(num_blocks)
        self._num_blocks = self._allocator.num_blocks
        self._block_size = block_size
        self.watermark_blocks = int(watermark * self._num_blocks)
        self._max_seq_len = max_seq_len
        self._tables: dict[int, BlockTable] = {}
        self._grow = grow_fn

    _name = "PagedAttention"
    _can_fork = False  # lesson 05's SharingBlockManager shares blocks
    _num_cow = 0  # copy-on-write copies made (only a sharing manager makes any)
    _prompt_tokens = _cached_prompt_tokens = 0  # (a prefix cache counts them)

    @property
    def view(self) -> ManagerView:
        """The accounting, read-only (:class:`~lesson_utils.memory.doors.ManagerView`)."""
        return ManagerView(self)

    @property
    def blocks(self) -> BlockDoor:
        """Single blocks, for the swap space and the hand-over (:class:`~lesson_utils.memory.doors.BlockDoor`)."""
        return BlockDoor(self)

    @property
    def num_free_blocks(self) -> int:
        return self._allocator.num_free

    # ---- hooks for sharing (lesson 05): nothing is ever shared here --------------------------------
    def _make_writable(self, seq_id: int, start: int, end: int) -> None:
        """Before tokens ``start .. end - 1`` of ``seq_id`` are written: copy shared blocks (none here)."""

    def pop_copies(self) -> list[tuple[int, int]]:
        """Block copies the cache must make before this step's writes (copy-on-write; none here)."""
        return []

    def _pending_copies(self) -> list[tuple[int, int]]:
        """The copies :meth:`pop_copies` would return, without taking them (a swap reads them)."""
        return []

    def fork(self, parent_id: int, child_id: int) -> None:
        raise ValueError("this block manager shares nothing and cannot fork: use lesson 05's SharingBlockManager")

    def _sharing(self) -> tuple[int, int]:
        """(blocks the tables would hold without sharing, distinct blocks they hold)."""
        logical = sum(len(t.blocks) for t in self._tables.values())
        return logical, len({b for t in self._tables.values() for b in t.blocks})

    def _forget_prefix(self, seq_id: int) -> None:
        """``seq_id`` leaves the GPU (swapped out): drop what the prefix cache keeps per sequence (nothing here)."""

    def _external_fragmentation(self) -> float:
        return float("nan")  # blocks leave no holes

    @property
    def _total_slots(self) -> int:
        return self._num_blocks * self._block_size

    def _holds(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def _free_queue(self) -> list[int]:
        return self._allocator.free_order()

    def _ref_count(self, block_id: int) -> int:
        return 0 if self._allocator.is_free(block_id) else 1

    # ---- the scheduler's interface -------------------------------------------------------------
    def check_admissible(self, seq: Sequence) -> None:
        longest = seq.request.prompt_len + seq.request.output_len
        if self._max_seq_len is not None and longest > self._max_seq_len:
            raise NeverFits(f"request {seq.seq_id} may reach {longest} tokens; the model allows {self._max_seq_len}")
        need = blocks_needed(longest, self._block_size)
        if need > self._num_blocks:
            raise NeverFits(
                f"request {seq.seq_id} may reach {longest} tokens = {need} blocks of {self._block_size}, "
                f"more than the whole cache ({self._num_blocks} blocks)"
            )

    def can_allocate(self, seq: Sequence) -> bool:
        need = blocks_needed(seq.len, self._block_size)
        if self._allocator.num_used == 0:  # an empty cache admits anything that fits at all
            return need <= self._num_blocks
        return need + self.watermark_blocks <= self._allocator.num_free

    def allocate(self, seq: Sequence) -> None:
        if seq.seq_id in self._tables:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        self._ensure_capacity(seq.seq_id, seq.len)

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        """Room for token number ``seq.len + 1`` and ``lookahead`` more (lesson 11's drafts); raises ``OutOfBlocks``
        (nothing changed) if there are not enough free blocks."""
        self._ensure_capacity(seq.seq_id, seq.len + 1 + _lookahead(lookahead))

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Lesson 11's rollback: ``seq_id``'s table keeps its first ``num_tokens`` tokens; the blocks past them (that
        only rejected draft tokens used) go back, one reference each - a block another table shares stays with it.
        Refuses to grow a table or to empty it (``free`` is the release)."""
        table = self._tables.get(seq_id)
        if table is None:
            raise ValueError(f"sequence {seq_id} holds no blocks (already freed, or never admitted)")
        if not is_int(num_tokens) or not 1 <= num_tokens <= table.num_tokens:
            raise ValueError(
                f"trim keeps 1 .. {table.num_tokens} tokens of sequence {seq_id}'s table, not {num_tokens!r}"
            )
        keep = blocks_needed(num_tokens, self._block_size)
        dropped = table.blocks[keep:]
        del table.blocks[keep:]
        table.num_tokens = num_tokens
        self._forget_past(seq_id, num_tokens)
        self._free_blocks(self._release_order(dropped))

    def _forget_past(self, seq_id: int, num_tokens: int) -> None:
        """A rollback: drop what the prefix cache keeps of ``seq_id`` past ``num_tokens`` tokens (nothing here)."""

    def _block_is_free(self, block_id: int) -> bool:
        return self._allocator.is_free(block_id)

    def cache_computed(self, seq: Sequence) -> None:
        """Nothing to register: this manager has no prefix cache (lesson 05's has)."""

    def snapshot(self) -> BlockSnapshot:
        """Every table, count and free block now (and the allocator's state), to put back if the step under way is
        refused; it names the blocks the step then hands out that held data now (their contents are the caller's
        to save before they are written)."""
        return BlockSnapshot(
            [capture(self), capture(self._allocator)],
            {sid: list(t.blocks) for sid, t in self._tables.items()},
            dict(self._hashed_blocks()),
            lambda: ({sid: t.blocks for sid, t in self._tables.items()}, self._hashed_blocks()),
        )

    # ---- used by the paged cache ----------------------------------------------------------------
    def _ensure_capacity(self, seq_id: int, num_tokens: int) -> BlockTable:
        """Grow ``seq_id``'s table (created if new) until it holds ``num_tokens`` tokens.

        All or nothing: if fewer blocks are free than the growth needs, raises ``OutOfBlocks`` and
        changes nothing (no half-grown table, no table left behind for a new sequence).
        """
        table = self._tables.get(seq_id)
        short = blocks_needed(num_tokens, self._block_size) - (len(table.blocks) if table is not None else 0)
        if short > self._allocator.num_free:
            raise OutOfBlocks(
                f"sequence {seq_id} needs {short} more block(s) for {num_tokens} tokens, but only "
                f"{self._allocator.num_free} of the {self._num_blocks} blocks are free"
            )
        if table is None:
            table = self._tables[seq_id] = BlockTable(self._block_size)
        while table.num_tokens < num_tokens:
            self._grow(table.blocks, table.num_tokens, self._block_size, self._allocator.allocate)
            table.num_tokens += 1
        return table

    def free(self, seq_id: int) -> BlockTable:
        """THE release: take ``seq_id``'s table out of the manager and give its blocks back, one reference each
        (finished, aborted, preempted, or swapped out: lesson 06 keeps the returned table's ids to copy the blocks
        out before anyone writes them again). Raises ``ValueError`` for a sequence that holds no blocks."""
        if not is_int(seq_id):
            raise TypeError(f"free takes a sequence id (an int: seq.seq_id), got {type(seq_id).__name__}")
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise ValueError(f"sequence {seq_id} holds no blocks (already freed, or never admitted)")
        self._forget_prefix(seq_id)
        self._free_blocks(self._release_order(table.blocks))
        return table

    def _free_blocks(self, ordered_blocks) -> None:
        """THE way blocks go back (vLLM's ``BlockPool.free_blocks``): one reference each, in the order the caller
        states - the order decides which blocks a later allocation reuses first."""
        for block_id in ordered_blocks:
            self._allocator.free(block_id)

    def _release_order(self, blocks: list[int]):
        return blocks  # nothing is cached here: any order will do

    def _allocate_block(self) -> int:
        """Lesson 09: one free block for a transfer's destination (not yet in any table: :meth:`adopt` puts it in
        one, :meth:`free_block` gives it back). Raises ``OutOfBlocks`` when none is free."""
        return self._allocator.allocate()

    def _free_block(self, block_id: int) -> None:
        """Give back a block from :meth:`allocate_block` that no table holds (a refused transfer's destinations)."""
        holder = self._holder_of(block_id)
        if holder is not None:
            raise ValueError(f"block {block_id} belongs to sequence {holder}: free the sequence, not its block")
        self._free_blocks([block_id])

    def _share_block(self, block_id: int) -> None:
        """One more table will hold ``block_id`` (lesson 05's managers count references; this one shares nothing)."""
        raise ValueError("this block manager shares nothing: use lesson 05's SharingBlockManager")

    def _holder_of(self, block_id: int) -> int | None:
        return next((sid for sid, t in self._tables.items() if block_id in t.blocks), None)

    def _taken_for_new_table(self, block_id: int, holders: dict[int, int]) -> bool:
        """Whether a reference to ``block_id`` was taken for the table about to be installed: here (nothing is
        shared) the block must be held by no table; lesson 05's manager counts references instead."""
        return holders.get(block_id, 0) == 0

    def _adopt(self, seq_id: int, blocks: list[int], num_tokens: int) -> BlockTable:
        """THE install: give ``seq_id`` a table of ``blocks`` holding ``num_tokens`` tokens whose K/V were written
        into them from elsewhere - lesson 09's hand-over (blocks from :meth:`allocate_block`) and lesson 06's
        swap-in (the same, or :meth:`share_block` for a block another returning sequence shares). Refuses, with
        nothing changed: a sequence that holds blocks already, a token count that is not a positive int, a block
        count that does not match it, a block id twice, a free block, and a block another sequence holds without
        a reference taken for this table. Reference for exercise 09-3."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not is_int(num_tokens):
            raise TypeError(f"num_tokens is an int, got {type(num_tokens).__name__} {num_tokens!r}")
        if num_tokens < 1:
            raise ValueError(f"a sequence holds at least one token, got num_tokens={num_tokens}")
        blocks = list(blocks)
        if len(blocks) != blocks_needed(num_tokens, self._block_size):
            raise ValueError(
                f"{num_tokens} tokens take {blocks_needed(num_tokens, self._block_size)} blocks of {self._block_size} "
                f"(block count), got {len(blocks)}"
            )
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block ids must be distinct: {blocks} names one block twice")
        holders: dict[int, int] = {}  # block -> tables holding it, counted once
        for t in self._tables.values():
            for b in t.blocks:
                holders[b] = holders.get(b, 0) + 1
        for b in blocks:
            if self._allocator.is_free(b):  # also refuses an id that is no block of this cache
                raise ValueError(f"block {b} is free: adopted blocks must be allocated first (allocate_block)")
            if not self._taken_for_new_table(b, holders):
                raise ValueError(
                    f"block {b} is held by sequence {self._holder_of(b)}: a received request needs blocks of its own"
                )
        table = self._tables[seq_id] = BlockTable(self._block_size, blocks, num_tokens)
        return table

    def _table_of(self, seq_id: int) -> BlockTable | None:
        """``seq_id``'s block table, or None when it holds no blocks. A read: blocks change only through this
        manager's methods (the caches read the table's blocks and token count to build a step's slots)."""
        return self._tables.get(seq_id)

    def placement(self, seq_id: int) -> Placement:
        """``seq_id``'s blocks, copied for a step's plan (the cache reads them there, not here)."""
        return Placement(blocks=tuple(self._block_table(seq_id)))

    def _tables_now(self) -> dict[int, tuple[list[int], int]]:
        """Every table as ``(blocks, tokens)``, copied (for pictures, checkers and a failed worker's clean-up)."""
        return {sid: (list(t.blocks), t.num_tokens) for sid, t in self._tables.items()}

    def _block_table(self, seq_id: int) -> list[int]:
        """The physical blocks of ``seq_id``, in order; ``ValueError`` for a sequence that holds none."""
        table = self._tables.get(seq_id)
        if table is None:
            raise ValueError(f"sequence {seq_id} holds no blocks here (never admitted, or freed already)")
        return table.blocks

    # ---- accounting -----------------------------------------------------------------------------
    def _breakdown(self) -> dict[str, int]:
        tokens = sum(t.num_tokens for t in self._tables.values())
        held = sum(t.capacity for t in self._tables.values())
        return {
            SlotKind.TOKEN: tokens,
            SlotKind.RESERVED: 0,  # paging reserves nothing for future tokens
            SlotKind.INTERNAL: held - tokens,  # only the unfilled tails of last blocks
            SlotKind.FREE: self._allocator.num_free * self._block_size,
        }

    def _utilization(self) -> float:
        """Share of the slots in held blocks that hold a token (the paper's 96.3 % measure)."""
        held = sum(t.capacity for t in self._tables.values())
        return sum(t.num_tokens for t in self._tables.values()) / held if held else 1.0

    def _slot_kinds(self) -> np.ndarray:
        kinds = np.full(self._total_slots, FREE, dtype=np.uint8)
        bs = self._block_size
        for table in self._tables.values():
            for i, block_id in enumerate(table.blocks):
                used = min(bs, table.num_tokens - i * bs)
                kinds[block_id * bs : block_id * bs + used] = TOKEN
                kinds[block_id * bs + used : (block_id + 1) * bs] = INTERNAL
        return kinds

    def _check_invariants(self) -> None:
        """Raise AssertionError naming the broken invariant (used by the tests after every step)."""
        held = [b for t in self._tables.values() for b in t.blocks]
        assert len(held) == len(set(held)), "a block is held by two tables"
        assert not any(self._allocator.is_free(b) for b in held), "a held block is also free"
        assert len(held) + self._allocator.num_free == self._num_blocks, "a block was lost"
        for sid, t in self._tables.items():
            assert len(t.blocks) == blocks_needed(t.num_tokens, self._block_size), (
                f"sequence {sid} holds the wrong number of blocks"
            )
