"""Prometheus metrics of one served engine, in a registry of its own (two servers in one process do not mix):
sequences running and waiting and KV blocks in use (read from the loop when scraped; a request with ``n`` samples is
``n`` sequences, as in vLLM v1), time to first token per request and inter-token latency per sample (observed as
outputs leave the loop), and samples finished by how they ended."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lesson_utils.api.engine_loop import EngineLoop, Output, RequestHandle

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("course_requests_running", "sequences the engine runs this step", registry=r)
        self.waiting = Gauge("course_requests_waiting", "sequences waiting for memory", registry=r)
        self.blocks_used = Gauge("course_kv_blocks_used", "KV blocks held", registry=r)
        self.blocks_total = Gauge("course_kv_blocks_total", "KV blocks in the cache", registry=r)
        self.ttft = Histogram(
            "course_time_to_first_token_seconds",
            "arrival to the first token leaving the loop",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "course_inter_token_latency_seconds",
            "between two outputs carrying tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.finished = Counter("course_requests_finished", "samples finished, by reason", ["reason"], registry=r)
        self._last_token_s: dict[tuple[int, int], float] = {}  # (request, sample) -> when its last tokens left
        loop.on_output = self.observe

    def observe(self, handle: RequestHandle, out: Output) -> None:
        """Called by the loop for every output it sends (in its thread). A gap is measured within one sample: the
        samples of one request leave in the same step, and the gaps between them are not latency."""
        key = (handle.request_id, out.index)
        if out.token_ids:
            now = handle.token_times[-1]
            if len(handle.token_times) == 1:
                self.ttft.observe(now - handle.arrived_s)
            if key in self._last_token_s:
                self.itl.observe(now - self._last_token_s[key])
            self._last_token_s[key] = now
        if out.finish_reason is not None:
            self._last_token_s.pop(key, None)
            self.finished.labels(out.finish_reason).inc()

    def scrape(self) -> bytes:
        stats = self.loop.stats
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.blocks_used.set(stats.blocks_used)
        self.blocks_total.set(stats.blocks_total)
        return generate_latest(self.registry)
