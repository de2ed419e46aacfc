"""Lesson 09's functions refuse what a learner's mistakes hand them - clearly, and leaving everything as it was -
and a request that its first token already finishes is never decoded after a hand-over."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy

from lesson_utils.cache.block_copy import pack_blocks, unpack_blocks
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.types import OutOfBlocks, Request, Sequence
from lesson_utils.disagg import handover
from lesson_utils.disagg.launch import check_requests
from lesson_utils.disagg.transfer import transfer_plan
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving.engine import Engine


def _caches(num_blocks=6, block_size=4, layers=2, heads=2, d=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(num_blocks, block_size, heads, d, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(num_blocks, block_size, heads, d, generator=g).to(dtype) for _ in range(layers)]
    return k, v


def _snapshot(k, v):
    return [t.clone() for t in k + v]


def _unchanged(before, k, v) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, k + v))


# ---- the hand-over of a request that is already finished -------------------------------------------------------
def _sides(w, num_blocks=16):
    prefill = handover.prefill_engine(w, PagedKVCache.for_model(w, num_blocks, 4))
    decode = Engine(w, PagedKVCache.for_model(w, num_blocks, 4))
    return prefill, prefill.manager, decode


@pytest.mark.parametrize("why", ["one token asked for", "the first token is the end of sequence"])
def test_a_request_its_first_token_finishes_is_never_decoded(tiny, why):
    model, w = tiny
    prompt = [2, 40, 41, 42, 43, 44]
    with torch.inference_mode():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    prefill, prefill_mgr, decode = _sides(w)
    max_new, eos = (1, None) if why == "one token asked for" else (5, first)
    seq = handover.hand_over(
        prefill, decode, Request(0, 0.0, len(prompt), max_new, prompt_ids=prompt), eos_token_id=eos
    )
    assert seq.output_ids == [first] and seq.is_finished and seq.finished_step is not None
    assert not decode.scheduler.has_work and decode.manager.num_free_blocks == 16 and not decode.manager.view.tables()
    assert prefill_mgr.num_free_blocks == 16 and not prefill_mgr.view.tables()
    decode.run()
    assert seq.output_ids == [first]  # still one token: it was never decoded


def test_the_scheduler_refuses_to_decode_a_finished_sequence(tiny):
    _, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, 16, 4))
    seq = Sequence(Request(3, 0.0, 4, 1, prompt_ids=[2, 5, 6, 7]), num_computed=4)
    seq.append_token(9, 0)
    with pytest.raises(ValueError, match="never decoded"):
        engine.scheduler.add_running(seq)
    assert not engine.scheduler.running


def test_a_hand_over_gives_everything_back_when_a_step_fails(tiny):
    _, w = tiny
    prefill, prefill_mgr, decode = _sides(w)

    def broken_unpack(*args):
        raise RuntimeError("the learner's unpack broke")

    with pytest.raises(RuntimeError, match="unpack broke"):
        handover.hand_over(prefill, decode, Request(0, 0.0, 9, 4, prompt_ids=[2] + [7] * 8), unpack_fn=broken_unpack)
    assert decode.manager.num_free_blocks == 16 and prefill_mgr.num_free_blocks == 16 and not decode.scheduler.has_work


# ---- transfer_plan -------------------------------------------------------------------------------------------
def test_a_plan_that_runs_out_of_blocks_gives_back_what_it_took():
    mgr = BlockManager(5, 4)
    for _ in range(3):
        mgr.blocks.allocate_block()
    free_before = mgr.num_free_blocks
    with pytest.raises(OutOfBlocks):
        transfer_plan(0, [10, 11, 12, 13], 13, 4, mgr.blocks.allocate_block, mgr.blocks.free_block)  # 4 blocks, 2 free
    assert mgr.num_free_blocks == free_before


@pytest.mark.parametrize(
    "args, error, words",
    [
        ((0, [1, 2], -3, 4), ValueError, "num_tokens must be at least 1"),
        ((0, [1, 2], 0, 4), ValueError, "num_tokens must be at least 1"),
        ((0, [1, 2], 5, 0), ValueError, "block_size must be at least 1"),
        ((0, [1, 2], 5.0, 4), TypeError, "num_tokens is an int"),
        ((0, [1], 5, 4), ValueError, "the table has 1"),
    ],
)
def test_bad_plans_are_refused_before_anything_is_allocated(args, error, words):
    mgr = BlockManager(8, 4)
    table = list(args[1])
    with pytest.raises(error, match=words):
        transfer_plan(*args, mgr.blocks.allocate_block, mgr.blocks.free_block)
    assert mgr.num_free_blocks == 8 and args[1] == table


# ---- pack_blocks / unpack_blocks ------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks, words", [([0, -1], "out of range"), ([6], "out of range"), ([1.0], "int")])
def test_packing_refuses_block_ids_that_are_not_blocks(blocks, words):
    k, v = _caches()
    with pytest.raises((ValueError, TypeError), match=words):
        pack_blocks(k, v, blocks)


def test_packing_refuses_caches_that_do_not_match():
    k, v = _caches()
    with pytest.raises(ValueError, match="k_cache has 2 layers but v_cache has 1"):
        pack_blocks(k, v[:1], [0])
    with pytest.raises(TypeError, match="list of per-layer tensors"):
        pack_blocks(torch.stack(k), v, [0])


@pytest.mark.parametrize("blocks, words", [([3, -1], "out of range"), ([0, 6], "out of range"), ([2, 2], "distinct")])
def test_unpacking_refuses_bad_destinations_before_writing_anything(blocks, words):
    k, v = _caches()
    packed = pack_blocks(*_caches(seed=1), [0, 1])
    before = _snapshot(k, v)
    with pytest.raises(ValueError, match=words):
        unpack_blocks(packed, k, v, blocks)
    assert _unchanged(before, k, v)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: pack_blocks(*_caches(block_size=8), [0, 1]), "block size 8 instead of 4"),
        (lambda: pack_blocks(*_caches(heads=1), [0, 1]), "KV heads 1 instead of 2"),
        (lambda: pack_blocks(*_caches(layers=3), [0, 1]), "layers 3 instead of 2"),
        (lambda: pack_blocks(*_caches(), [0, 1, 2]), "blocks 3 instead of 2"),
    ],
)
def test_unpacking_refuses_a_payload_that_does_not_fit(make, words):
    k, v = _caches()
    before = _snapshot(k, v)
    with pytest.raises(ValueError, match=words):
        unpack_blocks(make(), k, v, [4, 5])
    assert _unchanged(before, k, v)


def test_unpacking_refuses_what_is_not_a_payload():
    k, v = _caches()
    packed = pack_blocks(*_caches(seed=1), [0, 1])
    with pytest.raises(TypeError, match="one tensor"):
        unpack_blocks(list(packed), k, v, [4, 5])
    with pytest.raises(TypeError, match="floating"):
        unpack_blocks(packed.to(torch.int64), k, v, [4, 5])


def test_unpacking_converts_a_payload_in_another_dtype():
    src = _caches(seed=1, dtype=torch.float16)
    k, v = _caches()
    unpack_blocks(pack_blocks(*src, [0, 3]), k, v, [5, 1])
    assert torch.equal(k[1][5], src[0][1][0].float()) and torch.equal(v[0][1], src[1][0][3].float())


# ---- adoption -------------------------------------------------------------------------------------------------
def _state(mgr):
    return {s: (list(t.blocks), t.num_tokens) for s, t in mgr.view.tables().items()}, mgr.num_free_blocks


@pytest.mark.parametrize("manager_class", [BlockManager, SharingBlockManager])
@pytest.mark.parametrize(
    "what, make, error, words",
    [
        (
            "a block another sequence holds",
            lambda m, mine, held: (9, [mine, held], 8),
            ValueError,
            "held by sequence 1",
        ),
        ("the same block twice", lambda m, mine, held: (9, [mine, mine], 8), ValueError, "distinct"),
        ("a free block, not the first", lambda m, mine, held: (9, [mine, 15], 8), ValueError, "is free"),
        ("negative tokens", lambda m, mine, held: (9, [mine], -1), ValueError, "at least one token"),
        ("a float token count", lambda m, mine, held: (9, [mine], 4.0), TypeError, "num_tokens is an int"),
        ("the wrong block count", lambda m, mine, held: (9, [mine], 8), ValueError, "block count"),
        ("an id that is no block", lambda m, mine, held: (9, [mine, 99], 8), ValueError, "out of range"),
    ],
)
def test_adoption_refuses_and_changes_nothing(manager_class, what, make, error, words):
    mgr = manager_class(16, 4)
    mgr.allocate(Sequence(Request(1, 0.0, 4, 2, prompt_ids=[2, 3, 4, 5])))
    held, mine = mgr.view.block_table(1)[0], mgr.blocks.allocate_block()
    before = _state(mgr)
    with pytest.raises(error, match=words):
        mgr.blocks.adopt(*make(mgr, mine, held))
    assert _state(mgr) == before, what


def test_the_block_table_of_an_unknown_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="sequence 4 holds no blocks"):
        BlockManager(4, 4).view.block_table(4)


def test_a_block_in_a_table_cannot_be_freed_alone():
    mgr = BlockManager(4, 4)
    mgr.allocate(Sequence(Request(1, 0.0, 4, 2, prompt_ids=[2, 3, 4, 5])))
    with pytest.raises(ValueError, match="belongs to sequence 1"):
        mgr.blocks.free_block(mgr.view.block_table(1)[0])


# ---- run_disaggregated's requests ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "requests, error, words",
    [
        ([(0, [2, 5, 400], 3)], ValueError, "token 2 is 400, outside the model's vocabulary of 320"),
        ([(0, [2, 5], 0)], ValueError, "max_new_tokens must be an int of at least 1"),
        ([(0, [2, 5], 3), (0, [2, 6], 3)], ValueError, "used twice"),
        ([(0, [2] * 500, 20)], ValueError, "exceeds the model's 512 positions"),
        ([(0, "hello", 3)], TypeError, "tokenize text first"),
        ([(0, [2, 5])], TypeError, "req_id, prompt_ids, max_new_tokens"),
        ([(0, [2, 5], 3, -1.0)], ValueError, "arrival_s"),
    ],
)
def test_run_disaggregated_refuses_bad_requests_before_starting(requests, error, words):
    with pytest.raises(error, match=words):
        check_requests(requests, vocab_size=320, max_positions=512)


# ---- the prefill side runs a real step ---------------------------------------------------------------------------
def test_the_prefill_side_makes_the_first_token_in_one_engine_step_and_holds_the_blocks_until_released(tiny):
    """The first token is born where every token is (update_from_output), in one scheduler step; the blocks stay held
    until release, then every block is free; releasing twice, or a scheduler that does not hold, is refused."""
    model, w = tiny
    prefill, mgr, _ = _sides(w)
    prompt = [2] + list(range(40, 49))  # 10 tokens: 3 blocks of 4
    done = handover.prefill_request(prefill, Request(7, 0.0, len(prompt), 5, prompt_ids=prompt))
    assert done.first_token == hf_greedy(model, prompt, 1, None)[0]
    assert len(prefill.stats) == 1 and prefill.stats[0].prefill_tokens == len(prompt)
    assert list(prefill.scheduler.held) == [7] and done.blocks == list(mgr.view.block_table(7))[:3]
    assert done.request.output_len == 5  # what the decode side is asked for travels unchanged
    prefill.scheduler.release(7)
    assert mgr.num_free_blocks == 16 and not prefill.scheduler.held
    with pytest.raises(ValueError, match="sequence 7 is not held"):
        prefill.scheduler.release(7)
    with pytest.raises(ValueError, match="prefill_engine"):
        handover.prefill_request(
            Engine(w, PagedKVCache.for_model(w, 16, 4)), Request(8, 0.0, 3, 2, prompt_ids=[2, 5, 6])
        )


def test_a_prefill_side_full_of_unsent_blocks_says_so_and_keeps_nothing_of_the_refused_request(tiny):
    _, w = tiny
    prefill, mgr, _ = _sides(w, num_blocks=4)
    handover.prefill_request(prefill, Request(1, 0.0, 12, 3, prompt_ids=[2] + [9] * 11))  # 3 of 4 blocks held
    with pytest.raises(RuntimeError, match=r"finished sequences \[1\] hold their blocks: release"):
        handover.prefill_request(prefill, Request(2, 0.0, 9, 3, prompt_ids=[2] + [9] * 8))
    assert not prefill.scheduler.has_work and list(prefill.scheduler.held) == [1]
    prefill.scheduler.release(1)
    assert mgr.num_free_blocks == 4
