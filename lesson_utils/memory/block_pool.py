"""Lesson 05: a block pool with reference counts and a prefix cache.

Does lesson 03's allocator's job (the same block ids, a free queue in FIFO order), with two additions.

**Reference counts.** A block's count equals the number of block tables that hold it. Forking a sequence
bumps the counts of its blocks instead of copying them; a block returns to the free pool only when its
count drops to zero.

**Prefix cache.** A *full* block can be registered under a hash of its tokens chained with the hash of
the block before it, so the hash names the whole prefix up to and including that block. A later request
whose prompt starts with the same tokens finds the blocks by hash and reuses their K/V instead of
recomputing them. Lookups compare the block's tokens too, so a collision between blocks with different tokens
is caught; a collision between equal blocks behind different prefixes is not (vLLM has the same limit), which
a strong hash makes negligible: Python's 64-bit tuple hash here, a cryptographic hash in production.

Freed blocks keep their contents and their hash: they stay findable until the allocator needs them for
something else. The free queue is in eviction order - least recently freed first - and every operation
on it is O(1) (an ``OrderedDict``: pop the oldest, remove from the middle on a cache hit, append).

Invariants: ``ref_count[b] == 0`` exactly when ``b`` is in the free queue; a hash maps to at most one
block and that block's recorded tokens are the ones hashed; free + held == all blocks.
"""

from __future__ import annotations

from collections import OrderedDict

from lesson_utils.core.types import OutOfBlocks
from lesson_utils.memory.block_allocator import BlockIds

NO_PARENT = None


def block_hash(parent_hash, tokens) -> int:
    """Hash of a full block: chained with its parent's hash, so equal hashes mean equal whole prefixes."""
    return hash((parent_hash, tuple(int(t) for t in tokens)))


class BlockPool(BlockIds):
    """Lesson 03's allocator's job with reference counts and a prefix cache. It shares the allocator's block ids
    (:class:`~lesson_utils.memory.block_allocator.BlockIds`: the id checks, ``num_used``), not its free queue:
    this one is an ``OrderedDict``, because a prefix-cache hit revives a free block from the middle of the queue
    (O(1) there, O(n) in a deque), and a block is free exactly when its count is 0."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        super().__init__(num_blocks)
        self.enable_caching = enable_caching
        self.ref_count = [0] * num_blocks
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        self.hash_of: dict[int, int] = {}  # block -> hash (only cached, full blocks)
        self.tokens_of: dict[int, tuple[int, ...]] = {}
        self.block_of: dict[int, int] = {}  # hash -> block
        self.hits = self.lookups = self.evictions = 0

    # ---- counts ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free_queue)

    def free_order(self) -> list[int]:
        """The free blocks, least recently freed first: the order allocation takes them (and evicts their prefixes)."""
        return list(self._free_queue)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a findable prefix."""
        return sum(1 for b in self._free_queue if b in self.hash_of)

    def is_free(self, block_id: int) -> bool:
        self._check_id(block_id)
        return self.ref_count[block_id] == 0

    # ---- allocation ------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A block with count 1; evicts the least recently freed block's cached prefix if it had one."""
        if not self._free_queue:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        block_id, _ = self._free_queue.popitem(last=False)
        self._evict(block_id)
        self.ref_count[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """One more table holds ``block_id`` (a fork, or a prefix-cache hit that revives a free block)."""
        self._check_id(block_id)
        if self.ref_count[block_id] == 0:
            del self._free_queue[block_id]
        self.ref_count[block_id] += 1

    def decref(self, block_id: int) -> None:
        """One table fewer holds ``block_id``; at zero it joins the free queue's newest end."""
        self._check_id(block_id)
        if self.ref_count[block_id] == 0:
            raise ValueError(f"block {block_id} is already free (freed twice?)")
        self.ref_count[block_id] -= 1
        if self.ref_count[block_id] == 0:
            self._free_queue[block_id] = None

    def free(self, block_id: int) -> None:
        """The lesson 03 name: one reference fewer (what a block table gives back)."""
        self.decref(block_id)

    # ---- prefix cache ----------------------------------------------------------------------------
    def cache(self, block_id: int, h: int, tokens) -> None:
        """Register a full, computed block under hash ``h`` (no-op when caching is off or already known)."""
        self._check_id(block_id)
        if not self.enable_caching or h in self.block_of or block_id in self.hash_of:
            return
        self.block_of[h] = block_id
        self.hash_of[block_id] = h
        self.tokens_of[block_id] = tuple(int(t) for t in tokens)

    def lookup(self, h: int, tokens) -> int | None:
        """The cached block for ``h`` if its tokens really are ``tokens``; None otherwise."""
        if not self.enable_caching:
            return None
        self.lookups += 1
        block_id = self.block_of.get(h)
        if block_id is None or self.tokens_of[block_id] != tuple(int(t) for t in tokens):
            return None
        self.hits += 1
        return block_id

    def _evict(self, block_id: int) -> None:
        h = self.hash_of.pop(block_id, None)
        if h is not None:
            del self.block_of[h]
            del self.tokens_of[block_id]
            self.evictions += 1
