"""What one step hands from part to part, typed both ways (vLLM v1's ``SchedulerOutput`` / ``ModelRunnerOutput``).

* :class:`StepPlan` - the scheduler's decisions, handed to the runner: who runs and how many tokens each feeds,
  and the block copies to make first. An engine's plan also carries, per scheduled sequence, everything the runner
  and the cache need (:class:`SeqFeed`: the token ids to feed, drafts included, and where its K/V live), copied out
  of the scheduler's state when the plan is made: the runner and the cache read nothing live, so the plan is a
  message another process could execute;
* :class:`RunnerOutput` - the runner's result, handed back to the scheduler's ``update_from_output``: how many
  tokens it computed per sequence, and the logits rows of the sequences the plan says sample (``plan.sampling``).

A token is born in one place: ``FCFSScheduler.update_from_output`` samples it from the runner's logits and appends
it; the runner only computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lesson_utils.core.types import Placement, Sequence


@dataclass(frozen=True)
class SeqFeed:
    """What the runner feeds one scheduled sequence this step. ``token_ids``: the tokens to feed - a prompt or a chunk
    of it, or the newest token then the drafts to verify; ``start``: the position of the first (the tokens already
    computed); ``placement``: where its K/V live (its blocks, or its reservation); ``draft``: the drafted tokens among
    ``token_ids`` (the last ``len(draft)``); ``logits_rows``: the rows of logits it wants back - its last
    ``logits_rows`` fed tokens (1 + its drafts when it samples, 0 when a prompt chunk stops short)."""

    seq_id: int
    token_ids: tuple[int, ...]
    start: int
    placement: Placement
    draft: tuple[int, ...] = ()
    logits_rows: int = 0


@dataclass
class StepPlan:
    """What one step will do, decided by the scheduler before the model runs (``FCFSScheduler.schedule``)."""

    step: int
    scheduled: list[Sequence]  # the runner feeds each of them ``num_tokens[i]`` tokens, in this order
    num_tokens: list[int]  # tokens each scheduled sequence feeds: all it has not computed, or a prompt chunk
    admitted: list[Sequence] = field(default_factory=list)  # new to the cache this step (they prefill)
    preempted: list[Sequence] = field(default_factory=list)  # pushed out to make room (not scheduled)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu) copies, made first
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu) copies, made next
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) in the GPU cache, last
    prefill_tokens: int = 0  # prompt tokens among num_tokens (admissions, recomputes, prompt chunks)
    # THE decision of who samples, made once by the scheduler: indices into scheduled of the sequences whose
    # tokens are all computed after this step (a prompt chunk that stops short does not sample), and how many
    # tokens each may produce (one; a sequence verifying k drafted tokens would produce up to k + 1)
    sampling: list[int] = field(default_factory=list)
    sample_counts: list[int] = field(default_factory=list)
    held_slots: int = 0  # slots held or reserved once room was made, before the step runs (lookahead included)
    # per scheduled sequence, in order, what the model runner feeds (an engine's plan; a simulation's has none)
    feeds: list[SeqFeed] = field(default_factory=list)

    def tokens_to_feed(self) -> list[int]:
        """How many tokens each scheduled sequence feeds this step."""
        return list(self.num_tokens)


@dataclass
class RunnerOutput:
    """What the runner computed for a plan (``runner.execute(plan)``)."""

    new_computed: list[int]  # per plan.scheduled: tokens whose K/V this step computed
    logits: (
        torch.Tensor | None
    )  # [len(plan.sampling), vocab]: their rows, in that order; None from the accounting runner
