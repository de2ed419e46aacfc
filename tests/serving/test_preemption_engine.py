"""Lesson 06 through the real engine: preemption by recompute and by swapping, under memory that runs out.

What this file proves:

* through the real ``Engine`` (the ci profile's tiny random OPT, fp32), with a cache far too small for the
  batch, in both preemption modes (``"recompute"``, ``"swap"``) and on lesson 03's ``BlockManager`` and
  lesson 05's ``SharingBlockManager`` (prefix cache on and off): preemptions really happen, and of the mode
  asked for; every request still finishes with exactly the tokens of an unconstrained run and of Hugging
  Face ``generate`` (greedy, prompt by prompt); swapping never prefills a token twice, recompute does; after
  every step the managers' invariants hold, running sequences hold GPU tables, swapped ones CPU tables and
  waiting ones neither, every CPU block's count equals the number of CPU tables holding it, and every
  running sequence's cached K/V (read through its block table) are bit-for-bit the ones it had computed -
  swap-out/swap-in, copy-on-write and forks move K/V but never change them (a direct check: the tiny random
  model's near-uniform attention would hide corrupted K from a token comparison); at the end every GPU and
  every CPU block is free;
* parallel sampling (``n = 3`` forked samples sharing their prompt's blocks) under swap pressure: siblings
  swapped out in the same step copy their shared blocks once (fewer copies than blocks in the victims'
  tables), come back sharing them again, and still produce HF's tokens - also with another victim policy
  plugged in (oldest first), which preempts samples that already made room (copy-on-write included) this
  step;
* the same scheduler in the simulator, over 400 seeded random workloads (block sizes 1 / 2 / 4 / 8, both
  modes, prefix cache on and off, parallel sampling, swap spaces from 0 blocks up, token budgets or none,
  random arrivals, the default victim policy or another): every request and sample finishes with exactly
  its output length; invariants hold after every step (GPU and CPU side); a shadow of every slot's contents,
  moved by the copies the engine would make in its order, shows that sequences coming back from swap or
  starting on cached prefix blocks find their own K/V; every step's batch keeps to the token budget (unless
  one request alone exceeds it); nothing leaks; with the default policy the victim is always the latest
  admitted, swapped sequences return in the order they left and before anyone new is admitted; a fallback
  to recompute happens exactly when the swap space cannot hold the victim, with a note saying so;
  preemptions, swaps, fallbacks, prefix hits and forks all happen in a good share of the workloads;
* errors and limits: a request larger than the whole cache is refused at ``Engine.add_request``,
  ``FCFSScheduler.add`` and by the simulator (``NeverFits``, a clear message); ``"swap"`` without a swap
  space, an unknown mode, ``SwapSpace(-1)`` and a non-positive token budget are ``ValueError``; a swap space
  too small for any victim serves every request correctly (by recompute, with the note); the engine never
  batches more tokens than ``max_num_batched_tokens`` allows, a prompt that waits for the budget is not
  overtaken, and a sequence swapped out before its prefill ran counts its whole prompt when it comes back
  (and waits for the budget as a new request would);
* the victim is the most recently admitted sequence (ties: the later in the batch), and swapped sequences
  come back, in the order they left, before any new request is admitted (even one that would fit).
"""

from __future__ import annotations

import random
import re

import pytest
from helpers import hf_greedy
from helpers.preemption import FALLBACK, MANAGERS, SwapSpy, assert_all_free, make_manager, oldest_first, serve

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.types import NeverFits, Request, Sequence
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.serving import simulator
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.scheduler import FCFSScheduler, most_recently_admitted

# ---------------------------------------------------------------------------------------------------
# 1. The engine under memory pressure: token-identical in both modes, on every manager
# ---------------------------------------------------------------------------------------------------

N_NEW = 12
BLOCK = 4
# Prompts 3..17 tokens; three start with the same 9 tokens (two whole blocks of 4 for the prefix cache).
PROMPT_LENS = [9, 3, 14, 6, 17, 11]
SHARED = 9


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    _, w = tiny
    rng = random.Random(6)
    shared = [rng.randrange(4, w.vocab_size) for _ in range(SHARED)]
    out = [[rng.randrange(4, w.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    for i in (2, 4, 5):
        out[i][:SHARED] = shared
    return out


@pytest.fixture(scope="module")
def expected(tiny, prompts) -> list[list[int]]:
    model, w = tiny
    return [hf_greedy(model, p, N_NEW, w.eos_token_id) for p in prompts]


def tight_blocks(prompts, n_new: int, block_size: int) -> int:
    """Just enough for the longest request alone (plus one block), far from the batch's needs."""
    return max(blocks_needed(len(p) + n_new, block_size) for p in prompts) + 1


def test_prompts_make_a_demanding_workload(tiny, prompts, expected):
    """The reference really needs several blocks per request, and the tight cache holds a fraction of them."""
    assert all(len(o) >= 4 for o in expected)
    need = sum(blocks_needed(len(p) + len(o), BLOCK) for p, o in zip(prompts, expected))
    assert tight_blocks(prompts, N_NEW, BLOCK) * 3 < need


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_engine_matches_unconstrained_run_and_hf(tiny, prompts, expected, kind, mode):
    _, w = tiny
    _, roomy = serve(w, prompts, N_NEW, kind=kind, num_blocks=128)
    assert roomy == expected

    swap = 64 if mode == "swap" else None
    engine, got = serve(
        w, prompts, N_NEW, kind=kind, mode=mode, num_blocks=tight_blocks(prompts, N_NEW, BLOCK), swap_blocks=swap
    )
    sch = engine.scheduler
    assert sch.events, "no preemption: the cache was not tight enough to test anything"
    assert {e.mode for e in sch.events} == {mode}
    assert all(e.note == "" for e in sch.events)  # the swap space was large enough every time
    assert sum(s.preempted for s in engine.stats) == sch.num_preemptions
    assert got == expected
    assert engine.watch.checked > 0
    if mode == "swap":
        spy = engine.spy
        assert len(spy.out) == len(sch.events) and len(spy.back) == len(spy.out)  # every swapped sequence came back
        assert engine.swap_space.blocks_in >= engine.swap_space.blocks_out > 0
    once = sum(len(p) + len(o) - 1 for p, o in zip(prompts, expected))  # every token fed exactly once...
    if kind == "paged" or kind == "sharing":
        fed = sum(t for t, _ in engine.fed)
        assert (fed == once) if mode == "swap" else (fed > once)  # ...unless recomputed
    if kind == "prefix-cache" and mode == "recompute":
        assert engine.manager.view.cached_prompt_tokens > 0  # readmissions and shared prompts hit the cache


@pytest.mark.parametrize("kind", ["sharing", "prefix-cache"])
def test_parallel_samples_swap_their_shared_blocks_once(tiny, prompts, expected, kind):
    """n = 3 greedy samples per prompt: all equal HF's continuation; shared blocks cross the bus once."""
    _, w = tiny
    picked = [0, 2, 4]
    batch = [prompts[i] for i in picked]
    engine, got = serve(
        w, batch, N_NEW, kind=kind, mode="swap", num_blocks=tight_blocks(batch, N_NEW, BLOCK) + 3, swap_blocks=64, n=3
    )
    assert got == [[expected[i]] * 3 for i in picked]
    sch, spy = engine.scheduler, engine.spy
    assert sch.events and {e.mode for e in sch.events} == {"swap"}
    out_steps, in_steps = SwapSpy.by_step(spy.out), SwapSpy.by_step(spy.back)
    # some step swapped out several sequences that shared blocks: fewer copies than blocks in their tables
    assert any(victims > 1 and copies < blocks for victims, blocks, copies in out_steps.values()), out_steps
    assert any(victims > 1 and copies < blocks for victims, blocks, copies in in_steps.values()), in_steps
    # a copy per distinct block, never more; totals agree with the swap space's counters
    assert engine.swap_space.blocks_out == sum(c for _, _, c in out_steps.values())
    assert engine.swap_space.blocks_in == sum(c for _, _, c in in_steps.values())
    assert engine.swap_space.blocks_out < sum(b for _, b, _ in out_steps.values())


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("kind", ["sharing", "prefix-cache"])
def test_a_pluggable_victim_policy_keeps_outputs_and_kv_exact(tiny, prompts, expected, kind, mode):
    """With ``choose_victim=oldest_first`` the victim is often a sample that already copied-on-write its last
    block this step (the copy itself happens in the forward, after the swap copies): its swapped-out K/V must
    still be the ones it computed."""
    _, w = tiny
    batch = prompts[:4]
    engine, got = serve(
        w,
        batch,
        N_NEW,
        kind=kind,
        mode=mode,
        num_blocks=tight_blocks(batch, N_NEW, BLOCK) + 3,
        swap_blocks=64 if mode == "swap" else None,
        n=3,
        choose_victim=oldest_first,
    )
    assert got == [[e] * 3 for e in expected[:4]]
    assert engine.scheduler.events and {e.mode for e in engine.scheduler.events} == {mode}
    assert engine.manager.view.num_cow > 0 and engine.watch.checked > 0
    assert any(v is not most_recently_admitted(r) for r, v in engine.victim_log)  # the policy really differed


# ---------------------------------------------------------------------------------------------------
# 3. Errors and limits
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_larger_than_the_whole_cache_never_fits(tiny, kind, mode):
    _, w = tiny
    message = r"may reach 17 tokens = 5 blocks of 4, more than the whole cache \(4 blocks\)"
    space = SwapSpace(64) if mode == "swap" else None
    engine = Engine(
        w,
        PagedKVCache.for_model(w, manager=make_manager(kind, 4, 4, w.max_positions)),
        preemption_mode=mode,
        swap_space=space,
    )
    with pytest.raises(NeverFits, match=message):
        engine.add_request([5] * 10, 7)
    assert not engine.scheduler.has_work  # nothing half-added
    sch = FCFSScheduler(make_manager(kind, 4, 4), preemption_mode=mode, swap_space=space)
    with pytest.raises(NeverFits, match=message):
        sch.add(Sequence(Request(0, 0.0, 10, 7)))
    assert not sch.has_work
    with pytest.raises(NeverFits, match="more than the whole cache"):  # the simulator fails fast, too
        simulator.simulate([Request(0, 0.0, 10, 7)], sch.manager, scheduler=sch, progress=False)
    # exactly the whole cache is fine, even though it must then run alone
    assert len(engine.generate([[5] * 10, [6] * 9], 6)) == 2
    assert_all_free(engine.manager, space)


def test_bad_settings_are_refused(tiny):
    _, w = tiny
    m = BlockManager(8, 4)
    with pytest.raises(ValueError, match="preemption_mode='swap' needs a swap_space"):
        FCFSScheduler(m, preemption_mode="swap")
    with pytest.raises(ValueError, match="needs a swap_space"):
        Engine(w, PagedKVCache.for_model(w, 8, 4), preemption_mode="swap")
    for mode in ("lru", "Swap", "", None):
        with pytest.raises(ValueError, match=r"preemption_mode is 'recompute' or 'swap', got"):
            FCFSScheduler(m, preemption_mode=mode, swap_space=SwapSpace(4))
    for bad in (-1, -10, 2.5, "4", None):
        with pytest.raises(ValueError, match="non-negative number of blocks"):
            SwapSpace(bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_num_batched_tokens must be a positive int, got {bad}"):
            FCFSScheduler(m, max_num_batched_tokens=bad)
        with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive int"):
            Engine(w, PagedKVCache.for_model(w, 8, 4), max_num_batched_tokens=bad)
    empty = SwapSpace(0)
    assert empty.num_blocks == 0 and empty.num_free == 0 and not empty.cpu_tables


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("swap_blocks", [0, 2])
def test_a_swap_space_too_small_falls_back_to_recompute(tiny, prompts, expected, kind, swap_blocks):
    """0 CPU blocks: every victim is recomputed; 2: whoever does not fit is. Outputs stay exact."""
    _, w = tiny
    engine, got = serve(
        w,
        prompts,
        N_NEW,
        kind=kind,
        mode="swap",
        num_blocks=tight_blocks(prompts, N_NEW, BLOCK),
        swap_blocks=swap_blocks,
    )
    assert got == expected
    events = engine.scheduler.events
    fallbacks = [e for e in events if e.mode == "recompute"]
    assert fallbacks, "no victim was too large for the swap space"
    for e in fallbacks:
        assert re.fullmatch(rf"swap space full \(\d+ of {swap_blocks} CPU blocks free\): {FALLBACK}", e.note), e.note
    assert all(e.note == "" for e in events if e.mode == "swap")
    if swap_blocks == 0:
        assert len(fallbacks) == len(events) and engine.spy.out == [] and engine.swap_space.blocks_out == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_engine_keeps_to_the_token_budget(tiny, prompts, expected, mode):
    """Budget 10: prefill + decode tokens per step stay within it, except a prompt longer than the budget,
    which then runs alone (else it could never start). Outputs are unchanged."""
    _, w = tiny
    budget = 10
    roomy, unlimited = serve(w, prompts, N_NEW, num_blocks=128)
    assert roomy.fed[0] == (sum(map(len, prompts)), len(prompts))  # without a budget: everyone at once
    engine, got = serve(
        w,
        prompts,
        N_NEW,
        kind="prefix-cache",
        mode=mode,
        budget=budget,
        num_blocks=tight_blocks(prompts, N_NEW, BLOCK),
        swap_blocks=64 if mode == "swap" else None,
    )
    assert got == expected == unlimited
    fed = engine.fed
    assert all(tokens <= budget or seqs == 1 for tokens, seqs in fed), fed
    assert any(tokens > budget and seqs == 1 for tokens, seqs in fed)  # the 14- and 17-token prompts, alone
    assert engine.scheduler.events
