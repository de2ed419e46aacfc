"""Counting what a Triton kernel reads, element by element, in Triton's interpreter (CPU only).

``with count_reads(k_cache, v_cache) as reads: kernel(...)`` records every masked-in element each ``tl.load``
of the kernel fetched from those tensors' memory; ``reads[0]`` is then an int array shaped like ``k_cache``: how
many times each element was loaded. Lesson 04 uses it to show that a grouped-query kernel loads each K/V element
of a sequence's context once per KV head - not once per query head - and the tests use it to hold the kernels to
that. It counts loads, not DRAM traffic: a GPU's caches may serve a repeated load without DRAM, but the kernel
cannot count on that, and on a T4 its 4 MB L2 cache holds a few thousand tokens of one layer at best.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch


@contextlib.contextmanager
def count_reads(*tensors: torch.Tensor):
    """Yield one int64 array per tensor (its shape), counting the kernel loads of each of its elements."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "count_reads needs Triton's interpreter (TRITON_INTERPRET=1): it watches the interpreter's loads"
        )
    from triton.runtime import interpreter

    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("count_reads watches contiguous CPU tensors only")
    counts = [np.zeros(t.numel(), dtype=np.int64) for t in tensors]
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size()) for t in tensors]
    builder = interpreter.InterpreterBuilder
    original = builder.create_masked_load

    def counting_load(self, ptrs, mask, other, cache_policy, is_volatile):
        addresses = np.asarray(ptrs.data, dtype=np.int64)[np.asarray(mask.data, dtype=bool)]
        for (lo, hi, size), count in zip(spans, counts):
            inside = addresses[(addresses >= lo) & (addresses < hi)]
            np.add.at(count, (inside - lo) // size, 1)
        return original(self, ptrs, mask, other, cache_policy, is_volatile)

    builder.create_masked_load = counting_load
    try:
        yield [c.reshape(tuple(t.shape)) for c, t in zip(counts, tensors)]
    finally:
        builder.create_masked_load = original
