"""Lesson 03's mini engine: the paged cache under a real model, and the same memory manager in the simulator.

What this file proves:

* greedy decoding through ``PagedKVCache`` - by ``generate_greedy`` and by the ``Engine`` - is
  token-identical to Hugging Face ``model.generate(do_sample=False)`` run prompt by prompt (the ci
  profile's tiny random OPT, fp32), for block sizes 1, 4 and 16, with a one-token prompt, prompts that
  fill whole blocks, and sequences whose final length ends exactly on a block boundary; also when an
  early eos stops some sequences;
* under memory pressure the engine preempts (recompute) and still produces exactly the same tokens,
  keeping the block manager's invariants after every step and freeing every block at the end;
* the very same ``BlockManager`` + ``FCFSScheduler`` in the simulator finish every request with exactly
  its output length, leak no block, keep the token-state share of the budget far above the contiguous
  Max policy's on the same stream and budget, and with ``block_size=1`` waste nothing inside blocks;
* ``Engine.add_request`` refuses impossible requests with clear errors.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from helpers import ReservingPagedKVCache, assert_simulation_complete, hf_greedy

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.types import NeverFits
from lesson_utils.lab import workloads
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.memory.reservation import ContiguousReservationManager
from lesson_utils.model.generate import generate_greedy
from lesson_utils.serving import simulator
from lesson_utils.serving.engine import Engine

N_NEW = 8
# Lengths chosen around block boundaries for block sizes 1, 4 and 16 with N_NEW = 8 new tokens:
#   1          a one-token prompt (just bos, in real use)
#   4, 16      prompts that fill whole blocks at prefill
#   8, 24, 40  final length (prompt + 8 = 16, 32, 48) ends exactly on a block boundary
#   9, 25      the last token's K/V (prompt + 7 tokens are ever written) ends exactly on a boundary
#   5, 13      neither
PROMPT_LENS = [1, 4, 16, 8, 24, 40, 9, 25, 5, 13]


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    _, w = tiny
    rng = random.Random(0)
    return [[rng.randrange(4, w.vocab_size) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(tiny, prompts) -> list[list[int]]:
    model, w = tiny
    out = [hf_greedy(model, p, N_NEW, w.eos_token_id) for p in prompts]
    # No early eos: every sequence really reaches its planned, block-aligned final length.
    assert all(len(o) == N_NEW for o in out)
    return out


def plenty_of_blocks(block_size: int) -> int:
    return sum(blocks_needed(n + N_NEW, block_size) for n in PROMPT_LENS) + 2


def spy_on_frees(manager: BlockManager) -> dict[int, tuple[int, int]]:
    """Record (blocks, tokens) of every table at the moment it is freed."""
    seen: dict[int, tuple[int, int]] = {}
    free_seq = manager.free

    def spy(seq_id: int):
        t = manager.view.tables()[seq_id]
        seen[seq_id] = (len(t.blocks), t.num_tokens)
        return free_seq(seq_id)

    manager.free = spy
    return seen


def assert_all_free(manager: BlockManager) -> None:
    manager.view.check_invariants()
    assert not manager.view.tables()
    assert manager.num_free_blocks == manager.view.num_blocks
    assert all(manager.view.block_is_free(b) for b in range(manager.view.num_blocks))


# ---------------------------------------------------------------------------------------------------
# Token-identical to Hugging Face
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_generate_greedy_through_paged_cache_matches_hf(tiny, prompts, expected, block_size):
    _, w = tiny
    cache = ReservingPagedKVCache.for_model(w, plenty_of_blocks(block_size), block_size)
    seen = spy_on_frees(cache.manager)
    got = generate_greedy(w, cache, prompts, N_NEW)
    assert got == expected
    assert_all_free(cache.manager)
    for sid, n in enumerate(PROMPT_LENS):  # the last generated token is never fed back: n + 7 K/V
        assert seen[sid] == (blocks_needed(n + N_NEW - 1, block_size), n + N_NEW - 1)
    if block_size > 1:  # some tables really were exactly full when freed
        assert any(tokens == blocks * block_size for blocks, tokens in seen.values())


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_engine_matches_hf(tiny, prompts, expected, block_size):
    _, w = tiny
    cache = PagedKVCache.for_model(w, plenty_of_blocks(block_size), block_size)
    seen = spy_on_frees(cache.manager)
    engine = Engine(w, cache)
    got = engine.generate(prompts, N_NEW)
    assert got == expected
    assert engine.scheduler.num_preemptions == 0
    assert len(engine.scheduler.finished) == len(prompts) and not engine.scheduler.has_work
    assert_all_free(cache.manager)
    for sid, n in enumerate(PROMPT_LENS):  # the engine holds a slot for each token it generates
        assert seen[sid] == (blocks_needed(n + N_NEW, block_size), n + N_NEW)
    if block_size > 1:
        assert any(tokens == blocks * block_size for blocks, tokens in seen.values())
    assert engine.stats[0].prefill_tokens == sum(PROMPT_LENS)  # everyone prefilled together in step 0
    assert [s.free_blocks for s in engine.stats][-1] == cache.manager.view.num_blocks


def test_early_eos_stops_the_same_way_as_hf(tiny, prompts, expected):
    """With an 'eos' that some sequences emit, both paths stop right after it, like HF."""
    model, w = tiny
    counts = {t: sum(t in out for out in expected) for out in expected for t in out}
    eos = min(counts, key=lambda t: (abs(counts[t] - len(prompts) / 2), t))
    w_eos = dataclasses.replace(w, eos_token_id=eos)
    want = [hf_greedy(model, p, N_NEW, eos) for p in prompts]
    assert any(len(o) < N_NEW for o in want) and any(len(o) == N_NEW for o in want)
    cache = ReservingPagedKVCache.for_model(w_eos, plenty_of_blocks(4), 4)
    assert generate_greedy(w_eos, cache, prompts, N_NEW) == want
    assert_all_free(cache.manager)
    engine = Engine(w_eos, PagedKVCache.for_model(w_eos, plenty_of_blocks(4), 4))
    assert engine.generate(prompts, N_NEW) == want
    assert_all_free(engine.cache.manager)
    no_stop = Engine(w_eos, PagedKVCache.for_model(w_eos, plenty_of_blocks(4), 4), stop_at_eos=False)
    assert no_stop.generate(prompts, N_NEW) == expected


# ---------------------------------------------------------------------------------------------------
# Memory pressure: preemption by recompute
# ---------------------------------------------------------------------------------------------------


def test_preemption_under_memory_pressure_keeps_outputs_identical(tiny):
    _, w = tiny
    rng = random.Random(1)
    lens = [1, 7, 12, 3, 16, 9, 5, 11]
    batch = [[rng.randrange(4, w.vocab_size) for _ in range(n)] for n in lens]
    n_new, block_size = 14, 4

    roomy = Engine(w, PagedKVCache.for_model(w, 64, block_size), stop_at_eos=False)  # every request runs to n_new
    reference = roomy.generate(batch, n_new)
    assert roomy.scheduler.num_preemptions == 0

    # 9 blocks = 36 slots: the longest request (16 + 14 = 30 tokens) fits alone, never all of them.
    cache = PagedKVCache.for_model(w, 9, block_size, watermark=0.0)
    engine = Engine(w, cache, stop_at_eos=False)
    seqs = [engine.add_request(p, n_new) for p in batch]
    while engine.scheduler.has_work:
        engine.step()
        cache.manager.view.check_invariants()
        running = engine.scheduler.running
        assert set(cache.manager.view.tables()) == {s.seq_id for s in running}
        for s in running:  # a running sequence holds exactly its tokens, no more, no less
            assert cache.manager.view.tables()[s.seq_id].num_tokens == s.len
        assert engine.stats[-1].free_blocks == cache.manager.num_free_blocks
    assert engine.scheduler.num_preemptions > 0
    assert sum(s.preempted for s in engine.stats) == engine.scheduler.num_preemptions
    assert any(s.preemptions > 0 for s in seqs)
    assert [s.output_ids for s in seqs] == reference
    assert all(s.is_finished and len(s.output_ids) == n_new for s in seqs)
    assert_all_free(cache.manager)


# ---------------------------------------------------------------------------------------------------
# The same memory manager in the simulator
# ---------------------------------------------------------------------------------------------------


def _simulate_paged(requests, slots: int, block_size: int):
    manager = BlockManager(slots // block_size, block_size)
    res = simulator.simulate(requests, manager, progress=False)
    assert sorted(r.req_id for r in requests) == [r.req_id for r in requests]
    assert_simulation_complete(res, requests, manager.view.total_slots)
    assert_all_free(manager)  # no leaks
    assert not res.kinds["reserved"].any()
    return res


@pytest.mark.parametrize(
    "stream,slots", [(workloads.sharegpt_like, 40_000), (workloads.alpaca_like, 8_192)], ids=["sharegpt", "alpaca"]
)
def test_simulated_paging_beats_contiguous_max_on_the_same_stream(stream, slots):
    """Budgets small enough that both managers are memory-bound (requests wait) for part of the run."""
    requests = stream(300, rate_per_s=300, seed=0)
    paged = _simulate_paged(requests, slots, 16)
    contiguous = simulator.simulate(requests, ContiguousReservationManager(slots, "max"), progress=False)
    assert len(contiguous.finished) == len(requests)
    assert paged.saturated.any() and contiguous.saturated.any()  # both were memory-bound for a while
    paged_tokens = paged.mean_breakdown()["token states"]
    max_tokens = contiguous.mean_breakdown()["token states"]
    assert paged_tokens > 80 and max_tokens < 40, (paged_tokens, max_tokens)
    assert paged.mean_running() > 2 * contiguous.mean_running()
    assert paged.steps[-1] < contiguous.steps[-1]  # more requests at once: the stream is served sooner


def test_simulated_paging_with_block_size_one_wastes_nothing():
    res = _simulate_paged(workloads.alpaca_like(300, rate_per_s=300, seed=1), 8_192, 1)
    assert res.saturated.any()
    assert not res.kinds["internal fragmentation"].any()


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------


def test_add_request_errors(tiny):
    _, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, 40, 16))  # 640 slots: more than the model's 512 positions
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.add_request([], 4)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_new_tokens must be an int of at least 1, got {bad}"):
            engine.add_request([5, 6], bad)
    with pytest.raises(ValueError, match="a prompt of 500 tokens plus 13 new ones exceeds the model's 512 positions"):
        engine.add_request([5] * 500, 13)
    assert not engine.scheduler.waiting  # nothing half-added
    engine.add_request([5] * 500, 12)  # exactly 512 positions: allowed

    small = Engine(w, PagedKVCache.for_model(w, 4, 4))  # 16 slots
    with pytest.raises(NeverFits, match=r"may reach 17 tokens = 5 blocks of 4.*whole cache \(4 blocks\)"):
        small.add_request([5] * 10, 7)
    assert not small.scheduler.waiting
    assert small.generate([[5] * 10], 6) == [small.scheduler.finished[0].output_ids]  # 16 tokens: fits
    assert_all_free(small.cache.manager)
