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

from lesson_utils.cache.backends import DecodeKernelBackend, GatherBackend
from lesson_utils.cache.formats import Int8Format
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.device_discipline import acts_as_gpu


class Int8PagedKVCache(PagedKVCache):
    """A preset: :class:`~lesson_utils.cache.formats.Int8Format` with lesson 04's decode-kernel backend where
    ``use_kernels`` (a GPU by default), else lesson 03's gather one sequence at a time. ``quantize_fn``: a learner's
    exercise 10-1 (None: the course's rule); ``load_fn``: a learner's exercise 10-3 tile loader; ``check_finite``: the
    per-layer NaN check (default: where there are no kernels)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        manager,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        quantize_fn: Callable | None = None,
        use_kernels: bool | None = None,
        load_fn=None,
        check_finite: bool | None = None,
        backend=None,
    ):
        use_kernels = acts_as_gpu(device) if use_kernels is None else use_kernels
        # the check reads a flag back every layer: free on a CPU, a wait per layer on a GPU (where a NaN still
        # cannot pass silently: the engine refuses non-finite logits in the read it makes anyway)
        check_finite = not use_kernels if check_finite is None else check_finite
        fmt = Int8Format(dtype, quantize_fn=quantize_fn, load_fn=load_fn, check_finite=check_finite)
        if backend is None:
            backend = DecodeKernelBackend() if use_kernels else GatherBackend(batched_decode=False)
        super().__init__(num_layers, num_kv_heads, head_dim, manager, device=device, format=fmt, backend=backend)

    @property
    def use_kernels(self) -> bool:
        return self.kernel_writes

    @property
    def k_scale(self) -> list[torch.Tensor]:
        return self.format.k_scale

    @property
    def v_scale(self) -> list[torch.Tensor]:
        return self.format.v_scale

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.format.compute_dtype

    @property
    def check_finite(self) -> bool:
        return self.format.check_finite

    @check_finite.setter
    def check_finite(self, value: bool) -> None:
        self.format.check_finite = value

    @property
    def quantize_fn(self) -> Callable | None:
        return self.format.quantize_fn

    @quantize_fn.setter
    def quantize_fn(self, fn: Callable | None) -> None:
        self.format.quantize_fn = fn
