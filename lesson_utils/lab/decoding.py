"""Lesson 00: decoding one sequence with and without a KV cache, and timing both.

A *stepper* hides the model behind one call: ``step(new_tokens) -> logits of the last token``.

* :func:`cached_stepper` keeps K/V of everything it has seen: feed it the prompt once, then one token
  per step.
* :func:`uncached_stepper` keeps nothing: every call must carry the whole sequence so far, and the
  model recomputes K/V for all of it.

Both count the tokens they push through the model (``step.tokens_processed``), which is exactly the
work a KV cache saves.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from lesson_utils.cache.dense import DenseKVCache
from lesson_utils.cache.seam import StepBatch
from lesson_utils.model.weights import ModelWeights, forward


class Stepper:
    """``step(new_tokens)`` -> 1-D logits of the last token; counts tokens and calls."""

    def __init__(self, w: ModelWeights, cached: bool):
        self.w, self.cached = w, cached
        self.cache = DenseKVCache(w.num_layers)
        self.cached_len = 0
        self.tokens_processed = 0
        self.calls = 0

    def __call__(self, new_tokens: list[int]) -> torch.Tensor:
        new_tokens = [int(t) for t in new_tokens]
        if not new_tokens:
            raise ValueError("step() needs at least one token")
        if not self.cached:  # no memory between calls: start from scratch every time
            self.cache, self.cached_len = DenseKVCache(self.w.num_layers), 0
        device = self.w.embed_tokens.device
        batch = StepBatch.build([0], [new_tokens], [self.cached_len], device=device)
        logits = forward(self.w, batch, self.cache, last_only=True)[0]
        self.cached_len += len(new_tokens)
        self.tokens_processed += len(new_tokens)
        self.calls += 1
        return logits


def cached_stepper(w: ModelWeights) -> Stepper:
    return Stepper(w, cached=True)


def uncached_stepper(w: ModelWeights) -> Stepper:
    return Stepper(w, cached=False)


def decode_with_cache(step: Callable, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding through a cached stepper (the reference for exercise 00-2).

    The prompt goes through the model once; afterwards only the newest token does. The last generated
    token never needs to go through the model: nothing comes after it.
    """
    logits = step(prompt)
    out: list[int] = []
    for i in range(max_new_tokens):
        out.append(int(torch.argmax(logits)))
        if i + 1 < max_new_tokens:
            logits = step([out[-1]])
    return out


def time_per_token(
    w: ModelWeights,
    prompt: list[int],
    max_new_tokens: int,
    cached: bool,
    repeats: int = 3,
    *,
    threads: int | None = None,
    progress=None,
) -> list[float]:
    """Wall time (s) of each generated token, with or without a cache: the median over ``repeats`` runs.

    Synchronises CUDA around every step, so GPU times are real, not launch times. ``threads`` sets torch's
    CPU threads for the measurement (restored afterwards): on a small CPU two threads can make per-token
    times jump by an order of magnitude (two threads per core fighting for it); one thread gives steady numbers. ``progress`` (a tqdm bar, say) is
    updated once per generated token of every repeat.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    sync = torch.cuda.synchronize if w.embed_tokens.is_cuda else (lambda: None)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _median_times(w, prompt, max_new_tokens, cached, repeats, sync, progress)
    finally:
        torch.set_num_threads(saved_threads)


def _median_times(w, prompt, max_new_tokens, cached, repeats, sync, progress) -> list[float]:
    runs = []
    for _ in range(repeats):
        step = Stepper(w, cached=cached)
        times: list[float] = []
        seq = list(prompt)
        for i in range(max_new_tokens):
            sync()
            t0 = time.perf_counter()
            logits = step(seq if (not cached or i == 0) else seq[-1:])
            sync()
            times.append(time.perf_counter() - t0)
            seq.append(int(torch.argmax(logits)))
            if progress is not None:
                progress.update(1)
        runs.append(times)
    return [sorted(col)[len(col) // 2] for col in zip(*runs)]


def last_token_timing(w: ModelWeights, prompt: list[int], *, repeats: int = 5, threads: int | None = None):
    """The time of one decode step at the end of ``prompt``, with a cache and without, by the course's timing
    protocol (:func:`lesson_utils.lab.timing.measure`: warm-up, repeats in alternating order, median and spread).

    Each timed call builds its own stepper and feeds it ``prompt[:-1]`` untimed; only the step that feeds the last
    token is on the clock: one token through the model with a cache, the whole sequence without."""
    from lesson_utils.lab.timing import measure

    sync = torch.cuda.synchronize if w.embed_tokens.is_cuda else (lambda: None)

    def one(cached: bool) -> float:
        step = Stepper(w, cached=cached)
        if cached:
            step(prompt[:-1])
        sync()
        t0 = time.perf_counter()
        step(prompt[-1:] if cached else prompt)
        sync()
        return time.perf_counter() - t0

    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return measure(
            {"with cache": lambda: one(True), "without cache": lambda: one(False)},
            repeats=repeats,
            value=lambda seconds, _: seconds,
        )
    finally:
        torch.set_num_threads(saved)
