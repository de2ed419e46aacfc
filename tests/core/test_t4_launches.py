"""The launch term of the T4 prediction (lab/t4_roofline.py) and the operator count it takes (lab/step_profile.py)."""

from __future__ import annotations

import pytest

from lesson_utils.lab import t4_roofline
from lesson_utils.lab.step_profile import count_step_operators


def test_a_step_takes_the_longer_of_its_device_work_and_its_launches():
    pred = t4_roofline.t4_decode(135_000_000, 23_040, 4, 100, operators=2000)
    assert pred.step_s(0.0) == pred.bound_s
    assert pred.step_s(1e-9) == pred.bound_s  # launches hidden behind the device's work
    assert pred.step_s(10e-6) == pytest.approx(2000 * 10e-6)  # launch-bound: 20 ms of launches
    assert pred.tokens_per_s(10e-6) == pytest.approx(4 / 0.02)
    assert pred.tokens_per_s() == pytest.approx(4 / pred.bound_s)
    no_count = t4_roofline.t4_decode(135_000_000, 23_040, 4, 100, operators=0)
    assert no_count.step_s(10e-6) == no_count.bound_s  # nothing counted: nothing added


def test_more_launches_can_reverse_two_models_order():
    """A deeper model with more sequences wins on bytes and loses once its launches dominate (lesson 12's reading)."""
    shallow = t4_roofline.t4_decode(125_000_000, 36_864, 6, 46, operators=600)
    deep = t4_roofline.t4_decode(135_000_000, 23_040, 11, 46, operators=2400)
    assert deep.tokens_per_s() > shallow.tokens_per_s()
    assert deep.tokens_per_s(10e-6) < shallow.tokens_per_s(10e-6)


def test_the_operator_count_is_one_real_decode_step_and_grows_with_layers():
    import torch

    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.model import weights_from_hf
    from lesson_utils.model.catalog import random_causal_lm, tiny_config
    from lesson_utils.serving.engine import Engine

    def ops(layers):
        w = weights_from_hf(random_causal_lm(tiny_config("llama", layers=layers), 0).to(torch.float32))
        eng = Engine(w, PagedKVCache.for_model(w, 16, 8, batched_decode=True), stop_at_eos=False)
        eng.add_request([5, 6, 7], 4)
        eng.step()
        before = eng.scheduler.running[0].len
        count = count_step_operators(eng)
        assert eng.scheduler.running[0].len == before + 1  # the counted step was a real decode step
        return count

    two, four = ops(2), ops(4)
    assert 0 < two < four and (four - two) % 2 == 0  # each layer adds the same operators
