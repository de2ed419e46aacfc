"""Lesson 09: one request handed over from a prefill side to a decode side - the lesson's three steps, in one place.

* :func:`prefill_request` (prefill side): the prompt through one real engine step of the prefill side's
  :func:`prefill_engine` (schedule -> execute -> update_from_output, the one place a token is born), asking for
  its first token only; the result is a :class:`Prefilled` - the request, that token, and the prefill side's
  blocks holding the prompt's K/V, which its scheduler holds until ``scheduler.release(req_id)`` once they are sent.
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

from dataclasses import dataclass, replace
from typing import Callable

import torch

from lesson_utils.cache.block_copy import pack_blocks, unpack_blocks
from lesson_utils.core.types import OutOfBlocks, Request, Sequence, SequenceStatus
from lesson_utils.disagg.transfer import transfer_plan
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.serving.engine import Engine


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
    return manager.blocks.adopt(seq_id, blocks, num_tokens)


def make_room(engine, num_blocks: int, on_step: Callable | None = None) -> list[Sequence]:
    """Decode side, before a transfer of ``num_blocks`` blocks is taken in (exercise 09-3): back-pressure. While
    fewer blocks are free, the engine decodes on - its finished requests give their blocks back - and ``on_step``
    (if given) gets what each step returned; returns every sequence that finished meanwhile. A transfer that can
    never fit (more blocks than the cache has) is refused with a ``ValueError`` before any step; with nothing left
    to decode no block can come free, so a shortfall then is an ``OutOfBlocks``, not a wait without end."""
    manager = engine.manager
    if num_blocks > manager.view.num_blocks:
        raise ValueError(
            f"a transfer of {num_blocks} blocks can never fit this decode cache of {manager.view.num_blocks} blocks"
        )
    finished: list[Sequence] = []
    while manager.num_free_blocks < num_blocks:
        if not engine.scheduler.has_work:
            raise OutOfBlocks(
                f"{manager.num_free_blocks} blocks free for a transfer of {num_blocks}, and nothing is decoding: "
                "no block will come free"
            )
        done = engine.step()
        if on_step is not None:
            on_step(done)
        finished += done
    return finished


def finishes_at_once(prefilled: Prefilled, eos_token_id: int | None) -> bool:
    """Whether the first token already ends the request (one new token asked for, or it is the end of sequence)."""
    first_is_eos = eos_token_id is not None and prefilled.first_token == eos_token_id
    return prefilled.request.output_len <= 1 or first_is_eos


def prefill_engine(w, cache, **engine_kw) -> Engine:
    """The prefill side: an :class:`~lesson_utils.serving.engine.Engine` on ``cache`` whose scheduler holds a
    finished sequence's blocks (``hold_finished``) until they are sent and released."""
    kw = dict(engine_kw.pop("scheduler_kw", {}), hold_finished=True)
    return Engine(w, cache, stop_at_eos=False, scheduler_kw=kw, **engine_kw)


def prefill_request(engine: Engine, request: Request) -> Prefilled:
    """Prefill side: ``request``'s prompt through the prefill engine's own steps, asking for one token (greedy) -
    its K/V and its first token. The blocks stay held until the caller releases them
    (``engine.scheduler.release(request.req_id)``) once they are sent. A refused step leaves nothing behind."""
    scheduler = engine.scheduler
    if not scheduler.hold_finished:
        raise ValueError(
            "the prefill side's engine must hold a finished sequence's blocks until they are sent: make it with "
            "handover.prefill_engine(w, cache)"
        )
    seq = Sequence(replace(request, output_len=1))  # the prefill side computes the prompt and the first token only
    scheduler.add(seq)
    try:
        while not seq.is_finished:
            engine.step()
    except BaseException:
        if seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
            scheduler.abort(seq)
        raise
    manager = engine.manager
    blocks = list(
        manager.view.block_table(request.req_id)[: blocks_needed(request.prompt_len, manager.view.block_size)]
    )
    return Prefilled(request, seq.output_ids[0], blocks)


def receive(
    engine,
    prefilled: Prefilled,
    payload: torch.Tensor,
    *,
    eos_token_id: int | None = None,
    plan_fn: Callable = transfer_plan,
    unpack_fn: Callable = unpack_blocks,
    adopt_fn: Callable = _adopt,
    make_room_fn: Callable = make_room,
) -> Sequence:
    """Decode side: once ``make_room_fn(engine, blocks)`` has made room (back-pressure: :func:`make_room`), the
    request joins ``engine``'s running batch with its K/V (``payload``, from a pack) in blocks of its own, and its
    first token already generated. Returns its :class:`~lesson_utils.core.types.Sequence`; one
    that is already finished is returned as such, holding no block, and is never decoded. On any error every
    block taken here is given back before the error is raised."""
    req = prefilled.request
    step = len(engine.stats)
    seq = Sequence(req, eos_token_id=eos_token_id, num_computed=req.prompt_len, admitted_step=step)
    seq.append_token(prefilled.first_token, step)
    if finishes_at_once(prefilled, eos_token_id):
        seq.finished_step = step
        return seq
    manager, cache = engine.manager, engine.cache
    payloads = _payloads(payload, cache.slot_tensors)
    make_room_fn(engine, len(prefilled.blocks))
    plan = plan_fn(
        req.req_id,
        prefilled.blocks,
        req.prompt_len,
        manager.view.block_size,
        manager.blocks.allocate_block,
        manager.blocks.free_block,
    )
    try:
        for kind, packed in zip(cache.slot_tensors, payloads):
            unpack_fn(packed, kind.k, kind.v, plan.dst_blocks)
        adopt_fn(manager, req.req_id, plan.dst_blocks, req.prompt_len)
        engine.scheduler.add_running(seq)
    except BaseException:
        if manager.view.table_of(req.req_id) is not None:
            manager.free(req.req_id)
        else:
            for b in plan.dst_blocks:
                manager.blocks.free_block(b)
        raise
    return seq


def hand_over(
    prefill: Engine,
    decode_engine,
    request: Request,
    *,
    eos_token_id: int | None = None,
    plan_fn: Callable = transfer_plan,
    pack_fn: Callable = pack_blocks,
    unpack_fn: Callable = unpack_blocks,
    adopt_fn: Callable = _adopt,
    make_room_fn: Callable = make_room,
) -> Sequence:
    """Both halves in one process: prefill ``request`` on the ``prefill`` engine (:func:`prefill_engine`), pack its
    blocks, receive them into ``decode_engine`` (:func:`receive`), and release the prefill side's blocks whatever
    happened. Both caches must keep the same kinds of per-slot data (fp K/V on both sides, or int8 values and
    scales on both)."""
    sent = [k.name for k in prefill.cache.slot_tensors]
    kept = [k.name for k in decode_engine.cache.slot_tensors]
    if sent != kept:
        raise ValueError(
            f"the prefill cache keeps {', '.join(sent)} per slot and the decode cache keeps {', '.join(kept)}: a "
            "hand-over copies blocks as they are, so both sides need the same kind of cache (int8 to int8)"
        )
    prefilled = prefill_request(prefill, request)
    try:
        packed = [pack_fn(kind.k, kind.v, prefilled.blocks) for kind in prefill.cache.slot_tensors]
        payload = packed[0] if len(packed) == 1 else packed
        return receive(
            decode_engine,
            prefilled,
            payload,
            eos_token_id=eos_token_id,
            plan_fn=plan_fn,
            unpack_fn=unpack_fn,
            adopt_fn=adopt_fn,
            make_room_fn=make_room_fn,
        )
    finally:
        prefill.scheduler.release(request.req_id)
