"""Lessons 07 and 08: serve one workload several ways and measure what a user and an operator would see.

* :func:`serve_engine` feeds a course engine requests at their arrival times (wall clock) and records, per
  request, time to first token (from arrival) and time per output token after the first, and per step the
  requests running and the KV slots holding token states.
* :func:`serve_hf_static` is the baseline most people start from: Hugging Face ``generate`` on static,
  left-padded batches of up to ``batch_size`` requests taken in arrival order; a batch starts when its last
  request has arrived and the previous batch is done, and runs until its longest member finishes. A padded
  batch needs its longest prompt plus its longest output in positions, which can pass the model's limit
  (OPT: 2048) although every request fits alone: a batch is closed early rather than let that happen
  (:func:`static_batches`).

Both stop a request at end-of-sequence or at its own output length, so greedy outputs can be compared token
for token.

* :func:`serve_by_steps` (lesson 08) adds requests at given *steps* rather than wall-clock times, so runs with and
  without chunked prefill see the same arrivals, and records every step's time and tokens, every gap between
  consecutive tokens of the requests that were decoding, and the time to first token of the others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from lesson_utils.types import Request


@dataclass
class ServeResult:
    name: str
    outputs: dict[int, list[int]]  # req_id -> generated ids
    ttft_s: dict[int, float]
    tpot_s: dict[int, float]  # mean seconds per output token after the first
    wall_s: float
    running: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, requests running)
    kv_used: list[tuple[float, float]] = field(default_factory=list)  # (seconds, share of the budget holding tokens)
    token_times: dict[int, list[float]] = field(default_factory=dict)  # req_id -> seconds since start of each token

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs.values())

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def latency(self, which: str, q: float) -> float:
        values = list((self.ttft_s if which == "ttft" else self.tpot_s).values())
        return float(np.percentile(values, q)) if values else float("nan")


def _trim(ids: list[int], n: int, eos: int | None) -> list[int]:
    ids = ids[:n]
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos) + 1]
    return ids


def serve_engine(name: str, engine, requests: list[Request], progress: bool = True) -> ServeResult:
    """Add each request when its arrival time comes (a wall clock starting now); run until all are served."""
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.req_id))
    seqs: dict[int, object] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pending), desc=name, unit="req", leave=False)
    start = time.perf_counter()
    i = 0
    sched = engine.scheduler
    while i < len(pending) or sched.has_work:
        now = time.perf_counter() - start
        if not sched.has_work and pending[i].arrival_s > now:
            time.sleep(pending[i].arrival_s - now)  # idle server: wait for the next request
            now = pending[i].arrival_s
        while i < len(pending) and pending[i].arrival_s <= now:
            r = pending[i]
            seq = engine.add_request(r.prompt_ids, r.output_len)
            seq.added_at = start + r.arrival_s  # latencies count from arrival, queueing included
            seqs[r.req_id] = seq
            i += 1
        done = engine.step()
        if bar is not None:
            bar.update(len(done))
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    outputs = {rid: list(s.output_ids) for rid, s in seqs.items()}
    ttft = {rid: s.first_token_s for rid, s in seqs.items()}
    tpot = {
        rid: (s.finished_s - s.first_token_s) / (len(s.output_ids) - 1)
        for rid, s in seqs.items()
        if len(s.output_ids) > 1
    }
    running = [(st.t - start, st.running) for st in engine.stats]
    kv = [(st.t - start, st.kv_tokens / st.kv_slots) for st in engine.stats if st.kv_slots]
    t_of = {st.step: st.t - start for st in engine.stats}
    times = {rid: [t_of[k] for k in s.token_steps] for rid, s in seqs.items()}
    return ServeResult(name, outputs, ttft, tpot, wall, running, kv, times)


def inter_token_gaps(token_times: dict[int, list[float]], req_ids) -> np.ndarray:
    """Every gap between two consecutive tokens of the requests ``req_ids`` (seconds)."""
    return np.concatenate([np.diff(token_times[r]) for r in req_ids] + [np.zeros(0)])


@dataclass
class StepTrace:
    """One run of :func:`serve_by_steps`."""

    name: str
    step_s: np.ndarray  # wall seconds of every step
    step_tokens: np.ndarray  # tokens computed in every step (prompt tokens and decodes)
    itl_s: np.ndarray  # every gap between two consecutive tokens of a decoding request
    ttft_s: dict[int, float]  # time to first token of the watched (long-prompt) requests, from their arrival
    outputs: dict[int, list[int]]

    def itl_ms(self, q: float) -> float:
        """A percentile of the decoding requests' inter-token latency, in ms."""
        return float(np.percentile(self.itl_s, q) * 1e3) if len(self.itl_s) else float("nan")


def serve_by_steps(
    name: str, engine, requests: list[Request], arrive_step: dict[int, int], watch: set[int], progress: bool = True
) -> StepTrace:
    """Add request ``r`` before step ``arrive_step[r.req_id]``; run until all are served. ``watch``: the requests
    whose time to first token is reported (the long prompts); the others' inter-token gaps are collected.

    On a GPU every step ends with the tokens read back to the host (the sampler's sync), so step times are
    device times, not launch times."""
    pending = sorted(requests, key=lambda r: (arrive_step[r.req_id], r.req_id))
    seqs: dict[int, object] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pending), desc=name, unit="req", leave=False)
    first_step = len(engine.stats)
    i = 0
    while i < len(pending) or engine.scheduler.has_work:
        step = len(engine.stats) - first_step
        while i < len(pending) and arrive_step[pending[i].req_id] <= step:
            r = pending[i]
            seqs[r.req_id] = engine.add_request(r.prompt_ids, r.output_len)
            i += 1
        done = engine.step()
        if bar is not None:
            bar.update(len(done))
    if bar is not None:
        bar.close()
    stats = engine.stats[first_step:]
    t_of = {st.step: st.t for st in stats}
    gaps = []
    for rid, seq in seqs.items():
        if rid not in watch:
            times = [t_of[k] for k in seq.token_steps]
            gaps += list(np.diff(times))
    return StepTrace(
        name,
        np.array([st.seconds for st in stats]),
        np.array([st.tokens for st in stats]),
        np.array(gaps),
        {rid: seqs[rid].first_token_s for rid in watch},
        {rid: list(s.output_ids) for rid, s in seqs.items()},
    )


def _synchronize(t: torch.Tensor) -> None:
    """Wait until the GPU has computed ``t`` (nothing to wait for on a CPU)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class _StepClock:
    """A logits processor that only notes the time of every generation step (it changes no logits).

    On a GPU the scores are only queued when the processor runs: it waits for them first, so the first time
    it notes (the time to first token) includes the prefill rather than the moment it was launched.
    """

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        _synchronize(scores)
        self.times.append(time.perf_counter())
        return scores


def static_batches(requests: list[Request], batch_size: int, max_positions: int) -> list[list[Request]]:
    """Requests in arrival order, cut into batches of at most ``batch_size`` that each fit the model.

    A left-padded batch is as wide as its longest prompt and generates for its longest output, so it needs
    ``max(prompt_len) + max(output_len)`` positions; a batch is closed before the request that would push that
    past ``max_positions``. Raises ``ValueError`` for a request that cannot fit even alone.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    batches: list[list[Request]] = []
    width = longest = 0
    for r in sorted(requests, key=lambda r: (r.arrival_s, r.req_id)):
        if r.prompt_len + r.output_len > max_positions:
            raise ValueError(
                f"request {r.req_id} needs {r.prompt_len} + {r.output_len} positions; the model has {max_positions}"
            )
        fits = max(width, r.prompt_len) + max(longest, r.output_len) <= max_positions
        if batches and len(batches[-1]) < batch_size and fits:
            batches[-1].append(r)
            width, longest = max(width, r.prompt_len), max(longest, r.output_len)
        else:
            batches.append([r])
            width, longest = r.prompt_len, r.output_len
    return batches


def serve_hf_static(
    model,
    requests: list[Request],
    batch_size: int,
    eos_token_id: int | None,
    pad_token_id: int = 1,
    progress: bool = True,
) -> ServeResult:
    """Hugging Face ``generate`` in static, left-padded batches (see the module docstring)."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    batches = static_batches(requests, batch_size, model.config.max_position_embeddings)  # in arrival order
    outputs, ttft, tpot, running = {}, {}, {}, []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="HF static batches", unit="req", leave=False)
    start = time.perf_counter()
    for batch in batches:
        ready = max(r.arrival_s for r in batch)
        now = time.perf_counter() - start
        if ready > now:
            time.sleep(ready - now)
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # built on the host, moved once
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
            mask[row, width - r.prompt_len :] = 1
        clock = _StepClock()
        with torch.inference_mode():
            out = model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(r.output_len for r in batch),
                do_sample=False,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                logits_processor=LogitsProcessorList([clock]),
            )
        for row, r in enumerate(batch):
            gen = _trim(out[row, width:].tolist(), r.output_len, eos_token_id)
            outputs[r.req_id] = gen
            first = clock.times[0] - start
            last = clock.times[min(len(gen), len(clock.times)) - 1] - start
            ttft[r.req_id] = first - r.arrival_s
            if len(gen) > 1:
                tpot[r.req_id] = (last - first) / (len(gen) - 1)
            running.append((first, len(batch)))
        running.append((clock.times[-1] - start, 0))
        if bar is not None:
            bar.update(len(batch))
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return ServeResult("HF generate (static batches)", outputs, ttft, tpot, wall, running)


@dataclass
class KernelTiming:
    """One case of :func:`time_unified_kernel`: ``seqs`` sequences of ``query_len`` queries over ``context`` tokens."""

    seqs: int
    query_len: int
    context: int
    unified_ms: float
    baseline_ms: float
    baseline: str  # "decode kernel" (lesson 04's) for decodes, "gather + SDPA" for chunks
    max_error: float  # unified vs the baseline's output, checked once before timing


def _unified_inputs(seqs, query_len, context, heads, head_dim, block_size, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    nb = seqs * per_seq
    kc = torch.randn(nb, block_size, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    vc = torch.randn(nb, block_size, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    tables = torch.randperm(nb, generator=g).view(seqs, per_seq).to(dtype=torch.int32, device=device)
    q = torch.randn(seqs * query_len, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    starts = torch.arange(0, seqs * query_len + 1, query_len, dtype=torch.int32, device=device)
    lens = torch.full((seqs,), context, dtype=torch.int32, device=device)
    return q, kc, vc, tables, starts, lens


def _gather_sdpa(q, kc, vc, tables, query_len):
    """Chunks the lesson 03 way: gather every sequence's K/V into a contiguous copy, then PyTorch's SDPA."""
    seqs, heads, head_dim = tables.shape[0], q.shape[1], q.shape[2]
    k = kc[tables.long()].flatten(1, 2).transpose(1, 2)  # [seqs, heads, context (padded to blocks), d]
    v = vc[tables.long()].flatten(1, 2).transpose(1, 2)
    ctx = k.shape[2]
    qq = q.view(seqs, query_len, heads, head_dim).transpose(1, 2)
    mask = (
        torch.arange(ctx, device=q.device)[None, :]
        <= torch.arange(query_len, device=q.device)[:, None] + ctx - query_len
    )
    out = torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(seqs * query_len, heads, head_dim)


def time_unified_kernel(cases, *, heads, head_dim, block_size, dtype, device, timer) -> list[KernelTiming]:
    """Lesson 08 on a GPU: the unified kernel against lesson 04's decode kernel on decodes (``query_len`` 1) and
    against gather + SDPA on chunks, for each ``(seqs, query_len, context)`` in ``cases`` (``context`` a multiple
    of ``block_size``). Each pair is checked against the other once, untimed, then ``timer(fn) -> ms`` times it
    (``triton.testing.do_bench`` on a GPU). Validation off in the timed calls: no host sync inside them."""
    from lesson_utils.kernels.paged_attention import paged_attention_decode
    from lesson_utils.kernels.unified_attention import unified_attention

    results = []
    for i, (seqs, query_len, context) in enumerate(cases):
        if context % block_size:
            raise ValueError(f"context {context} is not a multiple of the block size {block_size}")
        q, kc, vc, tables, starts, lens = _unified_inputs(
            seqs, query_len, context, heads, head_dim, block_size, dtype, device, seed=i
        )

        unified = partial(unified_attention, q, kc, vc, tables, starts, lens, query_len, validate=False)
        if query_len == 1:
            name, baseline = "decode kernel", partial(paged_attention_decode, q, kc, vc, tables, lens, validate=False)
        else:
            name, baseline = "gather + SDPA", partial(_gather_sdpa, q, kc, vc, tables, query_len)
        error = float((unified().float() - baseline().float()).abs().max())
        results.append(KernelTiming(seqs, query_len, context, timer(unified), timer(baseline), name, error))
    return results
