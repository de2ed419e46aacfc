"""The model runner: one forward pass of the OPT model over every sequence a step scheduled."""

from __future__ import annotations

from typing import Callable

import torch

from lesson_utils.cache.host_blocks import HostBlocks
from lesson_utils.cache.seam import StepBatch
from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import Sequence
from lesson_utils.model.weights import ModelWeights, forward
from lesson_utils.serving.output import RunnerOutput, StepPlan


class ModelRunner:
    """Makes a plan's block copies in the cache, runs the forward pass, and hands back what it computed
    (:class:`~lesson_utils.serving.output.RunnerOutput`): tokens computed per sequence, and the logits rows of the
    sequences the plan says sample (``plan.sampling``). It changes no sequence: the scheduler's
    ``update_from_output`` advances the counts and picks the tokens."""

    def __init__(self, w: ModelWeights, cache, host_blocks: HostBlocks | None = None):
        self.w, self.cache, self.host_blocks = w, cache, host_blocks  # host_blocks: the swap space's data
        # the engine's step checkpoint (StepCheckpoint.protect) while a step runs: called before anything is written
        self.before_writes: Callable[[], None] | None = None

    def execute(self, plan: StepPlan) -> RunnerOutput:
        self.apply(plan)
        seqs, counts = plan.scheduled, plan.tokens_to_feed()
        if not seqs:
            return RunnerOutput([], None)
        ready = plan.sampling  # the scheduler decided who samples (a prompt chunk that stops short does not)
        if any(n > 1 for n in plan.sample_counts):  # lesson 11: a verifying sequence's rows, one per drafted position
            rows_of = [1] * len(seqs)
            for i, n in zip(ready, plan.sample_counts):
                rows_of[i] = n
            logits = self.logits(seqs, counts, rows_of)
            first = [sum(rows_of[:i]) for i in range(len(seqs))]
            keep = [r for i in ready for r in range(first[i], first[i] + rows_of[i])]
        else:
            logits = self.logits(seqs, counts)
            keep = ready
        if len(keep) < logits.shape[0]:
            logits = logits[to_device(keep, torch.long, logits.device)] if keep else logits[:0]
        return RunnerOutput(counts, logits)

    def apply(self, plan: StepPlan) -> None:
        """The plan's block copies, before the forward pass: swap-ins, swap-outs, then copy-on-write copies
        (a block a swap-out frees may be the destination of a copy-on-write of the same step)."""
        if self.before_writes is not None:
            self.before_writes()
        if plan.swap_in or plan.swap_out:
            self.cache.swap_in(plan.swap_in, self.host_blocks)
            self.cache.swap_out(plan.swap_out, self.host_blocks)
        for src, dst in plan.copies:
            self.cache.copy_block(src, dst)

    def logits(
        self, seqs: list[Sequence], counts: list[int] | None = None, rows: list[int] | None = None
    ) -> torch.Tensor:
        """Feed every sequence its next ``counts[i]`` uncomputed tokens (default: all of them; a draft's tokens come
        after its newest one); the logits of each one's last fed token, or of its last ``rows[i]`` fed tokens. The
        sequences are not changed."""
        if self.before_writes is not None:
            self.before_writes()
        device = self.w.embed_tokens.device
        if counts is None:
            counts = [len(s.token_ids) + len(s.draft) - s.num_computed for s in seqs]
        tokens = [(seq.token_ids + seq.draft)[seq.num_computed : seq.num_computed + n] for seq, n in zip(seqs, counts)]
        batch = StepBatch.build([s.seq_id for s in seqs], tokens, [s.num_computed for s in seqs], device=device)
        return forward(self.w, batch, self.cache, last_only=True, last_n=rows)
