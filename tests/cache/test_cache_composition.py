"""A paged cache is a storage format and an attention backend (issue 44): every format works with every backend.

The worked example of extending it: an fp8 (e4m3) format written here, in the test, as one small class - no file of
the package changes - and served by all four backends (lesson 03's gather, its batched decode, lesson 04's decode
kernel, lesson 08's unified kernel) token-identical to the same format's gather, with every block back, through
preemption by swap (its scales move with its values) and copy-on-write."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lesson_utils.cache.backends import DecodeKernelBackend, GatherBackend, UnifiedKernelBackend
from lesson_utils.cache.formats import FloatFormat, Int8Format, ScaledFormat
from lesson_utils.cache.int8_paged import Int8PagedKVCache
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.cache.triton_paged import TritonPagedKVCache, UnifiedTritonKVCache
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.token_budget import ChunkedPrefill

E4M3_MAX = 448.0


@triton.jit
def load_fp8_tile(ptrs, scale_ptrs, mask, token_mask):
    """An fp8 tile in fp32, times each token's scale. Masked lanes become 0 by ``tl.where`` (an integer ``other=`` cannot
    be cast to fp8)."""
    x = tl.where(mask, tl.load(ptrs, mask=mask).to(tl.float32), 0.0)
    s = tl.load(scale_ptrs, mask=token_mask, other=0.0)
    return x * s[:, None]


class Fp8Format(ScaledFormat):
    """fp8 (e4m3) values, one fp32 scale per token and head (the largest magnitude maps to 448), and its own tile loader.
    Everything else - the scales' layout, the dequantizing reads, the byte counts, every path that moves blocks -
    comes with :class:`ScaledFormat`."""

    name = "fp8"
    storage = torch.float8_e4m3fn
    tile_loader = load_fp8_tile

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        amax = x.float().abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        return (x.float() / scale[..., None]).to(self.storage), scale


FORMATS = {
    "fp": lambda w: FloatFormat(w.dtype),
    "int8": lambda w: Int8Format(w.dtype),
    "fp8": lambda w: Fp8Format(w.dtype),
}
BACKENDS = {
    "gather": lambda: GatherBackend(batched_decode=False),
    "batched gather": lambda: GatherBackend(batched_decode=True),
    "decode kernel": lambda: DecodeKernelBackend(),
    "unified kernel": lambda: UnifiedKernelBackend(),
}


def _engine(w, fmt: str, backend: str, *, num_blocks=60, swap=False, chunked=False) -> Engine:
    manager = SharingBlockManager(num_blocks, 4, max_seq_len=w.max_positions)
    cache = PagedKVCache.for_model(w, manager=manager, format=FORMATS[fmt](w), backend=BACKENDS[backend]())
    kw = dict(preemption_mode="swap", swap_space=SwapSpace(60)) if swap else {}
    return Engine(w, cache, stop_at_eos=False, chunked_prefill=ChunkedPrefill(6) if chunked else None, **kw)


PROMPTS = [[2, 40, 41, 42, 43, 44], [2, 50, 51], [2, 40, 41, 42, 43, 60, 61]]  # the third shares 5 tokens
NEW = 4


def _serve(engine: Engine, n: int = 1) -> list[list[list[int]]]:
    firsts = [engine.add_request(p, NEW, n=n if i == 0 else 1) for i, p in enumerate(PROMPTS)]
    engine.run()
    m = engine.manager
    assert m.num_free_blocks == m.view.num_blocks and not m.view.tables_now(), "a block was not given back"
    return [[s.output_ids for s in f.samples] for f in firsts]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_with_every_backend_serves_the_formats_own_tokens(tiny, fmt, backend):
    """The same format's tokens whatever the backend (one format's K/V are the same numbers, read by other code),
    with parallel samples sharing blocks (copy-on-write) and, for the float format's unified kernel, chunked prefill."""
    _, w = tiny
    want = _serve(_engine(w, fmt, "gather"), n=2)
    assert _serve(_engine(w, fmt, backend, chunked=backend == "unified kernel" and fmt == "fp"), n=2) == want
    if fmt == "fp":
        plain = Engine(w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False)
        assert [o[0] for o in want] == plain.generate(PROMPTS, NEW)  # the float format is lesson 03's cache


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_scaled_format_swaps_its_scales_with_its_values(tiny, fmt):
    _, w = tiny
    want = _serve(_engine(w, fmt, "gather"))
    engine = _engine(w, fmt, "decode kernel", num_blocks=5, swap=True)
    assert _serve(engine) == want and engine.scheduler.num_preemptions > 0


def test_the_fp8_format_stores_fp8_and_counts_its_bytes(tiny):
    _, w = tiny
    cache = PagedKVCache.for_model(w, 10, 4, format=Fp8Format(w.dtype))
    assert cache.k_cache[0].dtype == torch.float8_e4m3fn and cache.format.k_scale[0].dtype == torch.float32
    per_slot = w.num_kv_heads * (w.head_dim * 1 + 4)  # one byte a value, four a scale
    assert cache.bytes_per_block == 2 * w.num_layers * 4 * per_slot == cache.allocated_bytes() // 10
    assert [k.name for k in cache.slot_tensors] == ["K/V", "scales"]
    x = torch.randn(5, w.num_kv_heads, w.head_dim) * 3
    q, s = cache.format.quantize(x)
    assert (q.float() * s[..., None] - x).abs().max() <= 0.07 * x.abs().max()  # e4m3: 3 bits of mantissa


def test_the_presets_are_compositions():
    """The lessons' class names stay; each is a format and a backend, chosen by configuration."""
    from lesson_utils.memory.block_manager import BlockManager

    m = lambda: BlockManager(8, 4)  # noqa: E731
    cases = [
        (PagedKVCache(2, 2, 8, m()), "fp", "gather"),
        (TritonPagedKVCache(2, 2, 8, m()), "fp", "decode kernel"),
        (UnifiedTritonKVCache(2, 2, 8, m()), "fp", "unified kernel"),
        (Int8PagedKVCache(2, 2, 8, m()), "int8", "gather"),
        (Int8PagedKVCache(2, 2, 8, m(), use_kernels=True), "int8", "decode kernel"),
        (Int8PagedKVCache(2, 2, 8, m(), backend=UnifiedKernelBackend()), "int8", "unified kernel"),
    ]
    for cache, fmt, backend in cases:
        assert (cache.format.name, cache.backend.name) == (fmt, backend)
    learner = lambda *a: None  # noqa: E731 - a learner's gather: the course's fast paths step aside
    assert PagedKVCache(2, 2, 8, m(), gather_fn=learner).metadata_needs.table_ids is False
    assert PagedKVCache(2, 2, 8, m()).metadata_needs.table_ids is True
