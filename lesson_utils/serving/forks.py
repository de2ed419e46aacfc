"""Lesson 05: parallel sampling - after a prompt's prefill, its other samples fork off, sharing its blocks."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from lesson_utils.serving import sampling
from lesson_utils.types import Sequence, SequenceStatus


def fork_samples(
    parent: Sequence, logits: torch.Tensor | None, manager, new_seq_id: Callable[[], int]
) -> list[Sequence]:
    """The parent's ``pending_forks`` siblings: each shares the parent's blocks (``manager.fork``) and draws its
    own first token from the parent's logits row (``None`` in a simulation), with its own generator seeded from
    the parent's - so a seed repeats on any device. Returns them (running); the parent forks no more."""
    children = []
    for i in range(parent.pending_forks):
        child = Sequence(
            replace(parent.request, req_id=new_seq_id()),
            num_generated=parent.num_generated - 1,
            admitted_step=parent.admitted_step,
            output_ids=list(parent.output_ids[:-1]),
            token_steps=list(parent.token_steps[:-1]),
            eos_token_id=parent.eos_token_id,
            kv_len=parent.kv_len,
            temperature=parent.temperature,
            added_at=parent.added_at,
            status=SequenceStatus.RUNNING,
        )
        if parent.temperature > 0:
            child.generator = torch.Generator().manual_seed(int(parent.generator.initial_seed()) + 1000 * (i + 1))
        manager.fork(parent.seq_id, child.seq_id)
        child.append_token(None if logits is None else sampling.sample(child, logits), parent.first_token_step)
        parent.samples.append(child)
        children.append(child)
    parent.pending_forks = 0
    return children
