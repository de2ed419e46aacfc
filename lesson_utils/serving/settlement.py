"""The scheduler's second half (:class:`~lesson_utils.serving.scheduler.FCFSScheduler` inherits it): settling a
step once the runner has computed its plan - ``update_from_output``, the one place a token is born.

Every scheduled sequence's computed count advances; full computed blocks enter the prefix cache; a parent that has
just prefilled forks its parallel samples; ONE sampling call picks every due token; beams advance as a group;
lesson 11's verifying sequences keep the drafts the target agrees with and roll back the rest; finished sequences
free their memory (or, on lesson 09's prefill side, are held until sent).
"""

from __future__ import annotations

import torch

from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import Sequence, SequenceStatus
from lesson_utils.serving import sampling
from lesson_utils.serving.forks import fork_samples
from lesson_utils.serving.output import RunnerOutput, StepPlan
from lesson_utils.serving.speculative import settle_drafts


class SettlesSteps:
    """``update_from_output`` and what it needs, on the scheduler's own state (``running``, ``manager``,
    ``finished``, ``held``, ``verified``, ``observe``, ``new_seq_id``)."""

    # ---- after the forward pass -----------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, output: RunnerOutput) -> list[Sequence]:
        """Settle the step with what the runner computed; returns the sequences that finished.

        Every scheduled sequence's computed count advances; full computed blocks enter the prefix cache (here, before
        a finished sequence frees them); a parent that has just prefilled forks its parallel samples (sharing its
        blocks); then ONE sampling call picks the next token of every sequence the plan says samples and of every
        new sample (from its parent's row), and appends them - beams excepted: their group chooses, keeping its
        best continuations; finished sequences free their memory."""
        for seq, n in zip(plan.scheduled, output.new_computed):
            seq.num_computed += n
        due = [plan.scheduled[i] for i in plan.sampling]
        if any(seq.draft for seq in due):  # lesson 11: some sequences verify drafts this step
            return self._settle_verified(plan, output, due)
        for seq in plan.scheduled:
            self.manager.cache_computed(seq)
        children, parent_rows = [], []
        for j, seq in enumerate(due):
            if seq.pending_forks:
                kids = self._fork(seq)
                children += kids
                parent_rows += [j] * len(kids)
        logits = output.logits
        if logits is not None and children:
            logits = torch.cat([logits, logits[to_device(parent_rows, torch.long, logits.device)]])
        sampled = due + children
        tokens = [None] * len(sampled) if logits is None else sampling.next_tokens(sampled, logits)
        rows = {  # the beams' logits rows: their group chooses (None: a simulation)
            id(s): (None if logits is None else logits[j]) for j, s in enumerate(due) if s.beam is not None
        }
        for seq, token in zip(sampled, tokens):
            if seq.beam is None:
                seq.append_token(token, plan.step)
        return self._finish_step(plan, due, rows)

    def _settle_verified(self, plan: StepPlan, output: RunnerOutput, due: list[Sequence]) -> list[Sequence]:
        """Lesson 11: the step's settlement when some sequences verified drafts (:func:`~lesson_utils.serving.
        speculative.settle_drafts`: acceptance, eos and the last allowed token, the rollback, the prefix cache);
        then what finished is freed as in any step."""
        verifying = {id(s) for s in due if s.draft}
        for seq in plan.scheduled:
            if id(seq) not in verifying:
                self.manager.cache_computed(seq)
        self.verified += settle_drafts(
            due, output.logits, plan.sample_counts, plan.step, self.manager, self.speculation
        )
        return self._finish_step(plan, due, {})

    def _finish_step(self, plan: StepPlan, due: list[Sequence], rows: dict) -> list[Sequence]:
        """Beams advance, finished sequences free their memory (or are held, lesson 09); returns the finished."""
        if self.observe is not None:
            self.observe(plan)
        for group in list({id(s.beam): s.beam for s in self.running if s.beam is not None}.values()):
            if all(id(b) in rows for b in group.beams):
                group.advance([rows[id(b)] for b in group.beams], plan.step, self.manager, self.new_seq_id)
                # the group's beams run next step in the order chosen, after everyone else
                self.running = [s for s in self.running if s.beam is not group] + group.beams
        done = [s for s in self.running if s.is_finished]
        for seq in done:
            self.finish(seq, plan.step)
        for group in {id(s.beam): s.beam for s in done if s.beam is not None}.values():
            group.best = max(zip(group.beams, group.scores), key=lambda b: b[1])[0]  # max keeps the first of equals
        return done

    def finish(self, seq: Sequence, step: int) -> None:
        """``seq`` finished at ``step``: it leaves ``running`` for ``finished`` and its memory is freed - or, on lesson
        09's prefill side (``hold_finished``), held until :meth:`release` once its K/V have been sent. Lesson 07's
        exercise calls it for every sequence its update finds finished."""
        if not any(s is seq for s in self.running):
            raise ValueError(f"sequence {seq.seq_id} is not running, so it cannot finish (finished twice?)")
        if self.hold_finished:  # its blocks are still to be sent (lesson 09): release() frees them
            self.held[seq.seq_id] = seq
        else:
            self.manager.free(seq.seq_id)
        seq.finished_step, seq.status = step, SequenceStatus.FINISHED
        self.finished.append(seq)
        self.running = [s for s in self.running if s is not seq]

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling, after the parent's prefill: its n - 1 siblings share its blocks and join the running
        batch; each draws its first token in the step's one sampling call."""
        children = fork_samples(parent, self.manager, self.new_seq_id)
        self.running += children
        return children
