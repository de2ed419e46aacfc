"""Choosing tokens from logits rows: greedy (argmax) or sampled with the sequence's own generator.

Model-free: torch on a logits tensor. :func:`read_rows` brings a step's rows to the host in at most two syncs (the
argmax and finiteness of every row, the probabilities of the rows of sequences that sample); the scheduler's
``update_from_output`` calls it once a step and decides every due sequence's tokens from what it read (one sampled
token, or lesson 11's acceptance rule over a verifying sequence's rows). :func:`next_tokens` is the one-token case,
lesson 07's exercise uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import Sequence


@dataclass(frozen=True)
class RowReads:
    """What the host knows of a step's logits rows after :func:`read_rows`: ``argmax[r]`` for every row, and
    ``probs[r]`` (softmax of the row over its sequence's temperature, on the host) for every row whose sequence
    samples (``temperature > 0``)."""

    argmax: list[int]
    probs: dict[int, torch.Tensor]

    def sample(self, row: int, seq: Sequence) -> int:
        """Row ``row``'s token for ``seq``: the argmax when it is greedy, else one draw from its generator."""
        if seq.temperature > 0:
            return int(torch.multinomial(self.probs[row], 1, generator=seq.generator))
        return self.argmax[row]


def read_rows(row_seqs: list[Sequence], logits: torch.Tensor) -> RowReads:
    """Read every row of ``logits`` (``row_seqs[r]`` is the sequence row ``r`` belongs to; a sequence may own several)
    with at most two device-to-host syncs for the whole step: one for every row's argmax, one for the sampled rows'
    probabilities. The first read also carries whether each row is finite, so a NaN that reached the logits (a
    corrupted cache, say) is refused, naming the sequence, at no extra sync."""
    if len(row_seqs) != logits.shape[0]:
        raise ValueError(f"{len(row_seqs)} sequences for {logits.shape[0]} logits rows")
    if not row_seqs:
        return RowReads([], {})
    argmax, finite = torch.stack([logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1).long()]).tolist()
    bad = list(dict.fromkeys(row_seqs[r].seq_id for r, ok in enumerate(finite) if not ok))
    if bad:
        raise ValueError(
            f"the logits of sequence(s) {bad} hold NaN or inf: the model's activations or its KV cache are corrupted "
            "(an int8 cache on a GPU does not check its writes unless check_finite=True, which names the layer and slot)"
        )
    sampled = [r for r, s in enumerate(row_seqs) if s.temperature > 0]
    probs: dict[int, torch.Tensor] = {}
    if sampled:
        temps = to_device([row_seqs[r].temperature for r in sampled], torch.float32, logits.device)[:, None]
        rows = to_device(sampled, torch.long, logits.device)
        probs = dict(zip(sampled, torch.softmax(logits[rows].float() / temps, dim=-1).cpu()))
    return RowReads(argmax, probs)


def next_tokens(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Every sequence's next token, one row each (``logits[i]`` is ``seqs[i]``'s), with at most two device-to-host
    syncs for the whole step (:func:`read_rows`); a sampled row is drawn from its sequence's generator on the host, so a
    seed gives the same tokens on any device. Non-finite rows are refused, naming their sequences."""
    reads = read_rows(seqs, logits)
    return [reads.sample(r, s) for r, s in enumerate(seqs)]
