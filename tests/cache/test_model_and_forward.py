"""Tests for lesson_utils.model.loading (loading OPT) and lesson_utils.model.opt_forward (the cache-backed forward).

Numerical contract checked here: in fp32 on a CPU, ``opt_forward.forward`` through ``DenseKVCache``
matches Hugging Face's ``OPTForCausalLM`` logits within ``ATOL = 1e-4`` (max absolute difference), and
``generate_greedy`` is token-identical to ``model.generate(do_sample=False)``.

Nothing here touches the network: the hub paths are exercised with HF_HUB_OFFLINE or monkeypatched.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from helpers import assert_identical, hf_greedy
from transformers import OPTForCausalLM

from lesson_utils.cache import paged
from lesson_utils.cache.dense import DenseKVCache
from lesson_utils.cache.seam import StepBatch
from lesson_utils.core.env import Profile
from lesson_utils.model import loading as model_mod
from lesson_utils.model.generate import generate_greedy
from lesson_utils.model.loading import ByteTokenizer, LoadedModel, load_model, opt125m_config, tiny_opt_config
from lesson_utils.model.opt_forward import OPTWeights, forward

ATOL = 1e-4  # fp32, max |ours - HF| over all logits

CI = Profile(name="ci", device="cpu", device_name="test")
CPU = Profile(name="cpu", device="cpu", device_name="test")


def sharp_opt(pre_ln: bool = True, seed: int = 0) -> OPTForCausalLM:
    """A tiny random OPT with large weights (std 0.1, random biases and norms).

    Large weights spread the logits, so greedy argmax ties - which could flip on rounding noise - are
    negligible; random biases and norm parameters make sure none of them is silently skipped.
    """
    torch.manual_seed(seed)
    cfg = tiny_opt_config()
    cfg.do_layer_norm_before = pre_ln
    model = OPTForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if "layer_norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return model


@pytest.fixture(scope="module")
def opt_model() -> OPTForCausalLM:
    return sharp_opt()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def random_prompts(n: int, vocab: int, seed: int, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 3] + [rng.randint(1, max_len) for _ in range(n - 3)]
    return [[rng.randrange(4, vocab) for _ in range(k)] for k in lengths]


def cache_is_empty(cache: DenseKVCache) -> bool:
    return all(not d for d in cache.k) and all(not d for d in cache.v)


# ---------------------------------------------------------------------------------------------------
# ByteTokenizer
# ---------------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_special_ids():
    tok = ByteTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 2, 260)
    for text in ["", "hello world", "KV cache: 4 blocks × 16 tokens", "naïve café 🚀"]:
        ids = tok.encode(text)
        assert ids[0] == 2 and all(4 <= i < 260 for i in ids[1:])
        assert len(ids) == 1 + len(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.encode("ab", add_bos=False) == [ord("a") + 4, ord("b") + 4]
    assert tok.decode([2, 1, 3, 0, ord("x") + 4, 2]) == "x"  # specials skipped
    assert tok.decode([ord("x") + 4, 300, ord("y") + 4]) == "x<id 300>y"  # beyond the byte range: the id, readable
    assert tok.decode([0xFF + 4]) == "\\xff"  # invalid UTF-8 is shown as its byte, not raised
    assert "\ufffd" not in tok.decode(list(range(4, 400)))  # no replacement characters (they print as boxes)


# ---------------------------------------------------------------------------------------------------
# load_model
# ---------------------------------------------------------------------------------------------------


def test_ci_profile_builds_tiny_random_model_and_says_so(capsys):
    lm = load_model(profile=CI)
    out = capsys.readouterr().out
    assert "NOTICE" in out and "RANDOM" in out and "gibberish" in out
    assert isinstance(lm, LoadedModel) and not lm.is_pretrained
    assert isinstance(lm.tokenizer, ByteTokenizer)
    cfg = lm.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_dim) == (2, 64, 4, 256)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.do_layer_norm_before) == (320, 512, True)
    assert not lm.model.training
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}
    again = load_model(profile=CI)
    assert all(torch.equal(a, b) for a, b in zip(lm.model.parameters(), again.model.parameters()))


def _opt_like_tokenizer():
    """A real HF fast tokenizer built offline: byte-level BPE with OPT's special ids, bos prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],  # ids 0..3, as in OPT
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the cat sat on the mat", "paged attention keeps kv in blocks"], trainer)
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def test_local_folder_loads_through_auto_classes(tmp_path, capsys):
    saved = sharp_opt()
    saved.save_pretrained(tmp_path)
    _opt_like_tokenizer().save_pretrained(tmp_path)

    lm = load_model(local_path=tmp_path, profile=CPU)
    assert "NOTICE" not in capsys.readouterr().out
    assert lm.is_pretrained and str(tmp_path) in lm.source
    assert type(lm.model).__name__ == "OPTForCausalLM" and not lm.model.training
    theirs = lm.model.state_dict()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(theirs[name], tensor), name
    assert not isinstance(lm.tokenizer, ByteTokenizer)
    ids = lm.tokenizer("the cat sat")["input_ids"]
    assert ids[0] == 2 and lm.tokenizer.decode(ids, skip_special_tokens=True) == "the cat sat"
    assert (lm.tokenizer.pad_token_id, lm.tokenizer.eos_token_id) == (1, 2)


def test_local_folder_without_tokenizer_uses_bytes_with_notice(tmp_path, capsys):
    sharp_opt().save_pretrained(tmp_path)
    lm = load_model(local_path=tmp_path, profile=CPU)
    assert "NOTICE" in capsys.readouterr().out
    assert lm.is_pretrained and isinstance(lm.tokenizer, ByteTokenizer)


def test_offline_hub_falls_back_to_random_opt125m(monkeypatch, capsys):
    """The one OPT-125m-sized check: geometry of the fallback, and our forward on it matches HF."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(model_mod, "_hub_reachable", lambda *a: pytest.fail("probed the network offline"))
    lm = load_model("course-tests/not-a-real-model", profile=CPU)  # a name no cache can hold

    out = capsys.readouterr().out
    assert "NOTICE" in out and "RANDOM" in out and "HF_HUB_OFFLINE" in out
    assert not lm.is_pretrained and "OPT-125m geometry" in lm.source
    assert isinstance(lm.tokenizer, ByteTokenizer)
    cfg = lm.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (12, 768, 12)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (50272, 2048)

    w = OPTWeights.from_hf(lm.model)
    assert w.head_dim == 64
    ids = lm.tokenizer.encode("PagedAttention")
    ours = forward(w, StepBatch.build([0], [ids], [0]), DenseKVCache(w.num_layers), last_only=False)
    assert (ours - hf_logits(lm.model, ids)).abs().max().item() <= ATOL


def test_unreachable_hub_falls_back_without_downloading(monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(model_mod, "opt125m_config", tiny_opt_config)  # keep the test fast
    monkeypatch.setattr(model_mod, "_hub_reachable", lambda *a: False)
    calls = []

    def no_download(name, *, local_files_only, source):
        calls.append(local_files_only)
        raise OSError("not in the local cache")

    monkeypatch.setattr(model_mod, "_from_pretrained", no_download)
    lm = load_model(profile=CPU)
    assert calls == [True]  # looked in the local cache only
    assert "cannot be reached" in capsys.readouterr().out
    assert not lm.is_pretrained


def test_failed_download_falls_back_but_interrupt_propagates(monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(model_mod, "opt125m_config", tiny_opt_config)
    monkeypatch.setattr(model_mod, "_hub_reachable", lambda *a: True)

    def failing(name, *, local_files_only, source):
        raise ConnectionError("connection reset by peer")

    monkeypatch.setattr(model_mod, "_from_pretrained", failing)
    lm = load_model(profile=CPU)
    assert "ConnectionError: connection reset by peer" in capsys.readouterr().out
    assert not lm.is_pretrained

    def interrupted(name, *, local_files_only, source):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_mod, "_from_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(profile=CPU)


def test_short_hub_timeouts_are_restored(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_ETAG_TIMEOUT", raising=False)
    before = constants.HF_HUB_ETAG_TIMEOUT
    with model_mod._short_hub_timeouts(3):
        assert constants.HF_HUB_ETAG_TIMEOUT == 3
    assert constants.HF_HUB_ETAG_TIMEOUT == before
    assert "HF_HUB_ETAG_TIMEOUT" not in os.environ


def test_opt125m_config_is_the_default_config():
    cfg = opt125m_config()
    geometry = (cfg.num_hidden_layers, cfg.hidden_size, cfg.ffn_dim, cfg.word_embed_proj_dim)
    assert geometry == (12, 768, 3072, 768)


# ---------------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------------


def test_weights_are_shared_not_copied(opt_model):
    w = OPTWeights.from_hf(opt_model)
    assert w.embed_tokens.data_ptr() == opt_model.model.decoder.embed_tokens.weight.data_ptr()
    assert w.layers[1].fc2.weight.data_ptr() == opt_model.model.decoder.layers[1].fc2.weight.data_ptr()
    assert (w.num_layers, w.num_heads, w.head_dim, w.max_positions, w.eos_token_id) == (2, 4, 16, 512, 2)


@pytest.mark.parametrize("pre_ln", [True, False], ids=["pre-LN", "post-LN"])
def test_full_sequence_logits_match_hf(pre_ln):
    """All-token logits of one prefill step vs HF's, max abs diff <= ATOL (fp32)."""
    model = sharp_opt(pre_ln=pre_ln)
    w = OPTWeights.from_hf(model)
    assert w.do_layer_norm_before is pre_ln and (w.final_layer_norm is None) is (not pre_ln)
    for ids in random_prompts(6, w.vocab_size, seed=1, max_len=120):
        ours = forward(w, StepBatch.build([0], [ids], [0]), DenseKVCache(w.num_layers), last_only=False)
        assert ours.shape == (len(ids), w.vocab_size)
        assert (ours - hf_logits(model, ids)).abs().max().item() <= ATOL


def test_prefill_then_decode_matches_full_sequence(opt_model):
    """Splitting a sequence into a prefill and decode steps changes nothing (the cache holds the past)."""
    w = OPTWeights.from_hf(opt_model)
    ids = random_prompts(4, w.vocab_size, seed=2)[3] + [5, 6, 7, 8]
    full = hf_logits(opt_model, ids)
    cache = DenseKVCache(w.num_layers)
    split = 3
    rows = [forward(w, StepBatch.build([7], [ids[:split]], [0]), cache, last_only=False)]
    for pos in range(split, len(ids)):
        step = forward(w, StepBatch.build([7], [[ids[pos]]], [pos]), cache)  # last_only: [1, vocab]
        rows.append(step)
    assert (torch.cat(rows) - full).abs().max().item() <= ATOL


def test_mixed_step_of_prefill_and_decode(opt_model):
    """One step holding a decode token of sequence A and the whole prompt of sequence B."""
    w = OPTWeights.from_hf(opt_model)
    a, b = random_prompts(5, w.vocab_size, seed=3)[3:5]
    a = a + [9]
    cache = DenseKVCache(w.num_layers)
    forward(w, StepBatch.build([0], [a[:-1]], [0]), cache)
    step = StepBatch.build([0, 1], [[a[-1]], b], [len(a) - 1, 0])
    last = forward(w, step, cache)
    assert last.shape == (2, w.vocab_size)
    assert (last[0] - hf_logits(opt_model, a)[-1]).abs().max().item() <= ATOL
    assert (last[1] - hf_logits(opt_model, b)[-1]).abs().max().item() <= ATOL


# ---------------------------------------------------------------------------------------------------
# generate_greedy
# ---------------------------------------------------------------------------------------------------


def test_greedy_generation_is_token_identical_to_hf(opt_model):
    w = OPTWeights.from_hf(opt_model)
    prompts = random_prompts(24, w.vocab_size, seed=4)
    n_new = 12

    free_running = generate_greedy(w, DenseKVCache(w.num_layers), prompts, n_new, stop_at_eos=False)
    # Use as "eos" the token that about half of the sequences emit, so that stopping is exercised both ways.
    counts = {t: sum(t in out for out in free_running) for out in free_running for t in out}
    eos = min(counts, key=lambda t: (abs(counts[t] - len(prompts) / 2), t))
    w_eos = dataclasses.replace(w, eos_token_id=eos)

    expected = [hf_greedy(opt_model, p, n_new, eos, check_ties=False) for p in prompts]
    assert any(len(e) < n_new for e in expected) and any(len(e) == n_new for e in expected)

    batch_cache = DenseKVCache(w.num_layers)
    seq_ids = [100 + i for i in range(len(prompts))]
    together = generate_greedy(w_eos, batch_cache, prompts, n_new, seq_ids=seq_ids)
    assert cache_is_empty(batch_cache)  # every finished sequence was freed

    alone = [generate_greedy(w_eos, DenseKVCache(w.num_layers), [p], n_new)[0] for p in prompts]
    assert_identical(opt_model, prompts, expected, alone)  # each prompt generated alone
    assert_identical(opt_model, prompts, expected, together)  # all of them in one batch


def test_greedy_without_eos_stop_matches_hf(opt_model):
    w = OPTWeights.from_hf(opt_model)
    prompts = random_prompts(4, w.vocab_size, seed=5)
    got = generate_greedy(w, DenseKVCache(w.num_layers), prompts, 6, stop_at_eos=False)
    assert_identical(opt_model, prompts, [hf_greedy(opt_model, p, 6, None, check_ties=False) for p in prompts], got)


def test_generation_input_errors(opt_model):
    w = OPTWeights.from_hf(opt_model)
    cache = DenseKVCache(w.num_layers)
    with pytest.raises(ValueError, match=r"prompt 1 has 500 tokens.*max_new_tokens=20.*512"):
        generate_greedy(w, cache, [[5], [5] * 500], 20)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate_greedy(w, cache, [[]], 3)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        generate_greedy(w, cache, [[5]], 0)
    with pytest.raises(ValueError, match="distinct seq_ids"):
        generate_greedy(w, cache, [[5], [6]], 2, seq_ids=[3, 3])
    generate_greedy(w, cache, [[5] * 500], 12)  # exactly fills the 512 positions: allowed


def test_forward_rejects_positions_beyond_the_table(opt_model):
    w = OPTWeights.from_hf(opt_model)
    step = StepBatch.build([4], [[5, 6]], [511])  # positions 511 and 512
    with pytest.raises(ValueError, match=r"sequence 4 reaches position 512.*512 positions"):
        forward(w, step, DenseKVCache(w.num_layers))


def test_the_ci_model_notices_kv_written_to_the_wrong_block(tiny):
    """Token identity on the ci model is evidence only if its outputs depend on the K/V it reads: K/V of every
    decode token written into one wrong block must change what it generates (with OPT's default weight scale,
    this toy model's attention was so flat that 3 of 4 outputs came out unchanged)."""
    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.serving.engine import Engine

    _, w = tiny

    def decode_kv_to_the_last_block(batch, tables, block_size):
        slots = paged.slot_mapping(batch, tables, block_size)
        if all(q == 1 for q in batch.query_lens):
            slots = slots % block_size + 39 * block_size
        return slots

    g = torch.Generator().manual_seed(1)
    prompts = [[2] + torch.randint(4, w.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 20, 31)]
    outputs = []
    for slot_fn in (paged.slot_mapping, decode_kv_to_the_last_block):
        cache = PagedKVCache.for_model(w, num_blocks=40, block_size=4, slot_mapping_fn=slot_fn)
        outputs.append(Engine(w, cache, stop_at_eos=False).generate(prompts, 30))
    assert all(right != wrong for right, wrong in zip(*outputs))
