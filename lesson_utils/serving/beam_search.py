"""Beam search as a group of sequences the scheduler serves like any other (lesson 05).

Each step every live beam proposes its continuations; the ``width`` best by summed log-probability survive
(ties: by beam, then token order). A beam chosen more than once is forked (its blocks shared, copy-on-write
keeping the diverging last blocks apart); a beam not chosen leaves and frees its blocks. End-of-sequence is
not special: every beam runs ``max_new_tokens`` steps.

Invariant: between steps, ``group.beams`` are exactly the group's sequences in the scheduler's running queue,
in that order, and ``group.scores[i]`` is the summed log-probability of ``group.beams[i]``'s generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from lesson_utils.core.types import Sequence, SequenceStatus


@dataclass(eq=False)
class BeamGroup:
    width: int
    beams: list[Sequence] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    logical_blocks: int = 0  # summed over steps: blocks the beams' tables would hold without sharing
    physical_blocks: int = 0  # summed over steps: distinct blocks they hold
    best: Sequence | None = None  # once finished

    def choose(self, rows: list[torch.Tensor]) -> list[tuple[int, int, float]]:
        """``(beam index, token, score)`` of the ``width`` best continuations, best first (one host sync);
        ``rows[i]`` is beam ``i``'s logits row from this step's forward pass."""
        logp = torch.log_softmax(torch.stack(rows).float(), dim=-1).cpu()
        total = (torch.tensor(self.scores)[:, None] + logp).flatten()
        vocab = logp.shape[1]
        order = torch.argsort(-total, stable=True)[: self.width].tolist()
        return [(i // vocab, i % vocab, float(total[i])) for i in order]

    @property
    def saving(self) -> float:
        """Share of the beams' blocks that sharing saved, over the whole search."""
        return 1 - self.physical_blocks / self.logical_blocks if self.logical_blocks else 0.0

    def advance(self, rows: list[torch.Tensor], step: int, manager, new_seq_id: Callable[[], int]) -> None:
        """Keep the ``width`` best continuations: a beam chosen twice forks (``manager.fork``: blocks shared), a
        beam not chosen is freed and dropped; every kept beam gets its chosen token. ``rows[i]`` is beam ``i``'s
        logits row this step."""
        used: set[int] = set()
        beams = []
        for index, token, score in self.choose(rows):  # forks first: a fork copies its parent before it grows
            parent = self.beams[index]
            if index in used:
                child = parent.fork(new_seq_id())
                manager.fork(parent.seq_id, child.seq_id)
                beams.append((child, token, score))
            else:
                used.add(index)
                beams.append((parent, token, score))
        for index, seq in enumerate(self.beams):
            if index not in used:
                manager.free(seq.seq_id)
                seq.status = SequenceStatus.DROPPED
        for seq, token, _ in beams:
            seq.append_token(token, step)
        self.beams, self.scores = [b for b, _, _ in beams], [sc for _, _, sc in beams]
        logical, physical = manager.view.sharing()
        self.logical_blocks += logical
        self.physical_blocks += physical
