"""What one step hands from part to part, typed both ways (vLLM v1's ``SchedulerOutput`` / ``ModelRunnerOutput``).

* :class:`StepPlan` - the scheduler's decisions, handed to the runner: who runs and how many tokens each feeds,
  and the block copies to make first;
* :class:`RunnerOutput` - the runner's result, handed back to the scheduler's ``update_from_output``: how many
  tokens it computed per sequence, and the logits rows of the sequences the plan says sample (``plan.sampling``).

A token is born in one place: ``FCFSScheduler.update_from_output`` samples it from the runner's logits and appends
it; the runner only computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lesson_utils.core.types import Sequence


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
