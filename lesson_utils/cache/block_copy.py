"""Many blocks of every layer's K and V at once: gathered into one tensor, and scattered back.

:func:`pack_blocks` is the paged cache's swap-out gather (lesson 06: one copy to the host, not one per block and
layer) and lesson 09's message to the decode worker; :func:`unpack_blocks` is the swap-in scatter and the decode
worker's write. One tensor ``[2 (K, V), layers, len(blocks), block_size, kv_heads, head_dim]`` either way.
Every id is checked before anything is read or written (Python's -1 would quietly mean the last block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import is_int


@dataclass(frozen=True)
class SlotTensors:
    """One kind of data a paged cache keeps per slot, every layer: K's and V's tensors, each
    ``[num_blocks, block_size, ...]`` (the values; lesson 10's int8 cache adds its scales as a second kind).

    A cache names all of its kinds once (``cache.slot_tensors``), and every path that moves blocks - copy-on-write,
    swap out and in, the hand-over's pack and unpack, a refused step's restore - moves each kind: a block's
    scales can never be left behind by one path while its values travel."""

    name: str
    k: list[torch.Tensor]
    v: list[torch.Tensor]


def save_blocks(kinds: tuple[SlotTensors, ...], blocks: list[int]) -> list[torch.Tensor]:
    """A copy of ``blocks`` of every kind (one :func:`pack_blocks` tensor per kind), for :func:`restore_blocks`."""
    return [pack_blocks(kind.k, kind.v, blocks) for kind in kinds]


def restore_blocks(kinds: tuple[SlotTensors, ...], blocks: list[int], saved: list[torch.Tensor]) -> None:
    """Write :func:`save_blocks`'s copies back into the same blocks."""
    for kind, packed in zip(kinds, saved, strict=True):
        unpack_blocks(packed, kind.k, kind.v, blocks)


def _caches(k_cache, v_cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-layer K and V caches, checked: lists of tensors of one shape, as many layers of K as of V."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, (list, tuple)) or not cache or not all(isinstance(c, torch.Tensor) for c in cache):
            raise TypeError(f"{name} is a list of per-layer tensors [num_blocks, block_size, kv_heads, head_dim]")
    if len(k_cache) != len(v_cache):
        raise ValueError(f"k_cache has {len(k_cache)} layers but v_cache has {len(v_cache)}")
    shape = tuple(k_cache[0].shape)
    if len(shape) != 4 or any(tuple(c.shape) != shape for c in list(k_cache) + list(v_cache)):
        raise ValueError("every layer's K and V cache must have one shape [num_blocks, block_size, kv_heads, head_dim]")
    return list(k_cache), list(v_cache)


def _block_index(blocks, num_blocks: int, device, distinct: bool) -> torch.Tensor:
    """``blocks`` as an index tensor, every id checked first (Python's -1 would silently mean the last block)."""
    if isinstance(blocks, torch.Tensor) or not isinstance(blocks, (list, tuple)):
        raise TypeError(f"blocks is a list of block ids (ints), got {type(blocks).__name__}")
    for b in blocks:
        if not is_int(b):
            raise TypeError(f"a block id is an int, got {type(b).__name__} {b!r}")
        if not 0 <= b < num_blocks:
            raise ValueError(f"block id {b} is out of range: the cache has {num_blocks} blocks (0..{num_blocks - 1})")
    if distinct and len(set(blocks)) != len(blocks):
        raise ValueError(f"block ids must be distinct: {list(blocks)} names one block twice")
    return to_device(list(blocks), torch.long, device)


def pack_blocks(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], blocks: list[int]) -> torch.Tensor:
    """``[2, layers, len(blocks), block_size, kv_heads, head_dim]``: the blocks of every layer's K and V, in
    ``blocks`` order, in one tensor on the cache's device. Reference for exercise 09-2 (packing)."""
    k_cache, v_cache = _caches(k_cache, v_cache)
    index = _block_index(blocks, k_cache[0].shape[0], k_cache[0].device, distinct=False)
    return torch.stack([torch.stack([c[index] for c in k_cache]), torch.stack([c[index] for c in v_cache])])


def unpack_blocks(
    packed: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], blocks: list[int]
) -> None:
    """Write a :func:`pack_blocks` tensor into ``blocks`` of another cache, in place; returns None. A payload in
    another floating dtype or on another device is converted to the cache's first; every check is made before
    anything is written (a refused payload leaves the cache as it was). Reference for exercise 09-2 (unpacking)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed is one tensor from pack_blocks, got {type(packed).__name__}")
    k_cache, v_cache = _caches(k_cache, v_cache)
    num_blocks, *block_shape = k_cache[0].shape
    index = _block_index(blocks, num_blocks, k_cache[0].device, distinct=True)
    expected = (2, len(k_cache), len(blocks), *block_shape)
    if tuple(packed.shape) != expected:
        names = ("K and V", "layers", "blocks", "block size", "KV heads", "head dim")
        wrong = (
            ", ".join(
                f"{n} {got} instead of {want}" for n, got, want in zip(names, packed.shape, expected) if got != want
            )
            or f"{packed.dim()} dimensions instead of 6"
        )
        raise ValueError(f"the packed tensor does not fit this cache and these blocks: {wrong}")
    if not packed.dtype.is_floating_point and packed.dtype != k_cache[0].dtype:
        raise TypeError(f"packed holds K/V values (a floating dtype, or the cache's own), got {packed.dtype}")
    if packed.dtype != k_cache[0].dtype and not k_cache[0].dtype.is_floating_point:
        raise TypeError(
            f"a {packed.dtype} payload into a {k_cache[0].dtype} cache: integer blocks hold quantized values with "
            "scales beside them, and a cast would not quantize - send the cache's own blocks (int8 to int8)"
        )
    packed = packed.to(device=k_cache[0].device, dtype=k_cache[0].dtype)
    for layer, (kc, vc) in enumerate(zip(k_cache, v_cache)):
        kc[index] = packed[0, layer]
        vc[index] = packed[1, layer]
