"""The paged caches' one metadata builder (issue 29): each field equals its plain definition at block sizes that are
not powers of two, every cache gets what its path reads, and no layer re-derives anything - under the device
discipline mode, nothing travels to the device and no metadata tensor is converted once ``prepare`` has run."""

from __future__ import annotations

import pytest
import torch
from helpers import ReservesSlots, ReservingPagedKVCache, random_step
from torch.overrides import TorchFunctionMode

from lesson_utils.cache.attention import decode_slot_index
from lesson_utils.cache.int8_paged import Int8PagedKVCache
from lesson_utils.cache.paged import slot_mapping
from lesson_utils.cache.paged_metadata import MetadataNeeds, PagedMetadata, build_paged_metadata
from lesson_utils.cache.triton_paged import TritonPagedKVCache, UnifiedTritonKVCache
from lesson_utils.core import device_discipline as dd
from lesson_utils.core.device_discipline import DEVICE, discipline
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import blocks_needed

ALL = MetadataNeeds(decode="kernel", table_ids=True, int32_slots=True, whole_step=True)


def _tables(gen, batch, block_size):
    """Random distinct blocks for each sequence of ``batch``, enough for its context."""
    perm = torch.randperm(500, generator=gen).tolist()
    out = []
    for c in batch.context_lens:
        n = blocks_needed(c, block_size) + int(torch.randint(0, 2, (1,), generator=gen))  # sometimes a spare block
        out.append([perm.pop() for _ in range(n)])
    return out


@pytest.mark.parametrize("block_size", [1, 3, 5, 7, 16])
@pytest.mark.parametrize("seed", range(4))
def test_every_field_equals_its_definition(block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 40, (6,), generator=gen).tolist()
    batch = random_step(gen, list(range(10, 16)), lens)
    tables = _tables(gen, batch, block_size)
    for needs in (ALL, MetadataNeeds(decode="gather")):
        meta = build_paged_metadata(batch, tables, block_size, "cpu", needs, slot_mapping)
        assert isinstance(meta, PagedMetadata) and meta.block_tables == tables
        want = [
            t[p // block_size] * block_size + p % block_size for t, ps in zip(tables, batch.new_positions()) for p in ps
        ]
        assert meta.slots.dtype == torch.long and meta.slots.tolist() == want
        decodes = [i for i, n in enumerate(batch.query_lens) if n == 1]
        assert (meta.decode.indices if meta.decode else []) == decodes
        for i, ids in enumerate(meta.table_ids):
            assert (ids is None) == (i in decodes)
            if ids is not None:
                assert (
                    ids.dtype == torch.long
                    and ids.tolist() == tables[i][: blocks_needed(batch.context_lens[i], block_size)]
                )
        if needs.decode == "gather" and decodes:
            want_index = decode_slot_index(
                [tables[i] for i in decodes], [batch.context_lens[i] for i in decodes], block_size, "cpu"
            )
            assert torch.equal(meta.decode.slot_index, want_index)
            assert meta.decode_tables is None and meta.slots_i32 is None and meta.padded_tables is None
        if needs is ALL:
            assert meta.slots_i32.dtype == torch.int32 and meta.slots_i32.tolist() == want
            assert meta.decode.slot_index is None  # the kernel reads tables, not a slot index
            if decodes:
                assert meta.decode_tables.dtype == meta.decode_lens.dtype == torch.int32
                for row, i in zip(meta.decode_tables.tolist(), decodes):
                    assert row[: len(tables[i])] == tables[i] and set(row[len(tables[i]) :]) <= {0}
                assert meta.decode_lens.tolist() == [batch.context_lens[i] for i in decodes]
            assert meta.query_start.tolist() == [sum(batch.query_lens[:i]) for i in range(len(lens) + 1)]
            assert meta.context_lens.dtype == torch.int32 and meta.context_lens.tolist() == batch.context_lens
            assert meta.padded_tables.shape == (len(tables), max(map(len, tables)))
            assert meta.max_query_len == max(batch.query_lens)


def test_needs_refuse_an_unknown_decode_path():
    with pytest.raises(ValueError, match="decode is None, 'gather' or 'kernel'"):
        MetadataNeeds(decode="batched")


class _WatchMeta(TorchFunctionMode):
    """Records every conversion or copy made of one of the watched tensors (the step's metadata)."""

    CONVERSIONS = {"to", "int", "long", "type", "clone", "contiguous", "cpu", "cuda", "tolist"}

    def __init__(self, watched):
        super().__init__()
        self.watched, self.seen = {id(t) for t in watched}, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        out = func(*args, **(kwargs or {}))
        if name in self.CONVERSIONS and args and id(args[0]) in self.watched:
            same = isinstance(out, torch.Tensor) and (out.dtype, out.device) == (args[0].dtype, args[0].device)
            if not same or name in ("clone", "tolist"):  # ``.to`` what it already is changes nothing: not counted
                self.seen.append(name)
        return out


def _meta_tensors(meta):
    out = [v for v in vars(meta).values() if isinstance(v, torch.Tensor)]
    out += [t for t in meta.table_ids or [] if t is not None]
    if meta.decode:
        out += [t for t in (meta.decode.rows, meta.decode.context_lens, meta.decode.slot_index) if t is not None]
    return out


class _Int8(ReservesSlots, Int8PagedKVCache):
    pass


class _Triton(ReservesSlots, TritonPagedKVCache):
    pass


class _Unified(ReservesSlots, UnifiedTritonKVCache):
    pass


CACHES = {
    "paged (one by one)": lambda m: ReservingPagedKVCache(2, 2, 8, m, device=DEVICE, batched_decode=False),
    "paged (batched decode)": lambda m: ReservingPagedKVCache(2, 2, 8, m, device=DEVICE, batched_decode=True),
    "triton decode": lambda m: _Triton(2, 2, 8, m, device=DEVICE),
    "unified": lambda m: _Unified(2, 2, 8, m, device=DEVICE),
    "int8 (torch)": lambda m: _Int8(2, 2, 8, m, device=DEVICE, use_kernels=False),
    "int8 (kernels)": lambda m: _Int8(2, 2, 8, m, device=DEVICE, use_kernels=True, check_finite=False),
}


@pytest.mark.parametrize("kind", CACHES)
def test_no_layer_re_derives_the_steps_metadata(kind):
    """After ``prepare``, every layer's write and attend read the metadata as built: no copy to the device, no
    conversion of a metadata tensor (the int8 cache used to convert the slots to int32 in every layer)."""
    gen = torch.Generator().manual_seed(1)
    with discipline() as mode:
        cache = CACHES[kind](BlockManager(80, 4))
        lens = {1: 0, 2: 0, 3: 0}
        for _ in range(3):  # prompts, then steps that mix decodes with longer chunks
            ids = sorted(lens)
            batch = random_step(gen, ids, [lens[i] for i in ids])
            batch.input_ids, batch.positions = batch.input_ids.to(DEVICE), batch.positions.to(DEVICE)
            cache.prepare(batch)
            first = len(mode.transfers)
            with _WatchMeta(_meta_tensors(batch.meta)) as watch:
                for layer in range(2):
                    k, v, q = (torch.randn(batch.num_tokens, 2, 8, generator=gen).to(DEVICE) for _ in range(3))
                    cache.write(layer, batch, k, v)
                    cache.attend(layer, batch, q, 0.3)
            assert watch.seen == [], (kind, watch.seen)
            moved = [t for t in mode.transfers[first:] if t.direction == "to device"]
            assert len(moved) == 3 * 2, (kind, moved)  # only the test's own k, v and q, in each of the two layers
            for i, c in zip(batch.seq_ids, batch.context_lens):
                lens[i] = c
    assert dd.active() is None
