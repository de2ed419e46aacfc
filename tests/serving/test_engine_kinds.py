"""The engine-kind registry (``lesson_utils.lab.engine_kinds``): one entry per kind, and every place that loops over
kinds reads it - the GPU checks and each test module that serves every kind. A new entry, added here for the test,
is picked up by all of them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lesson_utils.lab import engine_kinds as registry
from lesson_utils.lab.engine_kinds import EngineKind, engine_kind, engine_kinds

TESTS = Path(__file__).resolve().parents[1]
# (module, its function that returns {kind name: factory}, the traits of the registered kinds it serves)
LOOPS_OVER_KINDS = [
    ("serving/test_speculative.py", "_kinds", dict(paged=True)),
    ("serving/test_refused_step.py", "_kinds", {}),
    ("serving/test_speculation_beside_others.py", "_forking_kinds", dict(paged=True)),
    ("model/test_modern_models.py", "_kinds", dict(exact=True)),
]


def _module(relative: str):
    path = TESTS / relative
    spec = importlib.util.spec_from_file_location(f"kinds_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_kind_is_a_valid_combination_with_a_unique_name():
    names = [k.name for k in engine_kinds()]
    assert len(names) == len(set(names)) and engine_kind("paged").backend == "gather"
    with pytest.raises(ValueError, match="backend 'flash' is not one of"):
        EngineKind("x", backend="flash")
    with pytest.raises(ValueError, match="contiguous reservations serve floats through the gather only"):
        EngineKind("x", memory="contiguous", format="int8")
    with pytest.raises(ValueError, match="no engine kind 'nope'"):
        engine_kind("nope")
    assert {k.name for k in engine_kinds(kernels=True)} >= {"Triton decode kernel", "int8 (unified kernel)"}
    assert all(k.short for k in engine_kinds(preemption="swap"))


def test_each_kind_builds_what_it_names(tiny):
    _, w = tiny
    for kind in engine_kinds():
        engine = kind.build(w, max_seq_len=40)
        if kind.paged:
            assert (engine.cache.format.name, engine.cache.backend.name) == (kind.format, {
                "batched gather": "gather"}.get(kind.backend, kind.backend))  # fmt: skip
        assert (engine.chunked_prefill is not None) == kind.chunked
        assert engine.preemption_mode == (kind.preemption or "recompute")


def test_a_new_kind_is_picked_up_everywhere(tiny, monkeypatch):
    """Registering a kind - int8 values served by lesson 03's batched gather - is all it takes: the GPU checks and every
    test module that loops over kinds then build it."""
    from course_tools import gpu_checks

    _, w = tiny
    new = EngineKind("int8 (batched gather)", format="int8", backend="batched gather")
    monkeypatch.setattr(registry, "ENGINE_KINDS", registry.ENGINE_KINDS + (new,))
    assert new.name in dict(gpu_checks.engine_kinds(w))
    for relative, function, traits in LOOPS_OVER_KINDS:
        kinds = getattr(_module(relative), function)(w)
        wanted = {k.name for k in engine_kinds(**traits)}
        assert wanted <= set(kinds), f"{relative} does not serve {sorted(wanted - set(kinds))}"
        assert (new.name in kinds) == (new.name in wanted), relative
    engine = _module("serving/test_speculative.py")._kinds(w)[new.name](stop_at_eos=False)
    assert engine.cache.format.name == "int8" and engine.cache.backend.batched_decode
    assert len(engine.generate([[2, 5, 6], [2, 7]], 3)[1]) == 3  # it serves (two decodes batched, dequantized)
