"""Moving one request's KV blocks from a prefill worker's cache to a decode worker's (lesson 09).

Three steps, each the reference of an exercise:

* :func:`transfer_plan` - which blocks of the finished prefill to send (its full blocks and the partial last
  one: ``blocks_needed(num_tokens)`` of them, in table order), and the decode worker's freshly allocated blocks
  they go to;
* :func:`pack_blocks` / :func:`unpack_blocks` - one request's blocks of every layer, K and V, as ONE tensor
  (one message on the wire), and back into the decode worker's cache at the plan's destinations;
* adoption (:meth:`~lesson_utils.memory.block_manager.BlockManager.adopt`) - the decode worker's block table
  for the request, holding those blocks with their token count.

Invariant: after unpack and adoption, gathering the request's K/V through the decode worker's table gives
exactly what gathering through the prefill worker's table gave (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lesson_utils.memory.block_table import blocks_needed


@dataclass(frozen=True)
class TransferPlan:
    """``src_blocks[i]`` of the prefill worker goes to ``dst_blocks[i]`` of the decode worker."""

    seq_id: int
    num_tokens: int
    src_blocks: list[int]
    dst_blocks: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.src_blocks)


def transfer_plan(
    seq_id: int, src_table: list[int], num_tokens: int, block_size: int, allocate: Callable[[], int]
) -> TransferPlan:
    """The blocks holding ``num_tokens`` tokens of ``src_table`` and one fresh destination block for each
    (``allocate()`` is the decode worker's allocator: it raises ``OutOfBlocks`` when none is left). Reference for
    exercise 09-1."""
    need = blocks_needed(num_tokens, block_size)
    if need > len(src_table):
        raise ValueError(f"{num_tokens} tokens need {need} blocks of {block_size}, the table has {len(src_table)}")
    src = list(src_table[:need])
    return TransferPlan(seq_id, num_tokens, src, [allocate() for _ in src])


def pack_blocks(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], blocks: list[int]) -> torch.Tensor:
    """``[2, layers, len(blocks), block_size, kv_heads, head_dim]``: the blocks of every layer's K and V, in
    ``blocks`` order, in one tensor on the cache's device. Reference for exercise 09-2 (packing)."""
    index = torch.tensor(blocks, dtype=torch.long, device=k_cache[0].device)
    return torch.stack([torch.stack([c[index] for c in k_cache]), torch.stack([c[index] for c in v_cache])])


def unpack_blocks(
    packed: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], blocks: list[int]
) -> None:
    """Write a :func:`pack_blocks` tensor into ``blocks`` of another cache, in place. Reference for exercise
    09-2 (unpacking)."""
    if packed.shape[:3] != (2, len(k_cache), len(blocks)):
        raise ValueError(
            f"a packed tensor for {len(blocks)} blocks of {len(k_cache)} layers, got {tuple(packed.shape)}"
        )
    index = torch.tensor(blocks, dtype=torch.long, device=k_cache[0].device)
    packed = packed.to(device=k_cache[0].device, dtype=k_cache[0].dtype)
    for layer, (kc, vc) in enumerate(zip(k_cache, v_cache)):
        kc[index] = packed[0, layer]
        vc[index] = packed[1, layer]
