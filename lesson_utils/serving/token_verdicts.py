"""Every due sequence's verdict after a step: the tokens it keeps, decided in one place for everyone.

A *due* sequence is one whose tokens are all computed after the step (``plan.sampling``): a decode, a prompt's last
chunk, a verifying sequence's newest token and drafts. Its verdict is one sampled token, or - when it verified
drafts (lesson 11) - the acceptance rule's kept drafts and the target's own token after them. A parallel sample
forked this step (lesson 05) is due too: it draws its first token from its parent's row. A beam's token is chosen by
its group, so a beam's verdict is ``None``.

One read of the logits serves them all (:func:`~lesson_utils.serving.sampling.read_rows`: at most two syncs), so a
step that verifies drafts settles its other sequences by exactly the rules of a step that does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import Sequence
from lesson_utils.serving.sampling import read_rows
from lesson_utils.serving.speculative import accept_greedy, accept_sampled


@dataclass(frozen=True)
class DueRows:
    """A due sequence and the logits rows that are its (``rows`` of them from row ``first``): one, or
    ``1 + len(seq.draft)`` for a verifying sequence; a fork's are its parent's."""

    seq: Sequence
    first: int
    rows: int


def verdicts(dues: list[DueRows], logits: torch.Tensor | None, speculation=None) -> list[list | None]:
    """The tokens each of ``dues`` keeps, in order: ``[token]``, a verifying sequence's kept drafts and the target's
    token (``speculation``'s rules where it names a learner's, else :func:`~lesson_utils.serving.speculative.
    accept_greedy` / :func:`~lesson_utils.serving.speculative.accept_sampled`), or ``None`` for a beam. ``logits`` is
    None in a simulation: tokens are then ``None`` placeholders, as many as a real run would keep
    (``speculation.simulated`` decides how many drafts are kept; every one without it)."""
    if logits is None:
        sim = speculation.simulated if speculation is not None else None
        return [
            None
            if d.seq.beam is not None
            else [None] * (1 + (sim.accepted(len(d.seq.draft)) if sim and d.seq.draft else len(d.seq.draft)))
            for d in dues
        ]
    order = [d.first + r for d in dues for r in range(d.rows)]
    if order != list(range(logits.shape[0])):  # forks read their parent's row again: one gather
        logits = logits[to_device(order, torch.long, logits.device)] if order else logits[:0]
    reads = read_rows([d.seq for d in dues for _ in range(d.rows)], logits)
    greedy_rule = (speculation and speculation.greedy_rule) or accept_greedy
    sampled_rule = (speculation and speculation.sampled_rule) or accept_sampled
    out: list[list | None] = []
    at = 0
    for d in dues:
        seq, mine = d.seq, range(at, at + d.rows)
        at += d.rows
        if seq.beam is not None:
            out.append(None)
        elif not seq.draft:
            out.append([reads.sample(mine[0], seq)])
        elif seq.temperature > 0:
            out.append(list(sampled_rule(list(seq.draft), torch.stack([reads.probs[r] for r in mine]), seq.generator)))
        else:
            out.append(list(greedy_rule(list(seq.draft), [reads.argmax[r] for r in mine])))
    return out
