"""Lesson 13's clients: what a server looks like from outside. Streaming clients that time every chunk they receive
(time to first token, inter-token latency), clients that leave mid-stream, and the prefix-cache timing channel - a
client that learns from its own time to first token whether someone else sent a prompt before it.

Every time here is measured by the client (``time.perf_counter`` around the HTTP exchange), never read from the
server, so it can be put beside the engine's own timestamps."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
from dataclasses import dataclass

import httpx

from lesson_utils.core.progress import busy


@dataclass(frozen=True)
class ClientTiming:
    """One streamed request as its client saw it (seconds from sending it)."""

    ttft_s: float
    chunk_s: list[float]  # when each chunk carrying text arrived
    text: str

    @property
    def itl_s(self) -> list[float]:
        """Gaps between chunks carrying text (inter-token latency, as a client can measure it)."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]


_CLIENT: httpx.Client | None = None


def _client() -> httpx.Client:
    """One HTTP client per process, made before any clock starts: making one builds a TLS context (tens of ms), which
    no request should be charged for."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(timeout=300.0)
    return _CLIENT


def stream_completion(base_url: str, body: dict, timeout_s: float = 300.0) -> ClientTiming:
    """POST ``body`` to ``/chat/completions`` (``messages``) or ``/completions`` with ``stream`` on; time each chunk."""
    path = "/chat/completions" if "messages" in body else "/completions"
    client = _client()
    t0 = time.perf_counter()
    times, text = [], ""
    with client.stream("POST", base_url + path, json={**body, "stream": True}, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece:
                    times.append(time.perf_counter() - t0)
                    text += piece
    if not times:
        raise RuntimeError("the stream carried no text")
    return ClientTiming(times[0], times, text)


def _stream_one(args: tuple[str, dict]) -> ClientTiming:
    return stream_completion(*args)


def concurrent_streams(base_url: str, bodies: list[dict], workers: int) -> list[ClientTiming]:
    """The bodies streamed by ``workers`` clients at once, each client a process of its own (started fresh: it imports
    only this module and httpx), so that its clock does not wait for this process's engine and server threads -
    clients in threads of the serving process would measure their own wait for Python's interpreter lock, not the
    server. Results in the bodies' order."""
    import multiprocessing

    from tqdm.auto import tqdm

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        jobs = pool.imap(_stream_one, [(base_url, b) for b in bodies])
        with busy(f"starting {workers} client processes"):
            first = next(jobs)
        return [first, *tqdm(jobs, total=len(bodies) - 1, desc="streaming clients", leave=False)]


def leave_mid_stream(base_url: str, body: dict, after_chunks: int, timeout_s: float = 300.0) -> int:
    """Stream ``body`` and close the connection after ``after_chunks`` events (``data:`` lines; 0: right after the
    response's headers, before any event); returns how many events were read."""
    path = "/chat/completions" if "messages" in body else "/completions"
    read = 0
    with _client().stream("POST", base_url + path, json={**body, "stream": True}, timeout=timeout_s) as r:
        if after_chunks > 0:
            for line in r.iter_lines():
                read += line.startswith("data:")
                if read >= after_chunks:
                    break
    return read


def disconnect_storm(base_url: str, bodies: list[dict], workers: int, max_chunks: int, seed: int = 0) -> list[int]:
    """Every body streamed and abandoned after a random number of events (0 .. max_chunks)."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    plan = [(b, rng.randint(0, max_chunks)) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        jobs = pool.map(lambda bp: leave_mid_stream(base_url, *bp), plan)
        return list(tqdm(jobs, total=len(plan), desc="clients leaving mid-stream", leave=False))


def time_to_first_token(base_url: str, body: dict) -> float:
    """One request's time to first token, as its client measures it (max_tokens is set to 1)."""
    return stream_completion(base_url, {**body, "max_tokens": 1}).ttft_s


def timing_channel(base_url: str, victim_of, probe_of, trials: int, seed: int = 0) -> tuple[list[float], list[float]]:
    """The prefix-cache side channel. In trial ``i`` the victim sends ``victim_of(i)`` (a prompt no one sent before:
    now it is in the cache); then the attacker times ``probe_of(True, i)`` - the victim's prompt, a hit if the cache
    is shared - and ``probe_of(False, i)`` - a fresh prompt of the same length, a miss - in random order. Returns the
    two lists of times to first token: (the victim's prompt, a fresh one)."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    same, fresh = [], []
    for i in tqdm(range(trials), desc="timing-channel trials", leave=False):
        stream_completion(base_url, {**victim_of(i), "max_tokens": 1})
        for guess in rng.sample([True, False], 2):
            (same if guess else fresh).append(time_to_first_token(base_url, probe_of(guess, i)))
    return same, fresh
