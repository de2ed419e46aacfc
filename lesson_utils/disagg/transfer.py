"""Moving one request's KV blocks from a prefill worker's cache to a decode worker's (lesson 09).

Three steps, each the reference of an exercise:

* :func:`transfer_plan` - which blocks of the finished prefill to send (its full blocks and the partial last
  one: ``blocks_needed(num_tokens)`` of them, in table order), and the decode worker's freshly allocated blocks
  they go to - lesson 06's swap mapping, all or nothing;
* packing and unpacking (:func:`lesson_utils.cache.block_copy.pack_blocks` / ``unpack_blocks``) - one request's
  blocks of every layer, K and V, as ONE tensor (one message on the wire), and back into the decode worker's
  cache at the plan's destinations: the same gather and scatter the paged cache's swap uses;
* adoption (:meth:`~lesson_utils.memory.block_manager.BlockManager.adopt`) - the decode worker's block table
  for the request, holding those blocks with their token count.

Invariant: after unpack and adoption, gathering the request's K/V through the decode worker's table gives
exactly what gathering through the prefill worker's table gave (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lesson_utils.core.types import is_int
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.memory.swap import swap_mapping


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


def _count(value, what: str, least: int) -> int:
    if not is_int(value):
        raise TypeError(f"{what} is an int, got {type(value).__name__} {value!r}")
    if value < least:
        raise ValueError(f"{what} must be at least {least}, got {value}")
    return value


def transfer_plan(
    seq_id: int,
    src_table: list[int],
    num_tokens: int,
    block_size: int,
    allocate: Callable[[], int],
    release: Callable[[int], None],
) -> TransferPlan:
    """The blocks holding ``num_tokens`` tokens of ``src_table`` (its full blocks and the partial last one, in
    order) and one fresh destination block for each, from ``allocate()`` (the decode side's: it raises
    ``OutOfBlocks`` when none is left). All or nothing: when ``allocate`` fails part-way, every destination
    already taken goes back through ``release(block)`` before the error is raised. ``src_table`` is not changed.
    Reference for exercise 09-1."""
    _count(num_tokens, "num_tokens", 1)
    _count(block_size, "block_size", 1)
    need = blocks_needed(num_tokens, block_size)
    if need > len(src_table):
        raise ValueError(f"{num_tokens} tokens need {need} blocks of {block_size}, the table has {len(src_table)}")
    src, taken = list(src_table[:need]), []

    def take() -> int:
        taken.append(allocate())
        return taken[-1]

    try:  # lesson 06's mapping: a fresh destination for each source block
        dst, _ = swap_mapping(src, take, {})
    except BaseException:
        for b in reversed(taken):
            release(b)
        raise
    return TransferPlan(seq_id, num_tokens, src, dst)
