"""The model-family registry (``lesson_utils.model.families``): adding a family is one entry, picked up by the config
check, ``weights_from_hf`` and the tiny configs; every attention variant the forwards do not implement is refused by
name in any family's spelling (issue 44: a tiny Mistral added to two lists was served with its sliding window
silently ignored)."""

from __future__ import annotations

import pytest
from helpers import hf_greedy

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.model import families, weights_from_hf
from lesson_utils.model.catalog import random_causal_lm, tiny_config
from lesson_utils.model.config_check import check_config
from lesson_utils.model.llama_forward import LlamaWeights
from lesson_utils.serving.engine import Engine


@pytest.fixture
def with_mistral(monkeypatch):
    """Mistral registered as a Llama-architecture family - the one entry adding it takes."""
    mistral = families.Family("mistral", "Mistral")
    monkeypatch.setitem(families.FAMILIES, "mistral", mistral)
    return mistral


def test_a_new_family_is_one_entry(with_mistral):
    cfg = tiny_config("mistral", sliding_window=None)
    assert check_config(cfg).num_kv_heads == 2
    model = random_causal_lm(cfg, seed=2)
    w = weights_from_hf(model)
    assert isinstance(w, LlamaWeights) and w.family == "mistral"
    prompts = [[2, 40, 41, 42, 43], [2, 9]]
    engine = Engine(w, PagedKVCache.for_model(w, 20, 4), stop_at_eos=False)
    assert engine.generate(prompts, 6) == [hf_greedy(model, p, 6, None) for p in prompts]


def test_mistrals_sliding_window_is_refused_by_name(with_mistral):
    with pytest.raises(ValueError, match="sliding_window=16 is not supported"):
        check_config(tiny_config("mistral", sliding_window=16))
    check_config(tiny_config("mistral", sliding_window=4096))  # longer than the model's 512 positions: no window


@pytest.mark.parametrize(
    "model_type, fields, match",
    [
        ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), "use_sliding_window=True"),
        ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), "use_sliding_window=True"),
        ("llama", dict(sliding_window=8), "sliding_window=8"),
        ("llama", dict(layer_types=["sliding_attention", "full_attention"]), "layer_types \\['sliding_attention'\\]"),
        ("llama", dict(attention_chunk_size=64), "attention_chunk_size=64"),
    ],
)
def test_every_family_refuses_attention_it_does_not_implement(model_type, fields, match):
    cfg = tiny_config(model_type)
    for k, v in fields.items():
        setattr(cfg, k, v)  # (set after construction: some configs derive these fields, or drop unknown ones)
    with pytest.raises(ValueError, match=match):
        check_config(cfg)


def test_an_unregistered_family_is_refused_naming_the_registered_ones():
    with pytest.raises(
        ValueError, match="model_type 'mistral' is not supported \\(supported: opt, llama, qwen2, qwen3\\)"
    ):
        check_config(_mistral_config())


def _mistral_config():
    from transformers import MistralConfig

    return MistralConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64
    )
