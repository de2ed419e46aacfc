from __future__ import annotations

import torch

from lesson_utils.cache.attention import attention_over_context
from lesson_utils.cache.seam import StepBatch


class DenseKVCache:
    """The simplest cache: one growing tensor per sequence and layer (``torch.cat`` on every step).

    Not a memory manager at all - it is the reference the real caches are compared with.
    Invariant: ``self.k[layer][seq].shape[0]`` equals the sequence's context length after each write.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.k: list[dict[int, torch.Tensor]] = [dict() for _ in range(num_layers)]
        self.v: list[dict[int, torch.Tensor]] = [dict() for _ in range(num_layers)]

    def prepare(self, batch: StepBatch) -> None:
        for sid, qlen, clen in zip(batch.seq_ids, batch.query_lens, batch.context_lens):
            have = self.k[0][sid].shape[0] if sid in self.k[0] else 0
            if have != clen - qlen:
                raise ValueError(f"sequence {sid} has {have} cached tokens, the step expects {clen - qlen}")

    def write(self, layer, batch, k, v):
        for sid, start, n in zip(batch.seq_ids, batch.starts, batch.query_lens):
            new_k, new_v = k[start : start + n], v[start : start + n]
            if sid in self.k[layer]:
                new_k = torch.cat([self.k[layer][sid], new_k])
                new_v = torch.cat([self.v[layer][sid], new_v])
            self.k[layer][sid], self.v[layer][sid] = new_k, new_v

    def attend(self, layer, batch, q, scale):
        out = torch.empty_like(q)
        for sid, start, n in zip(batch.seq_ids, batch.starts, batch.query_lens):
            out[start : start + n] = attention_over_context(
                q[start : start + n], self.k[layer][sid], self.v[layer][sid], scale
            )
        return out

    def free(self, seq_id: int) -> None:
        if seq_id not in self.k[0]:
            raise KeyError(f"sequence {seq_id} holds nothing in this cache (never written, or freed twice)")
        for layer in range(self.num_layers):
            del self.k[layer][seq_id], self.v[layer][seq_id]
