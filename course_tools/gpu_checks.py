"""What a GPU run measures besides the notebooks (issue 23): each part takes its device, sizes and timer as
arguments, so the same code runs on a CPU in the tests (tiny sizes, the Triton interpreter, the device-discipline
mode's sync counter) and on CUDA in :mod:`course_tools.gpu_run` (real sizes, ``triton.testing.do_bench``,
``torch.cuda.set_sync_debug_mode``).

* :func:`copy_bandwidth` - the device's measured copy bandwidth, the yardstick for the kernels;
* :func:`decode_kernel_bench` - lesson 04's kernel (both variants) against gather + SDPA and contiguous SDPA, by
  context length: time, K/V bytes read per second, and that as a share of the copy bandwidth;
* :func:`unified_kernel_bench` - lesson 08's kernel against lesson 04's on decodes and gather + SDPA on chunks;
* :func:`engine_kinds` and :func:`syncs_per_step` - every engine the course builds, and the syncs of each step;
* :func:`identity_stats` - every engine's outputs under the identity rule, threshold calibrated in the run.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

Timer = Callable[[Callable[[], object]], tuple[float, float, float]]  # fn -> (median, low, high) ms per call


def perf_counter_timer(repeats: int = 3) -> Timer:
    """A host-clock timer for a CPU (tests): (median, min, max) of ``repeats`` calls after one warm-up, in ms."""

    def timer(fn) -> tuple[float, float, float]:
        fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples), min(samples), max(samples)

    return timer


def do_bench_timer() -> Timer:
    """Triton's benchmark on a GPU (warm-up, many repeats, the cache flushed): (median, p10, p90) in ms."""
    from triton.testing import do_bench

    return lambda fn: tuple(do_bench(fn, quantiles=[0.5, 0.1, 0.9]))


def copy_bandwidth(device, timer: Timer, mib: int = 256) -> float:
    """GB/s of a device-to-device copy of ``mib`` MiB (read + write counted, as the kernels' reads are)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))[0]
    return 2 * src.numel() / (ms * 1e-3) / 1e9


@dataclass(frozen=True)
class KernelRow:
    """One way of computing one case: its time, and the K/V bytes it must read per second of that time."""

    kernel: str
    case: str  # e.g. "decode, 32 seqs x 1024 tokens"
    context: int
    ms: float  # median
    ms_low: float  # the timer's spread: min / p10
    ms_high: float  # max / p90
    gb_per_s: float
    share_of_copy: float  # gb_per_s over the measured copy bandwidth
    max_error: float  # against gather + SDPA (or lesson 04's kernel), checked once before timing


def _decode_inputs(batch, context, heads, head_dim, block_size, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = batch * -(-context // block_size)
    kc = torch.randn(nb, block_size, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    vc = torch.randn(nb, block_size, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    tables = torch.randperm(nb, generator=g).view(batch, -1).to(dtype=torch.int32, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    return q, kc, vc, tables, lens


def _gather_sdpa_decode(q, kc, vc, tables, context):
    k = kc[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)  # [batch, heads, context, d]
    v = vc[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0]


def _decode_ways(q, kc, vc, tables, lens, context) -> dict[str, Callable[[], torch.Tensor]]:
    from lesson_utils.kernels import paged_attention as kernels

    kcont = kc[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    vcont = vc[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def paged(variant):
        return lambda: kernels.paged_attention_decode(q, kc, vc, tables, lens, variant=variant, validate=False)

    ways = {f"paged ({v})": paged(v) for v in kernels.VARIANTS}
    ways["gather + SDPA"] = lambda: _gather_sdpa_decode(q, kc, vc, tables, context)
    ways["contiguous SDPA"] = lambda: sdpa(q[:, :, None], kcont, vcont)[:, :, 0]
    return ways


def decode_kernel_bench(
    device, dtype, timer: Timer, copy_gbs: float, *, batch=32, contexts=(256, 1024, 4096), heads=12, head_dim=64,
    block_size=16,
) -> list[KernelRow]:  # fmt: skip
    """Lesson 04's decode kernel (simple and tiled, and tiled over lesson 10's int8 cache) against gather + SDPA and
    contiguous SDPA (no paging: the lower bound), ``batch`` sequences per context length. Bytes: K and V of every
    context token, one layer (int8: 1 byte per value and a 4-byte scale per head)."""
    rows = []
    for context in contexts:
        q, kc, vc, tables, lens = _decode_inputs(batch, context, heads, head_dim, block_size, dtype, device)
        ways = _decode_ways(q, kc, vc, tables, lens, context)
        want = ways["gather + SDPA"]().float()
        nbytes = 2 * batch * context * heads * head_dim * kc.element_size()
        case = f"decode, {batch} seqs x {context} tokens"
        for name, fn in ways.items():
            error = float((fn().float() - want).abs().max())
            ms, low, high = timer(fn)
            gbs = nbytes / (ms * 1e-3) / 1e9
            rows.append(KernelRow(name, case, context, ms, low, high, gbs, gbs / copy_gbs, error))
        rows.append(_int8_decode_row(q, kc, vc, tables, lens, case, context, timer, copy_gbs))
    return rows


def gqa_decode_bench(
    device, dtype, timer: Timer, copy_gbs: float, *, batch=32, contexts=(1024, 4096), query_heads=9, kv_heads=3,
    head_dim=64, block_size=16,
) -> list[KernelRow]:  # fmt: skip
    """Lesson 04's decode kernel at a grouped-query geometry (default SmolLM2-135M's: 9 query heads over 3 KV heads
    of 64) against gather + SDPA on K/V repeated per query head. Bytes: what one step must read - K and V of every
    context token for the KV heads, each byte of a group once (the kernel's load count, tests/kernels)."""
    rows = []
    group = query_heads // kv_heads
    for context in contexts:
        _, kc, vc, tables, lens = _decode_inputs(batch, context, kv_heads, head_dim, block_size, dtype, device)
        q = torch.randn(batch, query_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(
            dtype=dtype, device=device
        )
        nbytes = 2 * batch * context * kv_heads * head_dim * kc.element_size()
        krep, vrep = kc.repeat_interleave(group, dim=2), vc.repeat_interleave(group, dim=2)
        ways = {
            f"GQA {query_heads}:{kv_heads} paged ({v})": _paged(q, kc, vc, tables, lens, v) for v in ("simple", "tiled")
        }
        gathered = f"GQA {query_heads}:{kv_heads} gather + SDPA, K/V repeated"
        ways[gathered] = functools.partial(_gather_sdpa_decode, q, krep, vrep, tables, context)
        want = ways[gathered]().float()
        case = f"decode, {batch} seqs x {context} tokens, {nbytes / 1e6:.1f} MB of K/V per step"
        for name, fn in ways.items():
            error = float((fn().float() - want).abs().max())
            ms, low, high = timer(fn)
            gbs = nbytes / (ms * 1e-3) / 1e9
            rows.append(KernelRow(name, case, context, ms, low, high, gbs, gbs / copy_gbs, error))
    return rows


def _paged(q, kc, vc, tables, lens, variant):
    from lesson_utils.kernels import paged_attention as kernels

    return lambda: kernels.paged_attention_decode(q, kc, vc, tables, lens, variant=variant, validate=False)


def _int8_decode_row(q, kc, vc, tables, lens, case, context, timer, copy_gbs) -> KernelRow:
    """Lesson 10: the same decode over the cache quantized to int8 (its bytes: 1 per value and 4 per scale), checked
    against dequantize-then-attend."""
    from lesson_utils.cache import quantize as Q
    from lesson_utils.kernels.int8_kv import int8_paged_attention_decode

    kq, ks = Q.quantize_kv(kc)
    vq, vs = Q.quantize_kv(vc)
    want = Q.int8_paged_attention_reference(q, kq, vq, ks, vs, tables, lens).float()

    def fn():
        return int8_paged_attention_decode(q, kq, vq, ks, vs, tables, lens, validate=False)

    error = float((fn().float() - want).abs().max())
    ms, low, high = timer(fn)
    batch, heads, head_dim = q.shape[0], kc.shape[2], kc.shape[3]
    gbs = 2 * batch * context * heads * (head_dim + 4) / (ms * 1e-3) / 1e9
    return KernelRow("paged int8 (tiled)", case, context, ms, low, high, gbs, gbs / copy_gbs, error)


def unified_kernel_bench(
    device, dtype, timer: Timer, copy_gbs: float, *, cases=((32, 1, 1024), (32, 1, 4096), (4, 256, 1024)), heads=12,
    head_dim=64, block_size=16,
) -> list[KernelRow]:  # fmt: skip
    """Lesson 08's unified kernel against lesson 04's kernel on decodes (query length 1) and gather + SDPA on chunks,
    per ``(seqs, query_len, context)``: :func:`lesson_utils.lab.kernel_timing.time_unified_kernel`, with bytes."""
    from lesson_utils.lab.kernel_timing import time_unified_kernel

    spreads = []  # time_unified_kernel takes a median-only timer: keep each call's (median, low, high) in call order

    def median_only(fn) -> float:
        spreads.append(timer(fn))
        return spreads[-1][0]

    rows = []
    timings = time_unified_kernel(
        cases, heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype, device=device, timer=median_only
    )
    for i, t in enumerate(timings):
        nbytes = 2 * t.seqs * t.context * heads * head_dim * torch.empty((), dtype=dtype).element_size()
        case = f"{'decode' if t.query_len == 1 else f'chunk of {t.query_len}'}, {t.seqs} seqs x {t.context} tokens"
        for name, (ms, low, high) in (("unified", spreads[2 * i]), (t.baseline, spreads[2 * i + 1])):
            gbs = nbytes / (ms * 1e-3) / 1e9
            rows.append(KernelRow(name, case, t.context, ms, low, high, gbs, gbs / copy_gbs, t.max_error))
    return rows


# ---- engines ------------------------------------------------------------------------------------------------


def engine_kinds(w) -> Iterator[tuple[str, object]]:
    """Every engine kind of the course's registry (:data:`lesson_utils.lab.engine_kinds.ENGINE_KINDS`), on ``w``'s
    device and dtype, as ``(name, engine)``: 40 blocks of 16 each; the kinds kept short of memory get 7, so that a
    longer workload preempts them (by recompute, by swap); the contiguous one reserves 64 tokens a request."""
    from lesson_utils.lab.engine_kinds import ENGINE_KINDS

    for kind in ENGINE_KINDS:
        yield (
            kind.name,
            kind.build(w, num_blocks=40, block_size=16, short_blocks=7, budget=8, swap_blocks=40, max_seq_len=64),
        )


def is_preempted(name: str) -> bool:
    """Whether the kind called ``name`` is kept short of memory (it is served the longer, preempting workload)."""
    from lesson_utils.lab.engine_kinds import engine_kind

    return engine_kind(name).short


def is_exact(name: str) -> bool:
    """Whether the kind called ``name`` is held to the identity rule (a quantized cache is compared under a bound)."""
    from lesson_utils.lab.engine_kinds import engine_kind

    return engine_kind(name).exact


@contextlib.contextmanager
def cuda_sync_counter() -> Iterator[list]:
    """Counts CUDA's own record of synchronizing calls (``torch.cuda.set_sync_debug_mode("warn")``): yields a list
    that holds one warning message per sync once the block ends. Refuses, saying so, where there is no CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA sync counter needs CUDA: on a CPU, count with discipline_sync_counter()")
    found: list = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found.extend(str(c.message) for c in caught if "synchroniz" in str(c.message).lower())


@contextlib.contextmanager
def discipline_sync_counter() -> Iterator[list]:
    """The device-discipline mode's count (a CPU standing for the GPU), in the same shape as :func:`cuda_sync_counter`."""
    from lesson_utils.core import device_discipline as dd

    found: list = []
    with dd.count_syncs() as c:
        yield found
    found.extend(c.why)


@dataclass(frozen=True)
class StepSyncs:
    """One engine's syncs per step over a workload, and what caused the worst step's."""

    engine: str
    steps: int
    max_per_step: int
    median_per_step: float
    swap_out_steps: int  # steps that swapped blocks out (each waits once, on purpose)
    worst: tuple[str, ...]


def syncs_per_step(name: str, engine, prompts, max_new_tokens: int, counter) -> StepSyncs:
    """Serve ``prompts`` step by step, counting each step's syncs with ``counter`` (a context manager factory
    yielding a list, as :func:`cuda_sync_counter`). A step that swaps out counts one sync less: that wait is
    deliberate (the staging buffer must land before the host reads it) and reported apart."""
    for p in prompts:
        engine.add_request(p, max_new_tokens)
    counts, worst, swap_steps = [], (), 0
    space = engine.scheduler.swap_space
    while engine.scheduler.has_work:
        before = space.blocks_out if space is not None else 0
        with counter() as found:
            engine.step()
        swapped = space is not None and space.blocks_out > before
        swap_steps += swapped
        n = len(found) - swapped
        if not counts or n > max(counts):
            worst = tuple(found)
        counts.append(n)
    return StepSyncs(name, len(counts), max(counts), statistics.median(counts), swap_steps, worst)


@dataclass(frozen=True)
class IdentityStats:
    engine: str
    summary: str  # IdentityReport.summary(): verdicts, threshold, the share of steps it could excuse
    ok: bool
    identical: int
    near_ties: int
    different: int
    threshold: float
    excusable_share: float | None


def identity_stats(model, w, prompts, max_new_tokens: int, *, references=None) -> list[IdentityStats]:
    """Every exact engine kind's greedy outputs against HF ``generate`` under the identity rule, the threshold calibrated
    in the run (:func:`lesson_utils.lab.identity.compare_all` with ``w``); quantized kinds are lesson 10's business."""
    from lesson_utils.lab import identity

    if references is None:
        references = [identity.hf_greedy(model, p, max_new_tokens, w.eos_token_id) for p in prompts]
    out = []
    for name, engine in engine_kinds(w):
        if not is_exact(name):
            continue
        got = engine.generate(prompts, max_new_tokens)
        report = identity.compare_all(model, prompts, references, got, w=w)
        cal = report.calibration
        out.append(
            IdentityStats(
                name,
                report.summary(),
                report.ok,
                report.identical,
                report.near_ties,
                report.different,
                report.comparisons[0].threshold,
                cal.excusable_share if cal else None,
            )  # fmt: skip
        )
    return out
