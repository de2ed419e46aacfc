"""The identity rule (lesson_utils.lab.identity): identical, diverged at a near-tie (accepted, reported), or different
(a bug). Tested on a constructed exact tie: two tokens given the same embedding row (OPT ties its output
projection to it) have equal logits at every step, so greedy's choice between them is rounding's, not the model's."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ReservingPagedKVCache

from lesson_utils.cache.seam import StepBatch
from lesson_utils.lab import identity
from lesson_utils.model.opt_forward import OPTWeights, forward


@pytest.fixture(scope="module")
def tied(tiny):
    """A copy of the tiny model in which token ``twin`` has the embedding of HF's first greedy token ``first``:
    ``(model, prompt, hf_tokens, first, twin)``."""
    model = copy.deepcopy(tiny[0])
    prompt = [2, 17, 99, 140, 23, 8]
    first = identity.hf_greedy(model, prompt, 1, None)[0]
    twin = first + 1 if first + 1 < model.config.vocab_size else first - 1
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[twin] = model.model.decoder.embed_tokens.weight[first]
    return model, prompt, identity.hf_greedy(model, prompt, 8, None), first, twin


def test_thresholds_are_stated_per_dtype():
    assert identity.near_tie_threshold(torch.float32) == 1e-4
    assert identity.near_tie_threshold(torch.float16) == 0.25
    with pytest.raises(ValueError, match="no near-tie threshold"):
        identity.near_tie_threshold(torch.int8)


def test_identical_outputs(tied):
    model, prompt, ref, _, _ = tied
    c = identity.compare(model, prompt, ref, list(ref))
    assert c.verdict == identity.IDENTICAL and c.ok and c.agreed == len(ref) and c.margin is None


def test_a_divergence_at_a_constructed_tie_is_accepted_and_reported(tied):
    model, prompt, ref, first, twin = tied
    assert ref[0] in (first, twin)
    other = twin if ref[0] == first else first
    got = [other] + ref[1:]  # the tied token instead: what another rounding could have picked
    c = identity.compare(model, prompt, ref, got)
    assert c.verdict == identity.NEAR_TIE_VERDICT and c.ok
    assert c.agreed == 0 and c.margin == 0.0
    assert "diverged at a near-tie after 0 tokens" in c.describe()


def test_a_divergence_at_a_clear_margin_is_a_failure(tiny):
    model, prompt = tiny[0], [2, 17, 99, 140, 23, 8]
    ref = identity.hf_greedy(model, prompt, 8, None)
    k = next(i for i in range(1, len(ref)) if identity.hf_margin(model, prompt, ref[:i]) > 1e-3)  # not at the tie
    margin = identity.hf_margin(model, prompt, ref[:k])
    with torch.inference_mode():
        runner_up = int(model(input_ids=torch.tensor([prompt + ref[:k]])).logits[0, -1].topk(2).indices[1])
    # HF's runner-up at step k, then HF's greedy choices on that text: wrong only by the margin at step k
    wrong = ref[:k] + [runner_up] + identity.hf_greedy(model, prompt + ref[:k] + [runner_up], len(ref) - k - 1, None)
    c = identity.compare(model, prompt, ref, wrong)
    assert c.verdict == identity.DIFFERENT and not c.ok and c.agreed == k
    assert c.margin == pytest.approx(margin) and "instead of" in c.describe()
    # the same divergence passes only under a threshold above its margin: the threshold is what decides
    assert identity.compare(model, prompt, ref, wrong, threshold=2 * margin).verdict == identity.NEAR_TIE_VERDICT
    # ... and only for the runner-up: a token further down HF's list is more than the margin away
    far = ref[:k] + [(ref[k] + 7) % model.config.vocab_size] + wrong[k + 1 :]
    assert identity.compare(model, prompt, ref, far, threshold=2 * margin).verdict == identity.DIFFERENT


def test_stopping_early_or_running_on_is_a_failure(tied):
    model, prompt, ref, _, _ = tied
    assert identity.compare(model, prompt, ref, ref[:-2]).verdict == identity.DIFFERENT
    assert "stops after" in identity.compare(model, prompt, ref[:-2], ref).describe()


def test_reports_count_every_verdict(tied):
    model, prompt, ref, first, twin = tied
    other = twin if ref[0] == first else first
    report = identity.compare_all(model, [prompt] * 3, [ref] * 3, [ref, [other] + ref[1:], ref[:2]])
    assert (report.identical, report.near_ties, report.different) == (1, 1, 1) and not report.ok
    assert "1/3 token-identical, 1 diverged at a near-tie" in report.summary()
    assert "prompt 2" in report.failures()
    with pytest.raises(ValueError):
        identity.compare_all(model, [prompt], [ref, ref], [ref])


def test_compare_with_hf_runs_hf_itself(tiny):
    model, w = tiny
    prompts = [[2, 5, 9], [2, 40, 41, 42, 43]]
    ours = [identity.hf_greedy(model, p, 5, w.eos_token_id) for p in prompts]
    report = identity.compare_with_hf(model, prompts, ours, 5, w.eos_token_id, progress=False)
    assert report.identical == 2 and report.ok


def test_fp16_threshold_is_far_above_this_forward_s_own_rounding(tiny):
    """In fp16 on this CPU the course's forward and HF's differ by far less than the fp16 threshold (the ci
    model's logits reach about 6.5; a real OPT-125m's about 30, which the threshold leaves room for)."""
    model = copy.deepcopy(tiny[0]).half()
    w = OPTWeights.from_hf(model)
    prompt = [2] + list(range(10, 70))
    cache = ReservingPagedKVCache.for_model(w, num_blocks=8, block_size=16)
    ours = forward(w, StepBatch.build([0], [prompt], [0]), cache, last_only=False).float()
    with torch.no_grad():
        hf = model(input_ids=torch.tensor([prompt])).logits[0].float()
    drift = float((ours - hf).abs().max())
    assert drift < identity.near_tie_threshold(torch.float16) / 10, drift
