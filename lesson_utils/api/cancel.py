"""What a server does when a client goes away: cancel its request in the engine, every sample of it, so its blocks are
free before the next step. Lesson 13's exercise 2 (this is its reference)."""

from __future__ import annotations

from lesson_utils.core.types import SequenceStatus

LIVE = (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED)


def cancel_request(engine, seq) -> None:
    """Cancel the request whose first sample is ``seq``: each of its samples still waiting, running or swapped is
    aborted through the scheduler (its blocks, or its swapped copy, are given back at once); samples that already
    finished or were cancelled are left as they are (a first sample aborted before its prefill ends never forks its
    siblings). Never raises for a request that has already ended; other requests are untouched."""
    for sample in list(seq.samples or [seq]):
        if sample.status in LIVE:
            engine.scheduler.abort(sample)
