"""One thread that serves the engine while requests arrive from elsewhere (an HTTP server's event loop).

The engine is not thread-safe, and need not be: only this loop's thread touches it. A caller hands a request in with
:meth:`EngineLoop.submit` (the loop admits it between two steps and answers through a future), cancels one with
:meth:`EngineLoop.abort`, and receives each sample's new text through the ``sink`` it gave - called from the loop's
thread, so an asyncio server wraps it with ``loop.call_soon_threadsafe``. The loop steps while any request runs and
sleeps on an event when none does.

Invariants: a request's every sample ends with exactly one :class:`Output` whose ``finish_reason`` is set; an
aborted request (a client that went away) is cancelled in the engine before the next step, so its blocks are free
then; a request is refused (:class:`QueueFull`) while ``max_waiting`` sequences already wait (the line can hold
more afterwards: preemption puts running sequences back at its head). A plugged-in function (lesson 13's ``cancel``
and ``text_rule``) that raises never stops the loop: the raise is noted in :attr:`EngineLoop.problems`, a text rule's
request ends with ``"error"``, and a cancel is finished by the reference.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from lesson_utils.api.cancel import LIVE, cancel_request
from lesson_utils.api.detokenizer import IncrementalDetokenizer, StopStrings, safe_new_text
from lesson_utils.core.types import SequenceStatus


@dataclass(frozen=True)
class SamplingParams:
    """What a client asked for, checked by the protocol layer."""

    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cache_salt: str | None = None  # prefix-cache blocks shared only with requests of the same salt


@dataclass(frozen=True)
class Output:
    """New output of one sample: ``text`` safe to show, the ``token_ids`` generated since the last one, and, on the
    sample's last output, why it ended: ``"stop"`` (end of turn or a stop string), ``"length"`` (``max_tokens``),
    ``"abort"`` (cancelled) or ``"error"`` (the engine refused a step, or the text rule raised: ``error`` says
    which, as a sentence)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None


class QueueFull(RuntimeError):
    """The waiting line is full: answer 429 and ask the client to retry later."""


class _RuleFailed(Exception):
    """The text rule raised (its exception is the cause): the request it served ends with an error."""


@dataclass
class _Sample:
    detok: IncrementalDetokenizer
    stops: StopStrings
    sent_ids: int = 0
    done: bool = False


@dataclass
class RequestHandle:
    """One submitted request, as the caller sees it: its id, prompt length and timings (``perf_counter`` seconds)."""

    request_id: int
    prompt_len: int
    params: SamplingParams
    arrived_s: float
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output carrying tokens left the loop
    completion_tokens: int = 0
    finished: bool = False


@dataclass
class _Live:
    handle: RequestHandle
    seq: object  # the engine's first sample (a Sequence)
    sink: Callable[[Output], None]
    samples: list[_Sample]
    abort_asked: bool = False


@dataclass(frozen=True)
class LoopStats:
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int


class EngineLoop:
    """Serve ``engine`` from a background thread; ``tokenizer`` turns tokens into text for the sinks."""

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        max_waiting: int = 64,
        idle_wait_s: float = 0.05,
        cancel=cancel_request,
        text_rule=safe_new_text,
    ):
        """``cancel(engine, seq)`` and ``text_rule`` (see :func:`~.detokenizer.safe_new_text`) are lesson 13's
        exercises; the references by default."""
        self.engine, self.tokenizer = engine, tokenizer
        self.cancel, self.text_rule = cancel, text_rule
        self.max_waiting = max_waiting
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[int, _Live] = {}
        self._next_id = 0
        self._lock = threading.Lock()  # guards _next_id and stats
        self.stats = LoopStats(0, 0, 0, engine.manager.view.num_blocks)
        self.on_output: Callable[[RequestHandle, Output], None] | None = None  # metrics hook
        self.done: collections.deque[RequestHandle] = collections.deque(maxlen=10_000)  # ended, newest last
        self.problems: collections.deque[str] = collections.deque(maxlen=100)  # plugged-in functions that raised
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- the caller's side (any thread) ------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[Output], None],
        arrived: float | None = None,
    ) -> Future:
        """Hand a request to the loop; the future resolves to its :class:`RequestHandle` once admitted to the
        engine's waiting line, or to the engine's refusal (``ValueError``: too long, an id outside the vocabulary),
        or :class:`QueueFull`. ``arrived`` (``perf_counter`` seconds): when the server received the request - its
        clock starts there, not when the loop gets to it between two steps; default now."""
        future: Future = Future()
        arrived = time.perf_counter() if arrived is None else arrived
        self._commands.put(("submit", (list(prompt_ids), params, sink, arrived), future))
        self._wake.set()
        return future

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request (a client disconnected); its blocks are free before the loop's next step."""
        self._commands.put(("abort", handle.request_id, None))
        self._wake.set()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` in the loop's thread between two steps (to read the engine safely); its result as a future."""
        future: Future = Future()
        self._commands.put(("call", fn, future))
        self._wake.set()
        return future

    # ---- the loop's thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._handle_commands()
            if self.engine.scheduler.has_work:
                try:
                    self.engine.step()
                except Exception as err:  # noqa: BLE001 - a refused step changed nothing; end every request with it
                    self._fail_all(f"the engine refused a step: {type(err).__name__}: {err}")
                self._publish()
            else:
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
            self._note_stats()

    def _handle_commands(self) -> None:
        while True:
            try:
                kind, payload, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._admit(*payload, future)
            elif kind == "abort":
                self._cancel(payload)
            else:
                try:
                    future.set_result(payload())
                except Exception as err:  # noqa: BLE001 - the caller gets it
                    future.set_exception(err)

    def _admit(self, prompt_ids, params: SamplingParams, sink, arrived: float, future: Future) -> None:
        if len(self.engine.scheduler.waiting) >= self.max_waiting:
            future.set_exception(QueueFull(f"{self.max_waiting} requests are already waiting"))
            return
        try:
            seq = self.engine.add_request(
                prompt_ids,
                params.max_tokens,
                n=params.n,
                temperature=params.temperature,
                seed=params.seed,
                cache_salt=params.cache_salt,
            )
        except Exception as err:  # noqa: BLE001 - the engine's refusal names the problem; nothing was queued
            future.set_exception(err)
            return
        with self._lock:
            self._next_id += 1
            rid = self._next_id
        handle = RequestHandle(rid, len(prompt_ids), params, arrived)
        samples = [
            _Sample(
                IncrementalDetokenizer(self.tokenizer, prompt_ids, rule=self.text_rule), StopStrings(list(params.stop))
            )
            for _ in range(params.n)
        ]
        self._live[rid] = _Live(handle, seq, sink, samples)
        future.set_result(handle)

    def _cancel(self, request_id: int, reason: str = "abort", error: str | None = None) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return  # already finished: nothing holds memory
        try:
            self.cancel(self.engine, live.seq)
        except Exception as err:  # noqa: BLE001 - a learner's cancel: note it, then give the blocks back regardless
            self._note_problem("cancel", err)
            try:
                cancel_request(self.engine, live.seq)
            except Exception as again:  # noqa: BLE001 - the engine was left inconsistent; keep serving the others
                self._note_problem("the reference cancel, after yours", again)
        live.handle.finished = True
        self.done.append(live.handle)
        for i, sample in enumerate(live.samples):
            if not sample.done:
                sample.done = True
                try:
                    self._send(live, Output(i, "", (), reason, error))
                except Exception as err:  # noqa: BLE001 - the sink that just failed (why we cancel) may fail again
                    self._note_problem("publishing an output", err)

    def _fail_all(self, why: str) -> None:
        for rid in list(self._live):
            self._cancel(rid, "error", why)

    def _send(self, live: _Live, out: Output) -> None:
        live.sink(out)
        if self.on_output is not None:
            self.on_output(live.handle, out)

    @staticmethod
    def _engine_samples(live: _Live) -> list:
        return list(live.seq.samples or [live.seq])

    def _note_problem(self, what: str, err: Exception) -> None:
        self.problems.append(f"{what} raised {type(err).__name__}: {err}")

    def _publish(self) -> None:
        now = time.perf_counter()
        for rid in list(self._live):
            try:
                self._publish_request(rid, now)
            except _RuleFailed as failed:  # a learner's text rule: this request ends, the others go on
                err = failed.__cause__
                self._note_problem("text_rule", err)
                self._cancel(rid, "error", f"the server's text rule raised {type(err).__name__}: {err}")
            except Exception as err:  # noqa: BLE001 - e.g. a sink whose event loop has closed
                self._note_problem("publishing an output", err)
                self._cancel(rid, "error", f"the server could not publish an output: {type(err).__name__}: {err}")

    def _publish_request(self, rid: int, now: float) -> None:
        live = self._live[rid]
        for i, s in enumerate(self._engine_samples(live)):
            out = self._new_output(live, i, s)
            if out is None:
                continue
            if out.token_ids:
                if live.handle.first_token_s is None:
                    live.handle.first_token_s = now
                live.handle.token_times.append(now)
                live.handle.completion_tokens += len(out.token_ids)
            self._send(live, out)
        if all(sample.done for sample in live.samples):
            live.handle.finished = True
            self.done.append(live.handle)
            del self._live[rid]

    def _new_output(self, live: _Live, i: int, s) -> Output | None:
        sample = live.samples[i]
        if sample.done:
            return None
        new = s.output_ids[sample.sent_ids :]
        sample.sent_ids = len(s.output_ids)
        text, stopped = sample.stops.feed(self._rule(sample.detok.push, new)) if new else ("", False)
        finish = None
        if stopped:
            if s.status in LIVE:
                self.engine.scheduler.abort(s)  # a stop string ends this sample now: its blocks come back
            finish = "stop"
        elif s.status is SequenceStatus.FINISHED:
            text += sample.stops.feed(self._rule(sample.detok.flush))[0] + sample.stops.flush()
            eos = self.engine.w.eos_token_id
            ended_at_eos = eos is not None and s.output_ids[-1:] == [eos]
            finish = "stop" if ended_at_eos or sample.stops.stopped else "length"
        if finish is not None:
            sample.done = True
        if not text and not new and finish is None:
            return None
        return Output(i, text, tuple(int(t) for t in new), finish)

    @staticmethod
    def _rule(call, *args) -> str:
        """``call(*args)`` on the detokenizer, which runs the text rule: its raise becomes :class:`_RuleFailed`."""
        try:
            return call(*args)
        except Exception as err:  # noqa: BLE001 - told apart from the loop's own errors by _publish
            raise _RuleFailed() from err

    def _note_stats(self) -> None:
        view = self.engine.manager.view
        free = self.engine.manager.num_free_blocks
        with self._lock:
            self.stats = LoopStats(
                len(self.engine.scheduler.running),
                len(self.engine.scheduler.waiting),
                view.num_blocks - (free or 0),
                view.num_blocks,
            )
