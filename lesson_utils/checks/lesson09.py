"""Checkers for lesson 09 (disaggregated prefill: the transfer plan, packing, adoption)."""

from __future__ import annotations

import copy

import torch

from lesson_utils.disagg.transfer import TransferPlan, pack_blocks, transfer_plan, unpack_blocks
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import BlockTable

from .core import CheckResult, case_device, failed, not_implemented, passed, short


def _reference_adopt(manager, seq_id, blocks, num_tokens):
    return manager.adopt(seq_id, blocks, num_tokens)


class _Allocator:
    """The decode worker's allocator for a case: hands out ``queue`` in order and counts the calls."""

    def __init__(self, queue):
        self.queue, self.calls = list(queue), 0

    def __call__(self):
        self.calls += 1
        if not self.queue:
            raise RuntimeError("the checker's allocator ran out: more blocks were allocated than the request needs")
        return self.queue.pop(0)


def _run(fn, name, reference, case_text, *args):
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, not_implemented(name, reference)
    except Exception as err:  # noqa: BLE001 - any learner error becomes feedback
        return None, failed(name, f"{case_text}: your code raised {type(err).__name__}: {err}", reference)


def check_transfer_plan(fn) -> CheckResult:
    """Exercise 09-1: which blocks to send (full ones and the partial last one) and where each goes."""
    name = "transfer_plan"
    cases = [
        ("a partial last block", 3, [7, 2, 9, 4], 9, 4, [11, 5, 8, 1]),
        ("exactly full blocks", 4, [3, 0, 6], 8, 4, [2, 9, 10]),
        ("one token", 5, [12, 13], 1, 16, [0, 4]),
        ("a table longer than the prompt", 6, [1, 2, 3, 4, 5, 6], 17, 8, [20, 21, 22, 23]),
    ]
    for label, seq_id, table, num_tokens, block_size, free in cases:
        case_text = f"case '{label}' (sequence {seq_id}, {num_tokens} tokens, block size {block_size}, table {table})"
        want = transfer_plan(seq_id, list(table), num_tokens, block_size, _Allocator(free))
        alloc = _Allocator(free)
        given = list(table)
        got, problem = _run(fn, name, transfer_plan, case_text, seq_id, given, num_tokens, block_size, alloc)
        if problem is not None:
            return problem
        if given != table:
            return failed(name, f"{case_text}: your code changed the prefill worker's table", transfer_plan)
        if not isinstance(got, TransferPlan):
            return failed(
                name,
                f"{case_text}: return a TransferPlan(seq_id, num_tokens, src_blocks, dst_blocks); got {short(got)}",
                transfer_plan,
            )
        if got.src_blocks != want.src_blocks:
            return failed(
                name,
                f"{case_text}: you send blocks {got.src_blocks}, expected {want.src_blocks} - the blocks that hold "
                f"the {num_tokens} tokens, the partial last one included, in table order",
                transfer_plan,
            )
        if alloc.calls != want.num_blocks or got.dst_blocks != want.dst_blocks:
            return failed(
                name,
                f"{case_text}: destinations {got.dst_blocks} after {alloc.calls} allocate() calls, expected "
                f"{want.dst_blocks} - one fresh block per block sent, in the same order",
                transfer_plan,
            )
        if (got.seq_id, got.num_tokens) != (seq_id, num_tokens):
            return failed(
                name, f"{case_text}: the plan names sequence {got.seq_id} with {got.num_tokens} tokens", transfer_plan
            )
    return passed(name, f"the right blocks and destinations on all {len(cases)} cases.", fn)


def _caches(seed, layers=2, num_blocks=9, block_size=4, heads=2, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    dev = case_device()
    k = [torch.randn(num_blocks, block_size, heads, d, generator=g).to(dtype).to(dev) for _ in range(layers)]
    v = [torch.randn(num_blocks, block_size, heads, d, generator=g).to(dtype).to(dev) for _ in range(layers)]
    return k, v


def check_pack_blocks(pack_fn, unpack_fn) -> CheckResult:
    """Exercise 09-2: one request's blocks of every layer into one tensor, and back into another cache.
    ``use`` is the pair ``(pack, unpack)``: the learner's once both pass, the course's until then."""
    result = _check_pack_blocks(pack_fn, unpack_fn)
    result.use = (pack_fn, unpack_fn) if result.passed else (pack_blocks, unpack_blocks)
    return result


def _check_pack_blocks(pack_fn, unpack_fn) -> CheckResult:
    name = "pack_blocks / unpack_blocks"
    for seed, blocks, dtype in [
        (1, [5, 0, 3], torch.float32),
        (2, [8], torch.float32),
        (3, [2, 7, 1, 4], torch.float16),
    ]:
        k, v = _caches(seed, dtype=dtype)
        before = copy.deepcopy((k, v))
        case_text = f"blocks {blocks} of a 2-layer cache ({str(dtype).replace('torch.', '')})"
        got, problem = _run(pack_fn, name, pack_blocks, case_text, k, v, list(blocks))
        if problem is not None:
            return problem
        want = pack_blocks(k, v, blocks)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            return failed(
                name,
                f"{case_text}: pack_blocks should return one tensor of shape {tuple(want.shape)} ([2 (K, V), layers, "
                f"blocks, block_size, kv_heads, head_dim]) in the cache's dtype; got {short(got)}",
                pack_blocks,
            )
        if got.device != want.device:
            return failed(
                name, f"{case_text}: the packed tensor is on {got.device}, the cache on {want.device}", pack_blocks
            )
        if not torch.equal(got, want):
            layer_wrong = [
                (kv, layer) for kv in range(2) for layer in range(2) if not torch.equal(got[kv, layer], want[kv, layer])
            ]
            kv, layer = layer_wrong[0]
            return failed(
                name,
                f"{case_text}: the packed {'K' if kv == 0 else 'V'} of layer {layer} differs - every layer's K and V, "
                "the blocks in the order given",
                pack_blocks,
            )
        if not all(torch.equal(a, b) for a, b in zip(k + v, before[0] + before[1])):
            return failed(name, f"{case_text}: pack_blocks changed the cache it read", pack_blocks)
        dst_k, dst_v = _caches(seed + 10, dtype=dtype)
        untouched = copy.deepcopy((dst_k, dst_v))
        targets = [(b + 3) % 9 for b in blocks][::-1]
        out, problem = _run(unpack_fn, name, unpack_blocks, case_text, want.clone(), dst_k, dst_v, list(targets))
        if problem is not None:
            return problem
        if out is not None:
            return failed(
                name, f"{case_text}: unpack_blocks writes into the caches in place and returns None", unpack_blocks
            )
        for layer in range(2):
            for i, b in enumerate(targets):
                if not (
                    torch.equal(dst_k[layer][b], want[0, layer, i]) and torch.equal(dst_v[layer][b], want[1, layer, i])
                ):
                    return failed(
                        name,
                        f"{case_text}, unpacked into blocks {targets}: block {b} of layer {layer} does not hold packed "
                        f"block {i} - the i-th packed block goes to the i-th destination",
                        unpack_blocks,
                    )
            for b in range(9):
                if b not in targets and not (
                    torch.equal(dst_k[layer][b], untouched[0][layer][b])
                    and torch.equal(dst_v[layer][b], untouched[1][layer][b])
                ):
                    return failed(
                        name, f"{case_text}: unpack_blocks changed block {b}, which is not a destination", unpack_blocks
                    )
    return passed(
        name, "every layer's K and V packed in order, and unpacked exactly into the destinations.", (pack_fn, unpack_fn)
    )


def _manager():
    m = BlockManager(8, 4, watermark=0.0)
    m.ensure_capacity(100, 5)  # another request already holds blocks 0, 1
    return m


def check_adopt(fn) -> CheckResult:
    """Exercise 09-3: the decode worker's block table for blocks it received."""
    name = "adopt"
    m = _manager()
    blocks = [m.allocator.allocate() for _ in range(3)][::-1]
    given = list(blocks)
    got, problem = _run(fn, name, _reference_adopt, "adopting 3 blocks holding 10 tokens", m, 7, given, 10)
    if problem is not None:
        return problem
    table = m.tables.get(7)
    if table is None:
        return failed(
            name,
            "after adopting, sequence 7 has no table in manager.tables: the manager must know it",
            _reference_adopt,
        )
    if not isinstance(got, BlockTable) or got is not table:
        return failed(
            name, f"return the BlockTable the manager now holds for the sequence; got {short(got)}", _reference_adopt
        )
    if table.blocks != blocks or table.num_tokens != 10:
        return failed(
            name,
            f"the table holds blocks {table.blocks} with {table.num_tokens} tokens; expected {blocks} with 10 "
            "(the received blocks, in order, and the tokens they hold - not their capacity)",
            _reference_adopt,
        )
    given.append(99)
    if table.blocks != blocks:
        return failed(
            name, "changing the list you were given changed the table: the table needs its own list", _reference_adopt
        )
    try:
        m.check_invariants()
    except AssertionError as err:
        return failed(name, f"the manager's invariants broke: {err}", _reference_adopt)
    refusals = [
        ("adopting sequence 7 again", lambda mm: (mm, 7, [mm.allocator.allocate()], 2), "already holds blocks"),
        ("3 blocks for 2 tokens", lambda mm: (mm, 8, [mm.allocator.allocate() for _ in range(3)], 2), "block count"),
        ("a free block", lambda mm: (mm, 9, [7], 3), "must be allocated"),
    ]
    for what, make, why in refusals:
        mm = copy.deepcopy(m)
        args = make(mm)
        before = ({s: (list(t.blocks), t.num_tokens) for s, t in mm.tables.items()}, mm.allocator.num_free)
        try:
            fn(*args)
        except NotImplementedError:
            return not_implemented(name, _reference_adopt)
        except ValueError:
            after = ({s: (list(t.blocks), t.num_tokens) for s, t in mm.tables.items()}, mm.allocator.num_free)
            if after != before:
                return failed(
                    name,
                    f"{what}: you raised, but the tables changed first - a refusal changes nothing",
                    _reference_adopt,
                )
            continue
        except Exception as err:  # noqa: BLE001
            return failed(name, f"{what}: expected ValueError, got {type(err).__name__}: {err}", _reference_adopt)
        return failed(name, f"{what} was accepted: refuse it with a ValueError ({why})", _reference_adopt)
    return passed(name, "the table, its own list of blocks, the manager's invariants, and three refusals.", fn)
