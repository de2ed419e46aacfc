"""How a paged cache stores K/V in its slots: a **format** (one axis of a paged cache; the attention backend is the
other, :mod:`~lesson_utils.cache.backends`).

A format owns everything that depends on what a slot holds:

* its per-slot tensors, every layer, named once (:attr:`slot_tensors`: K/V values, and scales where it has them) -
  every path that moves blocks (copy-on-write, swap, the hand-over, a refused step's restore) moves that list;
* ``write``: storing a step's new K/V (quantizing where it quantizes; by a Triton kernel where it has one and the
  cache's configuration asks for kernels);
* ``gather`` and ``gather_slots``: reading K/V back in the model's dtype (dequantizing where it quantizes);
* :meth:`kernel_operands`: what the Triton kernels read - the value tensors, the scales and the tile loader that turns
  a tile into fp32 (lesson 04's ``load_tile``, lesson 10's ``load_int8_tile``);
* its bytes: per block (a formula) and allocated (measured on the tensors).

Two formats: :class:`FloatFormat` (fp16/fp32 values, lessons 03-08) and :class:`Int8Format` (int8 values with an fp32
scale per token and head, lesson 10). A new format (fp8, say) is one class here; every backend serves it unchanged -
``tests/cache/test_cache_composition.py`` adds an fp8 one in the test and serves it by all four backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lesson_utils.cache.attention import gather_kv
from lesson_utils.cache.block_copy import SlotTensors
from lesson_utils.cache.quantize import KVQuantError, dequantize_kv, quantize_finite_kv
from lesson_utils.kernels.int8_kv import load_int8_tile, write_int8_kv_to_cache
from lesson_utils.kernels.paged_attention import write_kv_to_cache


@dataclass(frozen=True)
class KernelOperands:
    """What a Triton attention kernel reads of one layer: the value tensors, the scales beside them (None for a format
    without scales) and the ``@triton.jit`` tile loader (None: the kernels' own ``load_tile``)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None = None
    load_fn: object = None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A layer's ``[num_blocks, block_size, ...]`` tensor viewed as ``[num_slots, ...]``."""
    return t.view(-1, *t.shape[2:])


class FloatFormat:
    """K and V as floats of ``dtype`` (the model's, unless told otherwise): ``k_cache[layer]`` and ``v_cache[layer]``
    ``[num_blocks, block_size, num_kv_heads, head_dim]``. Written by lesson 04's write kernel when the cache uses
    kernels, else by one indexed assignment per layer."""

    name = "fp"

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.compute_dtype = dtype

    def allocate(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device) -> None:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]

    @property
    def slot_tensors(self) -> tuple[SlotTensors, ...]:
        return (SlotTensors("K/V", self.k_cache, self.v_cache),)

    def write(self, layer: int, batch, k: torch.Tensor, v: torch.Tensor, *, by_kernel: bool) -> None:
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if by_kernel:  # (its value checks read back from the GPU: the slots come from valid host-side tables)
            write_kv_to_cache(k, v, kc, vc, batch.meta.slots_i32, validate=False)
            return
        slots = batch.meta.slots
        _flat(kc)[slots] = k.to(kc.dtype)
        _flat(vc)[slots] = v.to(vc.dtype)

    def gather(self, layer: int, table, context_len: int, gather: Callable = gather_kv):
        """One sequence's K and V ``[context_len, kv_heads, d]`` through its table."""
        return gather(self.k_cache[layer], table, context_len), gather(self.v_cache[layer], table, context_len)

    def gather_slots(self, layer: int, slot_index: torch.Tensor):
        """K and V at ``slot_index`` (``[n, max_ctx]`` slots) in the model's dtype: the batched decode's gather."""
        return _flat(self.k_cache[layer])[slot_index], _flat(self.v_cache[layer])[slot_index]

    def kernel_operands(self, layer: int) -> KernelOperands:
        return KernelOperands(self.k_cache[layer], self.v_cache[layer])

    @property
    def bytes_per_block(self) -> int:
        k = self.k_cache[0]
        return 2 * len(self.k_cache) * k[0].numel() * k.element_size()

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kind in self.slot_tensors for t in kind.k + kind.v)


class ScaledFormat(FloatFormat):
    """Values of a narrow ``storage`` dtype with one fp32 scale per token and head beside them, read back in the model's
    dtype (``compute_dtype``): ``k_scale[layer]``, ``v_scale[layer]`` ``[num_blocks, block_size, num_kv_heads]``,
    indexed by the same slots, so a block's scales move wherever its values go.

    Invariant: for every written slot, ``values[slot] * scale[slot]`` is ``quantize``'s round trip of the vector written
    there; nothing changes it in place afterwards. Subclasses say how to ``quantize`` (and may have a write kernel)."""

    storage: torch.dtype
    tile_loader = load_int8_tile  # the kernels' @triton.jit tile loader: a tile's values x each token's scale, in fp32

    def __init__(self, compute_dtype: torch.dtype = torch.float32, *, load_fn=None, check_finite: bool = True):
        super().__init__(self.storage)
        self.compute_dtype = compute_dtype
        self.load_fn = load_fn  # a learner's @triton.jit tile loader (None: the format's own)
        self.check_finite = check_finite

    def allocate(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device) -> None:
        super().allocate(num_layers, num_blocks, block_size, kv_heads, head_dim, device)
        shape = (num_blocks, block_size, kv_heads)
        self.k_scale = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(num_layers)]

    @property
    def slot_tensors(self) -> tuple[SlotTensors, ...]:
        """The values, and their scales as ``[num_blocks, block_size, kv_heads, 1]`` views."""
        return super().slot_tensors + (
            SlotTensors("scales", [s.unsqueeze(-1) for s in self.k_scale], [s.unsqueeze(-1) for s in self.v_scale]),
        )

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[tokens, kv_heads, d]`` -> values of the storage dtype and fp32 scales ``[tokens, kv_heads]``."""
        raise NotImplementedError

    def write(self, layer: int, batch, k: torch.Tensor, v: torch.Tensor, *, by_kernel: bool) -> None:
        if self.check_finite:
            self.refuse_non_finite(layer, batch, k, v)
        slots = batch.meta.slots
        for values, cache, scales in ((k, self.k_cache, self.k_scale), (v, self.v_cache, self.v_scale)):
            q, s = self.quantize(values)
            _flat(cache[layer])[slots] = q
            _flat(scales[layer])[slots] = s

    def refuse_non_finite(self, layer: int, batch, k: torch.Tensor, v: torch.Tensor) -> None:
        """A NaN or inf in this layer's new K/V, named by sequence, position and slot; nothing is written then. The
        check reads one flag back from the device (free on a CPU, a wait per layer on a GPU)."""
        bad = ~(torch.isfinite(k).all(dim=(1, 2)) & torch.isfinite(v).all(dim=(1, 2)))
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            seq = next(i for i, (s, n) in enumerate(zip(batch.starts, batch.query_lens)) if s <= row < s + n)
            pos = batch.context_lens[seq] - batch.query_lens[seq] + row - batch.starts[seq]
            raise KVQuantError(
                f"layer {layer}: the K/V of sequence {batch.seq_ids[seq]}'s token at position {pos} (cache slot "
                f"{int(batch.meta.slots[row])}) holds NaN or inf; {self.name} with a scale cannot store it, and a NaN "
                "scale would poison every later step of this sequence. Nothing was written for this layer."
            )

    def gather(self, layer: int, table, context_len: int, gather: Callable = gather_kv):
        """One sequence's K and V through its table, dequantized into the model's dtype."""
        out = []
        for cache, scales in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale)):
            values = gather(cache[layer], table, context_len)
            s = gather(scales[layer].unsqueeze(-1), table, context_len)[..., 0]
            out.append(dequantize_kv(values, s, self.compute_dtype))
        return tuple(out)

    def gather_slots(self, layer: int, slot_index: torch.Tensor):
        return tuple(
            dequantize_kv(_flat(cache[layer])[slot_index], _flat(scales[layer])[slot_index], self.compute_dtype)
            for cache, scales in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale))
        )

    def kernel_operands(self, layer: int) -> KernelOperands:
        return KernelOperands(
            self.k_cache[layer],
            self.v_cache[layer],
            (self.k_scale[layer], self.v_scale[layer]),
            self.tile_loader if self.load_fn is None else self.load_fn,
        )

    @property
    def bytes_per_block(self) -> int:
        """The values' bytes and their scales' (4 bytes per token and head), every layer."""
        k, s = self.k_cache[0], self.k_scale[0]
        return 2 * len(self.k_cache) * (k[0].numel() * k.element_size() + s[0].numel() * s.element_size())


class Int8Format(ScaledFormat):
    """Lesson 10: int8 values, one fp32 scale per token and head (:func:`~lesson_utils.cache.quantize.quantize_kv`).

    ``quantize_fn``: None for the course's rule - then a cache that uses kernels writes with the Triton quantizing
    write kernel - or a learner's exercise 10-1, which then writes on every path (the kernel is the course's rule, so
    it never stands in for the learner's). ``check_finite``: refuse NaN/inf per layer (see :meth:`refuse_non_finite`)."""

    name = "int8"
    storage = torch.int8

    def __init__(self, compute_dtype=torch.float32, *, quantize_fn: Callable | None = None, load_fn=None,
                 check_finite: bool = True):  # fmt: skip
        super().__init__(compute_dtype, load_fn=load_fn, check_finite=check_finite)
        self.quantize_fn = quantize_fn

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quantize_fn is not None:
            return self.quantize_fn(x)
        # without its own finiteness check (a read-back): ``write`` has checked the layer already (check_finite), or
        # the check is off because it would wait for the GPU every layer - a NaN is then refused when the engine
        # reads the logits, in the read it makes anyway
        return quantize_finite_kv(x)

    def write(self, layer: int, batch, k: torch.Tensor, v: torch.Tensor, *, by_kernel: bool) -> None:
        if by_kernel and self.quantize_fn is None:
            if self.check_finite:
                self.refuse_non_finite(layer, batch, k, v)
            write_int8_kv_to_cache(
                k, v, self.k_cache[layer], self.v_cache[layer], self.k_scale[layer], self.v_scale[layer],
                batch.meta.slots_i32, validate=False,
            )  # fmt: skip
            return
        super().write(layer, batch, k, v, by_kernel=False)
