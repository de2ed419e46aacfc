"""The engine's contract with its callers: bad input gets a clear error at the door, a refused request leaves
nothing behind, the engine goes on serving, and a request can be cancelled wherever it is."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy

from lesson_utils.cache import attention
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.kernels import paged_attention as K
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_pool import BlockPool
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.scheduler import FCFSScheduler
from lesson_utils.serving.token_budget import ChunkedPrefill

GOOD = [2, 17, 99, 140]


def _all_free(engine) -> bool:
    m = engine.manager
    return m.num_free_blocks == m.view.num_blocks and not m.view.tables()


@pytest.fixture
def engine(tiny):
    _, w = tiny
    return Engine(w, PagedKVCache.for_model(w, num_blocks=40, block_size=4))


@pytest.mark.parametrize(
    "prompt, error, message",
    [
        ([2, 320], ValueError, "prompt token 1 is 320, outside the model's vocabulary of 320 ids"),
        ([2, -1], ValueError, "prompt token 1 is -1, outside"),
        ([2, 7.5], TypeError, r"prompt token 1 is 7.5 \(float\); token ids are ints"),
        ([2, "7"], TypeError, r"prompt token 1 is '7' \(str\)"),
        ([2, True], TypeError, r"prompt token 1 is True \(bool\)"),
        ("hello", TypeError, "tokenize text first"),
        (torch.tensor([[2, 5]]), TypeError, "must be 1-D"),
        (torch.tensor([2.0, 5.0]), TypeError, "integer dtype"),
        ([], ValueError, "at least one prompt token"),
        (None, TypeError, "a list of token ids"),
    ],
)
def test_bad_prompts_are_refused_at_the_door_and_the_engine_goes_on(tiny, engine, prompt, error, message):
    model, w = tiny
    with pytest.raises(error, match=message):
        engine.add_request(prompt, 4)
    assert not engine.scheduler.has_work  # nothing half-added
    assert engine.generate([GOOD], 5) == [hf_greedy(model, GOOD, 5, w.eos_token_id)]
    assert _all_free(engine)


def test_a_1d_integer_tensor_is_a_prompt(tiny, engine):
    model, w = tiny
    seq = engine.add_request(torch.tensor(GOOD, dtype=torch.int32), 5)
    engine.run()
    assert seq.output_ids == hf_greedy(model, GOOD, 5, w.eos_token_id)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an int"),
        ({"max_new_tokens": True}, "max_new_tokens must be an int"),
        ({"max_new_tokens": 3, "n": 0}, "n \\(samples per prompt\\)"),
    ],
)
def test_bad_request_settings_are_refused(engine, kw, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(GOOD, **kw)
    assert not engine.scheduler.has_work


def test_forking_on_a_manager_that_cannot_fork_is_refused_up_front(tiny, engine):
    model, w = tiny
    with pytest.raises(ValueError, match="cannot fork: use a SharingBlockManager"):
        engine.add_request(GOOD, 4, n=2)
    with pytest.raises(ValueError, match="cannot fork"):
        engine.beam_search(GOOD, 2, 4)
    assert not engine.scheduler.has_work
    assert engine.generate([GOOD], 5) == [hf_greedy(model, GOOD, 5, w.eos_token_id)]
    assert _all_free(engine)


def test_beam_search_refuses_bad_arguments(tiny):
    _, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, manager=SharingBlockManager(40, 4, max_seq_len=w.max_positions)))
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens must be an int of at least 1"):
            engine.beam_search(GOOD, 2, bad)
    with pytest.raises(ValueError, match="at least one beam-search prompt token"):
        engine.beam_search([], 2, 4)
    with pytest.raises(ValueError, match="beam-search prompt token 0 is 999"):
        engine.beam_search([999], 2, 4)
    best, _ = engine.beam_search(GOOD, 2, 4)
    assert len(best) == 4 and _all_free(engine)


def test_max_num_seqs_must_be_positive(tiny):
    _, w = tiny
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
            Engine(w, PagedKVCache.for_model(w, num_blocks=8, block_size=4), max_num_seqs=bad)
    FCFSScheduler(BlockManager(8, 4), max_num_seqs=1)


def test_cancelling_waiting_running_and_swapped_requests_frees_everything(tiny):
    model, w = tiny
    prompts = [[2] + list(range(10 + 7 * i, 30 + 7 * i)) for i in range(6)]
    cache = PagedKVCache.for_model(w, num_blocks=14, block_size=4)  # too small for all: some wait, some are swapped
    engine = Engine(w, cache, preemption_mode="swap", swap_space=SwapSpace(40), stop_at_eos=False)
    seqs = [engine.add_request(p, 16) for p in prompts]
    cancelled: dict[str, int] = {}  # queue -> the sequence cancelled from it
    while engine.scheduler.has_work:
        engine.step()
        for queue in ("swapped", "running", "waiting"):
            held = list(getattr(engine.scheduler, queue))
            if held and queue not in cancelled:
                engine.abort_request(held[0])
                cancelled[queue] = held[0].seq_id
    assert set(cancelled) == {"running", "waiting", "swapped"}, cancelled
    assert _all_free(engine)
    space = engine.swap_space
    assert space.num_free == space.num_blocks and not space.cpu_tables
    for p, s in zip(prompts, seqs):
        if s.seq_id in cancelled.values():
            assert s.aborted and not s.is_finished
        else:
            assert s.output_ids == hf_greedy(model, p, 16, None)
    with pytest.raises(ValueError, match="not waiting, running or swapped"):
        engine.abort_request(seqs[0])


def test_the_block_pool_refuses_to_cache_a_block_it_does_not_have():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="block id 99 is out of range"):
        pool.cache(99, 123, [1, 2])
    assert not pool.block_of


def test_write_kv_refuses_slots_below_minus_one():
    kc = torch.zeros(4, 4, 1, 8)
    k = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match="slot -2 is not a slot"):
        K.write_kv_to_cache(k, k, kc, kc.clone(), torch.tensor([3, -2]))
    K.write_kv_to_cache(k, k, kc, kc.clone(), torch.tensor([3, -1]))  # -1 skips a token


def test_decode_refuses_a_used_table_entry_outside_the_cache():
    """An id of 10**6 used to make the kernel read outside the cache (a segfault); padding stays allowed."""
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(6, 8, 1, 16, generator=g)
    q = torch.randn(2, 1, 16, generator=g)
    lens = torch.tensor([9, 3], dtype=torch.int32)
    padded = torch.tensor([[0, 1, 10**6], [2, -5, 10**6]], dtype=torch.int32)  # past each sequence's blocks
    out = K.paged_attention_decode(q, kc, kc, padded, lens)
    torch.testing.assert_close(out, attention.paged_attention_reference(q, kc, kc, padded, lens))
    for table, where in (
        ([[0, 10**6, 0], [2, 0, 0]], r"block_tables\[0, 1\] = 1000000"),
        ([[0, 1, 0], [-1, 0, 0]], r"block_tables\[1, 0\] = -1"),
    ):
        with pytest.raises(ValueError, match=where + r".*blocks 0 \.\. 5"):
            K.paged_attention_decode(q, kc, kc, torch.tensor(table, dtype=torch.int32), lens)


# ---- lessons 08 and 09 -------------------------------------------------------------------------------------------
@pytest.fixture
def chunked(tiny):
    _, w = tiny
    return Engine(w, PagedKVCache.for_model(w, num_blocks=40, block_size=4), chunked_prefill=ChunkedPrefill(8))


@pytest.mark.parametrize("prompt, error", [([2, 320], ValueError), ([2, 7.5], TypeError), ([], ValueError)])
def test_the_chunked_engine_refuses_bad_prompts_and_goes_on(tiny, chunked, prompt, error):
    model, w = tiny
    with pytest.raises(error):
        chunked.add_request(prompt, 4)
    assert not chunked.scheduler.has_work
    assert chunked.generate([GOOD + [5] * 10], 5) == [hf_greedy(model, GOOD + [5] * 10, 5, w.eos_token_id)]
    assert _all_free(chunked)


def test_a_refused_plan_leaves_the_chunked_engine_serving(tiny, chunked):
    """A learner's plan function that fails part-way: the step raises, and the same engine, given the course's
    policy back, serves the same requests to HF's tokens with every block free at the end."""
    from lesson_utils.serving.token_budget import budgeted_schedule

    model, w = tiny
    prompts = [GOOD + [7] * 9, GOOD + [8] * 3]
    seqs = [chunked.add_request(p, 4) for p in prompts]

    def admits_then_fails(running, waiting, budget, admit):
        for s in waiting:
            admit(s.seq_id)
        return None

    chunked.scheduler.plan_fn = admits_then_fails
    with pytest.raises(TypeError, match="admits_then_fails must return a list of Chunk"):
        chunked.step()
    assert _all_free(chunked) and len(chunked.scheduler.waiting) == 2
    chunked.scheduler.plan_fn = budgeted_schedule
    chunked.run()
    assert [s.output_ids for s in seqs] == [hf_greedy(model, p, 4, w.eos_token_id) for p in prompts]
    assert _all_free(chunked)


def test_a_hand_over_into_a_full_decode_side_is_refused_and_leaks_nothing(tiny):
    from lesson_utils.core.types import OutOfBlocks, Request
    from lesson_utils.disagg.handover import hand_over, prefill_engine

    model, w = tiny
    prefill = prefill_engine(w, PagedKVCache.for_model(w, num_blocks=16, block_size=4))
    decode = Engine(w, PagedKVCache.for_model(w, num_blocks=3, block_size=4))
    prompt = GOOD * 4  # 16 tokens: 4 blocks, the decode side has 3
    with pytest.raises(ValueError, match="can never fit"):  # back-pressure cannot help: refused before any step
        hand_over(prefill, decode, Request(0, 0.0, 16, 4, prompt_ids=prompt))
    assert _all_free(decode) and _all_free(prefill) and not prefill.scheduler.held
    short = Engine(w, PagedKVCache.for_model(w, num_blocks=6, block_size=4))
    short.manager.blocks.reserve(99, 12)  # 3 of 6 blocks held by no running request: nothing will free them
    with pytest.raises(OutOfBlocks, match="nothing is decoding"):
        hand_over(prefill, short, Request(2, 0.0, 16, 4, prompt_ids=prompt))
    assert short.manager.num_free_blocks == 3 and _all_free(prefill) and not prefill.scheduler.held
    seq = hand_over(prefill, decode, Request(1, 0.0, 4, 3, prompt_ids=GOOD))
    decode.run()
    assert seq.output_ids == hf_greedy(model, GOOD, 3, w.eos_token_id) and _all_free(decode)
