"""Lesson 03: the paged KV cache that plugs into the OPT forward.

Per layer, ``k_cache[layer]`` and ``v_cache[layer]`` have shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (the layout vLLM's kernels and lesson 04 use).
Which blocks belong to which sequence is the :class:`~lesson_utils.memory.block_manager.BlockManager`'s
business; this class only moves K/V in and out:

* ``prepare``: compute the slot mapping through the block tables the scheduler has grown for this step;
* ``write``: scatter the new K/V into their slots;
* ``attend``: gather each sequence's K/V through its block table and attend (plain torch; lesson 04
  swaps in a Triton kernel for the decode case).

How ``attend`` spends its time depends on the device. One sequence at a time (gather, then PyTorch's fused
attention) is what runs on a CPU: a Python loop of a few calls per sequence costs little next to moving K/V,
while a single batched gather pads every sequence to the longest one (which wins depends on the machine: time both before changing it). On
a GPU each call is a kernel launch, so ``batched_decode`` (on by default for a CUDA cache, unless a custom
``gather_fn`` is given - lesson 03's exercise) serves all decoding sequences with one padded gather and :func:`~lesson_utils.cache.attention.decode_attention`; lesson 04's kernel does the same without
the gather.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from lesson_utils.cache.attention import gather_kv  # noqa: F401 - importable from here, as lesson 03 does
from lesson_utils.cache.backends import GatherBackend
from lesson_utils.cache.block_copy import SlotTensors, pack_blocks, restore_blocks, save_blocks, unpack_blocks
from lesson_utils.cache.formats import FloatFormat
from lesson_utils.cache.paged_metadata import MetadataNeeds, build_paged_metadata
from lesson_utils.cache.seam import StepBatch
from lesson_utils.core.device_discipline import acts_as_gpu, synchronize
from lesson_utils.core.host_copy import to_device, wants_pinned
from lesson_utils.memory.block_manager import BlockManager


def slot_mapping(batch: StepBatch, block_tables: list[list[int]], block_size: int) -> torch.Tensor:
    """Flat cache slot of every new token in ``batch`` (``block_tables[i]`` belongs to ``batch.seq_ids[i]``).

    Returns a ``torch.long`` tensor on the batch's device, built from host-side data (the tables and the
    batch's lengths: a sequence's new tokens sit at positions ``context_len - query_len .. context_len - 1``)
    and copied to the device once without a wait (pinned, non-blocking), so no step waits for the GPU to hand
    ``batch.positions`` back, nor for the copy.
    """
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table, positions in zip(block_tables, batch.new_positions())
        for p in positions
    ]
    return to_device(slots, torch.long, batch.positions.device)


def swap_out_blocks(k_cache, v_cache, copies: list[tuple[int, int]], host: torch.Tensor) -> None:
    """``(gpu, cpu)`` blocks of every layer's ``k_cache``/``v_cache`` into ``host`` ``[2, layers, cpu blocks, ...]``:
    one gather, one asynchronous copy into pinned staging, one wait, one scatter on the host."""
    device = k_cache[0].device
    cpu = torch.tensor([c for _, c in copies])  # host index into the host swap space
    gathered = pack_blocks(k_cache, v_cache, [g for g, _ in copies])
    staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=wants_pinned(device))
    staging.copy_(gathered, non_blocking=True)
    synchronize(device, "a swap-out's blocks must land before the host reads them")
    host[:, :, cpu] = staging


def swap_in_blocks(k_cache, v_cache, copies: list[tuple[int, int]], host: torch.Tensor) -> None:
    """``(cpu, gpu)`` blocks from ``host`` back into the caches: one host-to-device copy from pinned memory,
    queued on the GPU's stream; nothing waits (PyTorch keeps the pinned buffer alive until it is read)."""
    cpu = torch.tensor([c for c, _ in copies])
    staging = torch.empty(
        (2, len(k_cache), len(copies)) + tuple(host.shape[3:]), dtype=host.dtype, pin_memory=host.is_pinned()
    )
    torch.index_select(host, 2, cpu, out=staging)
    unpack_blocks(staging.to(k_cache[0].device, non_blocking=True), k_cache, v_cache, [g for _, g in copies])


class PagedKVCache:
    """A paged KV cache: a storage **format** (:mod:`~lesson_utils.cache.formats`) and an attention **backend**
    (:mod:`~lesson_utils.cache.backends`) over one block manager's blocks. Any format works with any backend; the
    lessons' classes are presets of the two (this one: floats and lesson 03's gather; ``TritonPagedKVCache``,
    ``UnifiedTritonKVCache``, ``Int8PagedKVCache``).

    ``k_cache[layer]`` / ``v_cache[layer]`` are the format's value tensors ``[num_blocks, block_size, num_kv_heads,
    head_dim]``; ``slot_tensors`` names everything it keeps per slot, and every path that moves blocks moves all of
    it. ``kernel_writes``: new K/V written by the format's Triton write kernel (default: when the backend computes
    with kernels)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        manager: BlockManager,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        slot_mapping_fn: Callable = slot_mapping,
        gather_fn: Callable | None = None,
        batched_decode: bool | None = None,
        format: FloatFormat | None = None,
        backend=None,
        kernel_writes: bool | None = None,
    ):
        self.manager = manager  # the manager it was sized for: an engine takes it; a step never reads it
        self.num_blocks, self.block_size = manager.view.num_blocks, manager.view.block_size
        self.format = FloatFormat(dtype) if format is None else format
        self.backend = GatherBackend(gather_fn, batched_decode) if backend is None else backend
        self.format.allocate(
            num_layers, manager.view.num_blocks, manager.view.block_size, num_kv_heads, head_dim, device
        )
        self.backend.bind(acts_as_gpu(device))
        self.kernel_writes = self.backend.kernel_writes if kernel_writes is None else kernel_writes
        self._slot_mapping = slot_mapping_fn

    @classmethod
    def for_model(cls, w, num_blocks: int | None = None, block_size: int = 16, *, manager=None, **kw) -> "PagedKVCache":
        """A cache with the geometry of ``w`` (any model's weights): on ``manager``, or on a fresh
        :class:`BlockManager` of ``num_blocks`` blocks; on ``w``'s device and in its dtype unless ``device=`` /
        ``dtype=`` say otherwise."""
        manager_kw = {k: kw.pop(k) for k in ("watermark", "grow_fn", "allocator") if k in kw}
        if manager is None:
            if num_blocks is None:
                raise ValueError("give num_blocks (or a manager)")
            manager = BlockManager(num_blocks, block_size, max_seq_len=w.max_positions, **manager_kw)
        kw.setdefault("dtype", w.dtype)
        kw.setdefault("device", w.device)
        return cls(w.num_layers, w.num_kv_heads, w.head_dim, manager, **kw)

    # ---- what the format keeps --------------------------------------------------------------------------------
    @property
    def k_cache(self) -> list[torch.Tensor]:
        return self.format.k_cache

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return self.format.v_cache

    @property
    def slot_tensors(self) -> tuple[SlotTensors, ...]:
        """Everything this cache keeps per slot, named once: every path that moves blocks moves each of these."""
        return self.format.slot_tensors

    def save_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        """A copy of ``blocks``' contents, every kind and layer (a step about to overwrite them keeps it)."""
        return save_blocks(self.slot_tensors, blocks)

    def restore_blocks(self, blocks: list[int], saved: list[torch.Tensor]) -> None:
        """Put :meth:`save_blocks`'s copy back (a refused step)."""
        restore_blocks(self.slot_tensors, blocks, saved)

    @property
    def bytes_per_block(self) -> int:
        return self.format.bytes_per_block

    def allocated_bytes(self) -> int:
        """Bytes of every tensor this cache allocated: its capacity measured, not computed from a formula."""
        return self.format.allocated_bytes()

    # ---- the step -----------------------------------------------------------------------------------------------
    @property
    def metadata_needs(self) -> MetadataNeeds:
        """What this cache's ``write``/``attend`` read from the step's metadata (the backend's needs; a write kernel's
        int32 slots besides)."""
        needs = self.backend.metadata_needs()
        return replace(needs, int32_slots=True) if self.kernel_writes else needs

    def prepare(self, batch: StepBatch) -> None:
        """The step's metadata (:mod:`~lesson_utils.cache.paged_metadata`), built once for every layer. Allocates
        nothing: the scheduler reserved every slot this step writes (and made shared blocks writable) before the
        forward pass; a sequence without them is refused."""
        tables = self._tables(batch)
        device = self.k_cache[0].device
        batch.meta = build_paged_metadata(
            batch, tables, self.block_size, device, self.metadata_needs, self._slot_mapping
        )
        self.backend.adjust_metadata(batch, device)

    def _tables(self, batch: StepBatch) -> list[list[int]]:
        """Each sequence's blocks: from the step's plan (``batch.placements``: an engine's step reads no manager), or
        from the manager when the cache is driven by hand. A sequence without room for this step's tokens is
        refused: the scheduler reserves every slot a step writes before it runs."""
        tables = []
        for i, (sid, clen) in enumerate(zip(batch.seq_ids, batch.context_lens)):
            if batch.placements is not None:
                blocks = batch.placements[i].blocks
                have = "no blocks" if blocks is None else f"slots for {len(blocks) * self.block_size} tokens"
                room = 0 if blocks is None else len(blocks) * self.block_size
            else:
                table = self.manager.view.table_of(sid)
                blocks = None if table is None else table.blocks
                have = "no blocks" if table is None else f"slots for {table.num_tokens} tokens"
                room = 0 if table is None else table.num_tokens
            if blocks is None or room < clen:
                raise ValueError(
                    f"sequence {sid} holds {have}, but this step writes its tokens up to position {clen - 1}: "
                    "reserve them first (the memory manager's allocate / append_slot, which the scheduler calls)"
                )
            tables.append(list(blocks))
        return tables

    def write(self, layer, batch, k, v):
        self.format.write(layer, batch, k, v, by_kernel=self.kernel_writes)

    def attend(self, layer, batch, q, scale):
        return self.backend.attend(self.format, layer, batch, q, scale)

    def gather_context(self, layer: int, table, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V ``[context_len, kv_heads, d]`` through its table, in the model's dtype."""
        return self.format.gather(layer, table, context_len, self.backend.gather)

    # A swap moves all its blocks, K and V of every layer, in ONE host-device copy through a pinned staging
    # buffer: gather on the device (pack_blocks, lesson 09's packing too), one asynchronous copy, scatter on the
    # other side. Per layer (or per block) copies through pageable memory would each wait for the GPU and pay
    # PCIe's fixed cost again.
    def swap_out(self, copies: list[tuple[int, int]], host) -> None:
        """Copy ``(gpu, cpu)`` blocks into ``host`` (lesson 06: a :class:`~lesson_utils.cache.host_blocks.HostBlocks`),
        every kind of per-slot data: one device-to-host copy and one wait per kind (the host must not read the
        staging buffer before the data has landed)."""
        if copies:
            host.check_kinds(self.slot_tensors)
            for kind, tensor in zip(self.slot_tensors, host.tensors):
                swap_out_blocks(kind.k, kind.v, copies, tensor)

    def swap_in(self, copies: list[tuple[int, int]], host) -> None:
        """Copy ``(cpu, gpu)`` blocks back from ``host`` (lesson 06), every kind: one host-to-device copy from pinned
        memory per kind, queued on the GPU's stream; nothing waits (PyTorch keeps the pinned buffer alive until it
        is read)."""
        if copies:
            host.check_kinds(self.slot_tensors)
            for kind, tensor in zip(self.slot_tensors, host.tensors):
                swap_in_blocks(kind.k, kind.v, copies, tensor)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's contents, every kind and layer (copy-on-write's data movement)."""
        for kind in self.slot_tensors:
            for kc, vc in zip(kind.k, kind.v):
                kc[dst].copy_(kc[src])
                vc[dst].copy_(vc[src])

    def free(self, seq_id: int) -> None:
        self.manager.free(seq_id)
