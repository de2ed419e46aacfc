"""Lesson 09's two-worker run, configured: what the workers are given (:class:`DisaggConfig`, the :class:`Faults`
a test injects), the error a failed run raises, and the wire's fixed values (the ranks, the end marker)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

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


NO_FAULTS = Faults()  # a run as it should go
