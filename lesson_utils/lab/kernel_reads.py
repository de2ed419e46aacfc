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
import functools
import inspect
import os

import numpy as np
import torch


@contextlib.contextmanager
def count_reads(*tensors: torch.Tensor):
    """Yield one int64 array per tensor (its shape), counting the kernel loads of each of its elements.

    How: ``tl.load`` - Triton's public function, whose signature (``pointer, mask=None, other=None, ...``) every
    Triton from 3.0 to today shares - is wrapped for the duration; the wrapper lets the load run as before, then adds
    one to every element it fetched that lies in one of ``tensors`` (the masked-out lanes read nothing). The
    interpreter calls the wrapper as it calls any builtin (``functools.wraps`` carries the builtin mark), and the
    one thing read from the interpreter is that a pointer tensor holds its addresses in ``.handle.data``. No private
    method of the interpreter is replaced, so a change in their signatures (Triton 3.6 and 3.9 differ) cannot break
    the count. Masked and unmasked loads count alike."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "count_reads needs Triton's interpreter (TRITON_INTERPRET=1): it watches the interpreter's loads"
        )
    import triton.language as tl

    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("count_reads watches contiguous CPU tensors only")
    counts = [np.zeros(t.numel(), dtype=np.int64) for t in tensors]
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size()) for t in tensors]
    original = tl.load
    signature = inspect.signature(original)

    def record(pointer, mask) -> None:
        addresses = np.asarray(pointer.handle.data).astype(np.int64)
        if mask is None:
            mask = True
        handle = getattr(mask, "handle", None)  # a mask tensor, or a constant (True, a constexpr)
        taken = handle.data if handle is not None else getattr(mask, "value", mask)
        addresses, taken = np.broadcast_arrays(addresses, np.asarray(taken, dtype=bool))
        addresses = addresses[taken]
        for (lo, hi, size), count in zip(spans, counts):
            inside = addresses[(addresses >= lo) & (addresses < hi)]
            np.add.at(count, (inside - lo) // size, 1)

    @functools.wraps(original)  # keeps the builtin mark the interpreter looks for, and the public signature
    def counting_load(*args, **kwargs):
        result = original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        record(bound["pointer"], bound.get("mask"))
        return result

    modules = [m for m in (tl, tl.core) if getattr(m, "load", None) is original]
    for m in modules:
        m.load = counting_load
    try:
        yield [c.reshape(tuple(t.shape)) for c, t in zip(counts, tensors)]
    finally:
        for m in modules:
            m.load = original
