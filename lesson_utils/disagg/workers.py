"""Lesson 09: a prefill worker and a decode worker, two processes joined by torch.distributed.

The prefill worker runs each prompt (one forward pass: its K/V and its first token), sends the request's KV
blocks, and frees them; the decode worker allocates blocks, receives into them, adopts them into a block table
and decodes the request with its engine, beside the others already decoding. Each worker runs its half of
:mod:`lesson_utils.disagg.handover` (``prefill_request`` / ``receive``). Three messages per request, on gloo
(CPU tensors; a one-GPU machine stages through host memory):

1. a header, int64 ``[req_id, num_tokens, first_token, max_new_tokens, num_blocks]`` (``req_id`` -1: no more);
2. the prefill worker's block ids and the prompt's token ids, int64 ``[num_blocks + num_tokens]``;
3. the packed K/V of every layer, ``[2, layers, num_blocks, block_size, kv_heads, head_dim]``.

Before the clock starts (a barrier both pass once loaded) each worker serves one short request of its own
(``DisaggConfig.warmup``): the first step of a process pays one-off costs - allocator growth, lazy
initialisation - that would otherwise land in the first measured request's time to first token. The hand-over
is timed in its three stages: staging (pack the blocks into one tensor, in host memory), transfer (the decode
worker's receive of the payload) and unpack (allocate, write into the decode cache, adopt).

Every wait on the other worker is bounded by the process group's timeout; a worker that fails reports what
happened through the result queue after giving back every block it holds, and :func:`run_disaggregated`
turns a dead or stuck worker into a clear error within a bounded time (:mod:`lesson_utils.disagg.launch`; the
configuration in :mod:`lesson_utils.disagg.config`).

Security: torch.distributed's TCP store and gloo's traffic are unauthenticated and unencrypted. The rendezvous
binds to 127.0.0.1 unless told otherwise; use another address only on a trusted network.
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import time

import torch
import torch.distributed as dist

from lesson_utils.disagg.config import DECODE, END, NO_FAULTS, PREFILL, DisaggConfig, Faults


def _setup(cfg: DisaggConfig, rank: int):
    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.memory.block_manager import BlockManager
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.weights import weights_from_hf

    torch.set_num_threads(1)
    try:
        dist.init_process_group(  # start-up's bound: the transfers get their own group with timeout_s (_start_clock)
            "gloo",
            init_method=cfg.init_method,
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=cfg.startup_budget_s()),
        )
    except Exception as err:  # noqa: BLE001 - a rendezvous that timed out is reworded: what to raise
        if "timed out" in str(err).lower() or isinstance(err, TimeoutError):
            raise _late_start(cfg) from err
        raise
    w = weights_from_hf(load_model(local_path=cfg.model_dir, quiet=True).model)
    manager = BlockManager(cfg.num_blocks, cfg.block_size, watermark=0.0, max_seq_len=w.max_positions)
    cache = PagedKVCache.for_model(w, manager=manager)
    if len(cache.slot_tensors) != 1:  # the wire carries one K/V tensor per request (handover.receive checks too)
        raise ValueError(
            f"the two-worker hand-over sends K/V only; this cache keeps {', '.join(k.name for k in cache.slot_tensors)}"
        )
    return w, manager, cache


WARMUP_PROMPT_LEN, WARMUP_NEW_TOKENS = 24, 3


def _warmup_prompt(w, cfg: DisaggConfig) -> list[int]:
    """The warm-up request's prompt: a fixed one, long enough to span two blocks of 16, and never more than
    half the worker's cache (with the tokens it generates)."""
    n = max(1, min(WARMUP_PROMPT_LEN, cfg.num_blocks * cfg.block_size // 2 - WARMUP_NEW_TOKENS))
    return [w.bos_token_id] + [4 + i % (w.vocab_size - 4) for i in range(n - 1)]


def _late_start(cfg: DisaggConfig) -> TimeoutError:
    return TimeoutError(
        f"the other worker did not start within {cfg.startup_budget_s():.0f} s (spawn, imports, model load, "
        "warm-up): on a slow machine raise DisaggConfig.startup_s"
    )


def _start_clock(cfg: DisaggConfig):
    """Wait for the other worker (bounded by the start-up budget), then make the group every transfer uses, its
    waits bounded by ``timeout_s``. Returns that group."""
    try:
        dist.barrier()
    except Exception as err:  # noqa: BLE001 - reworded: what to raise
        raise _late_start(cfg) from err
    return dist.new_group([PREFILL, DECODE], timeout=datetime.timedelta(seconds=cfg.timeout_s))


def _warm_up_prefill(cfg: DisaggConfig, engine, results) -> None:
    """One prefill and one staging copy of the prefill worker's own, released again; its time is reported."""
    from lesson_utils.cache.block_copy import pack_blocks
    from lesson_utils.core.types import Request
    from lesson_utils.disagg.handover import prefill_request

    if not cfg.warmup:
        return
    t = time.perf_counter()
    prompt = _warmup_prompt(engine.w, cfg)
    done = prefill_request(engine, Request(-2, 0.0, len(prompt), 1, prompt_ids=prompt))
    _to_host(pack_blocks(engine.cache.slot_tensors[0].k, engine.cache.slot_tensors[0].v, done.blocks))
    engine.scheduler.release(-2)
    results.put(("warmed", "prefill", time.perf_counter() - t, time.time()))


def _warm_up_decode(cfg: DisaggConfig, w, engine, results) -> None:
    """One request served to the end by the decode worker's own engine (prefill and a few decodes)."""
    if not cfg.warmup:
        return
    t = time.perf_counter()
    engine.generate([_warmup_prompt(w, cfg)], WARMUP_NEW_TOKENS)
    results.put(("warmed", "decode", time.perf_counter() - t, time.time()))


def prefill_worker(rank: int, cfg: DisaggConfig, requests: list[tuple], results, faults: Faults = NO_FAULTS) -> None:
    """Prefill each ``(req_id, prompt_ids, max_new_tokens[, arrival_s])`` once it has arrived (seconds after both
    workers are ready), send its blocks to the decode worker, free them."""
    from lesson_utils.cache.block_copy import pack_blocks
    from lesson_utils.core.types import Request
    from lesson_utils.disagg.handover import prefill_engine, prefill_request

    sent = 0
    manager = None

    group = None

    def send(t: torch.Tensor) -> None:
        nonlocal sent
        dist.send(t.contiguous(), DECODE, group=group)
        sent += 1
        if faults.prefill_dies_after_messages is not None and sent >= faults.prefill_dies_after_messages:
            os._exit(17)  # a crash, as far as the other worker can tell

    try:
        if faults.prefill_start_delay_s:
            time.sleep(faults.prefill_start_delay_s)
        w, manager, cache = _setup(cfg, rank)
        engine = prefill_engine(w, cache)
        _warm_up_prefill(cfg, engine, results)
        group = _start_clock(cfg)  # both workers loaded and warm: the clock starts
        t0 = time.time()
        results.put(("start", t0))
        for req_id, prompt, max_new, *arrival in requests:
            wait = t0 + (arrival[0] if arrival else 0.0) - time.time()
            if wait > 0:
                time.sleep(wait)
            began = time.time()  # the prefill starts: the request's wait in the queue ends
            done = prefill_request(engine, Request(req_id, 0.0, len(prompt), max_new, prompt_ids=list(prompt)))
            prefilled_at = time.time()
            t_pack = time.perf_counter()
            packed = _to_host(pack_blocks(cache.slot_tensors[0].k, cache.slot_tensors[0].v, done.blocks))
            t_send = time.perf_counter()
            send(torch.tensor([req_id, len(prompt), done.first_token, max_new, len(done.blocks)], dtype=torch.int64))
            send(torch.tensor(list(done.blocks) + list(prompt), dtype=torch.int64))
            send(packed)
            now = time.perf_counter()
            results.put(
                (
                    "sent",
                    req_id,
                    packed.numel() * packed.element_size(),
                    now - t_send,
                    t_send - t_pack,
                    began,
                    prefilled_at,
                )
            )
            engine.scheduler.release(req_id)
        send(torch.tensor([END, 0, 0, 0, 0], dtype=torch.int64))
        results.put(("prefill done", manager.num_free_blocks == cfg.num_blocks))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it
        freed = _free_everything(manager)
        results.put(("error", "prefill", f"{type(err).__name__}: {err}", freed))
        _leave(results, 1)
    _leave(results, 0)


def _leave(results, code: int, destroy: bool = True) -> None:
    """A worker's deterministic end: its reports flushed to the parent first (nothing after can lose them), its
    process groups destroyed (unless a receiving thread may still be blocked in gloo), then ``os._exit``. Not the
    interpreter's own teardown: there gloo's threads met C++ static destructors now and then and the process
    aborted ("terminate called without an active exception", exit code -6) after it had delivered every output."""
    results.close()
    results.join_thread()  # the reports must leave before the process does
    sys.stdout.flush()
    sys.stderr.flush()
    if destroy and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(code)


def _receive(inbox: queue.Queue, layers: int, block_shape: tuple, dtype: torch.dtype, pin: bool, group) -> None:
    """The decode worker's receiving thread: blocking receives (gloo's asynchronous ones do not report completion
    until waited on), each bounded by the process group's timeout; every request, the end of the stream (None) or
    the error goes into ``inbox`` for the main thread, which owns the cache."""
    try:
        while True:
            header = torch.zeros(5, dtype=torch.int64)
            dist.recv(header, PREFILL, group=group)
            req_id, num_tokens, first, max_new, num_blocks = header.tolist()
            if req_id == END:
                inbox.put(None)
                return
            meta = torch.zeros(num_blocks + num_tokens, dtype=torch.int64)
            dist.recv(meta, PREFILL, group=group)
            payload = torch.empty((2, layers, num_blocks) + block_shape, dtype=dtype, pin_memory=pin)
            t = time.perf_counter()
            dist.recv(payload, PREFILL, group=group)
            inbox.put((req_id, num_tokens, first, max_new, meta, payload, time.perf_counter() - t))
    except Exception as err:  # noqa: BLE001 - handed to the main thread, which fails cleanly
        inbox.put(err)


def decode_worker(rank: int, cfg: DisaggConfig, results, faults: Faults = NO_FAULTS) -> None:
    """Receive prefilled requests and decode them; report each one's tokens, and that every block came back."""
    import threading

    from lesson_utils.core.types import Request
    from lesson_utils.disagg.handover import Prefilled, finishes_at_once, make_room, receive
    from lesson_utils.serving.engine import Engine

    manager = None
    try:
        w, manager, cache = _setup(cfg, rank)
        engine = Engine(w, cache, stop_at_eos=cfg.stop_at_eos)
        eos = w.eos_token_id if cfg.stop_at_eos else None
        k0 = cache.slot_tensors[0].k[0]
        _warm_up_decode(cfg, w, engine, results)
        group = _start_clock(cfg)
        step_times: list[float] = [float("nan")] * len(engine.stats)  # the end of every step (warm-up's: unknown)
        adopted_at: dict[int, float] = {}
        inbox: queue.Queue = queue.Queue()
        receiver = threading.Thread(
            target=_receive,
            args=(inbox, len(cache.slot_tensors[0].k), tuple(k0.shape[1:]), k0.dtype, k0.is_cuda, group),
            daemon=True,
        )
        receiver.start()
        stream_open = True
        while stream_open or engine.scheduler.has_work:
            while stream_open:  # adopt everything that has arrived; wait (bounded) only when there is nothing to decode
                try:
                    item = inbox.get_nowait() if engine.scheduler.has_work else inbox.get(timeout=cfg.timeout_s + 5)
                except queue.Empty:
                    if engine.scheduler.has_work:
                        break
                    raise TimeoutError(f"nothing from the prefill worker for {cfg.timeout_s + 5:.0f} s") from None
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    stream_open = False
                    break
                req_id, num_tokens, first, max_new, meta, payload, recv_s = item
                num_blocks = payload.shape[2]
                request = Request(req_id, 0.0, num_tokens, max_new, prompt_ids=meta[num_blocks:].tolist())
                prefilled = Prefilled(request, first, meta[:num_blocks].tolist())
                if not finishes_at_once(prefilled, eos):  # back-pressure: decode on until its blocks are free
                    make_room(engine, num_blocks, on_step=lambda done: _report(results, done, step_times, adopted_at))
                t_unpack = time.perf_counter()
                seq = receive(engine, prefilled, payload, eos_token_id=eos)
                if k0.is_cuda:  # the writes into the cache are queued: the unpack ends when they are done
                    torch.cuda.synchronize(k0.device)
                unpack_s = time.perf_counter() - t_unpack
                results.put(("received", req_id, payload.numel() * payload.element_size(), recv_s, unpack_s))
                adopted_at[req_id] = time.time()  # its first token is here: the user can see it
                if seq.finished_step is not None:  # its first token ended it: it is never decoded
                    results.put(("done", req_id, list(seq.output_ids), [adopted_at[req_id]]))
                if (
                    faults.decode_dies_after_adopting is not None
                    and len(adopted_at) >= faults.decode_dies_after_adopting
                ):
                    os._exit(18)  # a crash, as far as the other worker can tell
            if engine.scheduler.has_work:
                _report(results, engine.step(), step_times, adopted_at)
        results.put(("decode done", manager.num_free_blocks == cfg.num_blocks))
        receiver.join(timeout=cfg.timeout_s)  # it returned at the end of the stream
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it
        freed = _free_everything(manager)
        results.put(("error", "decode", f"{type(err).__name__}: {err}", freed))
        _leave(results, 1, destroy=False)  # the receiving thread may still be blocked in gloo
    _leave(results, 0, destroy=not receiver.is_alive())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """gloo sends host tensors: a GPU tensor goes through pinned host memory (one device-to-host copy)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def _report(results, done, step_times: list[float], adopted_at: dict[int, float]) -> None:
    """After a decode step: note its end time; send every finished request's tokens and their wall times (the
    first token's time is when its blocks were adopted, the others' the end of the step that made them)."""
    step_times.append(time.time())
    for seq in done:
        times = [adopted_at[seq.seq_id]] + [step_times[k] for k in seq.token_steps[1:]]
        results.put(("done", seq.seq_id, list(seq.output_ids), times))


def _free_everything(manager) -> bool:
    """After a failure: give back every block; True when all are free."""
    if manager is None:
        return True
    for seq_id in list(manager.view.tables_now()):
        manager.free(seq_id)
    return manager.num_free_blocks == manager.view.num_blocks
