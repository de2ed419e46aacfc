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

import torch

from .kv_cache import StepBatch


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
class BlockTable:
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


def slot_mapping(batch: StepBatch, block_tables: list[list[int]], block_size: int) -> torch.Tensor:
    """Flat cache slot of every new token in ``batch`` (``block_tables[i]`` belongs to ``batch.seq_ids[i]``).

    Returns a ``torch.long`` tensor on the batch's device, built from host-side data (the tables and the
    batch's lengths: a sequence's new tokens sit at positions ``context_len - query_len .. context_len - 1``)
    and moved to the device once, so no step waits for the GPU to hand ``batch.positions`` back.
    """
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table, positions in zip(block_tables, batch.new_positions())
        for p in positions
    ]
    return torch.tensor(slots, dtype=torch.long, device=batch.positions.device)


def gather_kv(cache: torch.Tensor, block_table: list[int], context_len: int) -> torch.Tensor:
    """One sequence's first ``context_len`` tokens, contiguous: ``[context_len, kv_heads, head_dim]``.

    ``cache`` is one layer's ``[num_blocks, block_size, kv_heads, head_dim]`` K or V cache. The last
    block is usually only partly filled: its tail is garbage and must be cut off.
    """
    num_blocks_used = blocks_needed(context_len, cache.shape[1])
    ids = torch.tensor(block_table[:num_blocks_used], dtype=torch.long, device=cache.device)
    return cache[ids].reshape(-1, cache.shape[2], cache.shape[3])[:context_len]


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention through block tables, in plain torch: what lesson 04's kernel must reproduce.

    ``q``: ``[num_seqs, num_heads, head_dim]`` (one new token per sequence); ``k_cache``/``v_cache``:
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_tables``: int ``[num_seqs, max_blocks]``
    (entries past a sequence's blocks are ignored); ``context_lens``: int ``[num_seqs]``, each >= 1.
    Returns ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype; softmax computed in fp32.
    """
    from .kv_cache import attention_over_context

    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        ctx = int(context_lens[i])
        if ctx < 1:
            raise ValueError(f"sequence {i} has context length {ctx}; decode needs at least one token")
        table = block_tables[i].tolist()
        k = gather_kv(k_cache, table, ctx)
        v = gather_kv(v_cache, table, ctx)
        out[i] = attention_over_context(q[i : i + 1], k, v, scale)[0]
    return out
