"""The seam between the model and a KV cache.

The compact OPT forward (``lesson_utils.model.opt_forward``) never stores keys and values itself: each step it
hands them to a cache object and asks the same object for attention. Lesson 01 plugs in a contiguous
arena, lesson 03 a paged cache, lesson 04 a Triton kernel; this module holds what they share: the step's
batch (:class:`StepBatch`), the metadata a cache prepares once per step for every layer
(:class:`AttentionMetadata`), and the :class:`KVCache` protocol. (The plain-torch attention every cache is
checked against lives in ``cache/attention.py``; the simplest cache in ``cache/dense.py``.)

A step processes a *flat* batch of new tokens from several sequences at once: a whole prompt for a
sequence being prefilled, one token for a sequence being decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import Placement


@dataclass
class DecodeGroup:
    """The sequences of a step that decode one token each, served together by one batched attention call.

    ``indices`` are their places in the batch; ``rows`` their rows in the flat batch and ``context_lens``
    their context lengths, both on the cache's device; ``slot_index`` (``[n, max_ctx]`` cache slots of their
    context tokens) is built in ``prepare`` by a cache whose decode attention gathers through it.
    """

    indices: list[int]
    rows: torch.Tensor
    context_lens: torch.Tensor
    slot_index: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """What a cache works out once per step, in ``prepare``, and reads in every layer's ``write``/``attend``.

    ``slots``: the flat cache slot of every new token (``torch.long``, on the cache's device);
    ``decode``: the sequences served together (:func:`mark_decodes`), None when there are none.
    The paged caches' metadata adds their block tables in every form their kernels take
    (:class:`~lesson_utils.cache.paged_metadata.PagedMetadata`).
    """

    slots: torch.Tensor
    decode: DecodeGroup | None = None


@dataclass
class StepBatch:
    """The new tokens of one forward step, flattened across sequences.

    Invariants: ``len(seq_ids) == len(query_lens) == len(context_lens)``;
    ``input_ids.shape == positions.shape == (sum(query_lens),)``; sequence ``i``'s new tokens are the
    contiguous run ``input_ids[starts[i] : starts[i] + query_lens[i]]`` and sit at positions
    ``context_lens[i] - query_lens[i] ... context_lens[i] - 1`` of that sequence.
    """

    seq_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]  # tokens held for the sequence once this step's K/V are written
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | None = None  # set by the cache's prepare(), for its own write() and attend()
    # where each sequence's K/V live, from the step's plan (an engine's step); None when a cache is driven by hand,
    # and then a managed cache asks its manager
    placements: list[Placement] | None = None

    @property
    def starts(self) -> list[int]:
        out, total = [], 0
        for n in self.query_lens:
            out.append(total)
            total += n
        return out

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    def new_positions(self) -> list[range]:
        """Each sequence's new-token positions, from the host-side lengths: no read-back of ``positions``."""
        return [range(c - q, c) for q, c in zip(self.query_lens, self.context_lens)]

    @classmethod
    def build(cls, seq_ids, new_tokens, context_before, device="cpu", placements=None) -> "StepBatch":
        """Make a step from each sequence's new token ids and how many tokens it already had cached (ids and
        positions built on the host and copied without a wait: :mod:`lesson_utils.core.host_copy`); ``placements``
        (one per sequence) say where their K/V live."""
        if not (len(seq_ids) == len(new_tokens) == len(context_before)):
            raise ValueError("seq_ids, new_tokens and context_before must have the same length")
        ids, pos, qlens, clens = [], [], [], []
        for toks, before in zip(new_tokens, context_before):
            if len(toks) == 0:
                raise ValueError("every sequence in a step needs at least one new token")
            ids.extend(int(t) for t in toks)
            pos.extend(range(before, before + len(toks)))
            qlens.append(len(toks))
            clens.append(before + len(toks))
        if placements is not None and len(placements) != len(seq_ids):
            raise ValueError(f"{len(placements)} placements for {len(seq_ids)} sequences")
        return cls(
            seq_ids=list(seq_ids),
            query_lens=qlens,
            context_lens=clens,
            input_ids=to_device(ids, torch.long, device),
            positions=to_device(pos, torch.long, device),
            placements=None if placements is None else list(placements),
        )


class KVCache(Protocol):
    """What the model needs from a cache. ``k``/``v``/``q`` are ``[num_tokens, heads, head_dim]``."""

    def prepare(self, batch: StepBatch) -> None:
        """Work out where this step's new tokens go and what attention reads (called once per step, before layer
        0). A contiguous cache of lesson 01 finds room here; a paged cache only reads the blocks the scheduler
        reserved, and refuses a sequence without them."""

    def write(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' keys and values for ``layer``."""

    def attend(self, layer: int, batch: StepBatch, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of each new token over its own sequence's cached tokens."""

    def free(self, seq_id: int) -> None:
        """Forget a finished sequence and give its memory back."""


class ServingCache(KVCache, Protocol):
    """What an engine, its model runner, its step checkpoint and lesson 09's hand-over need of a cache besides the
    model's four members - the whole door, checked by ``tests/core/test_architecture.py``. A paged cache
    (:class:`~lesson_utils.cache.paged.PagedKVCache` and its presets) has all of it; lessons 01-02's reserved cache
    keeps no blocks, so a block member is never asked of it (no copy, swap or protected block is ever planned there)
    and refuses by name if it is."""

    manager: object  # the memory manager it was sized for (core.types.MemoryManager); an engine decides with it

    @property
    def slot_tensors(self) -> tuple:
        """Everything it keeps per slot (``core.types.SlotTensors``: K/V, an int8 cache's scales): every path that
        moves blocks - copy-on-write, swap, a refused step's restore, the hand-over - moves each of these."""

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's contents, every kind and layer (copy-on-write)."""

    def swap_out(self, copies: list[tuple[int, int]], host) -> None:
        """Copy ``(gpu, cpu)`` blocks into the swap space's data (lesson 06)."""

    def swap_in(self, copies: list[tuple[int, int]], host) -> None:
        """Copy ``(cpu, gpu)`` blocks back from the swap space's data (lesson 06)."""

    def save_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        """A copy of ``blocks``' contents (a step about to overwrite them keeps it)."""

    def restore_blocks(self, blocks: list[int], saved: list[torch.Tensor]) -> None:
        """Put :meth:`save_blocks`'s copy back (a refused step)."""


def mark_decodes(batch: StepBatch, enabled: bool, device) -> DecodeGroup | None:
    """The sequences of ``batch`` that decode one token this step, to serve all at once (None when there are
    none, or when not ``enabled``). A cache calls it in ``prepare``; ``attend`` then serves the other
    sequences one by one and these together."""
    decode = [i for i, n in enumerate(batch.query_lens) if n == 1] if enabled else []
    if not decode:
        return None
    starts = batch.starts
    return DecodeGroup(
        decode,
        to_device([starts[i] for i in decode], torch.long, device),
        to_device([batch.context_lens[i] for i in decode], torch.long, device),
    )
