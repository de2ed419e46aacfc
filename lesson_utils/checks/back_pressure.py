"""Lesson 09's exercise 3, back-pressure: what the decode worker does when a transfer's blocks do not fit. Checked on
a real decode engine (random requests of known lengths decoding in a small cache) against
:func:`lesson_utils.disagg.handover.make_room`: the decode steps run, the sequences returned as finished, the blocks
free afterwards, and the two refusals (a transfer that can never fit; a shortfall with nothing decoding)."""

from __future__ import annotations

import time

import torch

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.progress import busy
from lesson_utils.core.types import OutOfBlocks, Sequence
from lesson_utils.disagg.handover import make_room
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.serving.engine import Engine

from .core import CheckResult, failed, not_implemented, passed

MAX_STEPS = 60
MAX_READS = 20_000
MAX_WAIT_S = 5.0  # a loop that sleeps between reads fails fast too
NUM_BLOCKS = 12


class _Spinning(Exception):
    """Raised by the checker's manager or engine when the learner's loop runs without end."""


class _WatchedManager(BlockManager):
    """A block manager whose free count stops a loop that keeps reading it without ever decoding (the count of
    reads and the deadline start when the learner's code gets the engine)."""

    _reads = 0
    _deadline = float("inf")

    @property
    def num_free_blocks(self) -> int:
        self._reads += 1
        if self._reads > MAX_READS:
            raise _Spinning(f"your loop read the free-block count {MAX_READS} times")
        if time.monotonic() > self._deadline:
            raise _Spinning(f"your make_room was still waiting after {MAX_WAIT_S:.0f} s")
        return super().num_free_blocks

    def _start_watching(self) -> None:
        self._reads, self._deadline = 0, time.monotonic() + MAX_WAIT_S


def _free_now(engine) -> int:
    """The decode side's free blocks, for the checker itself (not counted as a read)."""
    return len(engine.manager.view.free_queue())


def _engine(w, lengths: list[tuple[int, int]], held: int = 0):
    """A decode engine (blocks of 4) running one request per ``(prompt tokens, new tokens)``, prefilled; ``held``
    blocks are taken by a table no running request owns (a transfer being adopted, say)."""
    watched = _WatchedManager(NUM_BLOCKS, 4, watermark=0.0, max_seq_len=w.max_positions)
    engine = Engine(w, PagedKVCache.for_model(w, manager=watched), stop_at_eos=False)
    g = torch.Generator().manual_seed(9)
    for prompt, new in lengths:
        engine.add_request(torch.randint(4, w.vocab_size, (prompt,), generator=g).tolist(), new)
    while engine.scheduler.waiting:
        engine.step()
    if held:
        watched.blocks.reserve(999, 4 * held)
    steps = []
    real_step = engine.step

    def counted_step():
        if len(steps) >= MAX_STEPS:
            raise _Spinning(f"still waiting after {MAX_STEPS} decode steps")
        steps.append(1)
        return real_step()

    engine.step = counted_step
    watched._start_watching()  # the checker's own manager: from here on, the learner's reads count
    return engine, steps


def _finished_ids(got) -> list[int] | None:
    """The ids of the finished sequences the learner returned (any collection of Sequence objects), else None."""
    try:
        items = list(got)
    except TypeError:
        return None
    if not all(isinstance(x, Sequence) for x in items):
        return None
    return sorted(x.seq_id for x in items)


# (what, request lengths, blocks held elsewhere, blocks the transfer needs beyond those free once they are prefilled)
_CASES = [
    ("enough blocks are free already", [(6, 8)], 0, -3),
    ("exactly as many blocks are free as the transfer needs", [(7, 9), (5, 9)], 0, 0),
    ("the running requests must finish first", [(9, 4), (10, 6), (8, 9)], 0, 4),
    ("one request must finish, and then it is enough", [(15, 3), (5, 10)], 0, 2),
    ("an empty cache, and a transfer as large as all of it", [], 0, 0),
]


# a shortfall that no waiting can end: (requests, blocks held elsewhere, the situation, the question asked)
_STUCK = [
    (
        [(6, 3)],
        NUM_BLOCKS - 4,
        f"once the running request had finished, 4 of {NUM_BLOCKS} blocks were free for a transfer of 5 (the rest held "
        "by a table no request runs)",
        "Is the question whether anything is decoding asked only once? Raise OutOfBlocks when nothing is left to decode",
    ),
    (
        [],
        NUM_BLOCKS - 2,
        f"with nothing decoding and 2 of {NUM_BLOCKS} blocks free for a transfer of 5",
        "Can a block come free when nothing runs? Raise OutOfBlocks rather than wait",
    ),
]


def _stuck(fn, engine) -> str:
    """What the learner's make_room did when 5 blocks can never come free ("" when it raised OutOfBlocks)."""
    try:
        fn(engine, 5)
        return "returned although too few blocks are free"
    except NotImplementedError:
        raise
    except OutOfBlocks:
        return ""
    except _Spinning as err:
        return f"{err}"
    except Exception as err:  # noqa: BLE001
        return f"raised {type(err).__name__}: {err}"


def check_make_room(fn, w) -> CheckResult:
    """Exercise 09-3: back-pressure on the decode side before a transfer is taken in."""
    name = "make_room"
    with busy("checking your make_room on a small decode engine"):
        for what, lengths, held, extra in _CASES:
            ref_engine, ref_steps = _engine(w, lengths, held)
            need = _free_now(ref_engine) + extra
            want = sorted(s.seq_id for s in make_room(ref_engine, need))
            engine, steps = _engine(w, lengths, held)
            try:
                got = fn(engine, need)
            except NotImplementedError:
                return not_implemented(name, make_room)
            except _Spinning as err:
                return failed(
                    name,
                    f"{what} ({need} blocks needed): {err}. Does your loop decode while it waits, and stop once "
                    "enough blocks are free?",
                    make_room,
                )
            except Exception as err:  # noqa: BLE001 - any learner error becomes feedback
                return failed(
                    name, f"{what} ({need} blocks needed): your make_room raised {type(err).__name__}: {err}", make_room
                )
            free = _free_now(engine)
            if len(steps) != len(ref_steps) or free < need:
                return failed(
                    name,
                    f"{what} ({need} blocks needed, {NUM_BLOCKS} in the cache): you ran {len(steps)} decode step(s) and "
                    f"left {free} blocks free; the reference ran {len(ref_steps)}. Every step you wait delays the "
                    "transfer; every step too few leaves it without blocks: when exactly is there room?",
                    make_room,
                )
            ids = _finished_ids(got)
            if ids != want:
                shown = "something that is not Sequence objects" if ids is None else f"sequences {ids}"
                return failed(
                    name,
                    f"{what}: you returned {shown} ({got!r:.80}); expected the Sequence objects that finished while "
                    f"you waited (ids {want}) - the worker reports their tokens",
                    make_room,
                )
        engine, steps = _engine(w, [(6, 8)])
        try:
            fn(engine, NUM_BLOCKS + 1)
            problem = f"a transfer of {NUM_BLOCKS + 1} blocks into a cache of {NUM_BLOCKS} was not refused"
        except NotImplementedError:
            return not_implemented(name, make_room)
        except ValueError:
            problem = f"it was refused, but only after {len(steps)} decode step(s)" if steps else ""
        except Exception as err:  # noqa: BLE001
            problem = f"expected a ValueError, got {type(err).__name__}: {err}"
        if problem:
            return failed(
                name, f"{problem}: can waiting ever make it fit? Refuse it with a ValueError before any step", make_room
            )
        for lengths, held, situation, question in _STUCK:
            problem = _stuck(fn, _engine(w, lengths, held)[0])
            if problem:
                return failed(name, f"{situation}, your make_room {problem}. {question}", make_room)
    return passed(
        name,
        f"the same decode steps, finished sequences and free blocks as the reference in {len(_CASES)} cases, and both "
        "refusals (a transfer larger than the cache, a shortfall with nothing decoding).",
        fn,
    )
