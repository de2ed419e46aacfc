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
        kw["batched_decode"] = True  # decode tokens always go to the kernel
        super().__init__(*args, **kw)
        self.variant = variant

    def prepare(self, batch):
        super().prepare(batch)
        device = self.k_cache[0].device
        batch.extra["slots_i32"] = batch.extra["slots"].to(device=device, dtype=torch.int32)
        decode = batch.extra["decode"]
        if decode:
            tables = [batch.extra["block_tables"][i] for i in decode]
            width = max(len(t) for t in tables)
            padded = [list(t) + [0] * (width - len(t)) for t in tables]  # built on the host, moved once
            batch.extra["block_tables_t"] = torch.tensor(padded, dtype=torch.int32, device=device)
            batch.extra["context_lens_t"] = batch.extra["decode_ctx"].to(torch.int32)

    # The kernels' own value checks read their inputs back from the GPU (a sync per call, three per layer);
    # here the slots and lengths come from host-side block tables the block manager keeps valid, so they are
    # skipped: the step stays free of syncs until the logits are read.
    def write(self, layer, batch, k, v):
        write_kv_to_cache(k, v, self.k_cache[layer], self.v_cache[layer], batch.extra["slots_i32"], validate=False)

    def attend_decodes(self, layer, batch, q, scale):
        return paged_attention_decode(
            q,
            self.k_cache[layer],
            self.v_cache[layer],
            batch.extra["block_tables_t"],
            batch.extra["context_lens_t"],
            scale,
            variant=self.variant,
            validate=False,
        )
