"""What every forward in ``lesson_utils.model`` shares: parameter views of Hugging Face modules, the rows a step
returns logits for, and the position check a step makes before it touches the cache."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from lesson_utils.cache.seam import StepBatch
from lesson_utils.core.host_copy import to_device


def ref(t: torch.Tensor | None) -> torch.Tensor | None:
    """The same storage as ``t``, without autograd (the weights stay shared with the Hugging Face model)."""
    return None if t is None else t.detach()


class Linear(NamedTuple):
    """A linear layer's parameters (``bias`` None when the model has no biases)."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def from_module(cls, m) -> "Linear":
        return cls(ref(m.weight), ref(m.bias))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PlacedByEmbeddings:
    """``device`` and ``dtype`` of a weights object: where its token embeddings live (every cache made ``for_model``
    goes there too). Shared by every model's weights."""

    embed_tokens: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype


def select_rows(h: torch.Tensor, batch: StepBatch, last_only: bool, last_n: list[int] | None) -> torch.Tensor:
    """The hidden states a step returns logits for: every token's, each sequence's last one (``last_only``), or
    each sequence's last ``last_n[i]`` (lesson 11's verification), sequence after sequence. Every op after the
    last layer is per token, so the rows nobody needs are dropped before the norm and the vocabulary matmul."""
    if last_n is not None:
        rows = [r for s, n, m in zip(batch.starts, batch.query_lens, last_n) for r in range(s + n - m, s + n)]
        return h[to_device(rows, torch.long, h.device)]
    if last_only:
        last = [s + n - 1 for s, n in zip(batch.starts, batch.query_lens)]
        return h[to_device(last, torch.long, h.device)]
    return h


def check_positions(max_positions: int, batch: StepBatch) -> None:
    """Refuse a step that reaches past the model's positions (Python ints: no GPU synchronisation)."""
    for sid, clen in zip(batch.seq_ids, batch.context_lens):
        if clen > max_positions:
            raise ValueError(
                f"sequence {sid} reaches position {clen - 1}, but the model has only "
                f"{max_positions} positions (0 .. {max_positions - 1})"
            )
