"""When are two greedy outputs "the same"? One rule for every notebook and test that compares with HF.

Greedy decoding picks the larger of the top two logits. Two correct implementations that round differently
(another attention kernel, another batch shape and so another matmul algorithm, fp16 instead of fp32) agree
on every token until a step where those two logits are so close that rounding decides - a *near-tie* - and
from there on they continue two different, equally valid texts. So:

* compare token by token; identical outputs are ``identical``;
* at the first token that differs, ask Hugging Face's model for its top-2 logit margin at that step (one
  forward over the prompt and the tokens both agreed on). Below :func:`near_tie_threshold` the divergence is
  accepted and reported as ``near-tie`` ("diverged at a near-tie after N tokens"), never hidden;
* after an accepted divergence the two texts differ, so the reference says nothing more: every later token of
  the output is checked on the output's own prefix instead (teacher-forced, one HF forward over prompt +
  output): it must be HF's greedy choice there, or lose to it by less than the threshold (another near-tie,
  counted). A K/V bug flips the nearest ties first and so could hide behind the first divergence; it cannot
  hide behind every later token too (issue 23);
* a divergence at a clear margin, or an output that stops early or runs on, is ``different``: a bug.

Thresholds, by the model's dtype (the margin is a difference of logits, which for OPT-125m reach about 30):

* fp32: ``1e-4``. fp32 carries 24 bits; two summation orders of a 768-wide dot product differ by about
  ``1e-6`` of its size. On a CPU in fp32 this makes the rule "every token", except at a genuine tie.
* fp16: ``0.25``. fp16 carries 11 bits: a logit near 16-32 is stored to the nearest 1/64 (0.016), and a
  12-layer residual stream computed by other kernels drifts by several of those steps. A choice, not a GPU
  measurement: it leaves a wide margin over what rounding does on a CPU in fp16 (:func:`calibrate` measures that
  drift in a run; ``tests/core/test_identity_calibration.py`` holds it under a fifth of 0.25), so that a correct
  engine on a T4 does not stop a lesson.
* bf16: ``1.0`` (8 bits: the nearest 1/8 at 16-32, eight times fp16's step).

A bug that corrupts K/V usually shows up at a step with a clear margin, so the rule still catches it; a
threshold only excuses divergences at steps that rounding could decide. The fixed fp16 threshold is a choice:
:func:`calibrate` measures instead what rounding does in the run (the course's forward against HF's, teacher-
forced) and returns the threshold that justifies, and the share of steps it could excuse. The notebooks pass
the model's ``w`` to :func:`compare_all` / :func:`compare_with_hf`, which then calibrate and print both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lesson_utils.core.progress import busy

NEAR_TIE = {torch.float32: 1e-4, torch.float16: 0.25, torch.bfloat16: 1.0}

IDENTICAL, NEAR_TIE_VERDICT, DIFFERENT = "identical", "near-tie", "different"


def near_tie_threshold(dtype: torch.dtype) -> float:
    """The top-2 logit margin below which rounding may decide a greedy token, for a model in ``dtype``."""
    try:
        return NEAR_TIE[dtype]
    except KeyError:
        raise ValueError(f"no near-tie threshold for {dtype}; the course runs fp32, fp16 or bf16") from None


def _model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


def hf_greedy(
    model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None, pad_token_id: int = 1
) -> list[int]:
    """Hugging Face ``generate``'s greedy continuation of one unpadded prompt, cut right after the first eos."""
    device, _ = _model_device_dtype(model)
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
    tokens = out[0, len(prompt) :].tolist()
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens


def hf_margin(model, prompt: list[int], generated: list[int]) -> float:
    """HF's top-1 minus top-2 logit for the token after ``prompt + generated``: one forward, no cache."""
    device, _ = _model_device_dtype(model)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(prompt) + list(generated)], device=device)).logits[0, -1]
    top2 = logits.float().topk(2).values
    return float(top2[0] - top2[1])


@dataclass(frozen=True)
class Comparison:
    """One prompt's verdict under the rule (module docstring)."""

    verdict: str  # IDENTICAL, NEAR_TIE_VERDICT or DIFFERENT
    agreed: int  # tokens identical before the first difference (all of them when identical)
    margin: float | None  # HF's top-2 margin where the outputs first differ (None if they never do)
    threshold: float
    detail: str = ""
    later_ties: int = 0  # tokens after the divergence that were not HF's choice on the output's prefix, by a near-tie

    @property
    def ok(self) -> bool:
        return self.verdict != DIFFERENT

    def describe(self) -> str:
        if self.verdict == IDENTICAL:
            return f"identical ({self.agreed} tokens)"
        if self.verdict == NEAR_TIE_VERDICT:
            later = f"; {self.later_ties} later near-tie(s) on its own text" if self.later_ties else ""
            return (
                f"diverged at a near-tie after {self.agreed} tokens (HF's top-2 margin {self.margin:.2g} < "
                f"{self.threshold:g}){later}"
            )
        return f"DIFFERENT after {self.agreed} tokens: {self.detail}"


def compare(
    model, prompt: list[int], reference: list[int], got: list[int], *, threshold: float | None = None
) -> Comparison:
    """Apply the rule to one prompt: ``reference`` (HF's, or a reference engine's) against ``got``."""
    _, dtype = _model_device_dtype(model)
    threshold = near_tie_threshold(dtype) if threshold is None else threshold
    reference, got = list(reference), list(got)
    agreed = 0
    while agreed < min(len(reference), len(got)) and reference[agreed] == got[agreed]:
        agreed += 1
    if agreed == len(reference) == len(got):
        return Comparison(IDENTICAL, agreed, None, threshold)
    if agreed == min(len(reference), len(got)):  # one output is a strict prefix of the other
        return Comparison(
            DIFFERENT,
            agreed,
            None,
            threshold,
            f"one output stops after {agreed} tokens, the other goes on to {max(len(reference), len(got))}",
        )
    margin = hf_margin(model, prompt, reference[:agreed])
    if margin < threshold:
        return _check_own_text(model, prompt, got, agreed, margin, threshold)
    return Comparison(
        DIFFERENT,
        agreed,
        margin,
        threshold,
        f"token {agreed} is {got[agreed]} instead of {reference[agreed]}, where HF's top-2 margin is "
        f"{margin:.3g} (a near-tie would be below {threshold:g})",
    )


def _check_own_text(
    model, prompt: list[int], got: list[int], agreed: int, margin: float, threshold: float
) -> Comparison:
    """After a near-tie divergence at token ``agreed``: every later token of ``got`` must be HF's greedy choice on
    ``got``'s own prefix, or lose to it by less than ``threshold`` (teacher-forced, one forward)."""
    later = range(agreed, len(got))  # the diverging token itself too: it must be HF's runner-up or as close
    device, _ = _model_device_dtype(model)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(prompt) + list(got)], device=device)).logits[0].float()
    # row len(prompt) + j - 1 predicts token j of the output
    rows = logits[len(prompt) + agreed - 1 : len(prompt) + len(got) - 1]
    chosen = torch.tensor([got[j] for j in later], device=rows.device)
    gap = (rows.max(dim=-1).values - rows.gather(1, chosen[:, None])[:, 0]).tolist()
    best = rows.argmax(dim=-1).tolist()
    ties = 0
    for j, g, b in zip(later, gap, best):
        if g >= threshold:
            return Comparison(
                DIFFERENT,
                agreed,
                margin,
                threshold,
                f"diverged at a near-tie after {agreed} tokens, but then token {j} is {got[j]} where HF, fed this "
                f"output's own first {j} tokens, picks {b} by a margin of {g:.3g} (a near-tie would be below "
                f"{threshold:g})",
                ties,
            )
        ties += j > agreed and g > 0
    return Comparison(NEAR_TIE_VERDICT, agreed, margin, threshold, later_ties=ties)


@dataclass
class IdentityReport:
    """Verdicts for a set of prompts; ``summary()`` is what a notebook prints."""

    comparisons: list[Comparison] = field(default_factory=list)
    calibration: "Calibration | None" = None  # set when the threshold was calibrated in this run

    @property
    def identical(self) -> int:
        return sum(c.verdict == IDENTICAL for c in self.comparisons)

    @property
    def near_ties(self) -> int:
        return sum(c.verdict == NEAR_TIE_VERDICT for c in self.comparisons)

    @property
    def different(self) -> int:
        return sum(c.verdict == DIFFERENT for c in self.comparisons)

    @property
    def ok(self) -> bool:
        """No divergence except at near-ties."""
        return self.different == 0

    def summary(self) -> str:
        n = len(self.comparisons)
        text = f"{self.identical}/{n} token-identical"
        if self.near_ties:
            text += (
                f", {self.near_ties} diverged at a near-tie ("
                + "; ".join(
                    f"prompt {i} after {c.agreed} tokens, margin {c.margin:.2g}"
                    for i, c in enumerate(self.comparisons)
                    if c.verdict == NEAR_TIE_VERDICT
                )
                + ")"
            )
        text += f", {self.different} different"
        if self.comparisons:
            text += f" (near-tie threshold {self.comparisons[0].threshold:.3g}"
            if self.calibration is not None:
                c = self.calibration
                text += (
                    f", calibrated in this run: {100 * c.excusable_share:.1f} % of {c.steps} steps could be excused;"
                    f" the fixed {c.fixed_threshold:g}: {100 * c.fixed_excusable_share:.1f} %"
                )
            text += ")"
        return text

    def failures(self) -> str:
        return "\n".join(f"prompt {i}: {c.describe()}" for i, c in enumerate(self.comparisons) if not c.ok)


def compare_all(
    model,
    prompts: list[list[int]],
    references: list[list[int]],
    outputs: list[list[int]],
    *,
    threshold: float | None = None,
    w=None,
    progress: bool = True,
) -> IdentityReport:
    """The rule over several prompts (same order in all three lists). With ``w`` (the course's weights (``weights_from_hf``) of
    ``model``) and no ``threshold``, the threshold is calibrated on these prompts and references
    (:func:`calibrate`) and the report says what share of steps it could excuse. ``progress``: a clock that moves
    while the reference model reruns every prompt (seconds on a CPU)."""
    if not (len(prompts) == len(references) == len(outputs)):
        raise ValueError(f"{len(prompts)} prompts, {len(references)} references and {len(outputs)} outputs")
    calibration = None
    with busy(f"checking {len(prompts)} answers with the identity rule", show=progress):
        if w is not None and threshold is None:
            calibration = calibrate(
                model, w, [list(p) + list(r) for p, r in zip(prompts, references) if len(p) + len(r) > 1]
            )
            threshold = calibration.threshold
        compared = [compare(model, p, r, o, threshold=threshold) for p, r, o in zip(prompts, references, outputs)]
    return IdentityReport(compared, calibration)


def compare_with_hf(
    model,
    prompts: list[list[int]],
    outputs: list[list[int]],
    max_new_tokens: int,
    eos_token_id: int | None,
    *,
    progress: bool = True,
    threshold: float | None = None,
    w=None,
) -> IdentityReport:
    """Run HF ``generate`` on every prompt and apply the rule to ``outputs`` (the course engine's); ``w``
    calibrates the threshold as in :func:`compare_all`."""
    it = prompts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(prompts, desc="HF generate", leave=False)
    references = [hf_greedy(model, p, max_new_tokens, eos_token_id) for p in it]
    return compare_all(model, prompts, references, outputs, threshold=threshold, w=w)


# ---- calibration: the threshold this run's rounding needs (issue 23) -----------------------------------------

CALIBRATION_SAFETY = 4.0  # the margin a flip needs is at most 2 x max |delta logit|; x4 more for other kernels
CALIBRATION_FLOOR = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@dataclass(frozen=True)
class Calibration:
    """What rounding does to the logits in this run, and the near-tie threshold it justifies.

    ``max_delta`` is the largest |course logit - HF logit| over every position and vocabulary entry of the
    calibration sequences, teacher-forced (both forwards see the same tokens). Two implementations can only
    pick different greedy tokens where HF's top-2 margin is below ``|delta_top1| + |delta_top2| <= 2 x
    max_delta``; ``threshold`` is that times :data:`CALIBRATION_SAFETY` (other kernels and batch shapes round
    differently again), never below the dtype's floor. ``excusable_share`` is the share of the sequences'
    steps whose HF margin is below the threshold: the steps at which the rule could excuse a difference."""

    dtype: torch.dtype
    max_delta: float
    threshold: float
    excusable_share: float
    steps: int
    fixed_threshold: float  # the dtype's fixed threshold (NEAR_TIE), for comparison
    fixed_excusable_share: float

    def text(self) -> str:
        d = str(self.dtype).removeprefix("torch.")
        return (
            f"calibrated near-tie threshold {self.threshold:.3g} ({d}: the course's forward and HF's differ by at most "
            f"{self.max_delta:.2g} per logit over {self.steps} teacher-forced steps, x 2 x {CALIBRATION_SAFETY:g}); "
            f"{100 * self.excusable_share:.1f} % of those steps have a top-2 margin below it and could be excused "
            f"(with the fixed {self.fixed_threshold:g}: {100 * self.fixed_excusable_share:.1f} %)"
        )


def course_logits(w, ids: list[int]) -> torch.Tensor:
    """The course's forward (dense cache) over ``ids``, teacher-forced: ``[len(ids), vocab]``."""
    from lesson_utils.cache.dense import DenseKVCache
    from lesson_utils.cache.seam import StepBatch
    from lesson_utils.model.weights import forward

    t = torch.tensor(ids, device=w.device)
    batch = StepBatch([0], [len(ids)], [len(ids)], t, torch.arange(len(ids), device=w.device))
    return forward(w, batch, DenseKVCache(len(w.layers)), last_only=False)


_CALIBRATIONS: dict[tuple, Calibration] = {}  # a notebook compares several engines on the same tokens: measure once


def calibrate(model, w, sequences: list[list[int]], *, safety: float = CALIBRATION_SAFETY) -> Calibration:
    """Measure this run's rounding on ``sequences`` (prompts with their reference continuations) and return the
    threshold it justifies (:class:`Calibration`). The same model, weights and sequences are measured once."""
    if not sequences or any(len(s) < 2 for s in sequences):
        raise ValueError("calibration needs sequences of at least two tokens")
    key = (id(model), w.lm_head.data_ptr(), safety, tuple(tuple(int(t) for t in s) for s in sequences))
    if key not in _CALIBRATIONS:
        if len(_CALIBRATIONS) > 16:
            _CALIBRATIONS.clear()
        _CALIBRATIONS[key] = _measure(model, w, sequences, safety)
    return _CALIBRATIONS[key]


def _measure(model, w, sequences: list[list[int]], safety: float) -> Calibration:
    device, dtype = _model_device_dtype(model)
    deltas, margins = [], []
    with torch.inference_mode():
        for ids in sequences:
            hf = model(input_ids=torch.tensor([list(ids)], device=device)).logits[0].float()
            ours = course_logits(w, list(ids)).float()
            deltas.append(float((hf - ours).abs().max()))
            top2 = hf.topk(2, dim=-1).values
            margins.append(top2[:, 0] - top2[:, 1])
    m = torch.cat(margins)
    max_delta = max(deltas)
    threshold = max(CALIBRATION_FLOOR.get(dtype, 1e-4), safety * 2 * max_delta)
    fixed = near_tie_threshold(dtype)
    return Calibration(
        dtype,
        max_delta,
        threshold,
        float((m < threshold).float().mean()),
        int(m.numel()),
        fixed,
        float((m < fixed).float().mean()),
    )
