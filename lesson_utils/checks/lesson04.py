"""Checkers for lesson 04 (Triton paged kernel).

Each exercise is one ``@triton.jit`` building block of the decode kernel. The checker runs the course's
kernel with the learner's block and the course's other block on named cases, compares with the
plain-torch reference, and says which case broke and what that case tests.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from lesson_utils.cache import attention
from lesson_utils.core.device_discipline import kernel_launch
from lesson_utils.kernels import paged_attention as K

from .core import CheckResult, case_device, failed, not_implemented, passed

PROBE_PAD = 1024  # table entries on each side of a probe's table: a wrong index reads padding, not foreign memory
POISON = 1_000_003  # what that padding holds: a block id no table has, so a lane that read it shows in its slot


@triton.jit
def _probe_slots(
    table_ptr,
    slots_ptr,
    mask_ptr,
    start,
    context_len,
    SLOTS: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Runs a learner's ``block_slots`` alone and stores what it returns: nothing is loaded *through* the
    slots, so a wrong slot cannot make the kernel read outside the cache (in the interpreter that would
    crash the Python process, and the learner would see a dead kernel instead of feedback)."""
    slot, token_mask = SLOTS(table_ptr, start, context_len, TILE, BLOCK_SIZE)
    i = tl.arange(0, TILE)
    tl.store(slots_ptr + i, slot.to(tl.int64))
    tl.store(mask_ptr + i, token_mask.to(tl.int32))


def _probe_block_slots(fn) -> str:
    """'' when ``fn`` returns the right slots and mask on probe cases; else what was wrong. Raises what the
    learner's code raises (NotImplementedError included)."""
    dev = case_device()
    for block_size, tile, start, context_len in [
        (8, 8, 0, 8),
        (8, 16, 16, 29),
        (4, 32, 0, 13),
        (16, 16, 16, 17),
        (8, 8, 0, 1),
        (6, 16, 0, 20),  # block sizes that are not powers of two: a bit mask or a shift is exact only for those
        (12, 32, 32, 61),
    ]:
        g = torch.Generator().manual_seed(block_size * 100 + context_len)
        needed = -(-context_len // block_size)
        table = torch.randperm(64, generator=g)[: max(needed, 1)].to(torch.int32)
        # the table ends exactly where the context's last block ends; past it (and before it) lies poison
        buffer = torch.full((2 * PROBE_PAD + len(table),), POISON, dtype=torch.int32)
        buffer[PROBE_PAD : PROBE_PAD + len(table)] = table
        buffer = buffer.to(dev)
        slots = torch.zeros(tile, dtype=torch.int64, device=dev)
        mask = torch.zeros(tile, dtype=torch.int32, device=dev)
        with np.errstate(all="ignore"), kernel_launch():
            _probe_slots[(1,)](
                buffer[PROBE_PAD:], slots, mask, start, context_len, SLOTS=fn, TILE=tile, BLOCK_SIZE=block_size
            )
        token = torch.arange(start, start + tile)
        want_mask = token < context_len
        want = torch.where(
            want_mask,
            table.long()[torch.clamp(token // block_size, max=len(table) - 1)] * block_size + token % block_size,
            0,
        )
        got_mask, got = mask.cpu().bool(), slots.cpu()
        case = f"block size {block_size}, tokens {start}..{start + tile - 1}, context length {context_len}, table {table.tolist()}"
        if not torch.equal(got_mask, want_mask):
            t = int((got_mask != want_mask).nonzero()[0, 0])
            return (
                f"{case}: token {start + t} has mask {bool(got_mask[t])}, expected {bool(want_mask[t])} - which tokens "
                "of the tile exist?"
            )
        poisoned = (~want_mask) & (got >= POISON * block_size)
        if poisoned.any():
            t = int(poisoned.nonzero()[0, 0])
            entry = (start + t) // block_size
            return (
                f"{case}: token {start + t} does not exist (the context has {context_len} tokens), yet its lane read "
                f"table entry {entry} of a {len(table)}-entry table - past its end (on a GPU, memory that may not "
                "be yours). What does your block-id load read for lanes whose token does not exist?"
            )
        if not torch.equal(got[want_mask], want[want_mask]):
            t = int((got != want).logical_and(want_mask).nonzero()[0, 0])
            return (
                f"{case}: token {start + t} got slot {int(got[t])}, expected {int(want[t])} - which logical block "
                "and offset is that token, and which physical block does the table give?"
            )
    return ""


def _case(seed, ctxs, *, block_size=8, heads=2, kv_heads=1, head_dim=16, spare=None, q_scale=1.0, shuffle=True):
    """Random caches and block tables. ``spare`` extra table columns (default: a whole tile's worth) keep
    an unmasked lookup inside the table: the interpreter does not bounds-check, and reading outside a
    tensor could crash the Python process instead of producing a wrong answer the checker can explain."""
    if spare is None:
        spare = K.tile_tokens("tiled", block_size, head_dim) // block_size + 1
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(per_seq) + spare + 1
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist() if shuffle else list(range(num_blocks))
    # spare columns point at a real block full of other data: reading past the table is caught
    tables = torch.full((len(ctxs), max(per_seq) + spare), order[-1], dtype=torch.int32)
    taken = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(order[taken : taken + n], dtype=torch.int32)
        taken += n
    q = torch.randn(len(ctxs), heads, head_dim, generator=g) * q_scale
    dev = case_device()  # the kernel reads its arguments on the profile's device (compiled on a GPU)
    return tuple(t.to(dev) for t in (q, kc, vc, tables, torch.tensor(ctxs, dtype=torch.int32)))


def _run_cases(name, cases, kernel_kw, reference_fallback) -> CheckResult:
    for label, what, variant, case in cases:
        q, kc, vc, bt, cl = case
        want = attention.paged_attention_reference(q, kc, vc, bt, cl)
        try:
            with np.errstate(all="ignore"):  # a wrong kernel may overflow; the checker reports it below
                got = K.paged_attention_decode(q, kc, vc, bt, cl, variant=variant, **kernel_kw)
        except NotImplementedError:
            return not_implemented(name, reference_fallback)
        except Exception as err:  # noqa: BLE001 - compile or runtime errors become feedback
            if "NotImplementedError" in repr(err) or "not solved yet" in str(err):
                return not_implemented(name, reference_fallback)
            return failed(
                name,
                f"case '{label}' ({what}): the kernel raised {type(err).__name__}: {str(err)[:400]}",
                reference_fallback,
            )
        if not torch.isfinite(got).all():
            return failed(
                name,
                f"case '{label}' ({what}): the output has inf/nan values "
                f"(first at sequence {int((~torch.isfinite(got)).nonzero()[0, 0])}).",
                reference_fallback,
            )
        err = (got - want).abs()
        if err.max() > 1e-4:
            s, h, _ = (int(x) for x in (err == err.max()).nonzero()[0])
            return failed(
                name,
                f"case '{label}' ({what}): max abs error {err.max():.3g} vs the torch reference, at sequence {s} "
                f"(context {int(cl[s])}), head {h}\n    expected[{s}, {h}, :4]: {want[s, h, :4].tolist()}"
                f"\n    got[{s}, {h}, :4]:      {got[s, h, :4].tolist()}",
                reference_fallback,
            )
    return passed(name, f"the kernel built with it matches the torch reference on all {len(cases)} cases.", None)


def check_block_slots(fn) -> CheckResult:
    """Exercise 04-1: block-table lookup and pointer arithmetic (with the token mask)."""
    cases = [
        (
            "identity table",
            "one sequence in blocks 0, 1: logical and physical blocks coincide",
            "simple",
            _case(1, [16], shuffle=False),
        ),
        ("shuffled table", "physical blocks in random order: the table must be used", "simple", _case(2, [24, 16])),
        (
            "partial last block",
            "context 13 with block size 8: tokens 13-15 do not exist and must be masked",
            "simple",
            _case(3, [13, 5]),
        ),
        ("context 1", "a single token", "simple", _case(4, [1, 9])),
        ("several blocks per tile", "the tiled variant looks up many blocks at once", "tiled", _case(5, [37, 70])),
    ]
    try:  # the block alone first: wrong slots must be reported before a full kernel reads through them
        problem = _probe_block_slots(fn)
    except NotImplementedError:
        return not_implemented("block_slots", K.block_slots)
    except Exception as err:  # noqa: BLE001 - compile or runtime errors become feedback
        if "NotImplementedError" in repr(err) or "not solved yet" in str(err):
            return not_implemented("block_slots", K.block_slots)
        return failed(
            "block_slots",
            f"running your block_slots alone raised {type(err).__name__}: {str(err)[:400]}",
            K.block_slots,
        )
    if problem:
        return failed("block_slots", f"your block_slots, run alone in a probe kernel: {problem}", K.block_slots)
    result = _run_cases("block_slots", cases, {"slots_fn": fn}, K.block_slots)
    if result.passed:
        result.use = fn
    return result


def check_online_softmax_update(fn) -> CheckResult:
    """Exercise 04-2: one online-softmax step (running max, rescaled sum and accumulator)."""
    cases = [
        ("one tile", "context within one block: no rescaling needed yet", "simple", _case(11, [6, 8])),
        (
            "many tiles",
            "five blocks: each new maximum must rescale l and acc by exp(m_old - m_new)",
            "simple",
            _case(12, [40, 33]),
        ),
        (
            "large scores",
            "queries scaled x60: exp(score) overflows unless the running max is subtracted",
            "simple",
            _case(13, [30, 17], q_scale=60.0),
        ),
        ("tiled", "64 tokens per step", "tiled", _case(14, [70, 3])),
    ]
    result = _run_cases("online_softmax_update", cases, {"update_fn": fn}, K.online_softmax_update)
    if result.passed:
        result.use = fn
    return result
