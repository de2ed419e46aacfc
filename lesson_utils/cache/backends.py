"""How a paged cache computes attention over its slots: an **attention backend** (one axis of a paged cache; the
storage format is the other, :mod:`~lesson_utils.cache.formats`).

A backend owns what depends on how attention is computed: the step metadata it reads (:class:`MetadataNeeds`, built
once per step by :mod:`~lesson_utils.cache.paged_metadata`), whether new K/V are written by a kernel, and ``attend``.
It reads K/V only through the format (``gather``, ``gather_slots``, ``kernel_operands``), so every backend serves every
format:

* :class:`GatherBackend` - lesson 03: each sequence's K/V gathered through its table, then fused attention; with
  ``batched_decode`` the decoding sequences are served together through one padded gather (the GPU's better trade);
* :class:`DecodeKernelBackend` - lesson 04: decodes through the paged decode kernel (a tile of K/V at a time, block by
  block), prompts through the gather;
* :class:`UnifiedKernelBackend` - lesson 08: one launch per layer for the whole step, prompt chunks and decodes.

A backend's fast paths are chosen by its configuration (a learner's function given or not), never by comparing a
function with the course's default.
"""

from __future__ import annotations

from typing import Callable

import torch

from lesson_utils.cache.attention import decode_attention_over, fused_attention_over_context, gather_kv
from lesson_utils.cache.paged_metadata import MetadataNeeds, chunks_of
from lesson_utils.kernels.paged_attention import paged_attention_decode
from lesson_utils.kernels.unified_attention import unified_attention


def _attend_each(
    fmt, layer: int, batch, q: torch.Tensor, scale: float, skip: set[int], gather: Callable
) -> torch.Tensor:
    """Every sequence not in ``skip``, one at a time: its K/V gathered through its table, then fused attention."""
    out = torch.empty_like(q)
    tables = batch.meta.table_ids or batch.meta.block_tables
    for i, (table, start, n, ctx) in enumerate(zip(tables, batch.starts, batch.query_lens, batch.context_lens)):
        if i not in skip:
            k, v = fmt.gather(layer, table, ctx, gather)
            out[start : start + n] = fused_attention_over_context(q[start : start + n], k, v, scale)
    return out


class _Backend:
    """What every backend answers (the cache asks each of them the same things, never probing for members)."""

    name = ""
    kernel_writes = False  # new K/V written by the format's write kernel
    gather: Callable = staticmethod(gather_kv)  # how a sequence's K/V are gathered where the backend gathers

    def bind(self, on_gpu: bool) -> None:
        """Settle what depends on the device (called once, when the cache is built)."""

    def metadata_needs(self) -> MetadataNeeds:
        raise NotImplementedError

    def adjust_metadata(self, batch, device) -> None:
        """After the step's metadata is built (lesson 08's exercise 3 replaces part of it)."""

    def attend(self, fmt, layer: int, batch, q: torch.Tensor, scale: float) -> torch.Tensor:
        raise NotImplementedError


class GatherBackend(_Backend):
    """Lesson 03's attention: gather, then attend. ``gather_fn``: a learner's gather (exercise 03-4), None for the
    course's - which is also what lets the step hand it each table as a device tensor and lets a GPU serve its decodes
    together. ``batched_decode``: serve the decoding sequences in one padded gather (default: on a GPU with the
    course's gather; one by one on a CPU, where the Python loop costs less than the padding)."""

    name = "gather"

    def __init__(self, gather_fn: Callable | None = None, batched_decode: bool | None = None):
        self.gather_fn = gather_fn
        self.batched_decode = batched_decode  # None: decided by the device when the cache is built

    def bind(self, on_gpu: bool) -> None:
        if self.batched_decode is None:
            self.batched_decode = self.gather_fn is None and on_gpu

    @property
    def gather(self) -> Callable:
        return gather_kv if self.gather_fn is None else self.gather_fn

    def metadata_needs(self) -> MetadataNeeds:
        return MetadataNeeds(decode="gather" if self.batched_decode else None, table_ids=self.gather_fn is None)

    def attend(self, fmt, layer: int, batch, q: torch.Tensor, scale: float) -> torch.Tensor:
        decode = batch.meta.decode
        out = _attend_each(fmt, layer, batch, q, scale, set(decode.indices) if decode else set(), self.gather)
        if decode:
            k, v = fmt.gather_slots(layer, decode.slot_index)
            out[decode.rows] = decode_attention_over(q[decode.rows], k, v, decode.context_lens, scale)
        return out


class DecodeKernelBackend(_Backend):
    """Lesson 04's attention: the decoding sequences through the paged decode kernel, which walks each block table a
    tile at a time (``variant``: "simple" or "tiled"); prompts through lesson 03's gather (prefill attention is
    compute-bound and not this lesson's subject). New K/V are written by the format's write kernel."""

    name = "decode kernel"
    kernel_writes = True

    def __init__(self, variant: str = "tiled"):
        self.variant = variant

    def metadata_needs(self) -> MetadataNeeds:
        return MetadataNeeds(decode="kernel", int32_slots=True)

    # The kernels' own value checks read their inputs back from the GPU (one sync per call); the slots and lengths
    # come from host-side block tables the block manager keeps valid, so they are skipped: the step stays free of
    # syncs until the logits are read.
    def attend(self, fmt, layer: int, batch, q: torch.Tensor, scale: float) -> torch.Tensor:
        meta = batch.meta
        decode = meta.decode
        out = _attend_each(fmt, layer, batch, q, scale, set(decode.indices) if decode else set(), gather_kv)
        if decode:
            ops = fmt.kernel_operands(layer)
            out[decode.rows] = paged_attention_decode(
                q[decode.rows], ops.k, ops.v, meta.decode_tables, meta.decode_lens, scale, variant=self.variant,
                validate=False, int8_scales=ops.scales, load_fn=ops.load_fn,
            )  # fmt: skip
        return out


class UnifiedKernelBackend(_Backend):
    """Lesson 08's attention: ONE launch per layer for the whole step - prompt chunks and decodes alike. ``mask_fn``:
    a learner's causal mask (exercise 08-2); ``metadata_fn``: a learner's ``step_metadata(chunks, device)`` (exercise
    08-3), whose tensors the kernel then reads as given."""

    name = "unified kernel"
    kernel_writes = True

    def __init__(self, mask_fn=None, metadata_fn: Callable | None = None):
        self.mask_fn, self.metadata_fn = mask_fn, metadata_fn

    def metadata_needs(self) -> MetadataNeeds:
        return MetadataNeeds(table_ids=False, int32_slots=True, whole_step=True)

    def adjust_metadata(self, batch, device) -> None:
        """A learner's exercise 08-3 replaces the step's query starts, context lengths and longest query."""
        if self.metadata_fn is not None:
            meta = batch.meta
            meta.query_start, meta.context_lens, meta.max_query_len = self.metadata_fn(chunks_of(batch), device)

    def attend(self, fmt, layer: int, batch, q: torch.Tensor, scale: float) -> torch.Tensor:
        meta, ops = batch.meta, fmt.kernel_operands(layer)
        return unified_attention(
            q, ops.k, ops.v, meta.padded_tables, meta.query_start, meta.context_lens, meta.max_query_len, scale,
            mask_fn=self.mask_fn, validate=False, int8_scales=ops.scales, load_fn=ops.load_fn,
        )  # fmt: skip
