"""Lesson 09's checkers: the references pass; plausible wrong answers are rejected with the rule they break."""

from __future__ import annotations

import pytest
import torch
from helpers import rejected

from lesson_utils.cache.block_copy import pack_blocks, unpack_blocks
from lesson_utils.checks import lesson09
from lesson_utils.core.types import OutOfBlocks
from lesson_utils.disagg.transfer import TransferPlan, transfer_plan

pytestmark = pytest.mark.usefixtures("not_strict")


def test_the_references_pass_and_stubs_are_unsolved():
    assert lesson09.check_transfer_plan(transfer_plan).passed
    r = lesson09.check_pack_blocks(pack_blocks, unpack_blocks)
    assert r.passed and r.use == (pack_blocks, unpack_blocks)

    def stub(*args):
        raise NotImplementedError

    for result in (
        lesson09.check_transfer_plan(stub),
        lesson09.check_pack_blocks(stub, stub),
    ):
        assert not result.passed and not result.implemented
    assert lesson09.check_pack_blocks(stub, stub).use == (pack_blocks, unpack_blocks)


def full_blocks_only(seq_id, table, n, bs, allocate, release):
    src = table[: n // bs]
    return TransferPlan(seq_id, n, src, [allocate() for _ in src])


def whole_table(seq_id, table, n, bs, allocate, release):
    return TransferPlan(seq_id, n, list(table), [allocate() for _ in table])


def reversed_destinations(seq_id, table, n, bs, allocate, release):
    p = transfer_plan(seq_id, table, n, bs, allocate, release)
    return TransferPlan(seq_id, n, p.src_blocks, p.dst_blocks[::-1])


def pops_the_table(seq_id, table, n, bs, allocate, release):
    p = transfer_plan(seq_id, list(table), n, bs, allocate, release)
    table.clear()
    return p


def a_dict(seq_id, table, n, bs, allocate, release):
    p = transfer_plan(seq_id, table, n, bs, allocate, release)
    return dict(zip(p.src_blocks, p.dst_blocks))


def bit_shift_blocks(seq_id, table, n, bs, allocate, release):  # exact only for block sizes that are powers of two
    need = (n + bs - 1) >> (bs.bit_length() - 1)
    src = table[:need]
    return TransferPlan(seq_id, n, src, [allocate() for _ in src])


def keeps_what_it_took(seq_id, table, n, bs, allocate, release):  # no rollback when the decode side runs out
    src = table[: -(-n // bs)]
    return TransferPlan(seq_id, n, src, [allocate() for _ in src])


def swallows_the_error(seq_id, table, n, bs, allocate, release):
    try:
        return transfer_plan(seq_id, table, n, bs, allocate, release)
    except OutOfBlocks:
        return None


def checks_after_allocating(seq_id, table, n, bs, allocate, release):  # refuses, but only once blocks are taken
    src = table[: -(-n // bs)] if n > 0 and bs > 0 else table[:1]
    dst = []
    try:
        for _ in src:
            dst.append(allocate())
    except OutOfBlocks:
        for b in dst:
            release(b)
        raise
    if n < 1 or bs < 1 or -(-n // bs) > len(table):
        for b in dst:
            release(b)
        raise ValueError("a request that makes no sense")
    return TransferPlan(seq_id, n, list(src), dst)


def accepts_nonsense(seq_id, table, n, bs, allocate, release):
    src = table[: max(0, -(-n // max(bs, 1)))]
    dst = []
    try:
        for _ in src:
            dst.append(allocate())
    except OutOfBlocks:
        for b in dst:
            release(b)
        raise
    return TransferPlan(seq_id, n, src, dst)


def gives_back_twice(seq_id, table, n, bs, allocate, release):  # rolls back, then "to be sure" again
    src, dst = table[: -(-n // bs)], []
    try:
        for _ in src:
            dst.append(allocate())
    except OutOfBlocks:
        for b in dst + dst:
            release(b)
        raise
    return TransferPlan(seq_id, n, src, dst)


def its_own_error(seq_id, table, n, bs, allocate, release):  # the caller waits on OutOfBlocks, not on this
    try:
        return transfer_plan(seq_id, table, n, bs, allocate, release)
    except OutOfBlocks as err:
        raise RuntimeError("the decode side is full") from err


def refuses_with_a_type_error(seq_id, table, n, bs, allocate, release):
    if n < 1 or bs < 1:
        raise TypeError("bad request")
    return transfer_plan(seq_id, table, n, bs, allocate, release)


def a_short_table_sends_what_there_is(seq_id, table, n, bs, allocate, release):  # too few blocks: sends them all
    p = transfer_plan(seq_id, table, min(n, len(table) * bs) if bs > 0 else n, bs, allocate, release)
    return TransferPlan(seq_id, n, p.src_blocks, p.dst_blocks)


@pytest.mark.parametrize(
    "fn, needle",
    [
        (gives_back_twice, "came back twice"),
        (its_own_error, "expected the OutOfBlocks to come through"),
        (refuses_with_a_type_error, "expected a ValueError"),
        (a_short_table_sends_what_there_is, "1-block table"),
        (full_blocks_only, "partly filled"),
        (whole_table, "blocks the prompt does not fill"),
        (reversed_destinations, "lined up with them"),
        (pops_the_table, "changed the prefill worker's table"),
        (a_dict, "return a TransferPlan"),
        (bit_shift_blocks, "blocks of 3"),
        (keeps_what_it_took, "are still taken"),
        (swallows_the_error, "expected the OutOfBlocks to come through"),
        (checks_after_allocating, "only after"),
        (accepts_nonsense, "expected a ValueError"),
    ],
)
def test_wrong_plans_are_rejected(fn, needle):
    assert rejected(lesson09.check_transfer_plan(fn), needle)


def pack_sorted(k, v, blocks):
    return pack_blocks(k, v, sorted(blocks))


def pack_k_twice(k, v, blocks):
    return pack_blocks(k, k, blocks)


def pack_per_layer_list(k, v, blocks):
    return [pack_blocks([c], [d], blocks) for c, d in zip(k, v)]


def unpack_sorted(packed, k, v, blocks):
    unpack_blocks(packed, k, v, sorted(blocks))


def unpack_from_zero(packed, k, v, blocks):
    unpack_blocks(packed, k, v, list(range(len(blocks))))


def unpack_returns(packed, k, v, blocks):
    unpack_blocks(packed, k, v, blocks)
    return k


def pack_unchecked(k, v, blocks):  # Python's -1 quietly reads the last block
    index = torch.tensor(blocks, dtype=torch.long, device=k[0].device)
    return torch.stack([torch.stack([c[index] for c in k]), torch.stack([c[index] for c in v])])


def pack_checks_the_first(k, v, blocks):
    if blocks and not 0 <= blocks[0] < k[0].shape[0]:
        raise ValueError("bad block")
    return pack_unchecked(k, v, blocks)


def unpack_unchecked(packed, k, v, blocks):
    packed = packed.to(device=k[0].device, dtype=k[0].dtype)
    for layer, (kc, vc) in enumerate(zip(k, v)):
        for i, b in enumerate(blocks):
            kc[b] = packed[0, layer, i]
            vc[b] = packed[1, layer, i]


def unpack_checks_as_it_goes(packed, k, v, blocks):
    packed = packed.to(device=k[0].device, dtype=k[0].dtype)
    for i, b in enumerate(blocks):
        if not 0 <= b < k[0].shape[0]:
            raise ValueError(f"bad block {b}")
        for layer, (kc, vc) in enumerate(zip(k, v)):
            kc[b] = packed[0, layer, i]
            vc[b] = packed[1, layer, i]


def unpack_no_conversion(packed, k, v, blocks):
    index = torch.tensor(blocks, dtype=torch.long, device=k[0].device)
    for layer, (kc, vc) in enumerate(zip(k, v)):
        kc[index] = packed[0, layer]
        vc[index] = packed[1, layer]


def unpack_checks_blocks_only(packed, k, v, blocks):  # the block count and size checked; layers, heads, K/V not
    if packed.shape[2] != len(blocks) or packed.shape[3] != k[0].shape[1] or len(set(blocks)) != len(blocks):
        raise ValueError("does not fit")
    if any(not 0 <= b < k[0].shape[0] for b in blocks):
        raise ValueError("no such block")
    for layer in range(min(len(k), packed.shape[1])):
        k[layer][blocks] = packed[0, layer].to(k[layer].dtype)
        v[layer][blocks] = packed[-1, layer].to(v[layer].dtype)


@pytest.mark.parametrize(
    "pack, unpack, needle",
    [
        (pack_blocks, unpack_checks_blocks_only, "3 layers' blocks into a 2-layer cache was accepted"),
        (pack_sorted, unpack_blocks, "in the order given"),
        (pack_k_twice, unpack_blocks, "packed V of layer 0 differs"),
        (pack_per_layer_list, unpack_blocks, "should return one tensor"),
        (pack_blocks, unpack_sorted, "goes to the i-th destination"),
        (pack_blocks, unpack_from_zero, "goes to the i-th destination"),
        (pack_blocks, unpack_returns, "returns None"),
        (pack_unchecked, unpack_blocks, "packing blocks [2, -1] was accepted"),
        (pack_checks_the_first, unpack_blocks, "packing blocks [2, -1] was accepted"),
        (pack_blocks, unpack_unchecked, "unpacking into blocks [4, -1] was accepted"),
        (pack_blocks, unpack_checks_as_it_goes, "a block had been written first"),
        (pack_blocks, unpack_no_conversion, "an fp16 payload into an fp32 cache"),
    ],
)
def test_wrong_packing_is_rejected(pack, unpack, needle):
    result = lesson09.check_pack_blocks(pack, unpack)
    assert rejected(result, needle) and result.use == (pack_blocks, unpack_blocks)


def _room_ask_once(engine, need):  # asks whether anything decodes only before waiting
    from lesson_utils.core.types import OutOfBlocks

    if need > engine.manager.view.num_blocks:
        raise ValueError("never fits")
    if engine.manager.num_free_blocks < need and not engine.scheduler.has_work:
        raise OutOfBlocks("nothing decodes")
    done = []
    while engine.manager.num_free_blocks < need:
        done += engine.step()
    return done


def _room_refuses_the_whole_cache(engine, need):
    if need >= engine.manager.view.num_blocks:
        raise ValueError("never fits")
    return _room(engine, need)


def _room_sleeps(engine, need):  # waits for blocks that no step will free, a little at a time
    import time

    while engine.manager.num_free_blocks < need:
        time.sleep(0.01)
    return []


def _room(engine, need, *, loop="while", cmp="<", total=True, nothing_running="raise", returns=True):
    """The exercise with one switch per decision; all defaults: the right answer."""
    from lesson_utils.core.types import OutOfBlocks

    m = engine.manager
    if total and need > m.view.num_blocks:
        raise ValueError("never fits")
    done = []

    def short():
        free = m.num_free_blocks
        return free < need if cmp == "<" else free <= need

    if loop == "if":
        if short() and engine.scheduler.has_work:
            done += engine.step()
        return done if returns else []
    while short():
        if not engine.scheduler.has_work:
            if nothing_running == "raise":
                raise OutOfBlocks("nothing decodes")
            if nothing_running == "spin":
                continue
            break
        done += engine.step()
    return done if returns else []


def test_the_reference_make_room_passes(tiny):
    from lesson_utils.disagg.handover import make_room

    _, w = tiny
    assert lesson09.check_make_room(make_room, w).passed
    assert lesson09.check_make_room(_room, w).passed


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(loop="if"), "when exactly is there room"),
        (dict(cmp="<="), "when exactly is there room"),
        (dict(total=False), "can waiting ever make it fit"),
        (dict(nothing_running="spin"), "Raise OutOfBlocks when nothing is left to decode"),
        (dict(nothing_running="return"), "returned although too few blocks are free"),
        (dict(returns=False), "the Sequence objects that finished while you waited"),
    ],
)
def test_wrong_back_pressure_is_rejected(tiny, kw, needle):
    _, w = tiny
    assert rejected(lesson09.check_make_room(lambda e, n: _room(e, n, **kw), w), needle)


def test_a_cache_on_the_device_is_packed_there():
    from lesson_utils.core.device_discipline import DEVICE, discipline

    with discipline():
        k = [torch.randn(4, 2, 1, 4).to(DEVICE)]
        assert pack_blocks(k, k, [1, 0]).device == k[0].device


@pytest.mark.parametrize(
    "fn, needle",
    [
        (_room_ask_once, "asked only once"),
        (_room_refuses_the_whole_cache, "raised ValueError"),
        (_room_sleeps, "still waiting after"),
        (lambda e, n: [s.seq_id for s in _room(e, n)], "not Sequence objects"),
    ],
)
def test_more_back_pressure_mistakes(tiny, fn, needle):
    _, w = tiny
    assert rejected(lesson09.check_make_room(fn, w), needle)


def test_any_collection_of_the_finished_sequences_passes(tiny):
    _, w = tiny
    assert lesson09.check_make_room(lambda e, n: set(_room(e, n)), w).passed
