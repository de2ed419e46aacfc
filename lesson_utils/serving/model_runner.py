"""The model runner: one forward pass of the OPT model over every sequence a step scheduled."""

from __future__ import annotations

from itertools import accumulate
from typing import Callable

import torch

from lesson_utils.cache.host_blocks import HostBlocks
from lesson_utils.cache.seam import ServingCache, StepBatch
from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import Sequence
from lesson_utils.model.weights import ModelWeights, forward
from lesson_utils.serving.output import RunnerOutput, SeqFeed, StepPlan


class ModelRunner:
    """Makes a plan's block copies in the cache, runs the forward pass, and hands back what it computed
    (:class:`~lesson_utils.serving.output.RunnerOutput`): tokens computed per sequence, and the logits rows of the
    sequences the plan says sample (``plan.sampling``). It reads only the plan - each sequence's
    :class:`~lesson_utils.serving.output.SeqFeed` (tokens, start, where its K/V live) - and changes no sequence: the
    scheduler's ``update_from_output`` advances the counts and picks the tokens."""

    def __init__(self, w: ModelWeights, cache: ServingCache, host_blocks: HostBlocks | None = None):
        self.w, self.cache, self.host_blocks = w, cache, host_blocks  # host_blocks: the swap space's data
        # the engine's step checkpoint (StepCheckpoint.protect) while a step runs: called before anything is written
        self.before_writes: Callable[[], None] | None = None

    def execute(self, plan: StepPlan) -> RunnerOutput:
        self.apply(plan)
        if not plan.scheduled:
            return RunnerOutput([], None)
        if len(plan.feeds) != len(plan.scheduled):
            raise ValueError(
                f"the plan feeds {len(plan.feeds)} of its {len(plan.scheduled)} sequences: a model runner needs an "
                "engine's plan (FCFSScheduler(plan_feeds=True)), which says what to feed each of them"
            )
        return RunnerOutput([len(f.token_ids) for f in plan.feeds], self.run_feeds(plan.feeds))

    def run_feeds(self, feeds: list[SeqFeed]) -> torch.Tensor:
        """One forward pass over ``feeds``; the logits rows every feed asks for (its last ``logits_rows`` fed tokens), in
        order: ``[sum(logits_rows), vocab]``."""
        if self.before_writes is not None:
            self.before_writes()
        device = self.w.embed_tokens.device
        batch = StepBatch.build(
            [f.seq_id for f in feeds],
            [f.token_ids for f in feeds],
            [f.start for f in feeds],
            device=device,
            placements=[f.placement for f in feeds],
        )
        rows = [max(1, f.logits_rows) for f in feeds]
        logits = forward(self.w, batch, self.cache, last_only=True, last_n=rows if any(r > 1 for r in rows) else None)
        first = list(accumulate(rows, initial=0))
        keep = [r for f, at in zip(feeds, first) for r in range(at, at + f.logits_rows)]
        if len(keep) < logits.shape[0]:
            logits = logits[to_device(keep, torch.long, logits.device)] if keep else logits[:0]
        return logits

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
        """Feed every sequence (live, outside a step: lessons and measurements) its next ``counts[i]`` uncomputed tokens
        (default: all of them; a draft's tokens come after its newest one); the logits of each one's last fed token, or
        of its last ``rows[i]`` fed tokens. Where its K/V live is asked of the cache's manager now. The sequences are
        not changed."""
        if counts is None:
            counts = [len(s.token_ids) + len(s.draft) - s.num_computed for s in seqs]
        rows = rows or [1] * len(seqs)
        feeds = [
            SeqFeed(
                s.seq_id,
                tuple((s.token_ids + s.draft)[s.num_computed : s.num_computed + n]),
                s.num_computed,
                self.cache.manager.placement(s.seq_id),
                tuple(s.draft),
                r,
            )
            for s, n, r in zip(seqs, counts, rows)
        ]
        return self.run_feeds(feeds)
