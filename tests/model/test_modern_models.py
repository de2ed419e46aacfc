"""Llama, Qwen2 and Qwen3 through every engine kind, token-identical to Hugging Face ``generate`` (greedy, fp32, CPU).

Four random configurations cover the three families, grouped-query ratios 1, 3, 4 and 8 and head dims 64, 80 and
128, with Llama 3's RoPE scaling and tied embeddings on one of them. Norm weights and biases are drawn at random
(``catalog.random_causal_lm(spread=True)``): HF's own initialisation leaves norms at 1 and biases at 0, which would
hide a norm in the wrong place or a dropped bias. Every kind below must give HF's tokens exactly, every block must
be free at the end, and the kinds that preempt must really have preempted. The int8 cache is held to its own
fp-free rule instead (its values differ by design): every int8 path gives the int8 engine's own tokens.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from helpers import hf_greedy, reference_beam_search

from lesson_utils.cache.dense import DenseKVCache
from lesson_utils.cache.int8_paged import Int8PagedKVCache
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.types import Request, SlotKind
from lesson_utils.disagg.handover import hand_over, prefill_engine
from lesson_utils.lab.engine_kinds import engine_kind, engine_kinds
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.model import weights_from_hf
from lesson_utils.model.catalog import random_causal_lm, tiny_config
from lesson_utils.model.generate import generate_greedy
from lesson_utils.model.llama_forward import LlamaWeights
from lesson_utils.serving.draft_model import DraftModelProposer
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.speculative import Speculation
from lesson_utils.serving.token_budget import ChunkedPrefill

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # fmt: skip
MODELS = {  # name: (family, query heads, KV heads, head_dim, extra config)
    "llama 8:1 d64 llama3-rope tied": ("llama", 8, 1, 64, dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    "qwen2 3:1 d80": ("qwen2", 6, 2, 80, {}),
    "qwen3 4:1 d128": ("qwen3", 4, 1, 128, {}),
    "llama 1:1 d80": ("llama", 3, 3, 80, {}),
}
N_NEW = 8


@pytest.fixture(scope="module", params=list(MODELS))
def modern(request):
    family, heads, kv, d, extra = MODELS[request.param]
    model = random_causal_lm(tiny_config(family, heads=heads, kv_heads=kv, head_dim=d, **extra), seed=1, spread=True)
    w = weights_from_hf(model)
    assert isinstance(w, LlamaWeights) and (w.num_heads, w.num_kv_heads, w.head_dim) == (heads, kv, d)
    rng = random.Random(7)
    system = [rng.randrange(3, w.vocab_size) for _ in range(9)]
    prompts = [[rng.randrange(3, w.vocab_size) for _ in range(n)] for n in (1, 6, 13)]
    prompts.append(system + [rng.randrange(3, w.vocab_size) for _ in range(3)])
    prompts.append(system + [rng.randrange(3, w.vocab_size) for _ in range(5)])  # shares 2 blocks of 4 with the last
    want = [hf_greedy(model, p, N_NEW, w.eos_token_id) for p in prompts]
    return model, w, prompts, want


def _sharing(w, n, caching=True):
    return SharingBlockManager(n, 4, enable_prefix_caching=caching, max_seq_len=w.max_positions)


def _kinds(w):
    """Every exact engine kind of the registry (the int8 ones are held to their own rule below) and speculation, as
    factories: 60 blocks of 4 (9 for the kinds that preempt), a token budget of 6, requests of at most 24 tokens."""
    size = dict(num_blocks=60, short_blocks=9, budget=6, max_seq_len=24)
    kinds = {k.name: partial(k.build, w, **size) for k in engine_kinds(exact=True)}
    kinds["speculative (prompt lookup, k = 3)"] = partial(
        engine_kind("paged").build, w, speculation=Speculation(3), **size
    )
    return kinds


KINDS = [k.name for k in engine_kinds(exact=True)] + ["speculative (prompt lookup, k = 3)"]


def _all_free(engine) -> bool:
    m = engine.manager  # (the MemoryManager protocol: paged and contiguous alike)
    return m.view.breakdown()[SlotKind.FREE] == m.view.total_slots


def test_the_dense_forward_matches_hf(modern):
    _, w, prompts, want = modern
    assert generate_greedy(w, DenseKVCache(w.num_layers), prompts, N_NEW) == want


@pytest.mark.parametrize("kind", KINDS)
def test_every_engine_kind_is_token_identical_to_hf(modern, kind):
    _, w, prompts, want = modern
    engine = _kinds(w)[kind]()
    registered = kind if kind in {k.name for k in engine_kinds()} else "paged"
    if engine_kind(registered).kernels:  # the interpreter runs every program in Python: one 12-token prompt
        prompts, want = prompts[3:4], want[3:4]  # (tests/kernels/test_gqa_kernels.py holds the kernels to more cases)
    if kind == "prefix cache":  # the last request comes after the rest and finds the system prompt's 2 full blocks
        first = engine.generate(prompts[:-1], N_NEW)
        before = sum(s.prefill_tokens for s in engine.stats)
        assert first + engine.generate(prompts[-1:], N_NEW) == want
        assert sum(s.prefill_tokens for s in engine.stats) - before == len(prompts[-1]) - 8
    else:
        assert engine.generate(prompts, N_NEW) == want
    if engine_kind(registered).short:
        assert engine.scheduler.num_preemptions > 0, "the short cache was meant to preempt"
    assert _all_free(engine)


def test_parallel_samples_and_beam_search(modern):
    model, w, prompts, want = modern
    engine = Engine(w, PagedKVCache.for_model(w, manager=_sharing(w, 60)))
    first = engine.add_request(prompts[1], N_NEW, n=3)  # greedy samples: all three are HF's greedy tokens
    group = engine.add_beam_search(prompts[2], 2, 5)
    engine.run()
    assert [s.output_ids for s in first.samples] == [want[1]] * 3
    assert group.best.output_ids == reference_beam_search(model, prompts[2], 2, 5)
    assert _all_free(engine)


def test_a_draft_model_of_the_same_family_drafts_and_the_target_decides(modern):
    model, w, prompts, want = modern
    family = model.config.model_type
    draft_model = random_causal_lm(tiny_config(family, heads=2, kv_heads=1, head_dim=16), seed=5, spread=True)
    dw = weights_from_hf(draft_model)
    draft = Engine(dw, PagedKVCache.for_model(dw, manager=_sharing(dw, 60)), stop_at_eos=False)
    proposer = DraftModelProposer(draft, w.vocab_size)
    engine = Engine(w, PagedKVCache.for_model(w, 60, 4), speculation=Speculation(3, proposer))
    assert engine.generate(prompts[1:3], N_NEW) == want[1:3]
    assert proposer.calls > 0 and _all_free(engine)


def test_the_disaggregated_hand_over_decodes_as_one_engine(modern):
    _, w, prompts, want = modern
    prefill = prefill_engine(w, PagedKVCache.for_model(w, 60, 4))
    decode = Engine(w, PagedKVCache.for_model(w, 60, 4))
    p = prompts[3]
    seq = hand_over(prefill, decode, Request(0, 0.0, len(p), N_NEW, prompt_ids=p))
    decode.run()
    assert seq.output_ids == want[3]
    assert _all_free(decode) and _all_free(prefill)


def test_every_int8_path_gives_the_int8_engines_tokens(modern):
    _, w, prompts, _ = modern
    own = Engine(w, Int8PagedKVCache.for_model(w, 60, 4)).generate(prompts, N_NEW)
    paths = {
        "kernels, chunked": lambda: Engine(
            w, Int8PagedKVCache.for_model(w, 60, 4, use_kernels=True), chunked_prefill=ChunkedPrefill(6)
        ),
        "swap": lambda: Engine(
            w, Int8PagedKVCache.for_model(w, 9, 4), preemption_mode="swap", swap_space=SwapSpace(60)
        ),
    }
    for name, make in paths.items():
        engine = make()
        subset = slice(3, 4) if "kernels" in name else slice(None)  # one 12-token prompt: two chunks, then decodes
        assert engine.generate(prompts[subset], N_NEW) == own[subset], name
        assert _all_free(engine)


def test_a_prompt_past_the_models_positions_is_refused_like_any_oversized_request():
    model = random_causal_lm(tiny_config("llama", max_positions=32), seed=0)
    w = weights_from_hf(model)
    engine = Engine(w, PagedKVCache.for_model(w, 60, 4))
    with pytest.raises(ValueError, match="exceeds the model's 32 positions"):
        engine.add_request(list(range(3, 30)), 8)
    assert _all_free(engine) and not engine.scheduler.has_work


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "num_key_value_heads=4"),
        (dict(model_type="gemma"), "model_type 'gemma'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
        (dict(head_dim=15), "head_dim=15"),
        (dict(head_dim=512), "head_dim=512"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ],
)
def test_an_unsupported_config_is_refused_naming_the_field_before_any_memory(change, field):
    from lesson_utils.model.config_check import check_config

    cfg = tiny_config("llama")
    for k, v in change.items():
        setattr(cfg, k, v)
    if "rope_scaling" in change:  # transformers 5 keeps RoPE settings in rope_parameters
        cfg.rope_parameters = {"rope_theta": 10000.0, **change["rope_scaling"]}
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        check_config(cfg)


def test_weights_from_hf_refuses_before_reading_a_tensor():
    model = random_causal_lm(tiny_config("llama"), seed=0)
    model.config.num_key_value_heads = 4  # 6 heads over 4 KV heads
    with pytest.raises(ValueError, match="num_attention_heads=6 is not a multiple of num_key_value_heads=4"):
        weights_from_hf(model)


def test_rope_frequencies_equal_hfs_for_default_and_llama3_scaling():
    from lesson_utils.model.rope import inverse_frequencies

    for extra in ({}, dict(rope_scaling=LLAMA3_ROPE)):
        model = random_causal_lm(tiny_config("llama", **extra), seed=0)
        assert torch.equal(inverse_frequencies(model.config, 16), model.model.rotary_emb.inv_freq)


def test_the_shipped_configs_load_and_opt125m_matches_its_builder():
    from lesson_utils.model.catalog import SHIPPED, opt125m_config, shipped_config
    from lesson_utils.model.config_check import check_config

    for name in SHIPPED:
        check_config(shipped_config(name))
    a, b = shipped_config("facebook/opt-125m"), opt125m_config()
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "max_position_embeddings")
    assert all(getattr(a, f) == getattr(b, f) for f in fields)


def test_offline_a_modern_name_gets_random_weights_of_its_shipped_geometry(monkeypatch, capsys):
    """No hub: ``load_model("HuggingFaceTB/SmolLM2-135M")`` builds its geometry (a 2-layer stand-in keeps the test
    fast) with the boxed notice; the weights go through weights_from_hf."""
    import lesson_utils.model.loading as loading
    from lesson_utils.core.env import Profile

    small = tiny_config("llama", heads=9, kv_heads=3, head_dim=64)
    monkeypatch.setattr(loading, "shipped_config", lambda name: small)
    monkeypatch.setattr(loading, "_from_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    monkeypatch.setattr(loading, "_hub_reachable", lambda *a: False)
    lm = loading.load_model("HuggingFaceTB/SmolLM2-135M", profile=Profile(name="cpu", device="cpu", device_name="t"))
    assert not lm.is_pretrained and "SmolLM2-135M geometry" in lm.source
    assert "RANDOM weights" in capsys.readouterr().out
    w = weights_from_hf(lm.model)
    assert (w.num_heads, w.num_kv_heads, w.head_dim) == (9, 3, 64)


def test_parameter_counts_and_the_kv_table_follow_the_configs():
    """count_parameters equals the real model's count (built on the meta device: no memory) for every shipped
    config and a Qwen2 with biases; lesson 00's table holds GQA's factor and a T4 that cannot hold Llama-3-8B."""
    from transformers import AutoModelForCausalLM

    from lesson_utils.lab.kv_math import count_parameters
    from lesson_utils.lab.model_table import kv_table
    from lesson_utils.model.catalog import SHIPPED, shipped_config

    for cfg in [shipped_config(n) for n in SHIPPED] + [tiny_config("qwen2"), tiny_config("qwen3")]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        assert count_parameters(cfg) == sum(p.numel() for p in model.parameters()), cfg.model_type
    rows = {r.name.split("/")[-1]: r for r in kv_table()}
    assert rows["SmolLM2-135M"].bytes_per_token == 2 * 30 * 3 * 64 * 2 and rows["SmolLM2-135M"].gqa_factor == 3
    assert rows["Meta-Llama-3-8B"].bytes_per_token == 128 * 1024 and rows["Meta-Llama-3-8B"].budget is None
    assert rows["opt-125m"].gqa_factor == 1 and rows["opt-125m"].budget.requests_at(2048) > 100
