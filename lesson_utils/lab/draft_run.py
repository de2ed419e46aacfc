"""Lesson 11's draft-model run: a smaller model of the same family drafts for a larger one, both on paged caches
cut from ONE KV budget (the lookahead and the draft's own K/V are memory the target's sequences do not get).

It needs real weights to mean anything (a random draft model's guesses are noise) and is worth timing only on a
GPU, so the lesson runs it in the gpu profile with pretrained weights and says plainly where it is skipped; the
tests run it on tiny random models, where greedy identity and every block coming back still hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.lab import spec_math, timing
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving.draft_model import DraftModelProposer
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.speculative import Speculation


def kv_bytes_per_block(w, block_size: int, dtype_bytes: int) -> int:
    """Bytes one block of ``w``'s cache holds: K and V, every layer, every KV head."""
    return 2 * w.num_layers * w.num_kv_heads * w.head_dim * block_size * dtype_bytes


def split_budget(target_w, draft_w, budget_bytes: int, draft_share: float, block_size: int, dtype_bytes: int):
    """``(target blocks, draft blocks)``: ``draft_share`` of ``budget_bytes`` to the draft model's cache, the rest
    to the target's, each in its own model's block size in bytes."""
    if not 0 < draft_share < 1:
        raise ValueError(f"the draft's share of the KV budget is in (0, 1), got {draft_share}")
    draft = int(budget_bytes * draft_share) // kv_bytes_per_block(draft_w, block_size, dtype_bytes)
    target = int(budget_bytes * (1 - draft_share)) // kv_bytes_per_block(target_w, block_size, dtype_bytes)
    if draft < 1 or target < 1:
        raise ValueError(f"a budget of {budget_bytes} bytes leaves a cache without a single block")
    return target, draft


@dataclass
class DraftModelRun:
    """What the draft-model run measured: greedy identity with the target alone, every block back in both caches,
    the drafts kept, and the tokens/s of plain greedy vs speculation (the timing protocol's medians and spread)."""

    identical: bool
    all_free: bool
    target_blocks: int
    draft_blocks: int
    tokens_per_verify_step: float
    kept_by_position: list[float | None]
    speed: timing.Measurement

    def speedup(self) -> timing.Ratio:
        return self.speed.ratio("draft model", "plain")


def run_draft_model(
    target_w,
    draft_w,
    prompts: list[list[int]],
    new_tokens: int,
    k: int,
    *,
    budget_bytes: int,
    dtype_bytes: int,
    draft_share: float = 0.25,
    block_size: int = 16,
    repeats: int = 3,
    sync: Callable[[], None] | None = None,
) -> DraftModelRun:
    """Serve ``prompts`` one at a time (batch 1) with the target alone and with the draft model proposing ``k``
    tokens, both inside ``budget_bytes`` of KV; check the tokens are identical and every block comes back."""
    n_target, n_draft = split_budget(target_w, draft_w, budget_bytes, draft_share, block_size, dtype_bytes)
    plain_blocks = budget_bytes // kv_bytes_per_block(target_w, block_size, dtype_bytes)

    def engines(speculate: bool):
        if not speculate:
            return Engine(target_w, PagedKVCache.for_model(target_w, plain_blocks, block_size), stop_at_eos=False), None
        draft_cache = PagedKVCache.for_model(draft_w, manager=SharingBlockManager(n_draft, block_size))
        proposer = DraftModelProposer(Engine(draft_w, draft_cache, stop_at_eos=False), target_w.vocab_size)
        cache = PagedKVCache.for_model(target_w, n_target, block_size)
        return Engine(target_w, cache, stop_at_eos=False, speculation=Speculation(k, proposer)), proposer

    outputs, verified, free = {}, [], True

    def serve(speculate: bool):
        def run():
            out = []
            for p in prompts:
                e, proposer = engines(speculate)
                out += e.generate([p], new_tokens)
                verified.extend(e.scheduler.verified)
                nonlocal free
                free &= e.manager.num_free_blocks == e.manager.view.num_blocks
                if proposer is not None:
                    free &= not proposer.engine.manager.view.tables_now()
            outputs[speculate] = out
            return len(prompts) * new_tokens

        return run

    speed = timing.measure(
        {"plain": serve(False), "draft model": serve(True)},
        repeats=repeats,
        warmup=1,
        value=lambda n, s: n / s,
        unit="tok/s",
        sync=sync,
    )
    return DraftModelRun(
        outputs[False] == outputs[True],
        free,
        n_target,
        n_draft,
        spec_math.tokens_per_verify_step(verified),
        spec_math.acceptance_by_position(verified, k),
        speed,
    )
