"""Lesson 10's int4 contrast: int4's 15 levels per token and head, through the same symmetric rule as int8."""

from __future__ import annotations

import pytest
import torch

from lesson_utils.cache import quantize as Q


def test_int4_levels_are_the_int8_rule_with_seven_levels_a_side():
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    q, scale = Q.quantize_int4_levels(x)
    assert torch.equal(x, before)  # the input is left as it was
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert int(q.abs().max()) == 7
    assert torch.equal(q.float(), torch.round(x / (x.abs().amax(-1) / 7)[..., None]).clamp(-7, 7))
    assert float((Q.dequantize_kv(q, scale) - x).abs().max()) <= float(scale.max()) / 2 + 1e-6  # half a step at most
    zq, zs = Q.quantize_int4_levels(torch.zeros(1, 1, 4))
    assert int(zq.abs().sum()) == 0 and float(zs.sum()) == 0  # an all-zero vector: scale 0, no division


def test_int4_levels_refuse_what_int8_refuses():
    with pytest.raises(ValueError, match="NaN|inf"):
        Q.quantize_int4_levels(torch.tensor([[[float("nan"), 1.0]]]))
