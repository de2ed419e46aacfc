"""A bar that moves while one long call runs (loading a model, a checker's engine runs, two worker processes).

tqdm redraws a bar only when it is updated; a single call that takes seconds would leave it frozen. :func:`busy`
shows the elapsed time and refreshes it from a background thread every half second, so a learner sees that the cell
is working, and what on; :func:`ticking` does the same for a bar whose updates are seconds apart. Headless runs show
them too (the course's runner names cells in which nothing moved for seconds).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


@contextlib.contextmanager
def busy(desc: str, *, show: bool = True, interval_s: float = 0.5) -> Iterator[None]:
    """``with busy("loading OPT-125m"):`` - a bar reading ``desc: 3.5 s`` that counts up until the block ends."""
    if not show:
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed}", leave=False)
    try:
        with ticking(bar, interval_s):
            yield
    finally:
        bar.close()


@contextlib.contextmanager
def ticking(bar, interval_s: float = 1.0) -> Iterator[None]:
    """Redraw ``bar`` every ``interval_s`` from a background thread while the block runs, so its clock moves between
    two updates that are seconds apart (a bar of a few timed runs). ``bar`` None: nothing to redraw."""
    if bar is None:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(interval_s):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
