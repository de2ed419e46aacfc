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

import numpy as np
import torch

from lesson_utils.core.types import Request
from lesson_utils.serving.cost_model import StepCostModel, StepWork


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
    e2e_s: dict[int, float] = field(default_factory=dict)  # req_id -> arrival to last token, seconds
    steps: list[tuple[StepWork, float]] = field(default_factory=list)  # every model step: its work and seconds
    batches: list[list[int]] = field(default_factory=list)  # HF: the req_ids of each static batch, as served

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs.values())

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def latency(self, which: str, q: float) -> float:
        values = list((self.ttft_s if which == "ttft" else self.tpot_s).values())
        return float(np.percentile(values, q)) if values else float("nan")

    @property
    def normalized_latency(self) -> float:
        """The paper's measure (§6.2, Fig. 12): the mean over requests of end-to-end latency / output tokens (s/token)."""
        return float(np.mean([self.e2e_s[r] / len(self.outputs[r]) for r in self.e2e_s if self.outputs[r]]))


def _trim(ids: list[int], n: int, eos: int | None) -> list[int]:
    ids = ids[:n]
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos) + 1]
    return ids


def _token_bar(desc: str, total: int, progress: bool):
    """A bar that counts generated tokens: it moves every step, where a count of finished requests would stand
    still while a static batch runs."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok", leave=False)


def serve_engine(name: str, engine, requests: list[Request], progress: bool = True) -> ServeResult:
    """Add each request when its arrival time comes (a wall clock starting now); run until all are served."""
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.req_id))
    seqs: dict[int, object] = {}
    bar = _token_bar(name, sum(r.output_len for r in requests), progress)
    first_step = len(engine.stats)
    start = time.perf_counter()
    i = shown = 0
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
        engine.step()
        if bar is not None:
            generated = sum(s.num_generated for s in seqs.values())
            bar.update(generated - shown)
            shown = generated
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    stats = engine.stats[first_step:]
    outputs = {rid: list(s.output_ids) for rid, s in seqs.items()}
    ttft = {rid: s.first_token_s for rid, s in seqs.items()}
    tpot = {
        rid: (s.finished_s - s.first_token_s) / (len(s.output_ids) - 1)
        for rid, s in seqs.items()
        if len(s.output_ids) > 1
    }
    running = [(st.t - start, st.running) for st in stats]
    kv = [(st.t - start, st.kv_tokens / st.kv_slots) for st in stats if st.kv_slots]
    t_of = {st.step: st.t - start for st in stats}
    times = {rid: [t_of[k] for k in s.token_steps] for rid, s in seqs.items()}
    e2e = {rid: s.finished_s for rid, s in seqs.items()}
    steps = [(st.work, st.seconds) for st in stats]
    return ServeResult(name, outputs, ttft, tpot, wall, running, kv, times, e2e, steps)


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
    step_work: list[StepWork] = field(default_factory=list)  # what every step computed (the cost model's view)

    def itl_ms(self, q: float) -> float:
        """A percentile of the decoding requests' inter-token latency, in ms."""
        return float(np.percentile(self.itl_s, q) * 1e3) if len(self.itl_s) else float("nan")

    @property
    def mean_ttft_ms(self) -> float:
        """The watched requests' mean time to first token, in ms."""
        return float(np.mean(list(self.ttft_s.values())) * 1e3) if self.ttft_s else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Output tokens of every request over the run's total step time."""
        return sum(len(o) for o in self.outputs.values()) / float(self.step_s.sum())


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
        [st.work for st in stats],
    )


def _synchronize(t: torch.Tensor) -> None:
    """Wait until the GPU has computed ``t`` (nothing to wait for on a CPU)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class _StepClock:
    """A logits processor that only notes the time of every generation step (it changes no logits).

    On a GPU the scores are only queued when the processor runs: it waits for them first, so the first time
    it notes (the time to first token) includes the prefill rather than the moment it was launched.
    ``on_step(k)`` is called after step ``k`` (0 is the prefill) - the progress bar's hook.
    """

    def __init__(self, on_step=None):
        self.times: list[float] = []
        self.on_step = on_step

    def __call__(self, input_ids, scores):
        _synchronize(scores)
        self.times.append(time.perf_counter())
        if self.on_step is not None:
            self.on_step(len(self.times) - 1)
        return scores


def _fits_alone(r: Request, max_positions: int) -> None:
    if r.prompt_len + r.output_len > max_positions:
        raise ValueError(
            f"request {r.req_id} needs {r.prompt_len} + {r.output_len} positions; the model has {max_positions}"
        )


def next_static_batch(queue: list[Request], now: float, batch_size: int, max_positions: int) -> list[Request]:
    """The batch a static-batching server starts at time ``now``: from the head of ``queue`` (arrival order),
    the requests that have arrived, at most ``batch_size``, closed before the one that would push the padded
    batch (longest prompt + longest output) past ``max_positions``. Empty when the head has not arrived yet.
    ``queue`` is not changed."""
    batch: list[Request] = []
    width = longest = 0
    for r in queue:
        if r.arrival_s > now or len(batch) == batch_size:
            break
        _fits_alone(r, max_positions)
        if batch and max(width, r.prompt_len) + max(longest, r.output_len) > max_positions:
            break
        batch.append(r)
        width, longest = max(width, r.prompt_len), max(longest, r.output_len)
    return batch


def static_batches(requests: list[Request], batch_size: int, max_positions: int) -> list[list[Request]]:
    """The batches :func:`next_static_batch` forms when every request has arrived (the offline case): requests in
    arrival order, cut into batches of at most ``batch_size`` that each fit the model. Raises ``ValueError`` for a
    request that cannot fit even alone."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    queue = sorted(requests, key=lambda r: (r.arrival_s, r.req_id))
    for r in queue:
        _fits_alone(r, max_positions)
    batches = []
    while queue:
        batch = next_static_batch(queue, float("inf"), batch_size, max_positions)
        batches.append(batch)
        queue = queue[len(batch) :]
    return batches


def _batch_work(batch: list[Request], k: int) -> StepWork:
    """Step ``k`` of a padded batch (0 = the prefill of every row's padded prompt): every row is computed."""
    width = max(r.prompt_len for r in batch)
    if k == 0:
        return StepWork(0, len(batch) * width, len(batch) * width)
    return StepWork(len(batch), 0, len(batch) * (width + k))


def serve_hf_static(
    model,
    requests: list[Request],
    batch_size: int,
    eos_token_id: int | None,
    pad_token_id: int = 1,
    progress: bool = True,
) -> ServeResult:
    """Hugging Face ``generate`` on static, left-padded batches (module docstring). When the previous batch is done,
    the next one starts with the requests that have arrived (:func:`next_static_batch`; if none has, it waits for
    the next arrival) and runs until its longest member is done: newcomers wait for the batch to end."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    max_positions = model.config.max_position_embeddings
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    queue = sorted(requests, key=lambda r: (r.arrival_s, r.req_id))
    for r in queue:
        _fits_alone(r, max_positions)
    outputs, ttft, tpot, e2e, running, steps, batches = {}, {}, {}, {}, [], [], []
    bar = _token_bar("HF static batches", sum(r.output_len for r in requests), progress)
    start = time.perf_counter()
    while queue:
        now = time.perf_counter() - start
        if queue[0].arrival_s > now:
            time.sleep(queue[0].arrival_s - now)
            now = queue[0].arrival_s
        batch = next_static_batch(queue, now, batch_size, max_positions)
        queue = queue[len(batch) :]
        batches.append([r.req_id for r in batch])
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # built on the host, moved once
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
            mask[row, width - r.prompt_len :] = 1

        def tick(k, batch=batch):
            if bar is not None:
                bar.update(sum(r.output_len > k for r in batch))

        clock = _StepClock(tick)
        launched = time.perf_counter()
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
        marks = [launched] + clock.times
        steps += [(_batch_work(batch, k), marks[k + 1] - marks[k]) for k in range(len(clock.times))]
        for row, r in enumerate(batch):
            gen = _trim(out[row, width:].tolist(), r.output_len, eos_token_id)
            outputs[r.req_id] = gen
            first = clock.times[0] - start
            last = clock.times[min(len(gen), len(clock.times)) - 1] - start
            ttft[r.req_id] = first - r.arrival_s
            e2e[r.req_id] = last - r.arrival_s
            if len(gen) > 1:
                tpot[r.req_id] = (last - first) / (len(gen) - 1)
        running += [(launched - start, len(batch)), (clock.times[-1] - start, 0)]
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return ServeResult(
        "HF generate (static batches)", outputs, ttft, tpot, wall, running, e2e_s=e2e, steps=steps, batches=batches
    )


def padded_rows(batches: list[list[int]], output_lens: dict[int, int]) -> tuple[int, int]:
    """(decode rows computed, output tokens) of static batches as served: a batch computes every row until its
    longest output is done, so a row of a request that finished early is computed (and thrown away) meanwhile."""
    computed = sum(len(b) * max(output_lens[r] for r in b) for b in batches)
    return computed, sum(output_lens[r] for b in batches for r in b)


def simulate_hf_static(
    requests: list[Request], batch_size: int, max_positions: int, cost: StepCostModel
) -> dict[int, float]:
    """Static batching in a model of time: batches formed as :func:`serve_hf_static` forms them, each step costing
    what ``cost`` (fitted to HF's own measured steps) says. Returns each request's end-to-end latency (seconds)."""
    queue = sorted(requests, key=lambda r: (r.arrival_s, r.req_id))
    clock, e2e = 0.0, {}
    while queue:
        clock = max(clock, queue[0].arrival_s)
        batch = next_static_batch(queue, clock, batch_size, max_positions)
        queue = queue[len(batch) :]
        ends = []
        for k in range(max(r.output_len for r in batch)):
            clock += cost(_batch_work(batch, k))
            ends.append(clock)
        for r in batch:
            e2e[r.req_id] = ends[r.output_len - 1] - r.arrival_s
    return e2e
