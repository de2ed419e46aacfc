"""Lessons 03 and 05: a mini serving engine - requests in, token ids out.

Three pieces, each replaceable:

* the **scheduler** (:class:`~lesson_utils.serving.scheduler.FCFSScheduler`) decides who runs this step;
* the **memory manager** (the :class:`~lesson_utils.memory.block_manager.BlockManager` inside a
  :class:`~lesson_utils.cache.paged.PagedKVCache`, or lesson 05's
  :class:`~lesson_utils.memory.sharing.SharingBlockManager`) decides where their K/V live;
* the **model runner** runs one forward step over everyone scheduled: new sequences are prefilled
  (all their tokens not yet in the cache), running ones decode one token, side by side in one flat batch.

Replace the model runner with the accounting runner and you have the simulator (lesson 02): the same
scheduler and memory manager objects make the same decisions.

Lesson 05 adds: registering computed blocks in the prefix cache after each step, parallel sampling
(``n`` samples of one prompt share its blocks by forking after the prefill) and beam search (beams fork
and die; copy-on-write keeps their diverging last blocks apart).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field, replace

import torch

from lesson_utils.cache.seam import StepBatch
from lesson_utils.model.opt_forward import OPTWeights, forward
from lesson_utils.serving.scheduler import FCFSScheduler, StepPlan
from lesson_utils.serving.step import serve_step
from lesson_utils.types import OutOfBlocks, Request, Sequence


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
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{what} token {i} is {t!r} ({type(t).__name__}); token ids are ints")
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"{what} token {i} is {t}, outside the model's vocabulary of {vocab_size} ids (0 .. {vocab_size - 1})"
            )
        out.append(int(t))
    if not out:
        raise ValueError(f"a request needs at least one {what} token")
    return out


class ModelRunner:
    """Runs the OPT forward for a step and picks each sequence's next token."""

    def __init__(self, w: OPTWeights, cache, swap_space=None):
        self.w, self.cache, self.swap_space = w, cache, swap_space

    def apply(self, plan: StepPlan) -> None:
        """Make the plan's block copies in the cache before the forward pass (swap-ins first)."""
        if plan.swap_in or plan.swap_out:
            self.cache.swap_in(plan.swap_in, self.swap_space)
            self.cache.swap_out(plan.swap_out, self.swap_space)

    def logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed every sequence the tokens not yet in the cache; logits of each one's last token."""
        device = self.w.embed_tokens.device
        tokens = [seq.token_ids[seq.kv_len :] for seq in seqs]
        batch = StepBatch.build([s.seq_id for s in seqs], tokens, [s.kv_len for s in seqs], device=device)
        out = forward(self.w, batch, self.cache, last_only=True)
        for seq in seqs:
            seq.kv_len = len(seq.token_ids)
        return out

    @classmethod
    def sample(cls, seq: Sequence, logits: torch.Tensor) -> int:
        """One sequence's next token from its logits row (a forked sample's first token)."""
        return cls.next_tokens([seq], logits[None])[0]

    @staticmethod
    def next_tokens(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Every sequence's next token with at most two device-to-host syncs for the whole step: one for the
        greedy rows' argmax, one for the sampled rows' probabilities (each sampled on the host with its own
        generator, so a seed gives the same tokens on any device)."""
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, s in enumerate(seqs) if s.temperature > 0]
        if sampled:
            temps = torch.tensor([seqs[i].temperature for i in sampled], device=logits.device)[:, None]
            rows = torch.tensor(sampled, device=logits.device)
            probs = torch.softmax(logits[rows].float() / temps, dim=-1).cpu()
            for i, p in zip(sampled, probs):
                tokens[i] = int(torch.multinomial(p, 1, generator=seqs[i].generator))
        return tokens

    def execute(self, running: list[Sequence], step: int) -> None:
        if not running:
            return
        logits = self.logits(running)
        for seq, row, token in zip(running, logits, self.next_tokens(running, logits)):
            if seq.pending_forks:
                seq.last_logits = row  # its forked siblings sample their first token from the same logits
            seq.output_ids.append(token)
            seq.num_generated += 1
            if seq.first_token_step is None:
                seq.first_token_step = step


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


def default_step(scheduler, runner, manager, step: int) -> list[Sequence]:
    """One engine iteration, piece by piece (lesson 07's exercise, the reference its checker compares with):
    admit, make room, run, register, retire - :func:`~lesson_utils.serving.step.serve_step` without swap copies."""
    scheduler.admit(step)
    scheduler.reserve_next_slots()
    runner.execute(scheduler.running, step)
    for seq in scheduler.running:
        manager.cache_computed(seq)
    return scheduler.retire_finished(step)


@dataclass
class Engine:
    """Serve token-id requests on any cache that has a memory manager (greedy unless told otherwise)."""

    w: OPTWeights
    cache: object  # a PagedKVCache (lesson 03); anything with a ``manager`` implementing MemoryManager
    max_num_seqs: int | None = None
    stop_at_eos: bool = True
    preemption_mode: str = "recompute"  # lesson 06: or "swap"
    swap_space: object = None  # a lesson_utils.memory.swap.SwapSpace, for preemption_mode="swap"
    max_num_batched_tokens: int | None = None
    scheduler_kw: dict = field(default_factory=dict)  # e.g. a learner's choose_victim / reset
    step_fn: object = None  # lesson 07: a learner's version of default_step (no swapping, no forks)
    stats: list[StepStats] = field(default_factory=list)

    def __post_init__(self):
        if self.swap_space is not None and not self.swap_space.k:
            self.swap_space.attach_tensors(self.cache.k_cache)
        self.scheduler = FCFSScheduler(
            self.cache.manager,
            max_num_seqs=self.max_num_seqs,
            preemption_mode=self.preemption_mode,
            swap_space=self.swap_space,
            max_num_batched_tokens=self.max_num_batched_tokens,
            **self.scheduler_kw,
        )
        self.runner = ModelRunner(self.w, self.cache, self.swap_space)
        self._next_id = 0
        self._step = 0

    @property
    def manager(self):
        return self.cache.manager

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def add_request(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        n: int = 1,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> Sequence:
        """Queue a request; with ``n > 1`` its samples share the prompt's blocks (forked after the prefill).

        Returns the first sample; all ``n`` are in its ``samples`` list once they exist.
        """
        prompt_ids = check_token_ids(prompt_ids, self.w.vocab_size)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int of at least 1, got {max_new_tokens!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n (samples per prompt) must be an int of at least 1, got {n!r}")
        if n > 1 and not self.manager.can_fork:
            raise ValueError(
                f"n={n} samples share the prompt's blocks by forking, and this cache's memory manager "
                f"({type(self.manager).__name__}) cannot fork: use a SharingBlockManager (lesson 05)"
            )
        if len(prompt_ids) + max_new_tokens > self.w.max_positions:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new ones exceeds the model's "
                f"{self.w.max_positions} positions"
            )
        req = Request(self._new_id(), 0.0, len(prompt_ids), max_new_tokens, prompt_ids=list(prompt_ids))
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

    def abort_request(self, seq: Sequence) -> None:
        """Cancel a request (all its samples) wherever it is; every block it holds is free afterwards.

        Raises ``ValueError`` if it has already finished or been cancelled."""
        for sample in list(seq.samples or [seq]):
            self.scheduler.abort(sample)
        seq.pending_forks = 0

    def _fork_samples(self, parent: Sequence) -> None:
        """After the parent's prefill: n-1 siblings share its blocks and sample their own first token."""
        for i in range(parent.pending_forks):
            child = Sequence(
                replace(parent.request, req_id=self._new_id()),
                num_generated=parent.num_generated,
                admitted_step=parent.admitted_step,
                first_token_step=parent.first_token_step,
                output_ids=list(parent.output_ids[:-1]),
                eos_token_id=parent.eos_token_id,
                kv_len=parent.kv_len,
                temperature=parent.temperature,
            )
            if parent.temperature > 0:
                child.generator = torch.Generator().manual_seed(int(parent.generator.initial_seed()) + 1000 * (i + 1))
            child.output_ids.append(ModelRunner.sample(child, parent.last_logits))
            child.added_at = parent.added_at
            self.manager.fork(parent.seq_id, child.seq_id)
            parent.samples.append(child)
            self.scheduler.running.append(child)
        parent.pending_forks = 0
        parent.last_logits = None

    def step(self) -> list[Sequence]:
        """One iteration: admit, make room, run the model, register computed blocks, retire."""
        if self.step_fn is not None:
            return self._custom_step()
        t0 = time.perf_counter()
        sch = self.scheduler

        def fork_samples():  # after the prefill, a parent's n - 1 siblings share its blocks
            for seq in list(sch.running):
                if seq.pending_forks:
                    self._fork_samples(seq)

        plan, done = serve_step(sch, self.runner, self._step, after_run=fork_samples)
        now = time.perf_counter()
        preempted, prefill = plan.preempted, plan.prefill_tokens
        for seq in sch.running + done:
            if seq.first_token_step == self._step and seq.first_token_s is None:
                seq.first_token_s = now - seq.added_at
        self._record(t0, now, done, prefill, len(preempted))
        return done

    def _record(self, t0: float, now: float, done: list[Sequence], prefill: int, preempted: int) -> None:
        sch = self.scheduler
        for seq in done:
            seq.finished_s = now - seq.added_at
        free = sch.manager.num_free_blocks
        free = -1 if free is None else free
        br = sch.manager.breakdown()
        self.stats.append(
            StepStats(
                self._step,
                len(sch.running) + len(done),
                len(sch.waiting),
                free,
                prefill,
                preempted,
                now - t0,
                br["token states"],
                sum(br.values()),
                now,
            )
        )
        self._step += 1

    def _custom_step(self) -> list[Sequence]:
        t0 = time.perf_counter()
        sch = self.scheduler
        before = {id(s) for s in sch.running}
        done = self.step_fn(sch, self.runner, self.manager, self._step)
        now = time.perf_counter()
        for seq in sch.running + list(done):
            if seq.first_token_step == self._step and seq.first_token_s is None:
                seq.first_token_s = now - seq.added_at
        prefill = sum(s.len for s in sch.running if id(s) not in before)
        self._record(t0, now, list(done), prefill, 0)
        return list(done)

    def run(self, progress: bool = False, total: int | None = None) -> None:
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="serving", unit="seq", leave=False)
        while self.scheduler.has_work:
            done = self.step()
            if bar is not None:
                bar.update(len(done))
        if bar is not None:
            bar.close()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, progress: bool = False) -> list[list[int]]:
        """Serve every prompt (all arriving now); returns the generated ids of each, in order."""
        seqs = [self.add_request(p, max_new_tokens) for p in prompts]
        self.run(progress, total=len(seqs))
        return [s.output_ids for s in seqs]

    def beam_search(self, prompt_ids: list[int], beam_width: int, max_new_tokens: int) -> tuple[list[int], dict]:
        """Fixed-length beam search (end-of-sequence is not special) sharing blocks between beams.

        Each step every beam proposes its continuations; the ``beam_width`` best (sum of log-probs, ties by
        beam then token order) survive. A beam chosen more than once is forked; a beam not chosen is freed.
        Needs a manager with ``fork`` (lesson 05). Returns the best beam's tokens and sharing statistics.
        """
        if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
            raise ValueError(f"beam_width must be an int of at least 1, got {beam_width!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int of at least 1, got {max_new_tokens!r}")
        prompt_ids = check_token_ids(prompt_ids, self.w.vocab_size, "beam-search prompt")
        if len(prompt_ids) + max_new_tokens > self.w.max_positions:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new ones exceeds the model's "
                f"{self.w.max_positions} positions"
            )
        if not self.manager.can_fork:
            raise ValueError(
                f"beam search shares blocks between beams by forking, and this cache's memory manager "
                f"({type(self.manager).__name__}) cannot fork: use a SharingBlockManager (lesson 05)"
            )
        if self.scheduler.has_work:
            raise RuntimeError("beam_search needs the engine to itself: finish the queued requests first")
        mgr = self.manager
        root = Sequence(Request(self._new_id(), 0.0, len(prompt_ids), max_new_tokens, prompt_ids=list(prompt_ids)))
        mgr.check_admissible(root)
        if not mgr.can_allocate(root):
            raise OutOfBlocks("not enough free blocks to start the beam search")
        mgr.allocate(root)
        beams: list[tuple[Sequence, float]] = [(root, 0.0)]
        logical = physical = 0
        try:
            for _ in range(max_new_tokens):
                for seq, _ in beams:
                    mgr.append_slot(seq)
                logp = torch.log_softmax(self.runner.logits([s for s, _ in beams]).float(), dim=-1).cpu()
                for seq, _ in beams:
                    mgr.cache_computed(seq)
                total = torch.tensor([sc for _, sc in beams])[:, None] + logp
                order = torch.argsort(-total.flatten(), stable=True)[:beam_width].tolist()
                vocab = logp.shape[1]
                chosen = [(i // vocab, i % vocab, float(total.flatten()[i])) for i in order]
                used: set[int] = set()
                new_beams = []
                for bi, tok, score in chosen:  # forks first: a fork copies its parent before it grows
                    parent = beams[bi][0]
                    if bi in used:
                        child = Sequence(
                            replace(parent.request, req_id=self._new_id()),
                            num_generated=parent.num_generated,
                            output_ids=list(parent.output_ids),
                            kv_len=parent.kv_len,
                        )
                        mgr.fork(parent.seq_id, child.seq_id)
                        new_beams.append((child, tok, score))
                    else:
                        used.add(bi)
                        new_beams.append((parent, tok, score))
                for bi, (seq, _) in enumerate(beams):
                    if bi not in used:
                        mgr.free(seq)
                for seq, tok, _ in new_beams:
                    seq.output_ids.append(tok)
                    seq.num_generated += 1
                beams = [(seq, score) for seq, _, score in new_beams]
                lg, ph = mgr.sharing()
                logical, physical = logical + lg, physical + ph
        finally:
            for seq, _ in beams:
                if seq.seq_id in mgr.tables:
                    mgr.free(seq)
        best = max(beams, key=lambda b: b[1])[0]  # max keeps the first of equal scores
        return best.output_ids, {
            "saving": 1 - physical / logical if logical else 0.0,
            "cow": mgr.num_cow,
        }
