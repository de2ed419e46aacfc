"""Lesson 05: parallel sampling - after a prompt's prefill, its other samples fork off, sharing its blocks."""

from __future__ import annotations

from typing import Callable

import torch

from lesson_utils.core.types import Sequence


def fork_samples(parent: Sequence, manager, new_seq_id: Callable[[], int]) -> list[Sequence]:
    """The parent's ``pending_forks`` siblings, made in the step that completes its prompt and before its first token
    is drawn: each shares the parent's blocks (``manager.fork``) and its state so far, with its own generator seeded
    from the parent's - so a seed repeats on any device. The step's one sampling call then draws every sibling's
    first token from the parent's logits row. Returns them (running); the parent forks no more."""
    children = []
    for i in range(parent.pending_forks):
        child = parent.fork(new_seq_id())
        if parent.temperature > 0:
            child.generator = torch.Generator().manual_seed(int(parent.generator.initial_seed()) + 1000 * (i + 1))
        manager.fork(parent.seq_id, child.seq_id)
        parent.samples.append(child)
        children.append(child)
    parent.pending_forks = 0
    return children
