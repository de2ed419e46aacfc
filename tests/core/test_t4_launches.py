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


def test_a_verify_step_costs_its_multiply_adds_and_its_launches():
    plain = t4_roofline.t4_decode(135_000_000, 23_040, 64, 20, operators=2400)  # short contexts: little K/V
    verify = t4_roofline.t4_decode(135_000_000, 23_040, 64, 20, operators=2400 + 900 * 64, fed=5)
    assert verify.weights_s == plain.weights_s and verify.kv_s == plain.kv_s
    assert verify.flops_s == pytest.approx(5 * plain.flops_s)  # 320 tokens: past the compute-bound point
    assert 64 * 5 > t4_roofline.compute_bound_from_tokens() and verify.bound_s == verify.flops_s
    # without launches: 2 tokens per verification at 5x the multiply-adds of a read-bound step
    assert t4_roofline.speculation_speedup(plain, verify, 2.0) == pytest.approx(2.0 * plain.bound_s / verify.flops_s)
    one = t4_roofline.t4_decode(135_000_000, 23_040, 1, 200, operators=2400)
    one_verify = t4_roofline.t4_decode(135_000_000, 23_040, 1, 200, operators=2400, fed=5)
    # launch-bound at batch 1 with as many launches either way: a verification costs a decode step
    assert t4_roofline.speculation_speedup(one, one_verify, 2.0, 10e-6) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="same sequences"):
        t4_roofline.speculation_speedup(one, verify, 2.0)
    with pytest.raises(ValueError, match="decode step"):
        t4_roofline.speculation_speedup(verify, verify, 2.0)
    with pytest.raises(ValueError, match="at least the target's own token"):
        t4_roofline.speculation_speedup(plain, verify, 0.5)
    with pytest.raises(ValueError, match="at least one token"):
        t4_roofline.t4_decode(135_000_000, 23_040, 0, 200, operators=1)
    assert "verify step feeding 5 tokens each for 64" in verify.text() and "decode step of 64" in plain.text()


def test_the_profiler_leaves_no_log_lines_in_a_notebooks_output(capfd):
    import sys

    import torch

    from lesson_utils.lab.step_profile import quiet_profile

    with quiet_profile([torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(3).add(1)
    print("a warning of our own", file=sys.stderr)
    out, err = capfd.readouterr()
    assert "profiler_start" not in out + err and "profiler_stop" not in out + err  # Kineto's two lines, on fd 2
    assert "a warning of our own" in err  # Python's stderr is untouched afterwards
    assert any(e.name.startswith("aten::") for e in prof.events())


def test_the_launch_reading_follows_the_numbers():
    lo, hi = t4_roofline.LAUNCH_COSTS_S[0], t4_roofline.LAUNCH_COSTS_S[-1]
    bound = 1e-3
    assert t4_roofline.launch_reading(bound, bound / (0.5 * lo)).startswith("launch-bound at every")
    assert t4_roofline.launch_reading(bound, bound / (2 * hi)).startswith("bound by its bytes")
    assert t4_roofline.launch_reading(bound, bound / (0.5 * (lo + hi))).startswith("launch-bound above")
    assert "left out" in t4_roofline.launch_reading(bound, 0)
    assert t4_roofline.launch_step_s(bound, 100, 20e-6) == pytest.approx(2e-3)
    assert t4_roofline.launch_step_s(bound, 100, 1e-6) == bound
    pred = t4_roofline.t4_decode(125_000_000, 36_864, 4, 50, operators=600)
    text = t4_roofline.launches_text(pred)
    assert "600 operator launches" in text and all(f"at {c * 1e6:.0f} µs" in text for c in t4_roofline.LAUNCH_COSTS_S)


def test_the_counted_step_is_a_real_step_with_or_without_a_prompt_beside_its_decodes():
    import torch

    from lesson_utils.model import weights_from_hf
    from lesson_utils.model.catalog import random_causal_lm, tiny_config

    w = weights_from_hf(random_causal_lm(tiny_config("opt", layers=2), 0).to(torch.float32))
    decodes = t4_roofline.count_decode_operators(w, 3)
    mixed = t4_roofline.count_decode_operators(w, 3, prompt_tokens=20)
    assert 0 < decodes < mixed  # a prompt beside the decodes launches its own operators
    with pytest.raises(ValueError, match="at least one"):
        t4_roofline.count_decode_operators(w, 0)
