"""Lesson 05: sharing blocks between sequences - fork, copy-on-write, and a prefix cache.

:class:`SharingBlockManager` is lesson 03's block manager on a :class:`~lesson_utils.memory.block_pool.BlockPool`:

* :meth:`~SharingBlockManager.fork` gives a child sequence its parent's block table and bumps the counts:
  no block is allocated or copied (parallel sampling, beam search).
* Before a sequence writes into a block that other tables also hold, the block is copied to a fresh one
  and only the writer's table is repointed (**copy-on-write**); the copy itself is done by the cache on its
  tensors (:meth:`~SharingBlockManager.pop_copies`).
* With prefix caching on, admitting a sequence first looks its prompt up block by block (chained hashes,
  tokens verified) and starts it with the hits already computed (``seq.num_computed``). The last prompt token is
  always recomputed - its logits are needed to sample the first output token - so at most
  ``(len(prompt) - 1) // block_size`` blocks can hit. Blocks are registered once they are full and computed.

Invariants: every block's reference count equals the number of tables that hold it; a block is free exactly
when its count is 0; no block is lost; a cached block's tokens are the ones its hash was computed from.
"""

from __future__ import annotations

from typing import Callable

from lesson_utils.core.types import OutOfBlocks, Sequence, SlotKind
from lesson_utils.memory.block_manager import BlockManager, _lookahead
from lesson_utils.memory.block_pool import NO_PARENT, BlockPool, block_hash
from lesson_utils.memory.block_table import BlockTable, blocks_needed
from lesson_utils.memory.doors import PrefixCacheStats


def fork_table(parent: BlockTable, pool: BlockPool) -> BlockTable:
    """The child's table: the parent's blocks, shared (each count + 1). Reference for exercise 05-1."""
    for b in parent.blocks:
        pool.incref(b)
    return BlockTable(parent.block_size, list(parent.blocks), parent.num_tokens)


def copy_on_write(table: BlockTable, index: int, pool: BlockPool) -> tuple[int, int] | None:
    """Make ``table.blocks[index]`` exclusive before a write. Reference for exercise 05-2.

    If other tables hold the block too, allocate a fresh block, drop this table's reference to the old one,
    repoint only this table, and return ``(old, new)`` - the copy the cache must make. Otherwise None.
    """
    old = table.blocks[index]
    if pool.ref_count[old] == 1:
        return None
    new = pool.allocate()
    pool.decref(old)
    table.blocks[index] = new
    return old, new


def prefix_hits(pool: BlockPool, tokens: list[int], block_size: int, hash_fn: Callable = block_hash) -> list[int]:
    """Cached blocks that hold the longest prefix of ``tokens`` (whole blocks, leaving the last token out).

    Reference for exercise 05-3: walk the full blocks in order, chaining each block's hash to its
    parent's, and stop at the first miss.
    """
    hits, parent = [], NO_PARENT
    for i in range((len(tokens) - 1) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        parent = hash_fn(parent, chunk)
        block_id = pool.lookup(parent, chunk)
        if block_id is None:
            break
        hits.append(block_id)
    return hits


class SharingBlockManager(BlockManager):
    _name = "PagedAttention + sharing"
    _can_fork = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        max_seq_len: int | None = None,
        fork_fn: Callable = fork_table,
        cow_fn: Callable = copy_on_write,
        hash_fn: Callable = block_hash,
        prefix_fn: Callable = prefix_hits,
        pool: BlockPool | None = None,
    ):
        """``pool``: the block pool to draw from (a test that watches the pool's counts builds its own; by default a
        fresh one of ``num_blocks`` blocks)."""
        if pool is None:
            pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        elif pool.num_blocks != num_blocks:
            raise ValueError(f"the pool has {pool.num_blocks} blocks, not num_blocks={num_blocks}")
        super().__init__(num_blocks, block_size, watermark=watermark, max_seq_len=max_seq_len, allocator=pool)
        self._pool = pool
        self._fork, self._cow, self._hash, self._prefix = fork_fn, cow_fn, hash_fn, prefix_fn
        self._copies: list[tuple[int, int]] = []
        self._hashes: dict[int, list[int]] = {}  # seq_id -> chained hashes of its registered full blocks
        self._num_cow = 0
        self._prompt_tokens = 0
        self._cached_prompt_tokens = 0

    # ---- sharing --------------------------------------------------------------------------------
    def fork(self, parent_id: int, child_id: int) -> None:
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already holds blocks")
        if parent_id not in self._tables:
            raise ValueError(f"cannot fork sequence {parent_id}: it holds no blocks")
        self._tables[child_id] = self._fork(self._tables[parent_id], self._pool)
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))

    def _make_writable(self, seq_id: int, start: int, end: int) -> None:
        """Copy-on-write every shared block that positions ``start .. end-1`` will be written into."""
        table = self._tables[seq_id]
        first, last = start // self._block_size, min(len(table.blocks), blocks_needed(end, self._block_size)) - 1
        for index in range(first, last + 1):
            copy = self._cow(table, index, self._pool)
            if copy is not None:
                self._copies.append(copy)
                self._num_cow += 1

    def _pending_copies(self) -> list[tuple[int, int]]:
        return list(self._copies)

    def _forget_prefix(self, seq_id: int) -> None:
        self._hashes.pop(seq_id, None)

    def _forget_past(self, seq_id: int, num_tokens: int) -> None:
        del self._hashes.get(seq_id, [])[num_tokens // self._block_size :]

    def pop_copies(self) -> list[tuple[int, int]]:
        """Block copies ``(src, dst)`` that must happen on the cache tensors before this step's writes."""
        copies, self._copies = self._copies, []
        return copies

    # ---- the scheduler's interface (prefix cache, copy-on-write) ------------------------------------
    def _cows_needed(self, table: BlockTable, start: int, end: int) -> int:
        first, last = start // self._block_size, min(len(table.blocks), blocks_needed(end, self._block_size)) - 1
        return sum(1 for i in range(max(first, 0), last + 1) if self._pool.ref_count[table.blocks[i]] > 1)

    def can_allocate(self, seq: Sequence) -> bool:
        tokens = seq.token_ids
        hits = self._peek_hits(tokens, self._hash_for(seq)) if tokens else []
        revived = sum(1 for b in hits if self._pool.ref_count[b] == 0)
        need = blocks_needed(seq.len, self._block_size) - len(hits) + revived
        if self._pool.num_used == 0:
            return need <= self._num_blocks
        return need + self.watermark_blocks <= self._pool.num_free

    def _hash_for(self, seq: Sequence) -> Callable:
        """The block hash for ``seq``'s prefix chain: the manager's own, with the chain rooted at the request's
        ``cache_salt`` when it has one - a tenant's blocks are then found only by requests with the same salt, so the
        time to first token no longer tells one tenant what another has asked (vLLM's ``cache_salt``)."""
        salt = seq.request.cache_salt
        if salt is None:
            return self._hash
        root = hash(("cache_salt", salt))
        return lambda parent, chunk: self._hash(root if parent is NO_PARENT else parent, chunk)

    def _peek_hits(self, tokens: list[int], hash_fn: Callable | None = None) -> list[int]:
        saved = (self._pool.hits, self._pool.lookups)
        hits = self._prefix(self._pool, tokens, self._block_size, hash_fn or self._hash)
        self._pool.hits, self._pool.lookups = saved  # a peek is not a lookup
        return hits

    def allocate(self, seq: Sequence) -> None:
        if seq.seq_id in self._tables:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        tokens = seq.token_ids
        hits = self._prefix(self._pool, tokens, self._block_size, self._hash_for(seq)) if tokens else []
        for b in hits:
            self._pool.incref(b)
        self._tables[seq.seq_id] = BlockTable(self._block_size, list(hits), len(hits) * self._block_size)
        self._hashes[seq.seq_id] = [self._pool.hash_of[b] for b in hits]
        try:
            self._ensure_capacity(seq.seq_id, seq.len)
        except OutOfBlocks:
            self.free(seq.seq_id)
            raise
        seq.num_computed = len(hits) * self._block_size
        self._prompt_tokens += seq.len
        self._cached_prompt_tokens += seq.num_computed

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        """Room for the next token (and ``lookahead`` drafted ones after it), and every block the step writes made
        exclusive."""
        end = seq.len + 1 + _lookahead(lookahead)
        table = self._tables[seq.seq_id]
        extra = blocks_needed(end, self._block_size) - len(table.blocks)
        cows = self._cows_needed(table, seq.len - 1, end)
        if extra + cows > self._pool.num_free:
            raise OutOfBlocks(f"sequence {seq.seq_id} needs {extra + cows} block(s); {self._pool.num_free} are free")
        self._ensure_capacity(seq.seq_id, end)
        self._make_writable(seq.seq_id, seq.len - 1, end)

    def cache_computed(self, seq: Sequence) -> None:
        """Register the sequence's full blocks whose K/V are computed (``seq.num_computed``) and tokens known."""
        if not self._pool.enable_caching:
            return
        table, hashes = self._tables.get(seq.seq_id), self._hashes.setdefault(seq.seq_id, [])
        if table is None:
            return
        tokens = seq.token_ids
        full = min(seq.num_computed, len(tokens), table.num_tokens) // self._block_size
        for i in range(len(hashes), full):
            chunk = tokens[i * self._block_size : (i + 1) * self._block_size]
            h = self._hash_for(seq)(hashes[-1] if hashes else NO_PARENT, chunk)
            hashes.append(h)
            self._pool.cache(table.blocks[i], h, chunk)

    def _share_block(self, block_id: int) -> None:
        self._pool.incref(block_id)

    def _ref_count(self, block_id: int) -> int:
        return self._pool.ref_count[block_id]

    def _taken_for_new_table(self, block_id: int, holders: dict[int, int]) -> bool:
        return holders.get(block_id, 0) < self._pool.ref_count[block_id]  # share_block took one for this table

    def _hashed_blocks(self) -> dict[int, int]:
        return self._pool.hash_of

    def _prefix_cache_stats(self) -> PrefixCacheStats:
        pool = self._pool
        return PrefixCacheStats(pool.lookups, pool.hits, pool.evictions, pool.num_cached_free)

    def _release_order(self, blocks: list[int]):
        return reversed(blocks)  # tail blocks first: the free queue evicts them first, keeping shared prefixes

    # ---- accounting -----------------------------------------------------------------------------
    def _breakdown(self) -> dict[str, int]:
        held = {b for t in self._tables.values() for b in t.blocks}
        # a shared block counts once; its filled slots are the largest fill any holder reports
        fill: dict[int, int] = {}
        for t in self._tables.values():
            for i, b in enumerate(t.blocks):
                fill[b] = max(fill.get(b, 0), min(self._block_size, t.num_tokens - i * self._block_size))
        tokens = sum(fill.values())
        return {
            SlotKind.TOKEN: tokens,
            SlotKind.RESERVED: 0,
            SlotKind.INTERNAL: len(held) * self._block_size - tokens,
            SlotKind.FREE: self._pool.num_free * self._block_size,
        }

    def _check_invariants(self) -> None:
        counts: dict[int, int] = {}
        for t in self._tables.values():
            for b in t.blocks:
                counts[b] = counts.get(b, 0) + 1
        for b in range(self._num_blocks):
            assert self._pool.ref_count[b] == counts.get(b, 0), (
                f"block {b}: count {self._pool.ref_count[b]}, held by {counts.get(b, 0)} tables"
            )
            # (is_free() is defined by the count: the free queue is what must agree with it)
            in_queue = b in self._pool._free_queue
            assert (self._pool.ref_count[b] == 0) == in_queue, (
                f"block {b}: count {self._pool.ref_count[b]}, {'in' if in_queue else 'not in'} the free queue"
            )
        for sid, t in self._tables.items():
            assert len(t.blocks) == blocks_needed(t.num_tokens, self._block_size), (
                f"sequence {sid} holds the wrong number of blocks"
            )
        for b, h in self._pool.hash_of.items():
            assert self._pool.block_of[h] == b, f"block {b}'s hash maps elsewhere"
