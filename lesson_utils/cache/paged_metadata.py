"""One step's attention metadata for every paged cache, built once in ``prepare`` and only read afterwards.

Lessons 03, 04, 08 and 10 serve the same step through different attention paths: lesson 03's gather (one
sequence at a time, or the decodes through one padded gather), lesson 04's decode kernel, lesson 08's unified
kernel, lesson 10's int8 variants of both. Each path reads a different subset of the same facts - where every new
token goes, each sequence's blocks, where its queries start, how long its context is - in the dtype its kernel
takes. :func:`build_paged_metadata` works them all out in one place from the host-side block tables, copies each to
the device once (pinned, without a wait: :mod:`lesson_utils.core.host_copy`), and builds only what the cache's
:class:`MetadataNeeds` ask for; ``write`` and ``attend`` then read fields and re-derive nothing, every layer.
(vLLM v1's attention-backend metadata builders play this part there.)

Invariants of a :class:`PagedMetadata` built for ``batch``: ``slots[r]`` is the cache slot of the batch's flat
row ``r`` (``slots_i32`` the same values in int32); ``block_tables[i]`` is sequence ``i``'s table as the block
manager holds it; padded tables are padded with block 0 (never read: every kernel masks past
``context_lens``); every tensor is on the cache's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lesson_utils.cache.attention import decode_slot_index
from lesson_utils.cache.seam import AttentionMetadata, StepBatch, mark_decodes
from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import Chunk
from lesson_utils.memory.block_table import blocks_needed


@dataclass(frozen=True)
class MetadataNeeds:
    """What a paged cache's ``write`` and ``attend`` read, so the builder makes that and nothing else.

    ``decode``: how the sequences that decode one token are served - ``None``: one by one with the rest;
    ``"gather"``: together, through one padded slot index (lesson 03 on a GPU); ``"kernel"``: together, through a
    paged decode kernel that takes padded int32 block tables and int32 lengths (lessons 04, 10).
    ``table_ids``: the other sequences' used blocks as long tensors for the course's gather (off when a learner's
    ``gather_fn`` takes the lists). ``int32_slots``: the slots in int32, for a Triton write kernel.
    ``whole_step``: every sequence's padded int32 table, int32 query starts and context lengths (lesson 08's
    unified kernel, which serves all rows in one launch).
    """

    decode: str | None = None
    table_ids: bool = True
    int32_slots: bool = False
    whole_step: bool = False

    def __post_init__(self):
        if self.decode not in (None, "gather", "kernel"):
            raise ValueError(f"decode is None, 'gather' or 'kernel', not {self.decode!r}")


@dataclass
class PagedMetadata(AttentionMetadata):
    """The step's metadata for a paged cache (see the module docstring for its invariants). Fields a cache's
    :class:`MetadataNeeds` did not ask for stay None."""

    block_tables: list[list[int]] | None = None
    table_ids: list[torch.Tensor | None] | None = None  # None where the sequence is in ``decode``
    slots_i32: torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None  # [num decodes, widest table] int32
    decode_lens: torch.Tensor | None = None  # [num decodes] int32
    padded_tables: torch.Tensor | None = None  # [num seqs, widest table] int32
    query_start: torch.Tensor | None = None  # [num seqs + 1] int32
    context_lens: torch.Tensor | None = None  # [num seqs] int32
    max_query_len: int = 0


def padded(tables: list[list[int]], device) -> torch.Tensor:
    """``tables`` as one ``[len(tables), widest]`` int32 tensor on ``device``, padded with block 0."""
    width = max((len(t) for t in tables), default=1)
    return to_device([list(t) + [0] * (width - len(t)) for t in tables], torch.int32, device)


def build_paged_metadata(
    batch: StepBatch,
    tables: list[list[int]],
    block_size: int,
    device,
    needs: MetadataNeeds,
    slot_mapping_fn: Callable,
) -> PagedMetadata:
    """The step's :class:`PagedMetadata` from each sequence's block table (``tables[i]`` belongs to
    ``batch.seq_ids[i]``); ``slot_mapping_fn(batch, tables, block_size)`` computes the slots (lesson 03's exercise)."""
    decode = mark_decodes(batch, needs.decode is not None, device)
    slots = slot_mapping_fn(batch, tables, block_size)
    meta = PagedMetadata(slots, decode=decode, block_tables=tables)
    in_decode = set(decode.indices) if decode else set()
    if needs.table_ids:
        meta.table_ids = _table_ids(tables, batch.context_lens, in_decode, block_size, device)
    if needs.int32_slots:
        meta.slots_i32 = slots.to(device=device, dtype=torch.int32)
    if decode and needs.decode == "gather":
        decode.slot_index = decode_slot_index(
            [tables[i] for i in decode.indices], [batch.context_lens[i] for i in decode.indices], block_size, device
        )
    if decode and needs.decode == "kernel":
        meta.decode_tables = padded([tables[i] for i in decode.indices], device)
        meta.decode_lens = to_device([batch.context_lens[i] for i in decode.indices], torch.int32, device)
    if needs.whole_step:
        meta.padded_tables = padded(tables, device)
        meta.query_start, meta.context_lens, meta.max_query_len = step_metadata(chunks_of(batch), device)
    return meta


def chunks_of(batch: StepBatch) -> list[Chunk]:
    """The step's work as lesson 08's scheduler hands it out: sequence ``i`` computes tokens ``context_lens[i] -
    query_lens[i] .. context_lens[i] - 1``."""
    return [Chunk(sid, c - q, c) for sid, q, c in zip(batch.seq_ids, batch.query_lens, batch.context_lens)]


def step_metadata(chunks: list[Chunk], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What the unified kernel (lesson 08) reads about a step, from its chunks in batch order (exercise 08-3):

    - ``query_start``: int32 ``[len(chunks) + 1]`` on ``device``; chunk ``i``'s queries are rows ``query_start[i] ..
      query_start[i + 1] - 1`` of the step's flat batch (vLLM's ``query_start_loc``);
    - ``context_lens``: int32 ``[len(chunks)]``; the tokens sequence ``i`` holds once this step has written: its
      chunk's end, the cached tokens included (vLLM's ``seq_lens``);
    - ``max_query_len``: a host int, the longest chunk (the launch grid's size: the host must know it).
    """
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c.end - c.start)
    return (
        to_device(starts, torch.int32, device),
        to_device([c.end for c in chunks], torch.int32, device),
        max((c.end - c.start for c in chunks), default=0),
    )


def _table_ids(tables, context_lens, skip: set[int], block_size: int, device) -> list[torch.Tensor | None]:
    """The gathered sequences' used blocks as long tensors on ``device``: one copy for the step, sliced per sequence."""
    used = [
        t[: blocks_needed(c, block_size)] if i not in skip else [] for i, (t, c) in enumerate(zip(tables, context_lens))
    ]
    flat = to_device([b for t in used for b in t], torch.long, device)
    out, start = [], 0
    for i, t in enumerate(used):
        out.append(None if i in skip else flat[start : start + len(t)])
        start += len(t)
    return out
