"""Lesson 07: where one decode step's time goes, measured rather than guessed.

A decode step's fixed cost is often explained as "reading every weight of the model once". That is a
prediction: :func:`profile_decode_step` checks it. It measures

* the step itself (:func:`lesson_utils.lab.timing.measure`: warm-up, repeats, median and spread);
* the weight bytes a step reads (every parameter once; OPT's output layer is its tied embedding) and this
  device's copy bandwidth, hence how long reading them would take at that bandwidth;
* with PyTorch's profiler, the step's time in the weight matmuls (``aten::addmm``, ``aten::mm``), in every other
  operator, and outside any operator (Python: the course's forward code, scheduler and block manager);
* the operators per step and the measured cost of launching one trivial operator, hence the framework's
  per-operator overhead.

The profiler slows what it watches: shares come from the profiled steps, absolute times from the unprofiled ones.

:func:`time_decode_steps` measures the other axis: a decode step of 1, 2, ... sequences, every one with the same
context, so that what changes between the sizes is only the rows the step feeds (the jumps a row-bucket cost
model, :class:`lesson_utils.serving.cost_model.RowBucketCost`, is fitted to).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lesson_utils.lab.timing import Measurement, measure

MATMULS = ("aten::addmm", "aten::mm")


@dataclass
class StepProfile:
    """What :func:`profile_decode_step` measured (seconds and bytes; shares of one step)."""

    sequences: int  # sequences decoding in each measured step
    step: Measurement  # the unprofiled decode step ("decode step")
    weight_bytes: int
    copy: Measurement  # the copy of copy_bytes bytes ("copy")
    copy_bytes: int
    matmul_share: float  # of the profiled step: weight matmuls
    other_ops_share: float  # every other operator
    python_share: float  # outside any operator
    ops_per_step: float  # operators called from Python per step
    op_launch: Measurement  # one trivial operator ("one operator")
    device: str

    @property
    def step_s(self) -> float:
        return self.step["decode step"].median

    @property
    def copy_gb_s(self) -> float:
        """Bytes moved (read and written) per second by a large copy, in GB/s."""
        return 2 * self.copy_bytes / self.copy["copy"].median / 1e9

    @property
    def weights_read_s(self) -> float:
        """Seconds reading every weight once would take at the measured copy bandwidth."""
        return self.weight_bytes / (self.copy_gb_s * 1e9)

    @property
    def overhead_s(self) -> float:
        """Operators per step times the measured cost of launching one."""
        return self.ops_per_step * self.op_launch["one operator"].median


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied embedding counts once: the output layer reads the same matrix)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _sync(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


@contextlib.contextmanager
def _profiler_quiet():
    """Silence what the profiler's C++ side (Kineto) writes to file descriptor 2 as it starts and stops - two log
    lines a profile that would land in a notebook's output. Python's own warnings still show: a notebook's
    ``sys.stderr`` is not that descriptor."""
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def quiet_profile(activities):
    """``torch.profiler.profile(activities=...)`` without the profiler's own log lines."""

    @contextlib.contextmanager
    def run():
        prof = torch.profiler.profile(activities=activities)
        with _profiler_quiet():
            prof.__enter__()
        try:
            yield prof
        finally:
            with _profiler_quiet():
                prof.__exit__(None, None, None)

    return run()


def count_step_operators(engine) -> int:
    """The operators (top-level ``aten::`` calls from Python) one ``engine.step()`` launches - what a GPU's host must
    launch one by one in eager PyTorch. The step is a real step of ``engine``."""
    with quiet_profile([torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    return len(_operators(prof.events()))


def _operators(events) -> list:
    """The profiled events that are operators called from Python: top-level ``aten::`` calls."""
    return [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]


def profile_decode_step(engine, model: torch.nn.Module, *, repeats: int = 5, copy_mib: int = 128) -> StepProfile:
    """Profile ``engine``'s decode steps. Every sequence in it must already be decoding (prefilled), with enough
    tokens left for ``2 * repeats + 6`` more steps; each measured step is one real step of the engine."""
    device = next(model.parameters()).device
    sync = _sync(device)
    n = len(engine.scheduler.running)
    if n == 0 or engine.scheduler.waiting:
        raise ValueError("profile a step of sequences that are all running (prefilled), none waiting")
    step = measure({"decode step": engine.step}, repeats=repeats, warmup=1, sync=sync)

    activities = [torch.profiler.ProfilerActivity.CPU]
    on_gpu = device.type == "cuda"
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiled = 3
    with quiet_profile(activities) as prof:
        t0 = time.perf_counter()
        for _ in range(profiled):
            engine.step()
        if sync is not None:
            sync()
        wall = time.perf_counter() - t0
    events = prof.events()
    top = _operators(events)
    attr = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    matmul = sum(getattr(e, attr) for e in events if e.name in MATMULS) / 1e6
    if on_gpu:
        busy = sum(getattr(e, attr) for e in events if e.name.startswith("aten::")) / 1e6
    else:
        busy = sum(e.cpu_time_total for e in top) / 1e6
    matmul_share = min(1.0, matmul / wall)
    ops_share = min(1.0 - matmul_share, max(0.0, busy / wall - matmul_share))

    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    out = torch.empty(1, device=device)

    def many_adds():
        for _ in range(1000):
            torch.add(a, b, out=out)

    launch = measure({"one operator": many_adds}, repeats=5, warmup=1, sync=sync, value=lambda _, s: s / 1000)

    nbytes = copy_mib * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = measure({"copy": lambda: dst.copy_(src)}, repeats=5, warmup=1, sync=sync)
    return StepProfile(
        n,
        step,
        weight_bytes(model),
        copy,
        nbytes,
        matmul_share,
        ops_share,
        max(0.0, 1.0 - matmul_share - ops_share),
        len(top) / profiled,
        launch,
        str(device),
    )


def prefilled_engine(make_engine: Callable[[], Any], prompt: list[int], k: int, repeats: int):
    """A fresh engine from ``make_engine()`` holding ``k`` copies of ``prompt``, prefilled (each has its first token):
    every step from here is a decode step of all ``k`` for ``repeats + 3`` steps. The engine must decode past eos."""
    engine = make_engine()
    for _ in range(k):
        engine.add_request(list(prompt), repeats + 4)
    while engine.scheduler.waiting or any(s.num_generated == 0 for s in engine.scheduler.running):
        engine.step()  # admission and prefill; what follows are decode steps of all k sequences
    if len(engine.scheduler.running) != k:
        m = engine.manager
        raise ValueError(
            f"the engine holds {len(engine.scheduler.running)} of {k} sequences: the others were not admitted together "
            f"and finished first. Give it more memory ({m.num_free_blocks} of {m.view.num_blocks} blocks free now; a "
            f"watermark of {m.watermark_blocks} blocks is kept back from admissions: watermark=0 for a probe)"
        )
    return engine


def time_decode_steps(
    make_engine: Callable[[], Any],
    prompt: list[int],
    sizes: list[int],
    device: torch.device | str,
    *,
    repeats: int = 5,
    progress: str | None = None,
) -> Measurement:
    """A decode step of ``k`` sequences for every ``k`` in ``sizes`` (variant ``str(k)``), each sequence with
    ``prompt`` as its context, on ``device``: one :func:`prefilled_engine` per size, then its steps timed by
    :func:`~lesson_utils.lab.timing.measure` - warm-up, alternating order, median and spread. The contexts grow by
    one token per step, the same for every size."""
    if not sizes or any(not isinstance(k, int) or k < 1 for k in sizes):
        raise ValueError(f"sizes must be positive ints, got {sizes!r}")
    engines = {str(k): prefilled_engine(make_engine, prompt, k, repeats) for k in sizes}
    sync = _sync(torch.device(device))
    return measure(
        {name: e.step for name, e in engines.items()}, repeats=repeats, warmup=1, sync=sync, progress=progress
    )


def time_equal_steps(
    make_engines: dict[str, Callable[[], Any]],
    prompt: list[int],
    k: int,
    device: torch.device | str,
    *,
    repeats: int = 5,
    progress: str | None = None,
) -> Measurement:
    """The same decode step - ``k`` sequences, each with ``prompt`` as its context - on every engine kind of
    ``make_engines`` (variant = its name), timed alternately: what one memory layout costs against another at equal
    batch size (lesson 07: the paged engine's gather against the naive engine's contiguous reads)."""
    engines = {name: prefilled_engine(f, prompt, k, repeats) for name, f in make_engines.items()}
    sync = _sync(torch.device(device))
    return measure(
        {name: e.step for name, e in engines.items()}, repeats=repeats, warmup=1, sync=sync, progress=progress
    )
