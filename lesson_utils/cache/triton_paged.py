"""Lessons 04 and 08: the paged cache with Triton kernels as its attention backend.

Same memory layout and block manager as :class:`~lesson_utils.cache.paged.PagedKVCache` (lesson 03); two
things change:

* new K/V are stored by :func:`~lesson_utils.kernels.paged_attention.write_kv_to_cache` (one kernel launch per layer);
* decode tokens (one new token of a sequence) attend through
  :func:`~lesson_utils.kernels.paged_attention.paged_attention_decode`, which reads K/V block by block via the block
  table instead of gathering a contiguous copy. Prefill tokens still use the gather (prefill attention is
  compute-bound and is not this lesson's subject).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.cache.seam import AttentionMetadata
from lesson_utils.host_copy import to_device
from lesson_utils.kernels.paged_attention import paged_attention_decode, write_kv_to_cache
from lesson_utils.kernels.unified_attention import unified_attention


@dataclass
class TritonMetadata(AttentionMetadata):
    """The paged cache's step metadata, plus what the kernels take: int32 slots and, for the decoding
    sequences, their block tables padded into one int32 tensor and their context lengths as int32."""

    slots_i32: torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None


class TritonPagedKVCache(PagedKVCache):
    def __init__(self, *args, variant: str = "tiled", **kw):
        kw["batched_decode"] = True  # decode tokens always go to the kernel
        super().__init__(*args, **kw)
        self.variant = variant

    def prepare(self, batch):
        super().prepare(batch)
        device = self.k_cache[0].device
        meta = TritonMetadata(**vars(batch.meta), slots_i32=batch.meta.slots.to(device=device, dtype=torch.int32))
        if meta.decode:
            tables = [meta.block_tables[i] for i in meta.decode.indices]
            width = max(len(t) for t in tables)
            padded = [list(t) + [0] * (width - len(t)) for t in tables]  # built on the host, moved once
            meta.decode_tables = to_device(padded, torch.int32, device)
            meta.decode_lens = meta.decode.context_lens.to(torch.int32)
        batch.meta = meta

    # The kernels' own value checks read their inputs back from the GPU (one sync per call); here the slots
    # and lengths come from host-side block tables the block manager keeps valid, so they are skipped: the
    # step stays free of syncs until the logits are read.
    def write(self, layer, batch, k, v):
        write_kv_to_cache(k, v, self.k_cache[layer], self.v_cache[layer], batch.meta.slots_i32, validate=False)

    def attend_decodes(self, layer, batch, q, scale):
        return paged_attention_decode(
            q,
            self.k_cache[layer],
            self.v_cache[layer],
            batch.meta.decode_tables,
            batch.meta.decode_lens,
            scale,
            variant=self.variant,
            validate=False,
        )


@dataclass
class UnifiedMetadata(AttentionMetadata):
    """What lesson 08's unified kernel takes for the whole step, built on the host and moved once: int32 slots,
    every sequence's block table padded into one tensor, the query offsets and the context lengths."""

    slots_i32: torch.Tensor | None = None
    padded_tables: torch.Tensor | None = None
    query_start: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_query_len: int = 0


class UnifiedTritonKVCache(PagedKVCache):
    """Lesson 08: the paged cache with ONE attention launch per layer for the whole step - prefill chunks and
    decodes alike - through :func:`~lesson_utils.kernels.unified_attention.unified_attention`."""

    def __init__(self, *args, mask_fn=None, **kw):
        kw["batched_decode"] = False  # no separate decode path: every row goes to the one kernel
        super().__init__(*args, **kw)
        self.mask_fn = mask_fn

    def prepare(self, batch):
        super().prepare(batch)
        device = self.k_cache[0].device
        tables = batch.meta.block_tables
        width = max((len(t) for t in tables), default=1)
        starts = [0]
        for n in batch.query_lens:
            starts.append(starts[-1] + n)
        batch.meta = UnifiedMetadata(
            **vars(batch.meta),
            slots_i32=batch.meta.slots.to(device=device, dtype=torch.int32),
            padded_tables=to_device([list(t) + [0] * (width - len(t)) for t in tables], torch.int32, device),
            query_start=to_device(starts, torch.int32, device),
            context_lens=to_device(batch.context_lens, torch.int32, device),
            max_query_len=max(batch.query_lens, default=0),
        )

    def write(self, layer, batch, k, v):
        write_kv_to_cache(k, v, self.k_cache[layer], self.v_cache[layer], batch.meta.slots_i32, validate=False)

    def attend(self, layer, batch, q, scale):
        meta = batch.meta
        return unified_attention(
            q,
            self.k_cache[layer],
            self.v_cache[layer],
            meta.padded_tables,
            meta.query_start,
            meta.context_lens,
            meta.max_query_len,
            scale,
            mask_fn=self.mask_fn,
            validate=False,
        )
