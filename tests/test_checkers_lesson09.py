"""Lesson 09's checkers: the references pass; plausible wrong answers are rejected with the rule they break."""

from __future__ import annotations

import pytest
import torch
from helpers import rejected

from lesson_utils.checks import lesson09
from lesson_utils.disagg.transfer import TransferPlan, pack_blocks, transfer_plan, unpack_blocks
from lesson_utils.memory.block_table import BlockTable

pytestmark = pytest.mark.usefixtures("not_strict")


def test_the_references_pass_and_stubs_are_unsolved():
    assert lesson09.check_transfer_plan(transfer_plan).passed
    r = lesson09.check_pack_blocks(pack_blocks, unpack_blocks)
    assert r.passed and r.use == (pack_blocks, unpack_blocks)
    assert lesson09.check_adopt(lesson09._reference_adopt).passed

    def stub(*args):
        raise NotImplementedError

    for result in (
        lesson09.check_transfer_plan(stub),
        lesson09.check_pack_blocks(stub, stub),
        lesson09.check_adopt(stub),
    ):
        assert not result.passed and not result.implemented
    assert lesson09.check_pack_blocks(stub, stub).use == (pack_blocks, unpack_blocks)


def full_blocks_only(seq_id, table, n, bs, allocate):
    src = table[: n // bs]
    return TransferPlan(seq_id, n, src, [allocate() for _ in src])


def whole_table(seq_id, table, n, bs, allocate):
    return TransferPlan(seq_id, n, list(table), [allocate() for _ in table])


def reversed_destinations(seq_id, table, n, bs, allocate):
    p = transfer_plan(seq_id, table, n, bs, allocate)
    return TransferPlan(seq_id, n, p.src_blocks, p.dst_blocks[::-1])


def pops_the_table(seq_id, table, n, bs, allocate):
    p = transfer_plan(seq_id, list(table), n, bs, allocate)
    table.clear()
    return p


def a_dict(seq_id, table, n, bs, allocate):
    p = transfer_plan(seq_id, table, n, bs, allocate)
    return dict(zip(p.src_blocks, p.dst_blocks))


@pytest.mark.parametrize(
    "fn, needle",
    [
        (full_blocks_only, "the partial last one included"),
        (whole_table, "the partial last one included"),
        (reversed_destinations, "in the same order"),
        (pops_the_table, "changed the prefill worker's table"),
        (a_dict, "return a TransferPlan"),
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


@pytest.mark.parametrize(
    "pack, unpack, needle",
    [
        (pack_sorted, unpack_blocks, "in the order given"),
        (pack_k_twice, unpack_blocks, "packed V of layer 0 differs"),
        (pack_per_layer_list, unpack_blocks, "should return one tensor"),
        (pack_blocks, unpack_sorted, "goes to the i-th destination"),
        (pack_blocks, unpack_from_zero, "goes to the i-th destination"),
        (pack_blocks, unpack_returns, "returns None"),
    ],
)
def test_wrong_packing_is_rejected(pack, unpack, needle):
    result = lesson09.check_pack_blocks(pack, unpack)
    assert rejected(result, needle) and result.use == (pack_blocks, unpack_blocks)


def not_registered(manager, seq_id, blocks, n):
    return BlockTable(manager.block_size, list(blocks), n)


def aliases(manager, seq_id, blocks, n):
    manager.adopt(seq_id, list(blocks), n)
    manager.tables[seq_id].blocks = blocks
    return manager.tables[seq_id]


def capacity_not_tokens(manager, seq_id, blocks, n):
    t = manager.tables[seq_id] = BlockTable(manager.block_size, list(blocks), len(blocks) * manager.block_size)
    return t


def no_checks(manager, seq_id, blocks, n):
    t = manager.tables[seq_id] = BlockTable(manager.block_size, list(blocks), n)
    return t


def checks_after_changing(manager, seq_id, blocks, n):
    manager.tables[seq_id] = BlockTable(manager.block_size, list(blocks), n)
    return manager.adopt(seq_id, blocks, n)


@pytest.mark.parametrize(
    "fn, needle",
    [
        (not_registered, "no table in manager.tables"),
        (aliases, "needs its own list"),
        (capacity_not_tokens, "not their capacity"),
        (no_checks, "was accepted"),
        (checks_after_changing, "your code raised ValueError: sequence 7 already holds blocks"),
    ],
)
def test_wrong_adoptions_are_rejected(fn, needle):
    assert rejected(lesson09.check_adopt(fn), needle)


def test_a_cache_on_the_device_is_packed_there():
    from lesson_utils.device_discipline import DEVICE, discipline

    with discipline():
        k = [torch.randn(4, 2, 1, 4).to(DEVICE)]
        assert pack_blocks(k, k, [1, 0]).device == k[0].device
