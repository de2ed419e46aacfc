"""The two doors of a memory manager besides the scheduler's own (:class:`~lesson_utils.core.types.MemoryManager`).

* :class:`ManagerView` (``manager.view``) - the accounting, read-only: what lessons plot, checkers compare and tests
  assert (slot kinds, utilization, sharing, every table copied, the invariants). Nothing reached through it can
  change the manager: tables come back as copies.
* :class:`BlockDoor` (``manager.blocks``) - single blocks, for the two paths that move K/V outside a step's plan:
  lesson 06's swap space (a swap-in allocates, shares and adopts) and lesson 09's hand-over (a transfer's
  destinations allocated, adopted, or given back).

With the scheduler's door, these are a block manager's whole public surface (``tests/core/test_architecture.py``
holds it to 15 members); everything else is private to ``memory/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefixCacheStats:
    """What a prefix cache did so far (all zero for a manager without one)."""

    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    cached_free_blocks: int = 0  # free blocks that still hold a findable prefix


class NoPrefixCache:
    """What a manager without a prefix cache answers its view about one (lesson 05's sharing manager overrides it)."""

    def _hashed_blocks(self) -> dict[int, int]:
        return {}  # blocks holding a findable prefix, with its hash

    def _peek_hits(self, tokens: list[int]) -> list[int]:
        return []

    def _prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats()


class ManagerView:
    """A memory manager's accounting, read-only (``manager.view``). Block managers and contiguous reservations answer
    the same questions; where one has nothing to say (a contiguous manager's blocks) it says so."""

    def __init__(self, manager):
        self._m = manager

    # ---- what it is ------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._m._name

    @property
    def total_slots(self) -> int:
        return self._m._total_slots

    @property
    def num_blocks(self) -> int | None:
        """Blocks in the cache (None: contiguous memory)."""
        return self._m._num_blocks

    @property
    def block_size(self) -> int | None:
        return self._m._block_size

    @property
    def max_seq_len(self) -> int | None:
        return self._m._max_seq_len

    @property
    def can_fork(self) -> bool:
        """Whether sequences can share blocks (parallel sampling and beam search need it)."""
        return self._m._can_fork

    # ---- what it holds ---------------------------------------------------------------------------------------
    def breakdown(self) -> dict[str, int]:
        """Slots by kind (the paper's Fig. 2): token states, reserved, internal fragmentation, free."""
        return self._m._breakdown()

    def utilization(self) -> float:
        """Share of the held slots that hold a token state (the paper's 96.3 % measure)."""
        return self._m._utilization()

    def slot_kinds(self) -> np.ndarray:
        """Every slot's kind code, for memory maps."""
        return self._m._slot_kinds()

    def external_fragmentation(self) -> float:
        """How scattered free memory is (NaN for paged memory, which leaves no holes)."""
        return self._m._external_fragmentation()

    def sharing(self) -> tuple[int, int]:
        """Blocks the tables would hold without sharing, and the distinct blocks they hold."""
        return self._m._sharing()

    def tables_now(self) -> dict[int, tuple[list[int], int]]:
        """Every sequence's table as ``(blocks, tokens)``, copied."""
        return self._m._tables_now()

    def tables(self) -> dict:
        """Every sequence's :class:`~lesson_utils.memory.block_table.BlockTable`, copied (empty for contiguous memory)."""
        from lesson_utils.memory.block_table import BlockTable

        size = self._m._block_size
        return {sid: BlockTable(size, list(blocks), n) for sid, (blocks, n) in self._m._tables_now().items()}

    def block_table(self, seq_id: int) -> list[int]:
        """``seq_id``'s blocks, in order, copied (``ValueError`` for a sequence holding none)."""
        return list(self._m._block_table(seq_id))

    def holds(self, seq_id: int) -> bool:
        """Whether ``seq_id`` holds memory here."""
        return self._m._holds(seq_id)

    def table_of(self, seq_id: int):
        """A copy of ``seq_id``'s :class:`~lesson_utils.memory.block_table.BlockTable` (blocks and token count), or None
        when it holds no blocks."""
        from lesson_utils.memory.block_table import BlockTable

        table = self._m._table_of(seq_id)
        return None if table is None else BlockTable(table.block_size, list(table.blocks), table.num_tokens)

    def block_is_free(self, block_id: int) -> bool:
        return self._m._block_is_free(block_id)

    def free_queue(self) -> list[int]:
        """The free blocks in the order the next allocations take them (an eviction order with a prefix cache)."""
        return self._m._free_queue()

    def ref_count(self, block_id: int) -> int:
        """Tables holding ``block_id`` (0: free)."""
        return self._m._ref_count(block_id)

    def cached_blocks(self) -> dict[int, int]:
        """Blocks that hold a findable prefix, with its chained hash (a prefix cache; empty without one)."""
        return dict(self._m._hashed_blocks())

    def prefix_hits(self, tokens: list[int]) -> list[int]:
        """The cached blocks a prompt of ``tokens`` would start from now (a peek: it counts no lookup)."""
        return list(self._m._peek_hits(list(tokens)))

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups, hits and evictions of the prefix cache so far, and the free blocks still findable."""
        return self._m._prefix_cache_stats()

    # ---- what it counted -------------------------------------------------------------------------------------
    @property
    def num_cow(self) -> int:
        """Copy-on-write copies made so far."""
        return self._m._num_cow

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens admitted so far (a prefix cache counts them)."""
        return self._m._prompt_tokens

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens served from the prefix cache so far."""
        return self._m._cached_prompt_tokens

    def check_invariants(self) -> None:
        """Raise AssertionError naming the broken invariant (the tests call it after every step)."""
        self._m._check_invariants()


class BlockDoor:
    """Single blocks, for lesson 06's swap space and lesson 09's hand-over (``manager.blocks``)."""

    def __init__(self, manager):
        self._m = manager

    def allocate_block(self) -> int:
        """One free block for a transfer's destination, in no table yet (:meth:`adopt` puts it in one, :meth:`free_block`
        gives it back). ``OutOfBlocks`` when none is free."""
        return self._m._allocate_block()

    def free_block(self, block_id: int) -> None:
        """Give back a block from :meth:`allocate_block` that no table holds (a refused transfer's destinations)."""
        self._m._free_block(block_id)

    def share_block(self, block_id: int) -> None:
        """One more table will hold ``block_id`` (a swap-in whose block another returning sequence brought back)."""
        self._m._share_block(block_id)

    def adopt(self, seq_id: int, blocks: list[int], num_tokens: int):
        """THE install: ``seq_id`` gets a table of ``blocks`` holding ``num_tokens`` tokens written from elsewhere."""
        return self._m._adopt(seq_id, blocks, num_tokens)

    def reserve(self, seq_id: int, num_tokens: int):
        """Grow ``seq_id``'s table (made if new) to hold ``num_tokens`` tokens - for a cache driven by hand, outside a
        scheduler (lesson 10's measurements, tests). All or nothing: ``OutOfBlocks`` changes nothing."""
        return self._m._ensure_capacity(seq_id, num_tokens)

    def pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies this step will make, without taking them (a swap-out reads a block's source)."""
        return self._m._pending_copies()

    def block_table(self, seq_id: int) -> list[int]:
        """``seq_id``'s blocks, in order, copied."""
        return list(self._m._block_table(seq_id))
