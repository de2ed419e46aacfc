"""Lesson 10's outlier-channel study (lab/kv_outliers.py): the fake quantizer's error bound and zero handling, the
synthetic keys' structure, and that each scale axis wins on the structure it is made for."""

from __future__ import annotations

import pytest
import torch

from lesson_utils.lab import kv_outliers as O


@pytest.mark.parametrize("along", ["per token", "per channel"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_each_value_moves_by_at_most_half_a_step(along, bits):
    x = torch.randn(33, 3, 20, generator=torch.Generator().manual_seed(bits))
    x[5] = 0  # one all-zero token
    qmax = 2 ** (bits - 1) - 1
    step = x.abs().amax(dim=O.SCALE_AXES[along], keepdim=True) / qmax
    back = O.fake_quantize(x, along, bits)
    assert torch.isfinite(back).all()
    assert bool(((back - x).abs() <= step / 2 + 1e-6).all())
    if along == "per token":
        assert bool((back[5] == 0).all())
    levels = torch.round(back / torch.where(step > 0, step, torch.ones_like(step)))
    assert int(levels.abs().max()) <= qmax


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="along"):
        O.fake_quantize(torch.ones(2, 1, 4), "per tensor", 8)
    with pytest.raises(ValueError, match="bits"):
        O.fake_quantize(torch.ones(2, 1, 4), "per token", 1)


def test_synthetic_keys_have_fixed_outlier_channels_of_the_given_gain():
    k = O.synthetic_outlier_keys(200, 3, 32, outlier_channels=2, gain=20.0, seed=1)
    assert k.shape == (200, 3, 32)
    per_channel = k.abs().mean(dim=0)
    assert [int((per_channel[h] > 10).sum()) for h in range(3)] == [2, 2, 2]  # the same channels for every token
    assert 15 < O.channel_outlier_ratio(k) < 30
    assert O.channel_outlier_ratio(torch.randn(200, 3, 32)) < 2


def test_per_channel_wins_on_outlier_channels_and_per_token_on_outlier_tokens():
    keys = O.synthetic_outlier_keys(256, 4, 64)
    study = O.scale_study(keys)
    for bits in (8, 4):
        assert study[(bits, "per channel")] < study[(bits, "per token")] / 2
    tokens = torch.randn(256, 4, 64, generator=torch.Generator().manual_seed(2))
    tokens[::16] *= 50  # outlier tokens instead: one scale per channel would flatten the others
    study = O.scale_study(tokens)
    for bits in (8, 4):
        assert study[(bits, "per token")] < study[(bits, "per channel")]
