"""Lesson 05 under a real model: the prefix cache, parallel sampling and beam search in the ``Engine``.

What this file proves (the ci profile's tiny random OPT, fp32, ``SharingBlockManager`` behind
``PagedKVCache``):

* **prefix caching changes no token.** Prompts that share a long system prompt give exactly Hugging Face
  ``generate``'s greedy tokens (prompt by prompt) with the prefix cache on and off - served one after
  another, where each later prompt starts from exactly the cached blocks an independent count predicts
  (the system prompt, a duplicate prompt, a follow-up that extends an earlier prompt *and its answer*, a
  prompt that is exactly the cached system prompt so only its last token is recomputed), and served all
  at once; also under memory pressure, where preempted sequences are re-admitted with prefix hits.
  Afterwards every block is free (count 0) while the system prompt's blocks are still findable;
* **parallel sampling** (``add_request(n=4)``): greedy samples are identical to each other and to HF
  greedy; sampled ones (temperature 1, a seed) differ from each other, are reproducible from the seed, and
  each one equals a cache-free decode (HF forward over the whole sequence each step) that draws from the
  same generator - so the forked samples never read each other's K/V. Copy-on-write happened exactly
  ``n - 1`` times, and no block leaks;
* **beam search** (``Engine.beam_search``) returns exactly what a plain reference beam search returns that
  recomputes every beam from scratch with HF (no cache): scores summed in fp32, top ``k`` of the flattened
  ``[beams, vocab]`` scores with ties to the lower flat index, the best = the first beam of maximal score -
  for ``k`` = 1, 2, 4, with prefix caching on and off; ``k = 1`` is HF greedy; beams really share blocks;
  nothing leaks. HF's own beam search is *not* the reference: its end-of-sequence bookkeeping and length
  penalty make it a different algorithm from this fixed-length beam search;
* **the simulator** with ``SharingBlockManager`` on a shared-system-prompt stream finishes every request
  with its output length, leaks nothing, serves a large share of prompt tokens from the cache and holds far
  fewer blocks on average than with the prefix cache off.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import assert_simulation_complete, hf_greedy, reference_beam_search

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.lab import workloads
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving import simulator
from lesson_utils.serving.engine import Engine

N_NEW = 8
BS = 4
SYSTEM_LEN = 40  # ten whole blocks of 4
USER_LENS = [5, 3, 0, 12, 1, 4]  # 0: the prompt is exactly the system prompt (a multiple of the block size)


def sharing_engine(w, num_blocks: int, *, caching: bool = True, watermark: float = 0.01) -> Engine:
    manager = SharingBlockManager(
        num_blocks, BS, enable_prefix_caching=caching, watermark=watermark, max_seq_len=w.max_positions
    )
    return Engine(w, PagedKVCache.for_model(w, manager=manager))


def assert_all_free(m: SharingBlockManager) -> None:
    m.view.check_invariants()
    assert not m.view.tables() and m.num_free_blocks == m.view.num_blocks
    assert [m.view.ref_count(b) for b in range(m.view.num_blocks)] == [0] * m.view.num_blocks and all(
        m.view.block_is_free(b) for b in range(m.view.num_blocks)
    )


# ---------------------------------------------------------------------------------------------------
# Prefix caching: token-identical, on or off, one by one or all at once, with or without preemption
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def system_prompts(tiny):
    """Prompts = one shared system prompt + a user part; the last is a duplicate of the first."""
    _, w = tiny
    rng = random.Random(5)
    system = [rng.randrange(4, w.vocab_size) for _ in range(SYSTEM_LEN)]
    prompts = [system + [rng.randrange(4, w.vocab_size) for _ in range(n)] for n in USER_LENS]
    return system, prompts + [list(prompts[0])]


@pytest.fixture(scope="module")
def system_expected(tiny, system_prompts):
    model, w = tiny
    _, prompts = system_prompts
    out = [hf_greedy(model, p, N_NEW, w.eos_token_id) for p in prompts]
    assert all(len(o) == N_NEW for o in out)  # no early eos: every sequence runs its full length
    return out


def expected_cached_tokens(prompt: list[int], computed: list[list[int]]) -> int:
    """Prompt tokens a fresh request finds in the cache: whole blocks of the longest prefix it shares with
    the computed tokens of an earlier sequence (nothing evicted), leaving its last token out."""
    best = 0
    for c in computed:
        n = 0
        while (n + 1) * BS <= min(len(prompt) - 1, len(c)) and prompt[: (n + 1) * BS] == c[: (n + 1) * BS]:
            n += 1
        best = max(best, n)
    return best * BS


def test_prefix_cache_one_after_another_matches_hf_and_caching_off(tiny, system_prompts, system_expected):
    model, w = tiny
    system, prompts = system_prompts
    # a follow-up turn: the first prompt, its answer (computed, so cached: all but the newest token) and more
    follow_up = prompts[0] + system_expected[0] + [7, 8, 9]
    prompts = prompts + [follow_up]
    expected = system_expected + [hf_greedy(model, follow_up, N_NEW, w.eos_token_id)]
    plenty = sum(blocks_needed(len(p) + N_NEW, BS) for p in prompts) + 2

    on, off = sharing_engine(w, plenty), sharing_engine(w, plenty, caching=False)
    computed: list[list[int]] = []
    for prompt, want in zip(prompts, expected):
        cached_before = on.manager.view.cached_prompt_tokens
        assert on.generate([prompt], N_NEW) == [want]
        assert on.manager.view.cached_prompt_tokens - cached_before == expected_cached_tokens(prompt, computed)
        assert off.generate([prompt], N_NEW) == [want]
        computed.append(prompt + want[:-1])  # the newest token is never fed back
        assert_all_free(on.manager)
    hits = [expected_cached_tokens(p, computed[:i]) for i, p in enumerate(prompts)]
    assert hits[1] == SYSTEM_LEN and hits[2] == SYSTEM_LEN - BS  # the bare system prompt: last block recomputed
    assert hits[len(USER_LENS)] == (len(prompts[0]) - 1) // BS * BS  # the duplicate
    assert hits[-1] > len(prompts[0])  # the follow-up hits into the first answer's blocks
    assert off.manager.view.cached_prompt_tokens == 0 and not off.manager.view.cached_blocks()
    assert on.manager.view.prompt_tokens == off.manager.view.prompt_tokens == sum(map(len, prompts))
    assert on.manager.view.prefix_cache_stats().hits > 0 and on.manager.view.prefix_cache_stats().evictions == 0
    assert on.stats[-1].free_blocks == plenty
    assert len(on.manager.view.prefix_hits(system + [5])) == SYSTEM_LEN // BS  # still findable
    assert_all_free(off.manager)


def test_prefix_cache_all_at_once_matches_hf(tiny, system_prompts, system_expected):
    _, w = tiny
    _, prompts = system_prompts
    plenty = sum(blocks_needed(len(p) + N_NEW, BS) for p in prompts) + 2
    for caching in (True, False):
        engine = sharing_engine(w, plenty, caching=caching)
        assert engine.generate(prompts, N_NEW) == system_expected
        assert engine.scheduler.num_preemptions == 0
        assert_all_free(engine.manager)


def test_prefix_cache_under_memory_pressure_matches_hf(tiny, system_prompts, system_expected):
    """Too few blocks for everyone at once: sequences wait, are preempted (recompute) and re-admitted -
    starting from whatever prefix is still cached - and every token is still HF's."""
    _, w = tiny
    system, prompts = system_prompts
    longest = max(blocks_needed(len(p) + N_NEW, BS) for p in prompts)
    engine = sharing_engine(w, longest + 3, watermark=0.0)
    m = engine.manager
    admissions = []
    allocate = m.allocate

    def spy(seq):
        allocate(seq)
        admissions.append((seq.seq_id, seq.preemptions, seq.num_computed))

    m.allocate = spy
    seqs = [engine.add_request(p, N_NEW) for p in prompts]
    while engine.scheduler.has_work:
        engine.step()
        m.view.check_invariants()
        assert set(m.view.tables()) == {s.seq_id for s in engine.scheduler.running}
        for s in engine.scheduler.running:
            assert m.view.tables()[s.seq_id].num_tokens == s.len
    assert [s.output_ids for s in seqs] == system_expected
    assert engine.scheduler.num_preemptions > 0
    assert any(pre > 0 and kv > 0 for _, pre, kv in admissions), "no preempted sequence restarted from the cache"
    assert any(pre == 0 and kv >= SYSTEM_LEN for _, pre, kv in admissions), "no late arrival hit the system prompt"
    assert m.view.cached_prompt_tokens > 0
    assert_all_free(m)  # every count is 0 ...
    assert m.view.cached_blocks() and m.view.prefix_cache_stats().cached_free_blocks == len(
        m.view.cached_blocks()
    )  # ... yet the cache remembers
    assert len(m.view.prefix_hits(system + [5])) == SYSTEM_LEN // BS


# ---------------------------------------------------------------------------------------------------
# Parallel sampling
# ---------------------------------------------------------------------------------------------------

SAMPLE_PROMPT_LEN = 13  # not a multiple of the block size: the samples' first new token lands in a shared block


@pytest.fixture(scope="module")
def sample_prompt(tiny):
    _, w = tiny
    rng = random.Random(11)
    return [rng.randrange(4, w.vocab_size) for _ in range(SAMPLE_PROMPT_LEN)]


def test_parallel_sampling_greedy_samples_are_all_hf_greedy(tiny, sample_prompt):
    model, w = tiny
    want = hf_greedy(model, sample_prompt, N_NEW, w.eos_token_id)
    engine = sharing_engine(w, 32)
    first = engine.add_request(sample_prompt, N_NEW, n=4)
    engine.run()
    assert len(first.samples) == 4 and first.samples[0] is first
    assert len({s.seq_id for s in first.samples}) == 4
    assert [s.output_ids for s in first.samples] == [want] * 4
    # the 4 samples share the prompt's 4 blocks; the 4th (positions 12..15) gets the first new token:
    # 3 of its 4 holders copy it, the last writes in place
    assert engine.manager.view.num_cow == 3
    assert engine.manager.view.prompt_tokens == SAMPLE_PROMPT_LEN  # the prompt was prefilled once
    assert_all_free(engine.manager)


def sampled_decode(model, prompt: list[int], max_new_tokens: int, seed: int, temperature: float, eos: int) -> list[int]:
    """A cache-free sampled decode: the full sequence through HF every step, drawing from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    with torch.no_grad():
        while len(tokens) < max_new_tokens and (not tokens or tokens[-1] != eos):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
            tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    return tokens


def _sample(w, prompt, seed):
    engine = sharing_engine(w, 32)
    first = engine.add_request(prompt, N_NEW, n=4, temperature=1.0, seed=seed)
    engine.run()
    assert_all_free(engine.manager)
    assert engine.manager.view.num_cow == 3
    return first.samples


def test_parallel_sampling_with_temperature(tiny, sample_prompt):
    model, w = tiny
    samples = _sample(w, sample_prompt, seed=7)
    outs = [s.output_ids for s in samples]
    assert len(set(map(tuple, outs))) >= 2, "the samples do not differ"
    assert [s.output_ids for s in _sample(w, sample_prompt, seed=7)] == outs  # reproducible
    assert [s.output_ids for s in _sample(w, sample_prompt, seed=8)] != outs
    for s in samples:  # each sample is a decode of its own: no sample ever read another's K/V
        seed = s.generator.initial_seed()
        assert s.output_ids == sampled_decode(model, sample_prompt, N_NEW, seed, 1.0, w.eos_token_id)


# ---------------------------------------------------------------------------------------------------
# Beam search
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def beam_prompts(tiny, system_prompts):
    _, w = tiny
    rng = random.Random(3)
    return [[rng.randrange(4, w.vocab_size) for _ in range(9)], system_prompts[1][3]]  # 9 and 52 tokens


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_beam_search_matches_a_cache_free_reference(tiny, beam_prompts, caching):
    model, w = tiny
    engine = sharing_engine(w, 96, caching=caching)
    m = engine.manager
    for prompt in beam_prompts:
        greedy = hf_greedy(model, prompt, N_NEW, w.eos_token_id)
        for k in (1, 2, 4):
            cow_before = m.view.num_cow
            got, stats = engine.beam_search(prompt, k, N_NEW)
            assert got == reference_beam_search(model, prompt, k, N_NEW), f"k={k}, prompt of {len(prompt)}"
            assert len(got) == N_NEW
            if k == 1:
                assert len(greedy) == N_NEW and got == greedy  # one beam is greedy decoding
                assert stats["saving"] == 0.0 and m.view.num_cow == cow_before
            else:
                assert stats["saving"] > 0 and m.view.num_cow > cow_before  # beams shared blocks, then diverged
            assert_all_free(m)
    if caching:  # later searches started from the cached prompt
        assert m.view.cached_prompt_tokens > 0
    else:
        assert m.view.cached_prompt_tokens == 0


# ---------------------------------------------------------------------------------------------------
# The simulator
# ---------------------------------------------------------------------------------------------------


def test_simulated_prefix_caching_on_a_shared_system_prompt_stream():
    """A budget that is never short: both runs schedule identically, so the blocks held per step compare
    the memory each needs. With caching, the running requests share one copy of the system prompt."""
    requests = workloads.shared_system_prompt_stream(120, system_prompt_len=400, rate_per_s=10, seed=0)
    results = {}
    for caching in (True, False):
        m = SharingBlockManager(4000, 16, enable_prefix_caching=caching)
        res = simulator.simulate(requests, m, progress=False)
        assert sorted(r.req_id for r in requests) == [r.req_id for r in requests]
        assert_simulation_complete(res, requests, m.view.total_slots)
        assert_all_free(m)  # no leak
        assert not res.saturated.any() and res.num_preemptions == 0
        held = (m.view.total_slots - res.kinds["free"]) / m.view.block_size
        results[caching] = (m, res, held.mean())
    (on, res_on, held_on), (off, res_off, held_off) = results[True], results[False]
    assert np.array_equal(res_on.running, res_off.running)  # same schedule
    assert off.view.cached_prompt_tokens == 0 and on.view.prompt_tokens == off.view.prompt_tokens
    assert (
        on.view.cached_prompt_tokens > 0.8 * on.view.prompt_tokens
    )  # the 25 system-prompt blocks of each ~420-token prompt
    assert held_on < 0.4 * held_off, (held_on, held_off)


def test_a_forked_sequence_copies_its_progress_and_shares_nothing_mutable():
    """One clone for forks and beams (Sequence.fork): every field of progress copied, no list shared, the
    per-sequence state fresh - a field added to Sequence later is copied unless listed as fresh."""
    from dataclasses import fields

    import torch

    from lesson_utils.core.types import Request, Sequence, SequenceStatus

    parent = Sequence(Request(3, 1.5, 4, 9, prompt_ids=[2, 5, 6, 7]), eos_token_id=2, temperature=0.7, num_computed=5)
    parent.append_token(11, 4)
    parent.generator, parent.samples, parent.pending_forks, parent.preemptions = torch.Generator(), [parent], 2, 1
    parent.first_token_s, parent.added_at, parent.beam = 0.25, 9.0, "group"
    child = parent.fork(17)
    assert child.seq_id == 17 and parent.seq_id == 3 and child.request.prompt_ids == parent.request.prompt_ids
    fresh = {"request", "generator", "samples", "pending_forks", "preemptions", "status"}
    for f in fields(Sequence):
        if f.name not in fresh:
            assert getattr(child, f.name) == getattr(parent, f.name), f.name
    assert (child.generator, child.samples, child.pending_forks, child.preemptions) == (None, [], 0, 0)
    assert child.status is SequenceStatus.RUNNING
    child.append_token(12, 5)
    assert parent.output_ids == [11] and parent.token_steps == [4] and child.output_ids == [11, 12]
