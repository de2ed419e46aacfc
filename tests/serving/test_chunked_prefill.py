"""Lesson 08: chunked prefill under a token budget, and the unified kernel.

* the token-budget policy (``budgeted_schedule``): decodes first, then chunks, FCFS admission, the budget;
* the scheduler in ``chunked_prefill`` mode (hypothesis, on the accounting runner): every step within the budget,
  every prompt finishes with its full length, nothing leaks, the same tokens generated as without chunking;
* the engine with chunking: token-identical to HF with the prefix cache off and on, under preemption, and through
  the unified Triton kernel (interpreter);
* the unified kernel against its torch reference on random cases and edge cases, its input checks, and its
  sm_75 compile.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from helpers import assert_identical, hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lesson_utils.cache import attention
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.types import Request
from lesson_utils.kernels.unified_attention import unified_attention
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving import simulator
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.scheduler import FCFSScheduler
from lesson_utils.serving.token_budget import Chunk, ChunkedPrefill, TokenState, budgeted_schedule

# ---- the policy -----------------------------------------------------------------------------------------------


def _admit_all(computed: dict[int, int]):
    def admit(seq_id):
        return computed.get(seq_id, 0)

    return admit


def test_decodes_come_first_then_running_chunks_then_new_prompts():
    running = [TokenState(0, 30, 40), TokenState(1, 9, 10), TokenState(2, 19, 20)]
    waiting = [TokenState(3, 0, 50), TokenState(4, 0, 5)]
    got = budgeted_schedule(running, waiting, 16, _admit_all({}))
    assert got == [Chunk(1, 9, 10), Chunk(2, 19, 20), Chunk(0, 30, 40), Chunk(3, 0, 4)]


def test_a_prefix_hit_starts_the_chunk_after_the_cached_tokens_and_admission_is_fcfs():
    waiting = [TokenState(5, 0, 40), TokenState(6, 0, 3), TokenState(7, 0, 3)]
    asked = []

    def admit(seq_id):
        asked.append(seq_id)
        return {5: 32}.get(seq_id, 0) if seq_id != 6 else None  # 6 does not fit: 7 must not overtake it

    assert budgeted_schedule([], waiting, 100, admit) == [Chunk(5, 32, 40)]
    assert asked == [5, 6]


def test_a_budget_smaller_than_the_decodes_serves_them_in_order():
    running = [TokenState(i, 9, 10) for i in range(5)]
    assert budgeted_schedule(running, [TokenState(9, 0, 4)], 3, _admit_all({})) == [
        Chunk(0, 9, 10),
        Chunk(1, 9, 10),
        Chunk(2, 9, 10),
    ]


# ---- the scheduler, on the accounting runner -------------------------------------------------------------------


class BudgetRunner(simulator.AccountingRunner):
    """Checks every plan: within the budget, decodes first (a decode-ready sequence waits only when the budget is
    spent), each chunk starting at the sequence's computed count."""

    def __init__(self, sch: FCFSScheduler):
        super().__init__()
        self.sch, self.steps, self.max_tokens = sch, 0, 0

    def execute(self, plan):
        counts = plan.tokens_to_feed()
        total = sum(counts)
        assert total <= self.sch.max_num_batched_tokens, f"step {plan.step}: {total} tokens"
        ready = [s for s in self.sch.running if s.len - s.num_computed == 1 and s.admitted_step < plan.step]
        scheduled = {id(s) for s in plan.scheduled}
        if any(id(s) not in scheduled for s in ready):  # a decode waited: only other decodes may have run
            assert total == self.sch.max_num_batched_tokens, f"step {plan.step}: a decode waited, budget not spent"
            assert all(s.len - s.num_computed == 1 for s in plan.scheduled), (
                f"step {plan.step}: a chunk ran before a decode"
            )
        self.sch.manager.view.check_invariants()
        self.steps += 1
        self.max_tokens = max(self.max_tokens, total)
        return super().execute(plan)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 30)), min_size=1, max_size=12),
    budget=st.integers(1, 64),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 4, 16]),
    sharing=st.booleans(),
    arrivals=st.lists(st.integers(0, 6), min_size=12, max_size=12),
)
def test_chunked_scheduling_keeps_the_budget_finishes_every_prompt_and_leaks_nothing(
    lens, budget, num_blocks, block_size, sharing, arrivals
):
    longest = max(p + o for p, o in lens)
    num_blocks = max(num_blocks, -(-longest // block_size))  # every request fits an empty cache
    rng = random.Random(len(lens) * 7 + budget)
    reqs = []
    for i, (p, o) in enumerate(lens):
        ids = [rng.choice([4, 5]) for _ in range(p)] if sharing else None  # tiny alphabet: prefixes repeat
        reqs.append(Request(i, 0.02 * arrivals[i], p, o, prompt_ids=ids))
    if sharing:
        manager = SharingBlockManager(num_blocks, block_size, watermark=0.0)
    else:
        manager = BlockManager(num_blocks, block_size, watermark=0.0)
    sch = FCFSScheduler(manager, chunked=ChunkedPrefill(budget))
    runner = BudgetRunner(sch)
    res = simulator.simulate(reqs, manager, scheduler=sch, runner=runner, progress=False, max_steps=50_000)
    assert sorted(s.seq_id for s in res.finished) == list(range(len(reqs)))
    for s in res.finished:
        assert s.num_generated == s.request.output_len and s.num_computed == s.len - 1
    assert not manager.view.tables() and manager.num_free_blocks == num_blocks
    # without chunking the same requests generate the same lengths (the policy changes when, not what)
    plain = BlockManager(num_blocks, block_size, watermark=0.0)
    ref = simulator.simulate(reqs, plain, progress=False)
    assert sorted(s.num_generated for s in ref.finished) == sorted(s.num_generated for s in res.finished)


def test_chunked_prefill_needs_a_budget_and_recompute():
    m = BlockManager(8, 4)
    with pytest.raises(TypeError, match="ChunkedPrefill"):
        FCFSScheduler(m, chunked=True)
    with pytest.raises(ValueError, match="positive int"):
        ChunkedPrefill(0)
    with pytest.raises(ValueError, match="its own budget"):
        FCFSScheduler(m, chunked=ChunkedPrefill(8), max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="preempts by recompute"):
        FCFSScheduler(m, chunked=ChunkedPrefill(8), preemption_mode="swap", swap_space=object())


def test_a_wrong_plan_is_refused_with_what_is_wrong():
    def two_chunks(running, waiting, budget, admit):
        admit(waiting[0].seq_id)
        return [Chunk(waiting[0].seq_id, 0, 2), Chunk(waiting[0].seq_id, 2, 4)]

    def skips_ahead(running, waiting, budget, admit):
        admit(waiting[0].seq_id)
        return [Chunk(waiting[0].seq_id, 1, 3)]

    def out_of_order(running, waiting, budget, admit):
        admit(waiting[1].seq_id)
        return []

    for fn, message in [
        (two_chunks, "has two chunks"),
        (skips_ahead, "its chunk runs from 0"),
        (out_of_order, "in arrival order"),
    ]:
        m = BlockManager(16, 4)
        sch = FCFSScheduler(m, chunked=ChunkedPrefill(8, fn))
        for i in range(2):
            sch.add(_seq(i, 6, 2))
        with pytest.raises(ValueError, match=message):
            sch.schedule(0)


def _seq(i, p, o):
    from lesson_utils.core.types import Sequence

    return Sequence(Request(i, 0.0, p, o))


# ---- the engine: token identity with HF ----------------------------------------------------------------------


def _prompts(w, lens, seed=0):
    rng = random.Random(seed)
    return [[2] + [rng.randrange(4, w.vocab_size) for _ in range(n - 1)] for n in lens]


@pytest.mark.parametrize("budget", [1, 7, 32])
@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_chunked_engine_is_token_identical_to_hf(tiny, budget, caching):
    model, w = tiny
    shared = _prompts(w, [37], seed=1)[0]
    prompts = _prompts(w, [60, 5, 23], seed=2) + [shared + [9, 10, 11], shared + [12, 13]]
    manager = SharingBlockManager(64, 4, enable_prefix_caching=caching, max_seq_len=w.max_positions)
    engine = Engine(w, PagedKVCache.for_model(w, manager=manager), chunked_prefill=ChunkedPrefill(budget))
    got = engine.generate(prompts, 8)
    assert_identical(model, prompts, [hf_greedy(model, p, 8, w.eos_token_id, check_ties=False) for p in prompts], got)
    assert max(step.prefill_tokens for step in engine.stats) <= budget
    if caching:
        assert manager.view.cached_prompt_tokens > 0  # the second shared prompt started after the first's blocks
    assert not manager.view.tables() and manager.num_free_blocks == manager.view.num_blocks


def test_chunked_engine_under_preemption_is_token_identical_to_hf(tiny):
    model, w = tiny
    prompts = _prompts(w, [40, 33, 25, 18, 12], seed=3)
    engine = Engine(
        w,
        PagedKVCache.for_model(w, manager=BlockManager(16, 4, watermark=0.0, max_seq_len=w.max_positions)),
        chunked_prefill=ChunkedPrefill(16),
    )
    got = engine.generate(prompts, 20)
    assert engine.scheduler.num_preemptions > 0
    assert_identical(model, prompts, [hf_greedy(model, p, 20, w.eos_token_id, check_ties=False) for p in prompts], got)
    assert not engine.manager.view.tables() and engine.manager.num_free_blocks == 16


def test_a_long_prompt_no_longer_makes_one_step_long(tiny):
    """Chunking caps the tokens of every step: with a budget of 16, a 200-token prompt arriving beside decodes
    is spread over many steps, and no step computes more than 16 tokens."""
    _, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, 120, 4), chunked_prefill=ChunkedPrefill(16))
    running = [engine.add_request(p, 30) for p in _prompts(w, [5, 6, 7], seed=4)]
    for _ in range(3):
        engine.step()
    long = engine.add_request(_prompts(w, [200], seed=5)[0], 4)
    engine.run()
    assert max(step.prefill_tokens for step in engine.stats) <= 16
    assert long.first_token_step - long.admitted_step >= 200 // 16 - 1  # its prompt took a dozen steps
    assert all(len(s.token_steps) == 30 for s in running)


def test_the_unified_kernel_serves_the_chunked_engine(tiny):
    """The whole step through one Triton launch per layer (interpreter): prefill chunks and decodes alike."""
    from lesson_utils.cache.triton_paged import UnifiedTritonKVCache

    model, w = tiny
    prompts = _prompts(w, [21, 6], seed=6)
    cache = UnifiedTritonKVCache.for_model(w, 24, 4)
    engine = Engine(w, cache, chunked_prefill=ChunkedPrefill(8))
    got = engine.generate(prompts, 5)
    assert_identical(model, prompts, [hf_greedy(model, p, 5, w.eos_token_id, check_ties=False) for p in prompts], got)


# ---- the kernel ---------------------------------------------------------------------------------------------


def make_case(seed, *, dtype=torch.float32, qlens=None, ctxs=None, block_size=None, kv_heads=None, group=None, d=None):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bs = block_size or rng.choice([4, 8, 16])
    kvh = kv_heads or rng.choice([1, 2])
    grp = group or rng.choice([1, 2, 4])
    d = d or rng.choice([16, 24, 32, 64])
    if qlens is None:
        n = rng.randint(1, 4)
        qlens = [rng.choice([1, rng.randint(2, 3 * bs)]) for _ in range(n)]
        ctxs = [q + rng.randint(0, 3 * bs) for q in qlens]
    maxb = max(-(-c // bs) for c in ctxs)
    nb = len(qlens) * maxb + 2
    kc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: len(qlens) * maxb].view(len(qlens), maxb).int()
    q = torch.randn(sum(qlens), kvh * grp, d, generator=g).to(dtype)
    starts = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    return q, kc, vc, tables, starts, torch.tensor(ctxs, dtype=torch.int32), max(qlens)


@pytest.mark.parametrize("seed", range(8))
def test_unified_kernel_matches_the_reference_on_random_cases(seed):
    dtype = torch.float16 if seed % 3 == 2 else torch.float32
    q, kc, vc, tables, starts, ctx, mq = make_case(seed, dtype=dtype)
    got = unified_attention(q, kc, vc, tables, starts, ctx, mq)
    want = attention.unified_attention_reference(q, kc, vc, tables, starts, ctx)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if dtype == torch.float16 else 1e-5, rtol=1e-3)


@pytest.mark.parametrize(
    "qlens, ctxs",
    [
        ([1], [1]),  # a decode of a one-token sequence
        ([4], [4]),  # a whole prompt that fills exactly one block
        ([3], [9]),  # a chunk that starts and ends inside blocks
        ([8, 1, 5], [8, 17, 13]),  # a chunk from the start, a decode, a chunk after a cached prefix
        ([12], [12]),  # more queries than one query tile (8)
        ([1, 1, 1], [4, 5, 16]),  # decodes only: a query tile of one
    ],
)
def test_unified_kernel_edge_cases(qlens, ctxs):
    q, kc, vc, tables, starts, ctx, mq = make_case(11, qlens=qlens, ctxs=ctxs, block_size=4, kv_heads=2, group=2, d=16)
    got = unified_attention(q, kc, vc, tables, starts, ctx, mq)
    torch.testing.assert_close(got, attention.unified_attention_reference(q, kc, vc, tables, starts, ctx))


def test_unified_kernel_refuses_inconsistent_inputs():
    q, kc, vc, tables, starts, ctx, mq = make_case(
        1, qlens=[3, 2], ctxs=[5, 2], block_size=4, kv_heads=1, group=1, d=16
    )
    with pytest.raises(ValueError, match="more than max_query_len"):
        unified_attention(q, kc, vc, tables, starts, ctx, 2)
    with pytest.raises(ValueError, match="shorter than its queries"):
        unified_attention(q, kc, vc, tables, starts, torch.tensor([5, 1], dtype=torch.int32), mq)
    with pytest.raises(ValueError, match="must rise from 0"):
        unified_attention(q, kc, vc, tables, torch.tensor([0, 3, 4], dtype=torch.int32), ctx, mq)
    with pytest.raises(TypeError, match="int32"):
        unified_attention(q, kc, vc, tables.long(), starts, ctx, mq)


@pytest.mark.slow
def test_the_unified_kernel_compiles_for_a_t4():
    from lesson_utils.kernels import aot

    results = aot.compile_report(aot.unified_configs())
    report = aot.format_report(results)
    assert all(r.ok and r.fits_t4 for r in results), report
    assert not any(r.tensor_cores for r in results if r.target == "sm_75"), report
    opt = [r for r in results if r.target == "sm_75" and r.config.head_dim == 64]
    assert opt and all(r.spill_bytes in (0, None) for r in opt), report  # OPT-125m's shapes spill nothing on a T4


def test_serve_by_steps_records_every_step_and_every_gap(tiny):
    from lesson_utils.lab import benchmark

    _, w = tiny
    prompts = _prompts(w, [6, 7, 90], seed=9)
    reqs = [Request(i, 0.0, len(p), n, prompt_ids=p) for i, (p, n) in enumerate(zip(prompts, [12, 9, 3]))]
    engine = Engine(w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False, chunked_prefill=ChunkedPrefill(16))
    trace = benchmark.serve_by_steps("t", engine, reqs, {0: 0, 1: 0, 2: 4}, {2}, progress=False)
    assert len(trace.step_s) == len(engine.stats) and (trace.step_tokens <= 16).all()
    assert trace.step_tokens.sum() == sum(len(p) + n - 1 for p, n in zip(prompts, [12, 9, 3]))  # every token fed once
    assert len(trace.itl_s) == (12 - 1) + (9 - 1) and (trace.itl_s > 0).all()
    assert set(trace.ttft_s) == {2} and trace.ttft_s[2] > 0
    assert [len(o) for o in trace.outputs.values()] == [12, 9, 3]


@pytest.mark.parametrize("disciplined", [False, True], ids=["cpu", "device-discipline"])
def test_the_gpu_timing_cell_runs_and_checks_before_it_times(disciplined):
    """Lesson 08's kernel timings run only on a GPU; their code runs here, small, in the interpreter - and in the
    device-discipline mode, where a tensor made on the wrong device fails as it would on a T4."""
    import contextlib
    import time

    from lesson_utils.core.device_discipline import DEVICE, discipline
    from lesson_utils.lab import kernel_timing

    calls = []

    def timer(fn):
        t0 = time.perf_counter()
        fn()
        calls.append(fn)
        return (time.perf_counter() - t0) * 1e3

    with discipline() if disciplined else contextlib.nullcontext():
        rows = kernel_timing.time_unified_kernel(
            [(3, 1, 16), (2, 5, 8)],
            heads=2,
            head_dim=16,
            block_size=4,
            dtype=torch.float32,
            device=DEVICE if disciplined else "cpu",
            timer=timer,
        )
    assert [r.baseline for r in rows] == ["decode kernel", "gather + SDPA"] and len(calls) == 4
    assert all(r.max_error < 1e-4 and r.unified_ms > 0 and r.baseline_ms > 0 for r in rows)
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        kernel_timing.time_unified_kernel(
            [(1, 1, 10)], heads=2, head_dim=16, block_size=4, dtype=torch.float32, device="cpu", timer=timer
        )


def test_parallel_samples_and_beam_search_wait_for_a_chunked_prompt(tiny):
    """A prompt prefilled over several chunks samples (and forks its samples, or its beams) only once its last
    chunk has run: the same tokens as without chunking."""
    model, w = tiny
    prompt = _prompts(w, [45], seed=12)[0]

    def engine(chunked):
        manager = SharingBlockManager(64, 4, max_seq_len=w.max_positions)
        kw = {"chunked_prefill": ChunkedPrefill(8)} if chunked else {}
        return Engine(w, PagedKVCache.for_model(w, manager=manager), **kw)

    outputs = {}
    for chunked in (False, True):
        e = engine(chunked)
        first = e.add_request(prompt, 6, n=3)
        e.run()
        outputs[chunked] = [s.output_ids for s in first.samples]
        assert len(first.samples) == 3
    assert outputs[True] == outputs[False] == [hf_greedy(model, prompt, 6, w.eos_token_id)] * 3
    beams = {chunked: engine(chunked).beam_search(prompt, 3, 5)[0] for chunked in (False, True)}
    assert beams[True] == beams[False]


def test_a_beam_search_that_runs_out_of_blocks_under_chunking_fails_clearly_and_frees_everything(tiny):
    """The chunked path keeps the beam guard of the other: a beam cannot be preempted while its group goes on
    (before the one schedule path, the chunked copy preempted a beam by recompute and the search went on with a
    beam missing). The search fails with a clear error, and every block is free afterwards."""
    from lesson_utils.core.types import OutOfBlocks

    _, w = tiny
    prompt = _prompts(w, [10], seed=4)[0]
    manager = SharingBlockManager(6, 4, watermark=0.0, max_seq_len=w.max_positions)
    engine = Engine(w, PagedKVCache.for_model(w, manager=manager), chunked_prefill=ChunkedPrefill(8))
    with pytest.raises(OutOfBlocks, match="beam search ran out of blocks for its 4 beams"):
        engine.beam_search(prompt, 4, 12)
    assert not manager.view.tables() and manager.num_free_blocks == 6 and not engine.scheduler.has_work
