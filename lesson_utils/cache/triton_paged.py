"""Lessons 04 and 08: the paged cache with Triton kernels as its attention backend - presets of
:class:`~lesson_utils.cache.paged.PagedKVCache` (floats, as lesson 03's) with another backend.

* :class:`TritonPagedKVCache` (lesson 04): new K/V stored by :func:`~lesson_utils.kernels.paged_attention.
  write_kv_to_cache` (one kernel launch per layer); decode tokens attend through :func:`~lesson_utils.kernels.
  paged_attention.paged_attention_decode`, which reads K/V block by block via the block table instead of gathering a
  contiguous copy. Prefill tokens still use the gather (prefill attention is compute-bound and is not this lesson's
  subject) - :class:`~lesson_utils.cache.backends.DecodeKernelBackend`.
* :class:`UnifiedTritonKVCache` (lesson 08): ONE attention launch per layer for the whole step - prefill chunks and
  decodes alike - through :func:`~lesson_utils.kernels.unified_attention.unified_attention`
  (:class:`~lesson_utils.cache.backends.UnifiedKernelBackend`).
"""

from __future__ import annotations

from lesson_utils.cache.backends import DecodeKernelBackend, UnifiedKernelBackend
from lesson_utils.cache.paged import PagedKVCache


class TritonPagedKVCache(PagedKVCache):
    def __init__(self, *args, variant: str = "tiled", **kw):
        super().__init__(*args, backend=DecodeKernelBackend(variant), **kw)

    @property
    def variant(self) -> str:
        return self.backend.variant


class UnifiedTritonKVCache(PagedKVCache):
    """Lesson 08: the paged cache with ONE attention launch per layer for the whole step. ``mask_fn``: a learner's
    causal mask (exercise 08-2); ``metadata_fn``: a learner's ``step_metadata(chunks, device) -> (query_start,
    context_lens, max_query_len)`` (exercise 08-3)."""

    def __init__(self, *args, mask_fn=None, metadata_fn=None, **kw):
        super().__init__(*args, backend=UnifiedKernelBackend(mask_fn, metadata_fn), **kw)
