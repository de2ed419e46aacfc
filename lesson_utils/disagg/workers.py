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
turns a dead or stuck worker into a clear error within a bounded time.

Security: torch.distributed's TCP store and gloo's traffic are unauthenticated and unencrypted. The rendezvous
binds to 127.0.0.1 unless told otherwise; use another address only on a trusted network.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lesson_utils.core.types import is_int

PREFILL, DECODE = 0, 1
END = -1


class DisaggError(RuntimeError):
    """A worker died, got stuck, or reported an error; the message says which and what it said."""


@dataclass
class DisaggConfig:
    model_dir: str  # a model saved with save_pretrained: both workers load the same weights from it
    init_method: str = ""  # tcp://ADDR:PORT; run_disaggregated picks a free loopback port when empty
    num_blocks: int = 128
    block_size: int = 16
    timeout_s: float = 20.0  # every wait on the other worker once both have started
    stop_at_eos: bool = True
    warmup: bool = True  # each worker serves one request of its own before the clock starts
    startup_s: float | None = None  # spawn, imports, model load and warm-up; None: the profile's (startup_budget_s)

    def startup_budget_s(self) -> float:
        """Seconds both workers get to start (a cold GPU runtime loading CUDA in two spawned processes takes tens
        of seconds): ``startup_s``, or by profile gpu 180, cpu 90, ci 60."""
        if self.startup_s is not None:
            return float(self.startup_s)
        from lesson_utils.core.env import get_profile

        return float(get_profile().pick(gpu=180, cpu=90, ci=60))

    def deadline_s(self) -> float:
        """The whole run's bound in :func:`run_disaggregated`: start-up, then twice the per-wait timeout, plus 60 s."""
        return self.startup_budget_s() + 2 * self.timeout_s + 60


@dataclass(frozen=True)
class Faults:
    """Fault injection for the killed-worker demo and the tests (none by default): a worker that "crashes"."""

    prefill_dies_after_messages: int | None = None  # the prefill worker exits after sending this many messages
    prefill_start_delay_s: float = 0.0  # the prefill worker starts this much later (a slow runtime start)
    decode_dies_after_adopting: int | None = None  # the decode worker exits after adopting this many requests


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(cfg: DisaggConfig, rank: int):
    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.memory.block_manager import BlockManager
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

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
    w = OPTWeights.from_hf(load_model(local_path=cfg.model_dir, quiet=True).model)
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
    _to_host(pack_blocks(engine.cache.k_cache, engine.cache.v_cache, done.blocks))
    engine.scheduler.release(-2)
    results.put(("warmed", "prefill", time.perf_counter() - t, time.time()))


def _warm_up_decode(cfg: DisaggConfig, w, engine, results) -> None:
    """One request served to the end by the decode worker's own engine (prefill and a few decodes)."""
    if not cfg.warmup:
        return
    t = time.perf_counter()
    engine.generate([_warmup_prompt(w, cfg)], WARMUP_NEW_TOKENS)
    results.put(("warmed", "decode", time.perf_counter() - t, time.time()))


def prefill_worker(rank: int, cfg: DisaggConfig, requests: list[tuple], results, faults: Faults = Faults()) -> None:
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
            done = prefill_request(engine, Request(req_id, 0.0, len(prompt), max_new, prompt_ids=list(prompt)))
            t_pack = time.perf_counter()
            packed = _to_host(pack_blocks(cache.k_cache, cache.v_cache, done.blocks))
            t_send = time.perf_counter()
            send(torch.tensor([req_id, len(prompt), done.first_token, max_new, len(done.blocks)], dtype=torch.int64))
            send(torch.tensor(list(done.blocks) + list(prompt), dtype=torch.int64))
            send(packed)
            now = time.perf_counter()
            results.put(("sent", req_id, packed.numel() * packed.element_size(), now - t_send, t_send - t_pack))
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


def decode_worker(rank: int, cfg: DisaggConfig, results, faults: Faults = Faults()) -> None:
    """Receive prefilled requests and decode them; report each one's tokens, and that every block came back."""
    import threading

    from lesson_utils.core.types import Request
    from lesson_utils.disagg.handover import Prefilled, finishes_at_once, receive
    from lesson_utils.serving.engine import Engine

    manager = None
    try:
        w, manager, cache = _setup(cfg, rank)
        engine = Engine(w, cache, stop_at_eos=cfg.stop_at_eos)
        eos = w.eos_token_id if cfg.stop_at_eos else None
        k0 = cache.k_cache[0]
        _warm_up_decode(cfg, w, engine, results)
        group = _start_clock(cfg)
        step_times: list[float] = [float("nan")] * len(engine.stats)  # the end of every step (warm-up's: unknown)
        adopted_at: dict[int, float] = {}
        inbox: queue.Queue = queue.Queue()
        receiver = threading.Thread(
            target=_receive,
            args=(inbox, len(cache.k_cache), tuple(k0.shape[1:]), k0.dtype, k0.is_cuda, group),
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
                if not finishes_at_once(prefilled, eos):
                    while manager.num_free_blocks < num_blocks and engine.scheduler.has_work:
                        _report(results, engine.step(), step_times, adopted_at)  # finished requests free blocks
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
    for seq_id in list(manager.tables_now()):
        manager.free(seq_id)
    return manager.num_free_blocks == manager.num_blocks


@dataclass
class DisaggResult:
    """What both workers reported. The hand-over of request ``r`` is ``pack_s[r]`` (staging: its blocks packed
    into one host tensor) + ``recv_s[r]`` (transfer: the decode worker's receive of that tensor) +
    ``unpack_s[r]`` (allocating, writing into the decode cache, adopting)."""

    outputs: dict[int, list[int]]
    token_times: dict[int, list[float]]  # wall time each token reached the decode worker (seconds after start)
    bytes_sent: dict[int, int]
    send_s: dict[int, float]  # the prefill worker's three sends
    recv_s: dict[int, float]  # the decode worker's receive of the K/V payload
    all_blocks_free: bool
    pack_s: dict[int, float] = field(default_factory=dict)
    unpack_s: dict[int, float] = field(default_factory=dict)
    warmup_s: dict[str, float] = field(default_factory=dict)  # each worker's warm-up request ({} without one)
    warm_before_start: bool = True  # every warm-up ended before the clock started
    exit_codes: dict[str, int | None] = field(default_factory=dict)  # each worker's; 0 is a clean end

    def handover_s(self, req_id: int) -> float:
        """Staging + transfer + unpack of one request, in seconds."""
        return self.pack_s[req_id] + self.recv_s[req_id] + self.unpack_s[req_id]


@dataclass
class _Collected:
    """Everything the workers report through the result queue, as it arrives."""

    outputs: dict = field(default_factory=dict)
    token_times: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)
    send_s: dict = field(default_factory=dict)
    recv_s: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    finished: dict = field(default_factory=dict)  # worker -> all its blocks were free at the end
    start: float = 0.0
    pack_s: dict = field(default_factory=dict)
    unpack_s: dict = field(default_factory=dict)
    warmup_s: dict = field(default_factory=dict)
    warm_end: float = 0.0  # the wall time the last warm-up ended

    def take(self, msg) -> None:
        kind = msg[0]
        if kind == "start":
            self.start = msg[1]
        elif kind == "done":
            self.outputs[msg[1]], self.token_times[msg[1]] = msg[2], msg[3]
        elif kind == "sent":
            self.sizes[msg[1]], self.send_s[msg[1]], self.pack_s[msg[1]] = msg[2], msg[3], msg[4]
        elif kind == "received":
            self.recv_s[msg[1]], self.unpack_s[msg[1]] = msg[3], msg[4]
        elif kind == "warmed":
            self.warmup_s[msg[1]] = msg[2]
            self.warm_end = max(self.warm_end, msg[3])
        elif kind in ("prefill done", "decode done"):
            self.finished[kind.split()[0]] = msg[1]
        elif kind == "error":
            freed = f" (it freed its blocks: {msg[3]})" if len(msg) > 3 else ""
            self.errors.append(f"the {msg[1]} worker failed: {msg[2]}{freed}")


def check_requests(requests, vocab_size: int, max_positions: int) -> None:
    """Refuse, before any worker starts, what ``Engine.add_request`` refuses: each request is ``(req_id, prompt_ids,
    max_new_tokens[, arrival_s])`` with a distinct int id, token ids inside the vocabulary, at least one new token
    and room for all of them in the model's positions, and an arrival time of 0 or more."""
    from lesson_utils.serving.engine import check_token_ids

    seen = set()
    for i, item in enumerate(requests):
        if not isinstance(item, (tuple, list)) or len(item) not in (3, 4):
            raise TypeError(f"request {i} is (req_id, prompt_ids, max_new_tokens[, arrival_s]), got {item!r}")
        req_id, prompt, max_new, *arrival = item
        if not is_int(req_id) or req_id < 0:
            raise ValueError(f"request {i}: req_id must be a non-negative int, got {req_id!r}")
        if req_id in seen:
            raise ValueError(f"request {i}: req_id {req_id} is used twice")
        seen.add(req_id)
        prompt = check_token_ids(prompt, vocab_size, f"request {req_id}'s prompt")
        if not is_int(max_new) or max_new < 1:
            raise ValueError(f"request {req_id}: max_new_tokens must be an int of at least 1, got {max_new!r}")
        if len(prompt) + max_new > max_positions:
            raise ValueError(
                f"request {req_id}: a prompt of {len(prompt)} tokens plus {max_new} new ones exceeds the model's "
                f"{max_positions} positions"
            )
        if arrival and not (isinstance(arrival[0], (int, float)) and arrival[0] >= 0):
            raise ValueError(f"request {req_id}: arrival_s must be a number of seconds >= 0, got {arrival[0]!r}")


def run_disaggregated(
    cfg: DisaggConfig, requests: list[tuple[int, list[int], int]], faults: Faults = Faults(), progress: bool = True
) -> DisaggResult:
    """Start both workers (spawned processes), collect their results; raise :class:`DisaggError` if either dies
    or stalls (within ``cfg.deadline_s()``: start-up budget + 2 x timeout_s + 60 s), after stopping the other. Bad requests are refused first
    (:func:`check_requests`), with the model's vocabulary and positions read from ``cfg.model_dir``."""
    import torch.multiprocessing as mp
    from transformers import AutoConfig

    model_cfg = AutoConfig.from_pretrained(cfg.model_dir)
    check_requests(requests, model_cfg.vocab_size, model_cfg.max_position_embeddings)

    if not cfg.init_method:
        cfg.init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = {
        "prefill": ctx.Process(target=prefill_worker, args=(PREFILL, cfg, requests, results, faults), daemon=True),
        "decode": ctx.Process(target=decode_worker, args=(DECODE, cfg, results, faults), daemon=True),
    }
    for p in procs.values():
        p.start()
    got = _Collected()
    deadline = time.monotonic() + cfg.deadline_s()  # start-up (spawn, imports, model, warm-up) included
    bar = None
    if progress:  # moves with every request decoded; its clock runs through the workers' start-up too
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="two workers: requests decoded", unit="req", leave=False)
    try:
        while len(got.finished) < 2 and not got.errors:
            if bar is not None:
                bar.update(len(got.outputs) - bar.n)
                bar.refresh()
            try:
                got.take(results.get(timeout=0.5))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for n, p in procs.items() if n not in got.finished):
                    _drain(results, got, wait_s=cfg.timeout_s + 5)  # the other worker's report, bounded
                    break
                if time.monotonic() > deadline:
                    got.errors.append(
                        f"the workers did not finish within {cfg.deadline_s():.0f} s (stuck?): the bound is "
                        f"DisaggConfig.startup_s ({cfg.startup_budget_s():.0f} s: spawn, imports, model load, "
                        f"warm-up) + 2 x timeout_s ({cfg.timeout_s:.0f} s: every wait on the other worker) + 60 s; "
                        "on a slow machine raise startup_s, for a long workload timeout_s"
                    )
                    break
    finally:
        if bar is not None:
            bar.close()
        for p in procs.values():
            p.join(timeout=cfg.timeout_s + 5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    # exit code 1 is a worker that failed and reported why; anything else died without a word - unless it had
    # reported its end (every output delivered, its blocks counted): the run is judged by what was received
    crashed = [
        f"the {n} worker exited with code {p.exitcode}"
        for n, p in procs.items()
        if p.exitcode not in (0, 1) and n not in got.finished
    ]
    if got.errors or crashed:
        raise DisaggError("disaggregated serving failed: " + "; ".join(crashed + got.errors))
    rel = {rid: [t - got.start for t in ts] for rid, ts in got.token_times.items()}
    return DisaggResult(
        got.outputs,
        rel,
        got.sizes,
        got.send_s,
        got.recv_s,
        all(got.finished.values()),
        got.pack_s,
        got.unpack_s,
        got.warmup_s,
        got.warm_end <= got.start,
        {n: p.exitcode for n, p in procs.items()},
    )


def _drain(results, got: _Collected, wait_s: float) -> None:
    """After one worker died: wait (bounded) for the other's report."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            msg = results.get(timeout=0.5)
        except queue.Empty:
            continue
        got.take(msg)
        if msg[0] == "error" or len(got.finished) == 2:
            return
