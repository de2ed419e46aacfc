"""Checkers for lesson 03 (block table)."""

from __future__ import annotations

import random

import torch

from lesson_utils.cache import attention, paged
from lesson_utils.cache.seam import StepBatch
from lesson_utils.core.types import OutOfBlocks
from lesson_utils.memory import block_table as bt
from lesson_utils.memory.block_allocator import BlockAllocator

from .core import CheckResult, call_learner, case_device, check_function, failed, not_implemented, passed


def _state(a) -> tuple:
    """Everything an allocator's correctness depends on: a refused call must leave it unchanged."""
    return (list(a._free_queue), list(a._is_free), a.num_free)


def _refused(name, a, call, arg, expected, what):
    """None when ``call(arg)`` raises ``expected`` and leaves the allocator as it was; else a failed result."""
    before = _state(a)
    value, err = call_learner(call, arg) if arg is not None else call_learner(call)
    if not isinstance(err, expected):
        got = f"raised {type(err).__name__}: {err}" if err else f"returned {value!r}"
        return failed(name, f"{what} {got}; expected {expected.__name__}", BlockAllocator)
    if _state(a) != before:
        return failed(
            name,
            f"{what} raised {expected.__name__} as it should, but had already changed the allocator "
            f"(num_free {before[2]} -> {a.num_free}): a refused call must change nothing, or a block ends up "
            "handed out twice",
            BlockAllocator,
        )
    return None


def check_block_allocator(cls) -> CheckResult:
    """Exercise 03-1: ``allocate`` and ``free`` of a subclass of ``BlockAllocator``.
    Long on purpose: the spec's clauses one after another, each with the feedback its failure gets."""
    name = "block allocator"
    try:
        a = cls(4)
        got = [call_learner(a.allocate)[0] for _ in range(4)]
        if got != [0, 1, 2, 3]:
            return failed(
                name,
                f"allocating all 4 blocks of a fresh allocator gave {got}; expected 0, 1, 2, 3 - each once, taken from "
                "the left of the free queue",
                BlockAllocator,
            )
        bad = _refused(
            name,
            a,
            a.allocate,
            None,
            OutOfBlocks,
            "allocate() with no free block left (the scheduler catches OutOfBlocks)",
        )
        if bad is not None:
            return bad
        for held_id in (-1, -4, 4):  # every block is held: a negative id must not wrap around to a held block
            bad = _refused(name, a, a.free, held_id, ValueError, f"free({held_id}) while every block of 4 is held")
            if bad is not None:
                return bad
        _, err = call_learner(a.free, got[2])
        if err:
            return failed(name, f"free({got[2]}) of a held block raised {type(err).__name__}: {err}", BlockAllocator)
        value, err = call_learner(a.allocate)
        if value != got[2]:
            return failed(
                name,
                f"after freeing block {got[2]} (the only free one), allocate() gave {value!r}{f' and raised {err!r}' if err else ''}",
                BlockAllocator,
            )
        if a.num_free != 0:
            return failed(
                name, f"with every block held, num_free is {a.num_free}: keep self._free_queue in step", BlockAllocator
            )
        fifo = cls(4)
        for _ in range(4):
            fifo.allocate()
        for block_id in (2, 0, 3):
            fifo.free(block_id)
        order = [fifo.allocate() for _ in range(3)]
        if order != [2, 0, 3]:
            return failed(
                name,
                f"after freeing blocks 2, 0 and 3 (in that order), allocate() gave {order}; expected [2, 0, 3] - which end "
                "of the queue does free() give back to? (First in, first out: the block free the longest is reused "
                "first, which a prefix cache will count on.)",
                BlockAllocator,
            )
        b = cls(4)
        first = b.allocate()
        b.free(first)
        bad = _refused(name, b, b.free, first, ValueError, f"freeing block {first} twice (a double free)")
        if bad is not None:
            return bad
        for out_of_range in (4, -1, 100):
            bad = _refused(
                name, b, b.free, out_of_range, ValueError, f"free({out_of_range}) on a 4-block allocator (out of range)"
            )
            if bad is not None:
                return bad
        # randomized: never hand out a held block, counts always right
        rng, c, held = random.Random(0), cls(16), set()
        for i in range(300):
            if held and (rng.random() < 0.5 or len(held) == 16):
                x = rng.choice(sorted(held))
                c.free(x)
                held.discard(x)
            else:
                x = c.allocate()
                if x in held or not 0 <= x < 16:
                    return failed(
                        name,
                        f"operation {i}: allocate() returned {x}, which is {'already held' if x in held else 'out of range'}",
                        BlockAllocator,
                    )
                held.add(x)
            if c.num_free != 16 - len(held):
                return failed(
                    name,
                    f"operation {i}: num_free is {c.num_free}, but {16 - len(held)} blocks are free",
                    BlockAllocator,
                )
    except NotImplementedError:
        return not_implemented(name, BlockAllocator)
    except Exception as err:  # noqa: BLE001
        return failed(name, f"raised {type(err).__name__}: {err}", BlockAllocator)
    return passed(
        name,
        "hands out every block once, raises OutOfBlocks when empty, refuses double and out-of-range frees, and survives 300 random operations.",
        cls,
    )


def _grow_cases():
    cases = []
    for block_size, tokens in [(1, 5), (4, 13), (16, 40), (16, 16), (3, 10)]:
        cases.append((block_size, tokens))
    return cases


def check_grow_block_table(fn) -> CheckResult:
    """Exercise 03-2: add a block exactly when a new token starts a logical block."""
    name = "grow_block_table"
    for block_size, tokens in _grow_cases():
        ids_ref, ids_got = iter(range(100, 1000)), iter(range(100, 1000))
        ref, got = [], []
        for n in range(tokens):
            bt.grow_block_table(ref, n, block_size, ids_ref.__next__)
            try:
                result = fn(got, n, block_size, ids_got.__next__)
            except NotImplementedError:
                return not_implemented(name, bt.grow_block_table)
            except Exception as err:  # noqa: BLE001
                return failed(
                    name,
                    f"with block_size={block_size}, growing from {n} tokens raised {type(err).__name__}: {err}",
                    bt.grow_block_table,
                )
            if isinstance(result, list) and result is not got and got != ref and result == ref:
                return failed(
                    name,
                    f"with block_size={block_size}, growing from {n} tokens: you returned a new table, "
                    f"but the caller's table is still {got}. The engine keeps using the table it passed in: "
                    "grow that list itself (in place)",
                    bt.grow_block_table,
                )
            if got != ref:
                hint = ""
                if len(got) > len(ref):
                    hint = f"{len(got)} blocks for {n + 1} tokens: how many tokens does one block hold?"
                elif len(got) < len(ref):
                    hint = f"{len(got)} blocks for {n + 1} tokens: which token is the first to need a new block?"
                return failed(
                    name,
                    f"with block_size={block_size}, after growing from {n} to {n + 1} tokens\n"
                    f"    expected table: {ref}\n    got table:      {got}" + (f"\n    hint: {hint}" if hint else ""),
                    bt.grow_block_table,
                )
    return passed(name, f"tables grow exactly like the reference for {len(_grow_cases())} block sizes and lengths.", fn)


def _slot_cases():
    rng = random.Random(3)
    cases = []
    for block_size in (1, 3, 4, 6, 16, 12):  # not only powers of two: bit tricks are exact only for those
        k = rng.randint(1, 4)
        news = [[7] * rng.choice([1, 1, rng.randint(1, 20)]) for _ in range(k)]
        before = [rng.randint(0, 40) for _ in range(k)]
        batch = StepBatch.build(list(range(k)), news, before, device=case_device())
        pool = list(range(400))
        rng.shuffle(pool)
        tables = []
        for i, clen in enumerate(batch.context_lens):
            need = bt.blocks_needed(clen, block_size) + (i == 0)  # the first table holds a spare block for later
            tables.append([pool.pop() for _ in range(need)])
        cases.append((batch, tables, block_size))
    return cases


def check_slot_mapping(fn) -> CheckResult:
    """Exercise 03-3: the flat cache slot of every new token, through the block tables."""

    def show(case):
        b, tables, bs = case
        return f"block_size={bs}, block_tables={tables}, query_lens={b.query_lens}, positions={b.positions.tolist()}"

    def explain(case, expected, got):
        b, tables, bs = case
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return "return one slot per new token, as a torch.long tensor"
        if torch.equal(got, b.positions):
            return "these are the positions alone: where does the block table come in?"
        return "for one token, work out by hand which logical block and offset it has, then which physical block"

    return check_function(
        "slot_mapping",
        fn,
        paged.slot_mapping,
        _slot_cases(),
        show_input=show,
        explain=explain,
        arg_names=("batch", "block_tables", "block_size"),
    )


def _gather_cases():
    gen = torch.Generator().manual_seed(4)
    cases = []
    for block_size, ctx, spare in [
        (4, 1, 0),
        (4, 8, 0),
        (4, 7, 0),
        (16, 40, 0),
        (1, 5, 0),
        (4, 8, 1),
        (16, 17, 1),
        (3, 10, 1),
        (6, 13, 1),
    ]:
        cache = torch.randn(12, block_size, 2, 3, generator=gen).to(case_device())
        # spare: the table already holds the block reserved for the next token (the engine does that)
        table = torch.randperm(12, generator=gen)[: bt.blocks_needed(ctx, block_size) + spare].tolist()
        cases.append((cache, table, ctx))
    return cases


def check_gather_kv(fn) -> CheckResult:
    """Exercise 03-4: one sequence's K (or V) gathered into a contiguous tensor."""

    def explain(case, expected, got):
        cache, table, ctx = case
        if isinstance(got, torch.Tensor) and got.dim() == 3 and got.shape[0] > ctx:
            return "more tokens than context_len: what sits in the slots past the last token?"
        if isinstance(got, torch.Tensor) and got.shape == expected.shape:
            return "the right shape, other values: in what order do the blocks of a sequence come?"
        return f"expected shape {tuple(expected.shape)} = [context_len, kv_heads, head_dim]"

    return check_function(
        "gather_kv",
        fn,
        attention.gather_kv,
        _gather_cases(),
        show_input=lambda c: f"cache {tuple(c[0].shape)}, block_table={c[1]}, context_len={c[2]}",
        explain=explain,
        arg_names=("cache", "block_table", "context_len"),
    )
