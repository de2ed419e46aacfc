"""Settling a step once the runner has computed its plan - :meth:`Settlement.settle` (the scheduler's
``update_from_output``), the one place a token is born.

Every scheduled sequence's computed count advances; full computed blocks enter the prefix cache; a parent that has
just prefilled forks its parallel samples; every due sequence gets its verdict from ONE read of the logits (a
sampled token, or lesson 11's kept drafts and the target's token, the rest rolled back); beams advance as a group;
finished sequences free their memory (or, on lesson 09's prefill side, are held until sent). The same loop settles
every step: a step in which some sequence verifies drafts forks, caches and finishes the others as any step does.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable

from lesson_utils.core.types import MemoryManager, Sequence, SequenceStatus
from lesson_utils.serving.forks import fork_samples
from lesson_utils.serving.output import RunnerOutput, StepPlan
from lesson_utils.serving.queues import Queues
from lesson_utils.serving.speculative import Speculation, keep_verified
from lesson_utils.serving.token_verdicts import DueRows, verdicts


class Settlement:
    """A scheduler's settling half. It shares one state with the planning half, the :class:`Queues` (who runs, who
    finished, who is held); everything else it is handed: the memory manager it frees and forks through, the id
    source for forked samples and beams, lesson 11's speculation (its acceptance and rollback rules) and lesson 09's
    ``hold_finished``. It keeps what it records: ``verified`` (one ``(step, seq_id, drafted, accepted)`` per
    verification) and the simulator's ``observe`` hook."""

    def __init__(
        self,
        queues: Queues,
        manager: MemoryManager,
        new_seq_id: Callable[[], int],
        speculation: Speculation | None = None,
        *,
        hold_finished: bool = False,
    ):
        self.queues, self.manager, self.new_seq_id = queues, manager, new_seq_id
        self.speculation, self.hold_finished = speculation, hold_finished
        self.verified: list[tuple[int, int, int, int]] = []
        self.observe: Callable[[StepPlan], None] | None = None  # the simulator's hook: after the tokens, before frees

    # ---- after the forward pass -----------------------------------------------------------------------------
    def settle(self, plan: StepPlan, output: RunnerOutput) -> list[Sequence]:
        """Settle the step with what the runner computed; returns the sequences that finished.

        One loop for every step, whether or not some sequence verified drafts in it:

        1. every scheduled sequence's computed count advances, and its full computed blocks enter the prefix cache
           (a verifying sequence's only after its rollback: no block holding a rejected draft is registered);
        2. a parent that has just prefilled forks its parallel samples (sharing its blocks);
        3. every due sequence and new sample gets its verdict from ONE read of the logits
           (:func:`~lesson_utils.serving.token_verdicts.verdicts`): one sampled token, or a verifying sequence's
           kept drafts and the target's own token; beams get theirs from their group;
        4. the tokens are appended (a verifying sequence's through the rollback rule, which also gives back the
           slots of rejected drafts); beams advance; finished sequences free their memory (or are held, lesson 09).
        """
        for seq, n in zip(plan.scheduled, output.new_computed):
            seq.num_computed += n
        for seq in plan.scheduled:
            if not seq.draft:
                self.manager.cache_computed(seq)
        due = [plan.scheduled[i] for i in plan.sampling]
        first = list(accumulate(plan.sample_counts, initial=0))[: len(due)]  # each due sequence's first logits row
        dues = [DueRows(seq, first[j], plan.sample_counts[j]) for j, seq in enumerate(due)]
        for j, seq in enumerate(due):
            if seq.pending_forks:  # its samples draw their first token from its (last) row
                row = first[j] + plan.sample_counts[j] - 1
                dues += [DueRows(child, row, 1) for child in self._fork(seq)]
        logits = output.logits
        kept = verdicts(dues, logits, self.speculation)
        settle = (self.speculation and self.speculation.settle_rule) or keep_verified
        for d, tokens in zip(dues, kept):
            seq = d.seq
            if tokens is None:  # a beam: its group chooses
                continue
            if seq.draft:
                self.verified.append((plan.step, seq.seq_id, len(seq.draft), len(tokens) - 1))
                settle(seq, list(tokens), plan.step, self.manager)
                self.manager.cache_computed(seq)  # only now: its rejected drafts' blocks are gone
            else:
                seq.append_token(tokens[0], plan.step)
        for seq in [*plan.scheduled, *self.queues.running]:  # (one the budget left out drafted for nothing)
            seq.draft = []
        rows = {  # the beams' logits rows: their group chooses (None: a simulation)
            id(d.seq): (None if logits is None else logits[d.first]) for d in dues if d.seq.beam is not None
        }
        return self._finish_step(plan, due, rows)

    def _finish_step(self, plan: StepPlan, due: list[Sequence], rows: dict) -> list[Sequence]:
        """Beams advance, finished sequences free their memory (or are held, lesson 09); returns the finished."""
        if self.observe is not None:
            self.observe(plan)
        queues = self.queues
        for group in list({id(s.beam): s.beam for s in queues.running if s.beam is not None}.values()):
            if all(id(b) in rows for b in group.beams):
                group.advance([rows[id(b)] for b in group.beams], plan.step, self.manager, self.new_seq_id)
                # the group's beams run next step in the order chosen, after everyone else
                queues.running = [s for s in queues.running if s.beam is not group] + group.beams
        done = [s for s in queues.running if s.is_finished]
        for seq in done:
            self.finish(seq, plan.step)
        for group in {id(s.beam): s.beam for s in done if s.beam is not None}.values():
            group.best = max(zip(group.beams, group.scores), key=lambda b: b[1])[0]  # max keeps the first of equals
        return done

    def finish(self, seq: Sequence, step: int) -> None:
        """``seq`` finished at ``step``: it leaves ``running`` for ``finished`` and its memory is freed - or, on lesson
        09's prefill side (``hold_finished``), held until :meth:`release` once its K/V have been sent. Lesson 07's
        exercise calls it for every sequence its update finds finished."""
        queues = self.queues
        if not any(s is seq for s in queues.running):
            raise ValueError(f"sequence {seq.seq_id} is not running, so it cannot finish (finished twice?)")
        if self.hold_finished:  # its blocks are still to be sent (lesson 09): release() frees them
            queues.held[seq.seq_id] = seq
        else:
            self.manager.free(seq.seq_id)
        seq.finished_step, seq.status = step, SequenceStatus.FINISHED
        queues.finished.append(seq)
        queues.remove_running(seq)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling, after the parent's prefill: its n - 1 siblings share its blocks and join the running
        batch; each draws its first token in the step's one sampling call."""
        children = fork_samples(parent, self.manager, self.new_seq_id)
        self.queues.running += children
        return children
