"""Everything a cache keeps per slot travels with its blocks, on every path (issue: the int8 hand-over dropped its
scales). Each paged cache names its per-slot tensors once (``cache.slot_tensors``); this file enumerates the cache
kinds and the paths that move blocks - copy-on-write, swap out and in (through the cache layer's HostBlocks), a refused step's save and restore, and the
hand-over's pack / unpack - and checks every kind of data arrives. A guard test fails when a cache holds a
per-block tensor that ``slot_tensors`` does not name, so a future cache cannot be forgotten by any path."""

from __future__ import annotations

import pytest
import torch

from lesson_utils.cache.host_blocks import HostBlocks
from lesson_utils.cache.int8_paged import Int8PagedKVCache
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.cache.triton_paged import TritonPagedKVCache, UnifiedTritonKVCache
from lesson_utils.core.types import Request
from lesson_utils.disagg.handover import Prefilled, hand_over, prefill_engine, prefill_request, receive
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.serving.engine import Engine

NUM_BLOCKS, BS = 8, 4
CACHES = {
    "paged": lambda m: PagedKVCache(2, 2, 8, m),
    "Triton": lambda m: TritonPagedKVCache(2, 2, 8, m),
    "unified Triton": lambda m: UnifiedTritonKVCache(2, 2, 8, m),
    "int8": lambda m: Int8PagedKVCache(2, 2, 8, m),
    "int8 kernels": lambda m: Int8PagedKVCache(2, 2, 8, m, use_kernels=True),
}


def _filled(kind: str):
    cache = CACHES[kind](BlockManager(NUM_BLOCKS, BS))
    g = torch.Generator().manual_seed(0)
    for k in cache.slot_tensors:
        for t in k.k + k.v:
            if t.dtype.is_floating_point:
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=t.dtype))
    return cache


def _blocks(cache, blocks: list[int]) -> list[torch.Tensor]:
    return [torch.stack([torch.stack([t[blocks] for t in kind.k]), torch.stack([t[blocks] for t in kind.v])])
            for kind in cache.slot_tensors]  # fmt: skip


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def unnamed_per_block_tensors(cache) -> list[str]:
    """The cache's attributes holding a per-block tensor (first axis: the blocks) that ``slot_tensors`` does not
    name: data that copy-on-write, swap, the hand-over and a refused step would leave behind."""
    named = {t.untyped_storage().data_ptr() for k in cache.slot_tensors for t in k.k + k.v}
    found = []
    for attr, value in vars(cache).items():
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == NUM_BLOCKS:
                if t.untyped_storage().data_ptr() not in named:
                    found.append(f"{type(cache).__name__}.{attr}")
    return found


@pytest.mark.parametrize("kind", CACHES)
def test_every_per_block_tensor_of_a_cache_is_named_in_slot_tensors(kind):
    cache = CACHES[kind](BlockManager(NUM_BLOCKS, BS))
    assert unnamed_per_block_tensors(cache) == []
    assert len(cache.slot_tensors) == (2 if kind.startswith("int8") else 1)


def test_the_guard_can_fail():
    cache = PagedKVCache(2, 2, 8, BlockManager(NUM_BLOCKS, BS))
    cache.k_extra = [torch.zeros(NUM_BLOCKS, BS, 2)]  # a new per-block tensor no path knows about
    assert unnamed_per_block_tensors(cache) == ["PagedKVCache.k_extra"]


def test_every_paged_cache_class_is_enumerated_here():
    """A new paged cache class fails here until it joins CACHES (and so every path's test)."""

    def subclasses(cls):
        return {cls} | {s for c in cls.__subclasses__() for s in subclasses(c)}

    covered = {type(make(BlockManager(NUM_BLOCKS, BS))) for make in CACHES.values()}
    missing = {c.__qualname__ for c in subclasses(PagedKVCache) if c.__module__.startswith("lesson_utils")} - {
        c.__qualname__ for c in covered
    }
    assert not missing, f"paged caches no test here enumerates: {sorted(missing)}"


@pytest.mark.parametrize("kind", CACHES)
def test_copy_on_write_moves_every_kind(kind):
    cache = _filled(kind)
    want = _blocks(cache, [3])
    cache.copy_block(3, 6)
    assert _same(_blocks(cache, [6]), want)


@pytest.mark.parametrize("kind", CACHES)
def test_swap_out_and_in_moves_every_kind(kind):
    cache = _filled(kind)
    space = HostBlocks.for_cache(cache, 4)
    want = _blocks(cache, [1, 2])
    cache.swap_out([(1, 3), (2, 0)], space)
    for k in cache.slot_tensors:
        for t in k.k + k.v:
            t[[1, 2]] = 0
    cache.swap_in([(3, 5), (0, 7)], space)
    assert _same(_blocks(cache, [5, 7]), want)


def test_host_blocks_made_for_another_kind_of_cache_are_refused():
    cache = _filled("int8")
    fp_host = HostBlocks.for_cache(_filled("paged"), 4)  # values only
    with pytest.raises(ValueError, match="these host blocks hold K/V per slot, but the cache keeps K/V, scales"):
        cache.swap_out([(1, 3)], fp_host)


@pytest.mark.parametrize("kind", CACHES)
def test_a_refused_steps_save_and_restore_moves_every_kind(kind):
    cache = _filled(kind)
    want = _blocks(cache, [2, 5])
    saved = cache.save_blocks([2, 5])
    for k in cache.slot_tensors:
        for t in k.k + k.v:
            t[[2, 5]] = 1
    cache.restore_blocks([2, 5], saved)
    assert _same(_blocks(cache, [2, 5]), want)


def _int8(w, n=40, **kw):
    return Int8PagedKVCache.for_model(w, n, 4, **kw)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch path", "kernel path"])
def test_an_int8_hand_over_decodes_as_the_int8_engine_alone(tiny, use_kernels):
    _, w = tiny
    prompt, new = [2, 40, 41, 42, 43, 44, 45], 6
    alone = Engine(w, _int8(w, use_kernels=use_kernels)).generate([prompt], new)[0]
    prefill = prefill_engine(w, _int8(w, use_kernels=use_kernels))
    decode = Engine(w, _int8(w, use_kernels=use_kernels))
    seq = hand_over(prefill, decode, Request(0, 0.0, len(prompt), new, prompt_ids=prompt))
    decode.run()
    assert seq.output_ids == alone
    assert decode.manager.num_free_blocks == decode.manager.view.num_blocks
    assert prefill.manager.num_free_blocks == prefill.manager.view.num_blocks


def test_a_hand_over_without_the_scales_or_between_kinds_is_refused_and_takes_nothing(tiny):
    _, w = tiny
    prompt = [2, 40, 41, 42, 43, 44, 45]
    prefill = prefill_engine(w, _int8(w))
    prefill_cache = prefill.cache
    decode = Engine(w, _int8(w))
    req = Request(0, 0.0, len(prompt), 4, prompt_ids=prompt)
    done = prefill_request(prefill, req)
    from lesson_utils.cache.block_copy import pack_blocks

    values_only = pack_blocks(prefill_cache.k_cache, prefill_cache.v_cache, done.blocks)
    with pytest.raises(ValueError, match=r"holds 1 packed tensor\(s\), but the decode cache keeps 2"):
        receive(decode, Prefilled(req, done.first_token, done.blocks), values_only)
    assert decode.manager.num_free_blocks == decode.manager.view.num_blocks and not decode.scheduler.has_work
    fp = prefill_engine(w, PagedKVCache.for_model(w, 40, 4))
    with pytest.raises(ValueError, match="same kind of cache"):
        hand_over(fp, decode, Request(1, 0.0, len(prompt), 4, prompt_ids=prompt))
    assert fp.manager.num_free_blocks == fp.manager.view.num_blocks
    fp_engine = Engine(w, PagedKVCache.for_model(w, 40, 4))
    as_floats = [values_only.float(), pack_blocks(*[[s.unsqueeze(-1) for s in x] for x in
                 (prefill_cache.k_scale, prefill_cache.v_scale)], done.blocks)]  # fmt: skip
    with pytest.raises(TypeError, match="a cast would not quantize"):
        receive(decode, Prefilled(req, done.first_token, done.blocks), as_floats)
    assert decode.manager.num_free_blocks == decode.manager.view.num_blocks
    assert fp_engine.manager.num_free_blocks == fp_engine.manager.view.num_blocks
