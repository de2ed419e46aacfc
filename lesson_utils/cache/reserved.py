from __future__ import annotations

from dataclasses import dataclass, field

from lesson_utils.cache.seam import AttentionMetadata
from lesson_utils.core.types import NeverFits
from lesson_utils.memory.reservation import ContiguousReservationManager


@dataclass
class ReservedMetadata(AttentionMetadata):
    """A step's metadata for the reserved cache: each sequence's first slot (its reservation's start), in batch order."""

    first_slots: list[int] = field(default_factory=list)


class ReservedKVCache:
    """Lesson 01's contiguous arena as the engine's cache: reservations come from a
    :class:`ContiguousReservationManager` (the scheduler's memory manager), so the naive server and the paged
    one run through the same engine. Token ``p`` of a sequence lives in slot ``start + p``."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        manager: ContiguousReservationManager,
        *,
        dtype=None,
        device: str = "cpu",
        batched_decode: bool | None = None,
    ):
        import torch

        from lesson_utils.cache.contiguous import slot_mapping
        from lesson_utils.core.device_discipline import acts_as_gpu

        self.manager = manager
        shape = (num_layers, manager.view.total_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype or torch.float32, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_cache = [self.k[i] for i in range(num_layers)]  # per-layer views (what a swap space would mirror)
        self._slot_mapping = slot_mapping
        # as the paged cache: one batched decode attention on a GPU, a loop of fused calls on a CPU
        self.batched_decode = acts_as_gpu(device) if batched_decode is None else batched_decode

    @classmethod
    def for_model(cls, w, manager: ContiguousReservationManager, **kw) -> "ReservedKVCache":
        """A cache with the geometry of ``w``, on its device and in its dtype unless ``device=``/``dtype=`` say otherwise."""
        kw.setdefault("dtype", w.dtype)
        kw.setdefault("device", w.device)
        return cls(w.num_layers, w.num_kv_heads, w.head_dim, manager, **kw)

    def prepare(self, batch) -> None:
        from lesson_utils.cache.attention import decode_slot_index
        from lesson_utils.cache.seam import mark_decodes

        places = batch.placements or [self.manager.placement(sid) for sid in batch.seq_ids]  # (by hand: ask)
        for sid, clen, place in zip(batch.seq_ids, batch.context_lens, places):
            if clen > place.reserved:
                raise NeverFits(f"sequence {sid} needs {clen} slots but reserved {place.reserved}")
        decode = mark_decodes(batch, self.batched_decode, self.k.device)
        if decode:  # the same batched decode attention as the paged cache: only where K/V live differs
            first = [places[i].first_slot for i in decode.indices]
            ctx = [batch.context_lens[i] for i in decode.indices]
            decode.slot_index = decode_slot_index(first, ctx, None, self.k.device)
        slots = self._slot_mapping(batch, [p.first_slot for p in places])
        batch.meta = ReservedMetadata(slots, decode=decode, first_slots=[p.first_slot for p in places])

    def write(self, layer, batch, k, v):
        self.k[layer, batch.meta.slots] = k.to(self.k.dtype)
        self.v[layer, batch.meta.slots] = v.to(self.v.dtype)

    def attend(self, layer, batch, q, scale):
        import torch

        from lesson_utils.cache.attention import decode_attention, fused_attention_over_context

        out = torch.empty_like(q)
        decode = batch.meta.decode
        skip = set(decode.indices) if decode else set()
        rows = zip(batch.meta.first_slots, batch.starts, batch.query_lens, batch.context_lens)
        for i, (first, start, n, ctx) in enumerate(rows):
            if i in skip:
                continue
            out[start : start + n] = fused_attention_over_context(
                q[start : start + n], self.k[layer, first : first + ctx], self.v[layer, first : first + ctx], scale
            )
        if decode:
            out[decode.rows] = decode_attention(
                q[decode.rows], self.k[layer], self.v[layer], decode.slot_index, decode.context_lens, scale
            )
        return out

    # ---- the serving door's block members (cache.seam.ServingCache): contiguous memory has no blocks -----------
    slot_tensors: tuple = ()  # nothing moves block by block here

    def _no_blocks(self, *args) -> None:
        raise ValueError(
            "a reserved (contiguous) cache keeps no blocks: copy-on-write, swapping and the hand-over need a paged cache"
        )

    copy_block = swap_out = swap_in = restore_blocks = _no_blocks

    def save_blocks(self, blocks: list[int]) -> list:
        if blocks:
            self._no_blocks()
        return []

    def free(self, seq_id: int) -> None:
        """The scheduler frees reservations through the manager; nothing to do here."""
