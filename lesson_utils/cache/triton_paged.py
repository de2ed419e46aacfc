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

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.cache.paged_metadata import MetadataNeeds, chunks_of
from lesson_utils.kernels.paged_attention import paged_attention_decode, write_kv_to_cache
from lesson_utils.kernels.unified_attention import unified_attention


class TritonPagedKVCache(PagedKVCache):
    def __init__(self, *args, variant: str = "tiled", **kw):
        kw["batched_decode"] = True  # decode tokens always go to the kernel
        super().__init__(*args, **kw)
        self.variant = variant

    @property
    def metadata_needs(self) -> MetadataNeeds:
        return MetadataNeeds(decode="kernel", int32_slots=True)

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


class UnifiedTritonKVCache(PagedKVCache):
    """Lesson 08: the paged cache with ONE attention launch per layer for the whole step - prefill chunks and
    decodes alike - through :func:`~lesson_utils.kernels.unified_attention.unified_attention`."""

    def __init__(self, *args, mask_fn=None, metadata_fn=None, **kw):
        kw["batched_decode"] = False  # no separate decode path: every row goes to the one kernel
        super().__init__(*args, **kw)
        self.mask_fn = mask_fn
        # exercise 08-3: a learner's step_metadata(chunks, device) -> (query_start, context_lens, max_query_len)
        self.metadata_fn = metadata_fn

    def prepare(self, batch) -> None:
        super().prepare(batch)
        if self.metadata_fn is not None:
            meta = batch.meta
            meta.query_start, meta.context_lens, meta.max_query_len = self.metadata_fn(
                chunks_of(batch), self.k_cache[0].device
            )

    @property
    def metadata_needs(self) -> MetadataNeeds:
        return MetadataNeeds(table_ids=False, int32_slots=True, whole_step=True)

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
