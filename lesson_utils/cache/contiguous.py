from __future__ import annotations

from typing import Callable

import torch

from lesson_utils.cache.attention import fused_attention_over_context
from lesson_utils.cache.seam import AttentionMetadata, StepBatch
from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import NeverFits
from lesson_utils.memory.contiguous import FirstFitAllocator


def slot_mapping(batch: StepBatch, region_starts: list[int]) -> torch.Tensor:
    """Arena slot of every new token in ``batch``: its sequence's region start plus its position.

    ``region_starts[i]`` is where sequence ``batch.seq_ids[i]``'s reservation begins. Returns a ``torch.long``
    tensor on the batch's device. Computed from the batch's host-side lengths (the new tokens of a sequence sit
    at positions ``context_len - query_len .. context_len - 1``) and moved to the device once: reading
    ``batch.positions`` back would make the host wait for the GPU every step.
    """
    slots = [start + p for start, positions in zip(region_starts, batch.new_positions()) for p in positions]
    return to_device(slots, torch.long, batch.positions.device)


class ContiguousKVCache:
    """A naive KV cache: one preallocated arena, one contiguous reservation per sequence.

    ``k``/``v`` have shape ``[num_layers, num_slots, num_kv_heads, head_dim]``. A sequence's tokens live
    in slots ``start .. start + reservation - 1``; token at position ``p`` sits in slot ``start + p``.
    A sequence is reserved ``default_reservation`` slots at its first step unless :meth:`reserve` was
    called for it first (a request that states its own maximum length, as in the paper's Fig. 3).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        default_reservation: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        allocator: FirstFitAllocator | None = None,
        slot_mapping_fn: Callable = slot_mapping,
    ):
        self.allocator = allocator or FirstFitAllocator(num_slots)
        if self.allocator.num_slots != num_slots:
            raise ValueError("the allocator must manage exactly num_slots slots")
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.default_reservation = default_reservation
        self.start: dict[int, int] = {}  # seq_id -> first slot
        self.reserved: dict[int, int] = {}  # seq_id -> slots reserved
        self.length: dict[int, int] = {}  # seq_id -> tokens written
        self._slot_mapping = slot_mapping_fn

    @classmethod
    def for_model(cls, w, num_slots: int, default_reservation: int, **kw) -> "ContiguousKVCache":
        """An arena sized for the geometry of ``w`` (an ``OPTWeights``), on its device and in its dtype unless
        ``device=`` / ``dtype=`` say otherwise."""
        kw.setdefault("dtype", w.dtype)
        kw.setdefault("device", w.device)
        return cls(w.num_layers, num_slots, w.num_kv_heads, w.head_dim, default_reservation=default_reservation, **kw)

    def reserve(self, seq_id: int, num_slots: int) -> int:
        """Reserve ``num_slots`` for a new sequence; raises ``OutOfSlots`` / ``NeverFits``."""
        if seq_id in self.start:
            raise ValueError(f"sequence {seq_id} already holds a reservation")
        start = self.allocator.allocate(num_slots)
        self.start[seq_id], self.reserved[seq_id], self.length[seq_id] = start, num_slots, 0
        return start

    def prepare(self, batch: StepBatch) -> None:
        for sid, clen in zip(batch.seq_ids, batch.context_lens):
            if sid not in self.start:
                self.reserve(sid, self.default_reservation)
            if clen > self.reserved[sid]:
                raise NeverFits(
                    f"sequence {sid} needs {clen} slots but reserved only {self.reserved[sid]}: "
                    f"a contiguous cache cannot grow a reservation in place"
                )
        batch.meta = AttentionMetadata(self._slot_mapping(batch, [self.start[s] for s in batch.seq_ids]))
        for sid, clen in zip(batch.seq_ids, batch.context_lens):
            self.length[sid] = clen

    def write(self, layer, batch, k, v):
        slots = batch.meta.slots
        self.k[layer, slots] = k.to(self.k.dtype)
        self.v[layer, slots] = v.to(self.v.dtype)

    def attend(self, layer, batch, q, scale):
        out = torch.empty_like(q)
        for sid, start, n, ctx in zip(batch.seq_ids, batch.starts, batch.query_lens, batch.context_lens):
            first = self.start[sid]
            out[start : start + n] = fused_attention_over_context(
                q[start : start + n], self.k[layer, first : first + ctx], self.v[layer, first : first + ctx], scale
            )
        return out

    def free(self, seq_id: int) -> None:
        if seq_id not in self.start:
            raise ValueError(f"sequence {seq_id} holds no reservation (already freed, or never admitted)")
        self.allocator.free(self.start.pop(seq_id))
        del self.reserved[seq_id], self.length[seq_id]

    def usage(self) -> dict[str, int]:
        """Slots by kind right now: used (tokens written), reserved-but-unused, free."""
        used = sum(self.length.values())
        reserved = sum(self.reserved.values())
        return {"used": used, "reserved_unused": reserved - used, "free": self.allocator.free_slots}
