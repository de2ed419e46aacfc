"""Lesson 09: start the prefill and the decode worker (:mod:`lesson_utils.disagg.workers`), collect what they
report, and turn a dead or stuck worker into a clear :class:`~lesson_utils.disagg.config.DisaggError` within a
bounded time (:func:`run_disaggregated`)."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from lesson_utils.core.types import is_int
from lesson_utils.disagg.config import DECODE, NO_FAULTS, PREFILL, DisaggConfig, DisaggError, Faults, free_loopback_port
from lesson_utils.disagg.workers import decode_worker, prefill_worker


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
    prefill_began: dict[int, float] = field(default_factory=dict)  # when its prefill started (seconds after start)
    prefill_s: dict[int, float] = field(default_factory=dict)  # its prefill, first token included

    def ttft_parts(self, req_id: int, arrival_s: float) -> dict[str, float]:
        """Request ``req_id``'s time to first token (arrived ``arrival_s`` after the start) as the workers timed it:
        queue (arrival to prefill start), prefill, staging, transfer, unpack, and the rest - the decode worker
        finishing the step it was in, or waiting for blocks to free (back-pressure), before it took the request."""
        parts = {
            "queue": self.prefill_began[req_id] - arrival_s,
            "prefill": self.prefill_s[req_id],
            "staging": self.pack_s[req_id],
            "transfer": self.recv_s[req_id],
            "unpack": self.unpack_s[req_id],
        }
        parts["decode side's wait"] = self.token_times[req_id][0] - arrival_s - sum(parts.values())
        return parts

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
    prefill_began: dict = field(default_factory=dict)  # wall times
    prefilled_at: dict = field(default_factory=dict)

    def take(self, msg) -> None:
        kind = msg[0]
        if kind == "start":
            self.start = msg[1]
        elif kind == "done":
            self.outputs[msg[1]], self.token_times[msg[1]] = msg[2], msg[3]
        elif kind == "sent":
            self.sizes[msg[1]], self.send_s[msg[1]], self.pack_s[msg[1]] = msg[2], msg[3], msg[4]
            self.prefill_began[msg[1]], self.prefilled_at[msg[1]] = msg[5], msg[6]
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
    cfg: DisaggConfig, requests: list[tuple[int, list[int], int]], faults: Faults = NO_FAULTS, progress: bool = True
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
    return DisaggResult(
        got.outputs,
        {rid: [t - got.start for t in ts] for rid, ts in got.token_times.items()},
        got.sizes,
        got.send_s,
        got.recv_s,
        all(got.finished.values()),
        got.pack_s,
        got.unpack_s,
        got.warmup_s,
        got.warm_end <= got.start,
        {n: p.exitcode for n, p in procs.items()},
        {rid: t - got.start for rid, t in got.prefill_began.items()},
        {rid: got.prefilled_at[rid] - t for rid, t in got.prefill_began.items()},
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
