"""Checkers for lesson 09 (disaggregated prefill: the transfer plan, packing, back-pressure)."""

from __future__ import annotations

import copy

import torch

from lesson_utils.cache.block_copy import pack_blocks, unpack_blocks
from lesson_utils.core.types import OutOfBlocks
from lesson_utils.disagg.transfer import TransferPlan, transfer_plan

from .core import CheckResult, call_learner, case_device, failed, not_implemented, passed, short


class _Allocator:
    """The decode side's allocator for a case: hands out ``queue`` in order (then raises ``OutOfBlocks``), takes
    blocks back through ``release``, and counts both."""

    def __init__(self, queue):
        self.queue, self.calls, self.given, self.released = list(queue), 0, [], []

    def __call__(self):
        self.calls += 1
        if not self.queue:
            raise OutOfBlocks("the decode side has no free block left")
        self.given.append(self.queue.pop(0))
        return self.given[-1]

    def release(self, block):
        if block not in self.given or block in self.released:
            raise ValueError(f"release({block}): that block was not handed out by allocate() (or came back twice)")
        self.released.append(block)

    @property
    def held(self) -> list[int]:
        return [b for b in self.given if b not in self.released]


def _run(fn, name, reference, case_text, *args):
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, not_implemented(name, reference)
    except Exception as err:  # noqa: BLE001 - any learner error becomes feedback
        return None, failed(name, f"{case_text}: your code raised {type(err).__name__}: {err}", reference)


_PLAN_CASES = [  # (label, seq_id, table, num_tokens, block_size, free blocks on the decode side)
    ("a partial last block", 3, [7, 2, 9, 4], 9, 4, [11, 5, 8, 1]),
    ("exactly full blocks", 4, [3, 0, 6], 8, 4, [2, 9, 10]),
    ("one token", 5, [12, 13], 1, 16, [0, 4]),
    ("a table longer than the prompt", 6, [1, 2, 3, 4, 5, 6], 17, 8, [20, 21, 22, 23]),
    ("blocks of 3", 7, [9, 8, 7, 6, 5], 10, 3, [30, 31, 32, 33, 34]),
    ("blocks of 12", 8, [4, 40, 14], 25, 12, [1, 2, 3]),
    ("blocks of 5, a full last block", 9, [6, 3, 8, 1], 15, 5, [7, 0, 2, 9]),
]


def check_transfer_plan(fn) -> CheckResult:
    """Exercise 09-1: which blocks to send, a destination for each, all or nothing, bad requests refused first.
    Long on purpose: the spec's clauses one after another, each with the feedback its failure gets."""
    name = "transfer_plan"
    for label, seq_id, table, num_tokens, block_size, free in _PLAN_CASES:
        case_text = f"case '{label}' (sequence {seq_id}, {num_tokens} tokens, block size {block_size}, table {table})"
        ref = _Allocator(free)
        want = transfer_plan(seq_id, list(table), num_tokens, block_size, ref, ref.release)
        alloc = _Allocator(free)
        given = list(table)
        got, problem = _run(
            fn, name, transfer_plan, case_text, seq_id, given, num_tokens, block_size, alloc, alloc.release
        )
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
            need = -(-num_tokens // block_size)
            why = (
                "the last block is only partly filled: are its tokens on the other side without it?"
                if len(got.src_blocks) < need
                else "does the decode side need the blocks the prompt does not fill?"
                if len(got.src_blocks) > need
                else "in which order does the decode side read them?"
            )
            return failed(
                name,
                f"{case_text}: you send blocks {got.src_blocks}, expected {want.src_blocks} - {why}",
                transfer_plan,
            )
        if alloc.calls != want.num_blocks or got.dst_blocks != want.dst_blocks or alloc.released:
            return failed(
                name,
                f"{case_text}: destinations {got.dst_blocks} after {alloc.calls} allocate() and {len(alloc.released)} "
                f"release() calls, expected {want.dst_blocks} - one fresh block per block sent, lined up with them",
                transfer_plan,
            )
        if (got.seq_id, got.num_tokens) != (seq_id, num_tokens):
            return failed(
                name, f"{case_text}: the plan names sequence {got.seq_id} with {got.num_tokens} tokens", transfer_plan
            )
    # the decode side runs out part-way (after the first block, and after the second): nothing may stay taken
    for table, num_tokens, free in (([5, 6, 7], 10, [3]), ([5, 6, 7, 8], 13, [3, 4])):
        alloc = _Allocator(free)
        what = f"a {len(table)}-block transfer when the decode side has only {len(free)} free block(s)"
        try:
            got, err = call_learner(fn, 1, list(table), num_tokens, 4, alloc, alloc.release)
        except NotImplementedError:
            return not_implemented(name, transfer_plan)
        if not isinstance(err, OutOfBlocks):
            outcome = f"raised {type(err).__name__}: {err}" if err else f"returned {short(got)}"
            return failed(name, f"{what}: your code {outcome}; expected the OutOfBlocks to come through", transfer_plan)
        if alloc.held:
            return failed(
                name,
                f"{what}: OutOfBlocks came through, but blocks {alloc.held} are still taken - a plan that cannot be "
                "made must leave the decode side as it was",
                transfer_plan,
            )
    for args, what in (
        ((1, [5, 6], 0, 4), "0 tokens"),
        ((1, [5, 6], -3, 4), "-3 tokens"),
        ((1, [5, 6], 5, 0), "block size 0"),
        ((1, [5], 9, 4), "9 tokens of blocks of 4 in a 1-block table"),
    ):
        alloc = _Allocator([1, 2, 3])
        try:
            got, err = call_learner(fn, *args, alloc, alloc.release)
        except NotImplementedError:
            return not_implemented(name, transfer_plan)
        if not isinstance(err, ValueError):
            outcome = f"raised {type(err).__name__}: {err}" if err else f"returned {short(got)}"
            return failed(name, f"a request of {what}: your code {outcome}; expected a ValueError", transfer_plan)
        if alloc.calls:
            return failed(
                name,
                f"a request of {what}: refused, but only after {alloc.calls} allocate() call(s) - check first",
                transfer_plan,
            )
    return passed(
        name,
        f"the right blocks and destinations on {len(_PLAN_CASES)} cases (block sizes 3 to 16), nothing kept when the "
        "decode side runs out, bad requests refused before any block is taken.",
        fn,
    )


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
    for problem in (_conversions(name, unpack_fn), _refusals(name, pack_fn, unpack_fn)):
        if problem is not None:  # (a failed CheckResult is falsy: no `or` here)
            return problem
    return passed(
        name,
        "every layer's K and V packed in order and unpacked exactly into the destinations, a payload of another dtype "
        "(or device) converted, and ids that are no blocks and payloads that do not fit refused before anything changed.",
        (pack_fn, unpack_fn),
    )


def _conversions(name, unpack_fn) -> CheckResult | None:
    """The spec asks unpack to convert a payload to the cache's dtype and device: cases that need it."""
    k, v = _caches(4, dtype=torch.float16)
    sources = [("an fp16 payload into an fp32 cache", pack_blocks(k, v, [1, 6]))]
    if str(case_device()) != "cpu":  # the device-discipline mode (or a GPU): a payload that arrived in host memory
        sources.append(("a payload in host memory into the device's cache", pack_blocks(k, v, [1, 6]).float().cpu()))
    for what, payload in sources:
        dst_k, dst_v = _caches(5)
        _, problem = _run(unpack_fn, name, unpack_blocks, what, payload, dst_k, dst_v, [3, 0])
        if problem is not None:
            return problem
        want = payload.to(device=dst_k[0].device, dtype=dst_k[0].dtype)
        if not (torch.equal(dst_k[1][0], want[0, 1, 1]) and torch.equal(dst_v[0][3], want[1, 0, 0])):
            return failed(name, f"{what}: the blocks do not hold the payload's values", unpack_blocks)
    return None


def _refusals(name, pack_fn, unpack_fn) -> CheckResult | None:
    """Ids that are no blocks (Python's -1 would quietly mean the last one) and payloads that do not fit: refused
    with ValueError before anything is read or written - including when the bad item is not the first."""
    k, v = _caches(6)
    good = pack_blocks(k, v, [0, 1])
    cases = [
        ("packing blocks [2, -1]", pack_fn, lambda: (k, v, [2, -1])),
        ("packing blocks [0, 9] of a 9-block cache", pack_fn, lambda: (k, v, [0, 9])),
        ("unpacking into blocks [4, -1]", unpack_fn, lambda: (good.clone(), *_caches(7), [4, -1])),
        ("unpacking into blocks [2, 9] of a 9-block cache", unpack_fn, lambda: (good.clone(), *_caches(7), [2, 9])),
        (
            "unpacking blocks of 8 tokens into a cache of blocks of 4",
            unpack_fn,
            lambda: (pack_blocks(*_caches(8, block_size=8), [0, 1]), *_caches(7), [2, 3]),
        ),
        ("unpacking into the same block twice", unpack_fn, lambda: (good.clone(), *_caches(7), [5, 5])),
        # a payload that differs from the cache in one axis at a time (torch would broadcast some of them)
        (
            "unpacking 3 layers' blocks into a 2-layer cache",
            unpack_fn,
            lambda: (pack_blocks(*_caches(8, layers=3), [0, 1]), *_caches(7), [2, 3]),
        ),
        (
            "unpacking blocks of 1 KV head into a cache of 2",
            unpack_fn,
            lambda: (pack_blocks(*_caches(8, heads=1), [0, 1]), *_caches(7), [2, 3]),
        ),
        (
            "unpacking head_dim 16 into a cache of head_dim 8",
            unpack_fn,
            lambda: (pack_blocks(*_caches(8, d=16), [0, 1]), *_caches(7), [2, 3]),
        ),
        ("unpacking only the K half of a payload", unpack_fn, lambda: (good[:1].clone(), *_caches(7), [2, 3])),
        ("unpacking 2 blocks' payload into 3 blocks", unpack_fn, lambda: (good.clone(), *_caches(7), [2, 3, 4])),
    ]
    for what, fn, make in cases:
        args = make()
        caches = [t for t in args if isinstance(t, list) and t and isinstance(t[0], torch.Tensor)]
        before = [t.clone() for c in caches for t in c]
        try:
            fn(*args)
        except NotImplementedError:
            return not_implemented(name, (pack_blocks, unpack_blocks))
        except ValueError:
            after = [t for c in caches for t in c]
            if not all(torch.equal(a, b) for a, b in zip(before, after)):
                return failed(
                    name, f"{what}: refused, but a block had been written first - check every id first", unpack_blocks
                )
            continue
        except Exception as err:  # noqa: BLE001
            return failed(name, f"{what}: expected a ValueError, got {type(err).__name__}: {err}", pack_blocks)
        return failed(
            name,
            f"{what} was accepted: refuse it with a ValueError (what would a negative index, or a block past the end, "
            "read or overwrite?)",
            pack_blocks,
        )
    return None


from .back_pressure import check_make_room  # noqa: E402 - exercise 09-3, in its own module

__all__ = ["check_make_room", "check_pack_blocks", "check_transfer_plan"]
