"""Lesson 08's exercise 3: a step's chunks as what the unified kernel reads (``query_start``, ``context_lens``,
``max_query_len``) - the values on every case, then the kernel itself run on the learner's tensors as given."""

from __future__ import annotations

import math
import random

import torch

from lesson_utils.cache.paged_metadata import step_metadata
from lesson_utils.core.types import is_int
from lesson_utils.serving.token_budget import Chunk

from .core import CheckResult, case_device, check_function, failed, passed, short, show_message


# ---- exercise 08-3: a step's chunks as the unified kernel's metadata -------------------------------------------
def _metadata_cases() -> list[tuple]:
    """Decodes, whole prompts, chunks that start after cached tokens (an earlier chunk or the prefix cache), mixed
    steps in scheduler order, a chunk of one that ends a prompt, seq ids out of order, and an empty step."""
    dev = case_device()
    cases = [
        [Chunk(0, 9, 10), Chunk(1, 4, 5)],  # two decodes
        [Chunk(3, 0, 7)],  # a whole prompt
        [Chunk(5, 16, 24)],  # a chunk after 16 cached tokens
        [Chunk(2, 30, 31), Chunk(0, 12, 13), Chunk(7, 8, 20), Chunk(4, 0, 5)],  # decodes, a chunk, a new prompt
        [Chunk(1, 40, 41), Chunk(6, 32, 33)],  # a prompt's last token (a chunk of one) beside a decode
        [],  # nothing runs
    ]
    rng = random.Random(83)
    for _ in range(6):
        n = rng.randrange(1, 7)
        chunks = []
        for sid in rng.sample(range(40), n):
            start = rng.choice([0, rng.randrange(1, 300)])
            chunks.append(Chunk(sid, start, start + rng.choice([1, 1, rng.randrange(2, 90)])))
        cases.append(chunks)
    return [(c, dev) for c in cases]


def _metadata_equal(expected, got) -> bool:
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return False
    (qs, cl, mq), (gqs, gcl, gmq) = expected, got
    tensors_ok = all(
        isinstance(g, torch.Tensor) and g.dtype == torch.int32 and g.device == e.device and g.shape == e.shape
        for g, e in ((gqs, qs), (gcl, cl))
    )
    dense = tensors_ok and gqs.is_contiguous() and gcl.is_contiguous()  # what the kernel reads, not only the values
    return dense and torch.equal(gqs, qs) and torch.equal(gcl, cl) and is_int(gmq) and gmq == mq


def _metadata_hint(case, expected, got) -> str:
    chunks, dev = case
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return "return three values: (query_start, context_lens, max_query_len)"
    qs, cl, mq = got
    if not all(isinstance(t, torch.Tensor) for t in (qs, cl)):
        return "query_start and context_lens are tensors the kernel reads (torch.tensor(..., dtype=..., device=...))"
    if qs.dtype != torch.int32 or cl.dtype != torch.int32:
        return (
            f"your tensors are {qs.dtype} and {cl.dtype}: the kernel loads them as 32-bit ints - what would it read "
            "from a tensor of another dtype?"
        )
    if qs.device != expected[0].device or cl.device != expected[0].device:
        return f"the kernel reads them on {expected[0].device}: where did you make them?"
    for what, t in (("query_start", qs), ("context_lens", cl)):
        if not t.is_contiguous():
            return (
                f"your {what} has the right values, but as a strided view (strides {tuple(t.stride())}) of another "
                "tensor: the kernel reads consecutive int32s from its first element, which are not these values. "
                "Build it as a tensor of its own"
            )
    lens = [c.end - c.start for c in chunks]
    if not chunks and qs.tolist() == [0] and cl.numel() == 0:
        return "an empty step: what is the longest of no chunks? (the grid then has no rows)"
    if qs.numel() == len(chunks):
        return (
            f"{len(chunks)} chunks need {len(chunks) + 1} query starts: where do chunk 0's rows start, and where do the "
            "last chunk's end?"
        )
    if cl.numel() == len(chunks) and cl.tolist() == lens:
        return (
            "your context_lens are the chunks' lengths: how many tokens does a sequence hold once this step has "
            "written - its cached tokens included?"
        )
    if cl.numel() == len(chunks) and cl.tolist() == [c.start for c in chunks]:
        return "your context_lens leave out this step's own tokens: they are written before the kernel runs"
    if qs.tolist() != expected[0].tolist():
        return "query_start counts rows of the step's flat batch: how many rows does each chunk add?"
    if not is_int(mq):
        return "max_query_len sizes the launch grid on the host: a Python int, not a tensor"
    if mq == sum(lens):
        return (
            "max_query_len is the longest chunk, not the step's total: the grid has one row of programs per tile of it"
        )
    return ""


def _kernel_on(metadata, chunks, dev) -> torch.Tensor:
    """The unified kernel's output for a small step of ``chunks``, reading ``metadata`` exactly as given."""
    from lesson_utils.kernels.unified_attention import unified_attention

    g = torch.Generator().manual_seed(8)
    block_size, heads, dim = 4, 2, 16
    per_seq = [math.ceil(c.end / block_size) for c in chunks]
    k = torch.randn(sum(per_seq) + 1, block_size, 1, dim, generator=g).to(dev)
    v = torch.randn(sum(per_seq) + 1, block_size, 1, dim, generator=g).to(dev)
    rows, at = [], 1
    for n in per_seq:
        rows.append(list(range(at, at + n)) + [0] * (max(per_seq) - n))
        at += n
    tables = torch.tensor(rows, dtype=torch.int32).to(dev)
    q = torch.randn(sum(c.end - c.start for c in chunks), heads, dim, generator=g).to(dev)
    qs, cl, mq = metadata
    return unified_attention(q, k, v, tables, qs, cl, mq).cpu()


def check_step_metadata(fn) -> CheckResult:
    """Exercise 08-3: query_start, context_lens and max_query_len from a step's chunks (what the kernel reads): the
    values on every case, then the kernel itself run on the learner's tensors as given for a small step (a view with
    the right values but other memory would make it read other lengths)."""
    result = check_function(
        "step_metadata",
        fn,
        step_metadata,
        _metadata_cases(),
        equal=_metadata_equal,
        show_input=lambda c: f"chunks {short(c[0])}, device {c[1]}",
        explain=_metadata_hint,
        arg_names=("chunks", "device"),
        quiet=True,
    )
    if not result.passed:
        show_message(result.message)
        return result
    dev = case_device()
    chunks = [Chunk(0, 5, 6), Chunk(3, 0, 4), Chunk(1, 3, 7), Chunk(2, 9, 10)]  # decodes, a prompt, a chunk
    want = _kernel_on(step_metadata(chunks, dev), chunks, dev)
    try:
        got = _kernel_on(fn(chunks, dev), chunks, dev)
    except Exception as err:  # noqa: BLE001 - the kernel's refusal of the learner's tensors is feedback
        return failed(
            "step_metadata", f"the unified kernel refused your tensors for {short(chunks)}: {err}", step_metadata
        )
    off = float((got - want).abs().max())
    if not off <= 1e-5:
        return failed(
            "step_metadata",
            f"your values are right, but the unified kernel reading your tensors for {short(chunks)} computes attention "
            f"{off:.3g} away from the reference's: it reads the memory a tensor starts at, not the values a view shows",
            step_metadata,
        )
    return passed(
        "step_metadata",
        f"all {len(_metadata_cases())} cases match the reference, and the unified kernel reading your tensors as given "
        "computes what it computes from the reference's.",
        fn,
    )
