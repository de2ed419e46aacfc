"""Helpers shared by several test modules (import them: ``from helpers import hf_greedy, rejected``).

pytest puts this folder on ``sys.path`` (its default "prepend" import mode), so a plain import works.
"""

from __future__ import annotations

import torch

MIN_MARGIN = 1e-4  # top-1 minus top-2 logit along HF's greedy path: far above fp32 noise (~1e-6)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None, *, check_ties: bool = True) -> list[int]:
    """HF's greedy continuation of one unpadded prompt, cut right after the first eos (generate stops there).

    With ``check_ties`` the test fails loudly if any step's top two logits are within ``MIN_MARGIN``: a
    rounding difference could flip such an argmax, and the comparison would fail for no fault of ours.
    """
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=1,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    if check_ties:
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            assert (top2[0] - top2[1]).item() > MIN_MARGIN, "near-tie on HF's greedy path; pick other prompts"
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens


def rejected(result, *needles) -> bool:
    """A checker's result says "wrong" (not "unsolved") and its message names every one of ``needles``."""
    assert not result.passed and result.implemented, result.message
    for needle in needles:
        assert needle in result.message, f"{needle!r} not in:\n{result.message}"
    return True
