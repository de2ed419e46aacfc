"""Lesson 10: the paged KV cache in int8, with one fp32 scale per token and head beside the blocks.

Same block manager, block tables and slot mapping as lesson 03's :class:`~lesson_utils.cache.paged.PagedKVCache`;
what changes is what a slot holds. Per layer:

* ``k_cache[layer]``, ``v_cache[layer]``: int8 ``[num_blocks, block_size, num_kv_heads, head_dim]``;
* ``k_scale[layer]``, ``v_scale[layer]``: float32 ``[num_blocks, block_size, num_kv_heads]``, indexed by the same
  slots: a block's scales move with its values (copy-on-write, swap) wherever the values go.

Invariant: for every written slot, ``v_cache[slot] * v_scale[slot]`` is :func:`~lesson_utils.cache.quantize.
quantize_kv`'s round trip of the V written there (K alike); the values are never changed in place afterwards.

``write`` quantizes (``quantize_fn``: the course's, or a learner's exercise 10-1, which then writes on the kernel
path too, where the course's own quantizer is the Triton write kernel) and refuses a non-finite vector naming the
layer and slot. That check reads one flag per layer back from the device, so it is on by default only
off the kernel path (a CPU); on a GPU it would be a wait per layer, and there a NaN is caught one step later
instead, when the engine reads the logits (``sampling.next_tokens`` refuses non-finite rows, naming the sequence,
in the read it makes anyway). ``check_finite=True`` restores the per-layer check anywhere. ``attend`` dequantizes what it gathers and
attends as lesson 03 does; with ``use_kernels`` (on by default on a GPU) new K/V are quantized by
:func:`~lesson_utils.kernels.int8_kv.write_int8_kv_to_cache` and decodes read the int8 blocks directly through
lesson 04's kernel with the int8 tile loader.
"""

from __future__ import annotations

from typing import Callable

import torch

from lesson_utils.cache.attention import gather_kv
from lesson_utils.cache.block_copy import SlotTensors
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.cache.paged_metadata import MetadataNeeds
from lesson_utils.cache.quantize import KVQuantError, dequantize_kv, quantize_finite_kv, quantize_kv
from lesson_utils.core.device_discipline import acts_as_gpu
from lesson_utils.kernels.int8_kv import int8_paged_attention_decode, write_int8_kv_to_cache


class Int8PagedKVCache(PagedKVCache):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        manager,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        quantize_fn: Callable = quantize_kv,
        use_kernels: bool | None = None,
        load_fn=None,
        check_finite: bool | None = None,
    ):
        super().__init__(num_layers, num_kv_heads, head_dim, manager, dtype=torch.int8, device=device)
        self.compute_dtype = dtype  # what attention computes in: the model's dtype
        shape = (manager.num_blocks, manager.block_size, num_kv_heads)
        self.k_scale = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.quantize_fn = quantize_fn
        self.use_kernels = acts_as_gpu(device) if use_kernels is None else use_kernels
        self.batched_decode = self.use_kernels  # decodes go to the kernel together; else one by one
        self.load_fn = load_fn
        # the check reads a flag back every layer: free on a CPU, a wait per layer on a GPU (where a NaN still
        # cannot pass silently: the engine refuses non-finite logits in the read it makes anyway)
        self.check_finite = not self.use_kernels if check_finite is None else check_finite

    @property
    def bytes_per_block(self) -> int:
        """K and V values (1 byte each) and their scales (4 bytes per token and head), every layer."""
        k, s = self.k_cache[0], self.k_scale[0]
        return 2 * len(self.k_cache) * (k[0].numel() * k.element_size() + s[0].numel() * s.element_size())

    def allocated_bytes(self) -> int:
        """The values' bytes (lesson 03's count) and the scales' beside them."""
        return super().allocated_bytes() + sum(t.numel() * t.element_size() for t in self.k_scale + self.v_scale)

    @property
    def metadata_needs(self) -> MetadataNeeds:
        if self.use_kernels:
            return MetadataNeeds(decode="kernel", int32_slots=True)
        return MetadataNeeds(table_ids=self._gather is gather_kv)

    @property
    def slot_tensors(self) -> tuple[SlotTensors, ...]:
        """The int8 values, and their scales as ``[num_blocks, block_size, kv_heads, 1]`` views: every path that
        moves blocks (copy-on-write, swap, the hand-over, a refused step's restore) moves the scales with them."""
        return super().slot_tensors + (
            SlotTensors("scales", [s.unsqueeze(-1) for s in self.k_scale], [s.unsqueeze(-1) for s in self.v_scale]),
        )

    def write(self, layer, batch, k, v):
        if self.check_finite:
            self._refuse_non_finite(layer, batch, k, v)
        if self.use_kernels and self.quantize_fn is quantize_kv:  # a learner's quantizer writes on every path
            write_int8_kv_to_cache(
                k, v, self.k_cache[layer], self.v_cache[layer], self.k_scale[layer], self.v_scale[layer],
                batch.meta.slots_i32, validate=False,
            )  # fmt: skip
            return
        # the course's quantizer checks finiteness itself; skip that second pass when this layer was just checked
        quantize = quantize_finite_kv if self.quantize_fn is quantize_kv and self.check_finite else self.quantize_fn
        slots = batch.meta.slots
        for values, cache, scales in ((k, self.k_cache, self.k_scale), (v, self.v_cache, self.v_scale)):
            q, s = quantize(values)
            c = cache[layer]
            c.view(-1, c.shape[2], c.shape[3])[slots] = q
            scales[layer].view(-1, c.shape[2])[slots] = s

    def _refuse_non_finite(self, layer, batch, k, v) -> None:
        bad = ~(torch.isfinite(k).all(dim=(1, 2)) & torch.isfinite(v).all(dim=(1, 2)))
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            seq = next(i for i, (s, n) in enumerate(zip(batch.starts, batch.query_lens)) if s <= row < s + n)
            pos = batch.context_lens[seq] - batch.query_lens[seq] + row - batch.starts[seq]
            raise KVQuantError(
                f"layer {layer}: the K/V of sequence {batch.seq_ids[seq]}'s token at position {pos} (cache slot "
                f"{int(batch.meta.slots[row])}) holds NaN or inf; int8 with a scale cannot store it, and a NaN scale "
                "would poison every later step of this sequence. Nothing was written for this layer."
            )

    def gather_context(self, layer, table, context_len):
        """One sequence's K and V through its table, dequantized into the model's dtype (lesson 03's loop reads these)."""
        k = self._gather(self.k_cache[layer], table, context_len)
        v = self._gather(self.v_cache[layer], table, context_len)
        ks = self._gather(self.k_scale[layer].unsqueeze(-1), table, context_len)[..., 0]
        vs = self._gather(self.v_scale[layer].unsqueeze(-1), table, context_len)[..., 0]
        return dequantize_kv(k, ks, self.compute_dtype), dequantize_kv(v, vs, self.compute_dtype)

    def attend_decodes(self, layer, batch, q, scale):
        """The decoding sequences together through lesson 04's kernel with the int8 tile loader (``use_kernels``)."""
        meta = batch.meta
        return int8_paged_attention_decode(
            q, self.k_cache[layer], self.v_cache[layer], self.k_scale[layer], self.v_scale[layer],
            meta.decode_tables, meta.decode_lens, scale, load_fn=self.load_fn, validate=False,
        )  # fmt: skip
