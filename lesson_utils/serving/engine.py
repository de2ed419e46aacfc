"""The course's serving engine (lessons 03-09) - requests in, token ids out.

Three pieces, each replaceable:

* the **scheduler** (:class:`~lesson_utils.serving.scheduler.FCFSScheduler`) decides who runs this step;
* the **memory manager** (the :class:`~lesson_utils.memory.block_manager.BlockManager` inside a
  :class:`~lesson_utils.cache.paged.PagedKVCache`, or lesson 05's
  :class:`~lesson_utils.memory.sharing.SharingBlockManager`) decides where their K/V live;
* the **model runner** (:class:`~lesson_utils.serving.model_runner.ModelRunner`) runs one forward step over
  everyone scheduled: new sequences are prefilled (all their tokens not yet in the cache), running ones decode
  one token, side by side in one flat batch.

Each :meth:`Engine.step` is one :func:`~lesson_utils.serving.step.serve_step` (or lesson 07's version of it):
the simulator (lesson 02) runs the same function with the accounting runner in place of the model runner, so
the same scheduler and memory manager objects make the same decisions.

What the later lessons add is configuration, not another engine: the prefix cache, parallel sampling (``n``
samples of one prompt share its blocks by forking after the prefill) and beam search (lesson 05, a sharing
memory manager), preemption by swap or recompute and the victim policy (lesson 06: ``preemption_mode``,
``swap_space``, ``scheduler_kw``), chunked prefill (lesson 08: ``chunked_prefill=ChunkedPrefill(budget)``) and
requests prefilled elsewhere (lesson 09: :mod:`lesson_utils.disagg.handover`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lesson_utils.cache.host_blocks import HostBlocks
from lesson_utils.cache.seam import ServingCache
from lesson_utils.core.progress import ticking
from lesson_utils.core.types import MemoryManager, Request, Sequence, SequenceStatus, SlotKind, is_int
from lesson_utils.model.weights import ModelWeights
from lesson_utils.serving.beam_search import BeamGroup
from lesson_utils.serving.checkpoint import StepCheckpoint
from lesson_utils.serving.cost_model import StepWork
from lesson_utils.serving.model_runner import ModelRunner
from lesson_utils.serving.output import StepPlan
from lesson_utils.serving.scheduler import FCFSScheduler
from lesson_utils.serving.speculative import Speculation
from lesson_utils.serving.step import StepResult, serve_step
from lesson_utils.serving.token_budget import ChunkedPrefill


def check_token_ids(ids, vocab_size: int, what: str = "prompt") -> list[int]:
    """``ids`` as a list of ints, or a clear error: a list (or tuple) of ints or a 1-D integer tensor, each id in
    ``0 .. vocab_size - 1``, at least one. Checked at the door: an id outside the vocabulary would otherwise
    fail in the embedding of every later step (on a GPU: a device-side assert that breaks the process)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(
                f"a {what} tensor must be 1-D with an integer dtype, got shape {tuple(ids.shape)} and {ids.dtype}"
            )
        ids = ids.tolist()
    elif isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise TypeError(
            f"a {what} is a list of token ids (ints) or a 1-D integer tensor, got {type(ids).__name__}"
            + (": tokenize text first" if isinstance(ids, str) else "")
        )
    out = []
    for i, t in enumerate(ids):
        if not is_int(t):
            raise TypeError(f"{what} token {i} is {t!r} ({type(t).__name__}); token ids are ints")
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"{what} token {i} is {t}, outside the model's vocabulary of {vocab_size} ids (0 .. {vocab_size - 1})"
            )
        out.append(int(t))
    if not out:
        raise ValueError(f"a request needs at least one {what} token")
    return out


@dataclass
class StepStats:
    step: int
    running: int
    waiting: int
    free_blocks: int
    prefill_tokens: int
    preempted: int
    seconds: float = 0.0
    kv_tokens: int = 0  # slots holding token states after the step
    kv_slots: int = 0  # the whole KV budget, in slots
    t: float = 0.0  # time.perf_counter() at the end of the step
    tokens: int = 0  # tokens the model computed this step (prompt tokens, decodes and drafts)
    decodes: int = 0  # sequences that decoded one token
    context_tokens: int = 0  # K/V tokens attended over, summed over the step's sequences
    kv_held: int = 0  # slots held or reserved for sequences after the step (token states included)
    drafted: int = 0  # lesson 11: draft tokens fed after verifying sequences' newest tokens
    planned_held: int = 0  # slots held or reserved while the step ran (lesson 11's lookahead slots included)

    @property
    def work(self) -> StepWork:
        """What the step computed, as the cost model sees it."""
        return StepWork(self.decodes, self.prefill_tokens, self.context_tokens, self.drafted)


def _positive_int(value, what: str) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{what} must be an int of at least 1, got {value!r}")
    return value


@dataclass
class Engine:
    """Serve token-id requests on any cache that has a memory manager (greedy unless told otherwise)."""

    w: ModelWeights
    cache: ServingCache  # a PagedKVCache (lesson 03) or a preset of it; lesson 02's ReservedKVCache
    max_num_seqs: int | None = None
    stop_at_eos: bool = True
    preemption_mode: str = "recompute"  # lesson 06: or "swap"
    swap_space: object = None  # a lesson_utils.memory.swap.SwapSpace, for preemption_mode="swap"
    max_num_batched_tokens: int | None = None  # a token budget per step for whole prompts (no chunking)
    chunked_prefill: ChunkedPrefill | None = None  # lesson 08: prompts prefilled a chunk at a time, in its budget
    scheduler_kw: dict = field(default_factory=dict)  # lesson 06: a learner's choose_victim / reset
    step_fn: object = serve_step  # lesson 07: a learner's version of serve_step
    speculation: Speculation | None = None  # lesson 11: drafts verified in the step (Speculation(k, propose))
    stats: list[StepStats] = field(default_factory=list)
    # the memory manager the engine's scheduler decides with (None: the one the cache was sized for). The cache reads
    # no manager while a step runs: the plan carries each sequence's blocks
    manager: MemoryManager | None = None

    def __post_init__(self):
        # the swap space's data side: CPU copies of every kind the cache keeps per slot (the swap space keeps ids)
        self.host_blocks = (
            HostBlocks.for_cache(self.cache, self.swap_space.num_blocks) if self.swap_space is not None else None
        )
        if self.manager is None:
            self.manager = self.cache.manager
        self.scheduler = FCFSScheduler(
            self.manager,
            max_num_seqs=self.max_num_seqs,
            preemption_mode=self.preemption_mode,
            swap_space=self.swap_space,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked=self.chunked_prefill,
            speculation=self.speculation,
            vocab_size=self.w.vocab_size,
            plan_feeds=True,
            **self.scheduler_kw,
        )
        self.runner = ModelRunner(self.w, self.cache, self.host_blocks)
        self._step = 0

    # ---- requests in ---------------------------------------------------------------------------------
    def _request(self, prompt_ids, max_new_tokens: int, what: str = "prompt") -> Request:
        prompt_ids = check_token_ids(prompt_ids, self.w.vocab_size, what)
        _positive_int(max_new_tokens, "max_new_tokens")
        if len(prompt_ids) + max_new_tokens > self.w.max_positions:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new ones exceeds the model's "
                f"{self.w.max_positions} positions"
            )
        return Request(self.scheduler.new_seq_id(), 0.0, len(prompt_ids), max_new_tokens, prompt_ids=prompt_ids)

    def _needs_fork(self, what: str) -> None:
        if not self.manager.view.can_fork:
            raise ValueError(
                f"{what} by forking, and this cache's memory manager ({type(self.manager).__name__}) cannot "
                "fork: use a SharingBlockManager (lesson 05)"
            )

    def add_request(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        n: int = 1,
        temperature: float = 0.0,
        seed: int | None = None,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Queue a request; with ``n > 1`` its samples share the prompt's blocks (forked after the prefill).
        ``cache_salt``: its prefix-cache blocks are shared only with requests of the same salt (one per tenant).

        Returns the first sample; all ``n`` are in its ``samples`` list once they exist.
        """
        req = self._request(prompt_ids, max_new_tokens)
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError(f"cache_salt is a non-empty string (one per tenant), got {cache_salt!r}")
            req.cache_salt = cache_salt
        if _positive_int(n, "n (samples per prompt)") > 1:
            self._needs_fork(f"n={n} samples share the prompt's blocks")
        seq = Sequence(
            req,
            eos_token_id=self.w.eos_token_id if self.stop_at_eos else None,
            temperature=temperature,
            pending_forks=n - 1,
        )
        if temperature > 0:
            seq.generator = torch.Generator().manual_seed(seed if seed is not None else req.req_id)
        seq.samples = [seq]
        seq.added_at = time.perf_counter()
        self.scheduler.add(seq)  # raises NeverFits for a request the cache can never hold
        return seq

    def add_beam_search(self, prompt_ids: list[int], beam_width: int, max_new_tokens: int) -> BeamGroup:
        """Queue a fixed-length beam search (end-of-sequence is not special); its beams share blocks.

        Returns the group; once it has finished, ``group.best`` is the best beam."""
        _positive_int(beam_width, "beam_width")
        if self.speculation is not None:
            raise ValueError(
                "beam search with speculative decoding is not supported: a beam's tokens are chosen by its group, "
                "not verified one sequence at a time - use an engine without speculation for beam search"
            )
        req = self._request(prompt_ids, max_new_tokens, "beam-search prompt")
        self._needs_fork("beam search shares blocks between beams")
        root = Sequence(req)
        root.added_at = time.perf_counter()
        group = BeamGroup(beam_width, [root], [0.0])
        root.beam = group
        self.scheduler.add(root)
        return group

    def abort_request(self, seq: Sequence) -> None:
        """Cancel a request (all its samples) wherever it is; every block it holds is free afterwards.

        Raises ``ValueError`` if it has already finished or been cancelled."""
        for sample in list(seq.samples or [seq]):
            self.scheduler.abort(sample)
        seq.pending_forks = 0

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One iteration (:func:`~lesson_utils.serving.step.serve_step`, or ``step_fn``), timed and recorded;
        returns the sequences that finished in it.

        All or nothing: if anything refuses the step (non-finite logits naming a sequence, a plan function's error,
        an error in the forward pass), every sequence, block table and counter is put back as it was before the
        step (:class:`~lesson_utils.serving.checkpoint.StepCheckpoint`) and the error is raised; abort the
        sequence it names and the others are served as they would have been without it."""
        t0 = time.perf_counter()
        checkpoint = StepCheckpoint.take(self.scheduler, self.cache, self.host_blocks)
        self.runner.before_writes = checkpoint.protect
        try:
            result = self.step_fn(self.scheduler, self.runner, self._step)
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], StepPlan)):
                raise TypeError(
                    "a step returns (plan, finished): the StepPlan from scheduler.schedule(step) and the list "
                    f"scheduler.update_from_output(plan, output) returns; got {type(result).__name__}"
                )
        except BaseException:  # a refused step changes nothing: every sequence, table and counter as before it
            checkpoint.restore()
            raise
        finally:
            self.runner.before_writes = None
        plan, done = StepResult(*result)
        done = list(done)
        now = time.perf_counter()
        for seq in self.scheduler.running + done:
            if seq.first_token_step == self._step and seq.first_token_s is None:
                seq.first_token_s = now - seq.added_at
        for seq in done:
            seq.finished_s = now - seq.added_at
        self._record(plan, done, t0, now)
        self._step += 1
        return done

    def _record(self, plan: StepPlan, done: list[Sequence], t0: float, now: float) -> None:
        sch = self.scheduler
        free = sch.manager.num_free_blocks
        br = sch.manager.view.breakdown()
        work = StepWork.of_plan(plan)
        self.stats.append(
            StepStats(
                self._step,
                len(sch.running) + len(done),
                len(sch.waiting),
                -1 if free is None else free,
                plan.prefill_tokens,
                len(plan.preempted),
                now - t0,
                br[SlotKind.TOKEN],
                sum(br.values()),
                now,
                work.decodes + work.prefill_tokens + work.drafted,
                work.decodes,
                work.context_tokens,
                sum(br.values()) - br[SlotKind.FREE],
                work.drafted,
                plan.held_slots,
            )
        )

    # ---- serving --------------------------------------------------------------------------------------
    def run(self, progress: bool = False, total: int | None = None) -> None:
        """Step until nothing is left. ``progress`` shows a bar of the tokens computed (prompt tokens and
        decodes; it moves every step, so a slow step - a long prompt in the Triton interpreter - shows);
        ``total`` is the tokens expected, when known (a stop at EOS ends the bar early, a recompute adds)."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="serving", unit="token", leave=False)
        with ticking(bar):  # a slow step (a long prompt in the Triton interpreter) still shows a moving clock
            while self.scheduler.has_work:
                self.step()
                if bar is not None:
                    bar.update(self.stats[-1].tokens)
        if bar is not None:
            bar.close()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, progress: bool = False) -> list[list[int]]:
        """Serve every prompt (all arriving now); returns the generated ids of each, in order."""
        seqs = [self.add_request(p, max_new_tokens) for p in prompts]
        # every prompt token, then every new token but the last (its K/V is never needed)
        self.run(progress, total=sum(len(p) + max_new_tokens - 1 for p in prompts))
        return [s.output_ids for s in seqs]

    def beam_search(self, prompt_ids: list[int], beam_width: int, max_new_tokens: int) -> tuple[list[int], dict]:
        """Serve one beam search to the end (:meth:`add_beam_search`, then steps until it finishes).

        Needs the engine to itself (its sharing statistics count every table) and a manager that can fork.
        Returns the best beam's tokens and ``{"saving": share of blocks saved by sharing, "cow": copies made}``.
        """
        if self.scheduler.has_work:
            raise RuntimeError("beam_search needs the engine to itself: finish the queued requests first")
        group = self.add_beam_search(prompt_ids, beam_width, max_new_tokens)
        try:
            while group.best is None:
                self.step()
        except BaseException:
            for beam in group.beams:  # a failed search leaves nothing behind
                if beam.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
                    self.scheduler.abort(beam)
            raise
        return group.best.output_ids, {"saving": group.saving, "cow": self.manager.view.num_cow}
