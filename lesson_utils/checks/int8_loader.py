"""Lesson 10's exercise 3: the kernels' int8 tile loader, checked inside lesson 04's decode kernel and lesson 08's
unified kernel against the dequantize-then-attend references - and, in Triton's interpreter, by what it loads."""

from __future__ import annotations

import torch

from lesson_utils.cache import quantize as Q

from .core import CheckResult, case_device, failed, not_implemented, passed, short

# ---- exercise 3: the kernels' int8 tile loader --------------------------------------------------------------


def _loader_cases(device) -> list[dict]:
    cases = []
    for seed, (bs, kvh, group, d, lens, size) in enumerate(
        [
            (4, 1, 1, 16, [7, 1], 0.05),
            (8, 2, 2, 24, [17, 8, 3], 0.05),
            (16, 1, 4, 64, [33], 1e-7),  # scales far below the typical: an fp16 product loses them (subnormal there)
            (4, 2, 1, 80, [5, 12], 1e3),  # far above: 127 x 1e3 overflows fp16; the second table is full to its end
        ]
    ):
        g = torch.Generator().manual_seed(100 + seed)
        width = max(-(-c // bs) for c in lens)
        nb = len(lens) * width + 1
        ks = torch.rand(nb, bs, kvh, generator=g) * size
        vs = torch.rand(nb, bs, kvh, generator=g) * size
        tables = (torch.randperm(nb - 1, generator=g)[: len(lens) * width] + 1).view(len(lens), width)
        ks[int(tables[0, 0]), 0] = 0  # a zero scale (an all-zero vector)
        # block 0 is in no table: the lanes of tokens past a context point into it (their slot lookup is masked),
        # and its scales are NaN - a loader that reads them anyway turns the output NaN
        ks[0], vs[0] = float("nan"), float("nan")
        # queries shrunk where the values are huge: scores of about 1e6 (127 x 1e3 against unit queries) make a
        # softmax that fp32's rounding alone moves by 1 % on a GPU (the first GPU run saw 0.8 % for the course's own
        # loader); at 1/size the scores are tens, as in a model, and an fp16 product still overflows
        q_scale = 1.0 / size if size > 1 else 1.0
        cases.append(
            dict(
                q=(q_scale * torch.randn(len(lens), kvh * group, d, generator=g)).to(device),
                k=torch.randint(-127, 128, (nb, bs, kvh, d), generator=g, dtype=torch.int8).to(device),
                v=torch.randint(-127, 128, (nb, bs, kvh, d), generator=g, dtype=torch.int8).to(device),
                ks=ks.to(device),
                vs=vs.to(device),
                tables=tables.to(torch.int32).to(device),
                lens=torch.tensor(lens, dtype=torch.int32).to(device),
                size=size,
                shown=f"block_size={bs}, kv_heads={kvh}, query heads per kv head={group}, head_dim={d}, contexts={lens}, "
                f"scales up to {size:g}",
            )
        )
    return cases


_SHAPE_WORDS = ("incompatible dimensions", "make_shape_compatible", "broadcast", "shape")


def _loader_error(kernel: str, c: dict, err: BaseException) -> str:
    """Feedback for an exception raised by a kernel running the learner's loader: shape errors become a question."""
    text = str(err).splitlines()[-1][:300] if str(err) else type(err).__name__
    if any(word in str(err) for word in _SHAPE_WORDS):
        return (
            f"in {kernel}, on ({c['shown']}), the shapes in your loader do not combine ({text}). The tile is "
            "[TILE, HEAD_DIM_P] and the scales [TILE], one per row: to multiply each row by its own scale, what "
            "shape must the scales have, and which axis does Triton line up when two shapes differ?"
        )
    return f"in {kernel}, on ({c['shown']}), the kernel with your loader raised {type(err).__name__}: {text}"


def _non_finite(kernel: str, c: dict, got: torch.Tensor) -> str:
    """Feedback for a non-finite output: NaN (poison read past the data), or inf / -inf (an overflowing product)."""
    if bool(torch.isnan(got).any()) and c["size"] <= 1:
        return (
            f"in {kernel}, on ({c['shown']}): the output holds NaN. In this check NaN sits only in the scales of a "
            "block no sequence owns (the lanes of tokens past the context point into it; in a real cache it holds "
            "whatever is there), so your loader read one of those (or made a NaN itself, 0 x inf or 0 / 0): which "
            "scale does each row of your tile read, and which mask guards each of your two loads?"
        )
    return (
        f"in {kernel}, on ({c['shown']}): the output holds NaN, inf or -inf, though every scale your tile should "
        f"read is finite (values up to 127 x {c['size']:g} = {127 * c['size']:,.6g} here): in which dtype does your "
        "tile hold them, and what is that dtype's largest number?"
    )


def _loader_mistake(fn_out, c) -> str:
    no_scale = Q.int8_paged_attention_reference(
        c["q"], c["k"], c["v"], torch.ones_like(c["ks"]), torch.ones_like(c["vs"]), c["tables"], c["lens"]
    )
    if torch.allclose(fn_out.float(), no_scale.float(), rtol=1e-3, atol=1e-3):
        return "the values come out as if every scale were 1: where do the scales (scale_ptrs) enter your tile?"
    if c["size"] < 1e-3:
        return (
            "these scales are near 1e-7 (a K or V whose largest value is about 1e-5): in which dtype is your product "
            "computed, and can that dtype hold 1e-7 to three digits? (fp16's smallest normal number is 6.1e-5)"
        )
    return "compare one token's row: value x scale of THAT token (scale_ptrs[i] belongs to row i of the tile)"


def _reads_outside_the_context(fn, reference, c: dict) -> str:
    """In Triton's interpreter: '' when ``fn`` loads no K/V value or scale that the reference loader leaves alone,
    else what it read. A masked-off lane's value cannot change the output here - int8 values are always finite and
    the masked scale that multiplies them is 0 - so the output cannot show an unmasked value load; the count of what
    the kernel loaded (:mod:`lesson_utils.lab.kernel_reads`) does. On a GPU there is no such count (the compiled
    kernel reads silently, and past the end of the cache it is an illegal address): there the check is skipped.
    What it cannot see either: a masked load without ``other=`` reads zeros in the interpreter and undefined values on
    a GPU (a NaN there times a masked scale of 0 is NaN) - the spec's "masked tokens read 0 and scale 0" says why
    ``other=0`` is part of the answer, and the hint for a NaN output asks about it."""
    from lesson_utils.core.env import triton_interpreted
    from lesson_utils.kernels.int8_kv import int8_paged_attention_decode
    from lesson_utils.lab.kernel_reads import count_reads

    if not triton_interpreted() or c["k"].device.type != "cpu":
        return ""
    tensors = (c["k"], c["v"], c["ks"], c["vs"])
    counted = []
    for loader in (reference, fn):
        with count_reads(*tensors) as reads:
            int8_paged_attention_decode(c["q"], *tensors, c["tables"], c["lens"], load_fn=loader)
        counted.append(reads)
    for what, ref, got in zip(("K values", "V values", "K scales", "V scales"), *counted):
        extra = int(((got > 0) & (ref == 0)).sum())
        if extra:
            return (
                f"on ({c['shown']}) your loader read {extra} {what} the mask turns off (tokens past the context, or "
                "columns past head_dim). The output cannot show it here, but on a GPU those are reads of memory the "
                "sequence does not own - past the cache's end, an illegal address. Which mask guards each of your loads?"
            )
    return ""


def check_load_int8_tile(fn, quiet: bool = False) -> CheckResult:
    """Exercise 10-3: a ``@triton.jit`` ``load_int8_tile(ptrs, scale_ptrs, mask, token_mask)`` -> the fp32 tile,
    run inside lesson 04's decode kernel and lesson 08's unified kernel against the dequantize-then-attend
    references, with scales from 1e-7 to 1e3, NaN poison in the block that the lanes past each context point at,
    and one table full to its last slot; in the interpreter, also what it loads (an unmasked value load reads memory
    past the context that no output can show: see :func:`_reads_outside_the_context`). Every kernel call is guarded:
    a learner's error becomes feedback."""
    from lesson_utils.kernels.int8_kv import int8_paged_attention_decode, int8_unified_attention

    name = "load_int8_tile"
    if not hasattr(fn, "fn") and not callable(fn):
        return failed(name, f"expected a @triton.jit function, got {type(fn).__name__}", None, quiet)
    if not hasattr(fn, "fn"):
        return failed(name, "decorate your function with @triton.jit: the kernels call it on the GPU", None, quiet)
    from lesson_utils.kernels.int8_kv import load_int8_tile

    def run(kernel: str, c: dict, call, want: torch.Tensor, hint) -> CheckResult | None:
        try:
            got = call()
        except NotImplementedError:
            return not_implemented(name, load_int8_tile, quiet)
        except Exception as err:  # noqa: BLE001 - a learner's kernel error is feedback
            if "NotImplementedError" in str(err):
                return not_implemented(name, load_int8_tile, quiet)
            return failed(name, _loader_error(kernel, c, err), load_int8_tile, quiet)
        if not bool(torch.isfinite(got).all()):
            return failed(name, _non_finite(kernel, c, got), load_int8_tile, quiet)
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
        if not err <= 1e-3:  # NaN included
            return failed(
                name,
                f"in {kernel}, on ({c['shown']}): relative error {err:.3g} against dequantize-then-attend (at most "
                f"1e-3 expected)\n    first row expected: {short(want.flatten()[:6])}\n    got:               "
                f"{short(got.flatten()[:6])}\n    hint: {hint(got)}",
                load_int8_tile,
                quiet,
            )
        return None

    decode = "lesson 04's decode kernel"
    for c in _loader_cases(case_device()):
        want = Q.int8_paged_attention_reference(c["q"], c["k"], c["v"], c["ks"], c["vs"], c["tables"], c["lens"])
        bad = run(
            decode, c,
            lambda c=c: int8_paged_attention_decode(
                c["q"], c["k"], c["v"], c["ks"], c["vs"], c["tables"], c["lens"], load_fn=fn
            ),
            want, lambda got, c=c: _loader_mistake(got, c),
        )  # fmt: skip
        if bad is not None:
            return bad
    for c in _loader_cases(case_device())[:2]:  # past each context; and past head_dim 24 (its tile is 32 wide)
        unmasked = _reads_outside_the_context(fn, load_int8_tile, c)
        if unmasked:
            return failed(name, f"in {decode}: {unmasked}", load_int8_tile, quiet)
    c = _loader_cases(case_device())[1]  # chunks and decodes through the unified kernel
    starts = torch.tensor([0, 1, 3, 4], dtype=torch.int32, device=c["q"].device)
    q = torch.cat([c["q"][:1], c["q"][1:2].expand(2, -1, -1), c["q"][2:]]).contiguous()
    want = Q.int8_unified_attention_reference(q, c["k"], c["v"], c["ks"], c["vs"], c["tables"], starts, c["lens"])
    bad = run(
        "lesson 08's unified kernel", c,
        lambda: int8_unified_attention(
            q, c["k"], c["v"], c["ks"], c["vs"], c["tables"], starts, c["lens"], 2, load_fn=fn
        ),
        want, lambda got: "the decode kernel matched: what differs when a sequence brings several query rows?",
    )  # fmt: skip
    if bad is not None:
        return bad
    return passed(
        name,
        "lesson 04's decode kernel (4 geometries, scales from 1e-7 to 1e3) and lesson 08's unified kernel match "
        "dequantize-then-attend.",
        fn,
        quiet,
    )
