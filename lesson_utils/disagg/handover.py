"""Lesson 09: one request handed over from a prefill side to a decode side - the lesson's three steps, in one place.

* :func:`prefill_request` (prefill side): admit the prompt, run it once, sample its first token; the result is a
  :class:`Prefilled` - the request, that token, and the prefill side's blocks holding the prompt's K/V.
* :func:`receive` (decode side): plan the transfer, write the K/V into fresh blocks, adopt them into a block
  table, and let the request join the running batch. A request that its first token already finishes (one new
  token asked for, or the token is the end of sequence) is never decoded: it comes back finished, holding no
  block.
* :func:`hand_over` does both in one process (what lesson 09's first cell runs); the two worker processes of
  :mod:`lesson_utils.disagg.workers` each run their half, with the packed K/V on the wire in between.

Each step can be a learner's version (``plan_fn``, ``pack_fn``, ``unpack_fn``, ``adopt_fn``); whatever they do,
a failed hand-over gives back every block it took on the decode side, and the prefill side frees its own.

Everything a cache keeps per slot travels (``cache.slot_tensors``): K/V values, and an int8 cache's scales beside
them - one packed tensor per kind, packed and unpacked by the same functions. Both sides must keep the same kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lesson_utils.cache.block_copy import pack_blocks, unpack_blocks
from lesson_utils.disagg.transfer import transfer_plan
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.serving import sampling
from lesson_utils.types import Request, Sequence


@dataclass(frozen=True)
class Prefilled:
    """A finished prefill, ready to hand over."""

    request: Request
    first_token: int
    blocks: list[int]  # the prefill side's blocks holding the prompt's K/V, in order


def _payloads(payload, kinds) -> list[torch.Tensor]:
    """The packed tensors, one per kind of per-slot data the decode cache keeps, or a clear refusal."""
    payloads = [payload] if isinstance(payload, torch.Tensor) else payload
    if not isinstance(payloads, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in payloads):
        raise TypeError(
            f"a payload is one packed tensor, or one per kind of per-slot data; got {type(payload).__name__}"
        )
    if len(payloads) != len(kinds):
        names = ", ".join(k.name for k in kinds)
        raise ValueError(
            f"the payload holds {len(payloads)} packed tensor(s), but the decode cache keeps {len(kinds)} kind(s) of "
            f"per-slot data ({names}): pack every one of them (cache.slot_tensors), in that order - an int8 cache's "
            "blocks without their scales would decode from zeroed keys"
        )
    return list(payloads)


def _adopt(manager, seq_id: int, blocks: list[int], num_tokens: int):
    return manager.adopt(seq_id, blocks, num_tokens)


def finishes_at_once(prefilled: Prefilled, eos_token_id: int | None) -> bool:
    """Whether the first token already ends the request (one new token asked for, or it is the end of sequence)."""
    first_is_eos = eos_token_id is not None and prefilled.first_token == eos_token_id
    return prefilled.request.output_len <= 1 or first_is_eos


def prefill_request(runner, manager, request: Request) -> Prefilled:
    """Prefill side: blocks for the prompt, one forward pass over it, its first token (greedy). The blocks stay
    allocated until the caller frees the request (``manager.free``) once they are sent."""
    seq = Sequence(request)
    manager.allocate(seq)
    first = sampling.next_tokens([seq], runner.logits([seq]))[0]
    blocks = list(manager.block_table(request.req_id)[: blocks_needed(request.prompt_len, manager.block_size)])
    return Prefilled(request, int(first), blocks)


def receive(
    engine,
    prefilled: Prefilled,
    payload: torch.Tensor,
    *,
    eos_token_id: int | None = None,
    plan_fn: Callable = transfer_plan,
    unpack_fn: Callable = unpack_blocks,
    adopt_fn: Callable = _adopt,
) -> Sequence:
    """Decode side: the request joins ``engine``'s running batch with its K/V (``payload``, from a pack) in blocks
    of its own, and its first token already generated. Returns its :class:`~lesson_utils.types.Sequence`; one
    that is already finished is returned as such, holding no block, and is never decoded. On any error every
    block taken here is given back before the error is raised."""
    req = prefilled.request
    step = len(engine.stats)
    seq = Sequence(req, eos_token_id=eos_token_id, kv_len=req.prompt_len, admitted_step=step)
    seq.append_token(prefilled.first_token, step)
    if finishes_at_once(prefilled, eos_token_id):
        seq.finished_step = step
        return seq
    manager, cache = engine.manager, engine.cache
    payloads = _payloads(payload, cache.slot_tensors)
    plan = plan_fn(
        req.req_id, prefilled.blocks, req.prompt_len, manager.block_size, manager.allocate_block, manager.free_block
    )
    try:
        for kind, packed in zip(cache.slot_tensors, payloads):
            unpack_fn(packed, kind.k, kind.v, plan.dst_blocks)
        adopt_fn(manager, req.req_id, plan.dst_blocks, req.prompt_len)
        engine.scheduler.add_running(seq)
    except BaseException:
        if manager.table_of(req.req_id) is not None:
            manager.free(req.req_id)
        else:
            for b in plan.dst_blocks:
                manager.free_block(b)
        raise
    return seq


def hand_over(
    prefill_runner,
    prefill_manager,
    decode_engine,
    request: Request,
    *,
    eos_token_id: int | None = None,
    plan_fn: Callable = transfer_plan,
    pack_fn: Callable = pack_blocks,
    unpack_fn: Callable = unpack_blocks,
    adopt_fn: Callable = _adopt,
) -> Sequence:
    """Both halves in one process: prefill ``request`` on ``prefill_runner``'s cache, pack its blocks, receive them
    into ``decode_engine`` (:func:`receive`), and free the prefill side's blocks whatever happened. Both caches
    must keep the same kinds of per-slot data (fp K/V on both sides, or int8 values and scales on both)."""
    sent = [k.name for k in prefill_runner.cache.slot_tensors]
    kept = [k.name for k in decode_engine.cache.slot_tensors]
    if sent != kept:
        raise ValueError(
            f"the prefill cache keeps {', '.join(sent)} per slot and the decode cache keeps {', '.join(kept)}: a "
            "hand-over copies blocks as they are, so both sides need the same kind of cache (int8 to int8)"
        )
    prefilled = prefill_request(prefill_runner, prefill_manager, request)
    try:
        cache = prefill_runner.cache
        packed = [pack_fn(kind.k, kind.v, prefilled.blocks) for kind in cache.slot_tensors]
        payload = packed[0] if len(packed) == 1 else packed
        return receive(
            decode_engine,
            prefilled,
            payload,
            eos_token_id=eos_token_id,
            plan_fn=plan_fn,
            unpack_fn=unpack_fn,
            adopt_fn=adopt_fn,
        )
    finally:
        prefill_manager.free(request.req_id)
