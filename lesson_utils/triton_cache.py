"""Lesson 04: the paged cache with Triton kernels as its attention backend.

Same memory layout and block manager as :class:`~lesson_utils.paged_cache.PagedKVCache` (lesson 03); two
things change:

* new K/V are stored by :func:`~lesson_utils.kernels.write_kv_to_cache` (one kernel launch per layer);
* decode tokens (one new token of a sequence) attend through
  :func:`~lesson_utils.kernels.paged_attention_decode`, which reads K/V block by block via the block
  table instead of gathering a contiguous copy. Prefill tokens still use the gather (prefill attention is
  compute-bound and is not this lesson's subject).
"""

from __future__ import annotations

import torch

from .kernels import paged_attention_decode, write_kv_to_cache
from .paged_cache import PagedKVCache


class TritonPagedKVCache(PagedKVCache):
    def __init__(self, *args, variant: str = "tiled", **kw):
        super().__init__(*args, **kw)
        self.variant = variant

    def prepare(self, batch):
        super().prepare(batch)
        device = self.k_cache[0].device
        tables = batch.extra["block_tables"]
        width = max(len(t) for t in tables)
        padded = torch.zeros((len(tables), width), dtype=torch.int32)
        for i, t in enumerate(tables):
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        batch.extra["block_tables_t"] = padded.to(device)
        batch.extra["context_lens_t"] = torch.tensor(batch.context_lens, dtype=torch.int32, device=device)
        batch.extra["slots_i32"] = batch.extra["slots"].to(device=device, dtype=torch.int32)
        batch.extra["decode"] = [i for i, n in enumerate(batch.query_lens) if n == 1]

    def write(self, layer, batch, k, v):
        write_kv_to_cache(k, v, self.k_cache[layer], self.v_cache[layer], batch.extra["slots_i32"])

    def attend(self, layer, batch, q, scale):
        decode = batch.extra["decode"]
        if len(decode) < len(batch.seq_ids):  # some sequences are prefilling: the gather path serves them
            out = super().attend(layer, batch, q, scale)
        else:
            out = torch.empty_like(q)
        if decode:
            rows = torch.tensor([batch.starts[i] for i in decode], device=q.device)
            sel = torch.tensor(decode, device=q.device)
            out[rows] = paged_attention_decode(
                q[rows], self.k_cache[layer], self.v_cache[layer],
                batch.extra["block_tables_t"][sel], batch.extra["context_lens_t"][sel], scale,
                variant=self.variant,
            )
        return out
