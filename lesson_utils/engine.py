"""Lesson 03: a mini serving engine - requests in, token ids out.

Three pieces, each replaceable:

* the **scheduler** (:class:`~lesson_utils.scheduler.FCFSScheduler`) decides who runs this step;
* the **memory manager** (here the :class:`~lesson_utils.block_manager.BlockManager` inside a
  :class:`~lesson_utils.paged_cache.PagedKVCache`) decides where their K/V live;
* the **model runner** runs one forward step over everyone scheduled: new sequences are prefilled
  (all their tokens), running ones decode one token, side by side in one flat batch.

Replace the model runner with the accounting runner and you have the simulator (lesson 02): the same
scheduler and memory manager objects make the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_cache import StepBatch
from .opt_forward import OPTWeights, forward
from .scheduler import FCFSScheduler, Sequence
from .workloads import Request


class ModelRunner:
    """Runs the OPT forward for a step and picks the next token of each sequence (greedy)."""

    def __init__(self, w: OPTWeights, cache):
        self.w, self.cache = w, cache

    def execute(self, running: list[Sequence], step: int) -> None:
        if not running:
            return
        device = self.w.embed_tokens.device
        tokens = [seq.token_ids[seq.kv_len :] for seq in running]
        batch = StepBatch.build([s.seq_id for s in running], tokens, [s.kv_len for s in running], device=device)
        next_ids = forward(self.w, batch, self.cache, last_only=True).argmax(dim=-1).tolist()
        for seq, tok in zip(running, next_ids):
            seq.kv_len = len(seq.token_ids)
            seq.output_ids.append(int(tok))
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


@dataclass
class Engine:
    """Serve token-id requests with greedy decoding on any cache that has a memory manager."""

    w: OPTWeights
    cache: object  # a PagedKVCache (lesson 03); anything with a ``manager`` implementing MemoryManager
    max_num_seqs: int | None = None
    stop_at_eos: bool = True
    stats: list[StepStats] = field(default_factory=list)

    def __post_init__(self):
        self.scheduler = FCFSScheduler(self.cache.manager, max_num_seqs=self.max_num_seqs)
        self.runner = ModelRunner(self.w, self.cache)
        self._next_id = 0
        self._step = 0

    def add_request(self, prompt_ids: list[int], max_new_tokens: int) -> Sequence:
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.w.max_positions:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new ones exceeds the model's "
                f"{self.w.max_positions} positions"
            )
        req = Request(self._next_id, 0.0, len(prompt_ids), max_new_tokens, prompt_ids=list(prompt_ids))
        self._next_id += 1
        seq = Sequence(req, eos_token_id=self.w.eos_token_id if self.stop_at_eos else None)
        self.scheduler.add(seq)  # raises NeverFits for a request the cache can never hold
        return seq

    def step(self) -> list[Sequence]:
        """One iteration: admit, make room, run the model, retire. Returns the sequences that finished."""
        sch = self.scheduler
        sch.admit(self._step)
        preempted = sch.reserve_next_slots()
        if not sch.running and sch.waiting:
            raise RuntimeError("the head request cannot be admitted even into an empty cache")
        prefill = sum(len(s.token_ids) for s in sch.running if s.kv_len == 0)
        self.runner.execute(sch.running, self._step)
        done = sch.retire_finished(self._step)
        free = getattr(sch.manager, "allocator", None)
        self.stats.append(
            StepStats(self._step, len(sch.running) + len(done), len(sch.waiting),
                      free.num_free if free is not None else -1, prefill, len(preempted))
        )
        self._step += 1
        return done

    def generate(self, prompts: list[list[int]], max_new_tokens: int, progress: bool = False) -> list[list[int]]:
        """Serve every prompt (all arriving now); returns the generated ids of each, in order."""
        seqs = [self.add_request(p, max_new_tokens) for p in prompts]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="serving", unit="req", leave=False)
        while self.scheduler.has_work:
            done = self.step()
            if bar is not None:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return [s.output_ids for s in seqs]
