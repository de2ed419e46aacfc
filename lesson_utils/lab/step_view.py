"""Lesson 07: one step as the model runner sees it - a mixed batch (prefills, decodes, a prefix-cached prompt)
flattened into the one forward pass every engine of the course runs.

:func:`flatten_plan` builds what the runner builds for a :class:`~lesson_utils.serving.output.StepPlan`: each
scheduled sequence's new tokens laid end to end (their positions), where each new token's K/V go (the slot
mapping, from the block tables), where each sequence's queries start in the flat batch, how long each context is
once the step has written, and which flat rows get logits. It changes nothing: the cache's ``prepare`` only reads
the blocks the plan carries, which the scheduler has already grown for this step.
"""

from __future__ import annotations

from dataclasses import dataclass

from lesson_utils.cache.seam import StepBatch


@dataclass(frozen=True)
class FlatStep:
    """One step's flattened metadata. Invariants: ``query_start[i] .. query_start[i + 1] - 1`` are sequence ``i``'s
    rows of ``positions`` and ``slots``; ``context_lens[i] = positions of its last row + 1``; ``logits_rows`` holds
    the last row of every sequence that samples (``plan.sampling``), in that order."""

    seq_ids: list[int]
    kinds: list[str]  # what each sequence does this step
    cached_before: list[int]  # tokens whose K/V were in the cache before the step
    positions: list[int]
    slots: list[int]
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]

    def table(self) -> str:
        """A per-sequence view, then the flat arrays the kernels read."""
        lines = [f"{'seq':>4} {'does':<26} {'cached':>6} {'positions fed':>14}  {'slots written':<24} block table"]
        for i, sid in enumerate(self.seq_ids):
            rows = range(self.query_start[i], self.query_start[i + 1])
            pos = [self.positions[r] for r in rows]
            span = f"{pos[0]}" if len(pos) == 1 else f"{pos[0]}-{pos[-1]}"
            slots = [self.slots[r] for r in rows]
            shown = ", ".join(map(str, slots[:5])) + (", ..." if len(slots) > 5 else "")
            lines.append(
                f"{sid:>4} {self.kinds[i]:<26} {self.cached_before[i]:>6} {span:>14}  {shown:<24} {self.block_tables[i]}"
            )
        lines += [
            f"positions    ({len(self.positions)} rows): {self.positions}",
            f"slot mapping ({len(self.slots)} rows): {self.slots}",
            f"query_start: {self.query_start}   context_lens: {self.context_lens}",
            f"rows that get logits: {self.logits_rows}",
        ]
        return "\n".join(lines)


def flatten_plan(plan, cache) -> FlatStep:
    """The runner's view of ``plan`` on ``cache`` (a paged cache whose manager the plan's scheduler uses); call it
    after ``scheduler.schedule`` and before ``runner.execute``."""
    seqs, counts = plan.scheduled, plan.tokens_to_feed()
    feeds = plan.feeds  # what the runner feeds: each sequence's tokens, and where its K/V live (an engine's plan)
    batch = StepBatch.build(
        [f.seq_id for f in feeds],
        [f.token_ids for f in feeds],
        [f.start for f in feeds],
        placements=[f.placement for f in feeds],
    )
    cache.prepare(batch)
    admitted = {id(s) for s in plan.admitted}
    kinds = []
    for s, n in zip(seqs, counts):
        if s.num_computed >= s.request.prompt_len:
            kinds.append("decode: 1 new token")
        elif id(s) in admitted and s.num_computed > 0:
            kinds.append(f"prefill, {s.num_computed} from prefix cache")
        else:
            kinds.append("prefill" if s.num_computed + n >= s.request.prompt_len else "prefill, a chunk")
    starts = batch.starts + [batch.num_tokens]
    return FlatStep(
        [s.seq_id for s in seqs],
        kinds,
        [s.num_computed for s in seqs],
        batch.positions.tolist(),
        batch.meta.slots.tolist(),
        starts,
        list(batch.context_lens),
        [list(t) for t in batch.meta.block_tables],
        [starts[i + 1] - 1 for i in plan.sampling],
    )
