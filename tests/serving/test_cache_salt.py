"""A per-tenant salt in the prefix cache's block hash (lesson 13; vLLM's ``cache_salt``): a request finds cached blocks
only under its own salt, so the time to first token tells one tenant nothing about another's prompts, and the tokens
are unchanged."""

from __future__ import annotations

import pytest
import torch

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.model import weights_from_hf
from lesson_utils.model.catalog import random_causal_lm, tiny_config
from lesson_utils.serving.engine import Engine


@pytest.fixture(scope="module")
def w():
    return weights_from_hf(random_causal_lm(tiny_config("llama"), 11).to(torch.float32))


def _engine(w):
    manager = SharingBlockManager(64, 4, enable_prefix_caching=True, max_seq_len=w.max_positions)
    return Engine(w, PagedKVCache.for_model(w, manager=manager), stop_at_eos=False), manager


PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # three full blocks of 4 before the last token


def _cached_after(w, first_salt, second_salt):
    eng, manager = _engine(w)
    first = eng.add_request(PROMPT, 3, cache_salt=first_salt)
    eng.run()
    second = eng.add_request(PROMPT, 3, cache_salt=second_salt)
    eng.step()  # admitted: its prefix-cache hits are counted
    eng.run()
    return manager.view.cached_prompt_tokens, first.output_ids, second.output_ids


@pytest.mark.parametrize(
    "first, second, hit",
    [
        (None, None, True),
        ("tenant-a", "tenant-a", True),
        ("tenant-a", "tenant-b", False),
        (None, "tenant-a", False),
        ("tenant-a", None, False),
    ],
)
def test_a_prefix_is_found_only_under_the_same_salt(w, first, second, hit):
    cached, out1, out2 = _cached_after(w, first, second)
    assert (cached > 0) is hit
    assert cached in (0, 12)  # whole blocks of the shared prefix, or nothing
    assert out1 == out2  # the salt changes where K/V may be reused, never the tokens


def test_samples_keep_their_requests_salt_and_bad_salts_are_refused(w):
    eng, manager = _engine(w)
    seq = eng.add_request(PROMPT, 3, n=2, temperature=1.0, seed=1, cache_salt="tenant-a")
    eng.run()
    assert all(s.request.cache_salt == "tenant-a" for s in seq.samples) and len(seq.samples) == 2
    for bad in ("", 5, b"tenant"):
        with pytest.raises(ValueError, match="cache_salt"):
            eng.add_request(PROMPT, 3, cache_salt=bad)
    assert manager.num_free_blocks == manager.view.num_blocks  # refused requests took nothing
