"""Checkers for lesson 00 (KV cache primer)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from lesson_utils.lab import kv_math
from lesson_utils.lab.decoding import Stepper, decode_with_cache

from .core import CheckResult, check_function, failed, not_implemented, passed, short


def _config(layers, hidden, heads, kv_heads=None, head_dim=None, name="model"):
    cfg = SimpleNamespace(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, name=name)
    if kv_heads is not None:
        cfg.num_key_value_heads = kv_heads
    if head_dim is not None:
        cfg.head_dim = head_dim
    return cfg


def _config_cases(seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    cases = [
        (_config(12, 768, 12, name="OPT-125m"), 4),
        (_config(12, 768, 12, name="OPT-125m"), 2),
        (_config(40, 5120, 40, name="OPT-13B"), 2),
        (_config(32, 4096, 32, kv_heads=8, name="Llama-3-8B (GQA)"), 2),
        (_config(1, 64, 1, name="one layer, one head"), 1),
        (_config(28, 3072, 16, kv_heads=16, head_dim=256, name="explicit head_dim (Gemma-7B)"), 2),
        (_config(32, 4096, 32, kv_heads=8, head_dim=64, name="explicit head_dim, not hidden/heads"), 2),
    ]
    for _ in range(6):
        heads = rng.choice([4, 8, 16, 32])
        kv = rng.choice([h for h in (1, 2, 4, 8, heads) if heads % h == 0])
        cases.append(
            (_config(rng.randint(1, 48), heads * rng.choice([32, 64, 128]), heads, kv_heads=kv), rng.choice([1, 2, 4]))
        )
    return cases


def _describe_config(case: tuple) -> str:
    cfg, nbytes = case
    fields = ", ".join(f"{k}={v}" for k, v in vars(cfg).items())
    return f"config({fields}), dtype_bytes={nbytes}"


def _explain_kv(case, expected, got):
    cfg, nbytes = case
    if isinstance(got, (int, float)) and got:
        if nbytes > 1 and got * nbytes == expected:
            return "that looks like a number of elements: how many bytes does one element take?"
        if got * 2 == expected:
            return "exactly half: did you count both the key and the value?"
        if (
            kv_math.kv_heads_of(cfg) != cfg.num_attention_heads
            and got * kv_math.kv_heads_of(cfg) == expected * cfg.num_attention_heads
        ):
            return "this is a grouped-query model: how many heads are K and V stored for (num_key_value_heads)?"
        if (
            getattr(cfg, "head_dim", None)
            and got * cfg.head_dim * cfg.num_attention_heads == expected * cfg.hidden_size
        ):
            return "this config states its head_dim: is it hidden_size / num_attention_heads here?"
    return ""


def check_kv_bytes_per_token(fn) -> CheckResult:
    """Exercise 00-1: bytes of K/V per token, from a config."""
    return check_function(
        "kv_bytes_per_token",
        fn,
        kv_math.kv_bytes_per_token,
        _config_cases(),
        show_input=_describe_config,
        explain=_explain_kv,
    )


class _ScriptedStep:
    """A stepper whose greedy token follows a script (with end-of-sequence in the middle): the spec asks for
    exactly ``max_new_tokens`` tokens, eos or not. Counts tokens like :class:`Stepper`."""

    def __init__(self, script: list[int], vocab_size: int):
        self.script, self.vocab_size = script, vocab_size
        self.tokens_processed = self.calls = 0

    def __call__(self, new_tokens):
        import torch

        new_tokens = [int(t) for t in new_tokens]
        if not new_tokens:
            raise ValueError("step() needs at least one token")
        logits = torch.zeros(self.vocab_size)
        logits[self.script[min(self.calls, len(self.script) - 1)]] = 5.0
        self.tokens_processed += len(new_tokens)
        self.calls += 1
        return logits


def check_decode_with_cache(fn, w) -> CheckResult:
    """Exercise 00-2: greedy decoding through a cached stepper.

    Checks the tokens against the reference and counts the tokens pushed through the model: with a
    cache that is the prompt once, then one token per generated token except the last.
    """
    name = "decode_with_cache"
    rng = random.Random(1)

    def model():
        return Stepper(w, cached=True)

    def emits_eos():  # a model that emits end-of-sequence mid-way
        return _ScriptedStep([9, 17, w.eos_token_id, 23, 5, 6], w.vocab_size)

    cases = [([w.bos_token_id], 1, model), ([w.bos_token_id, 7], 5, model)]
    cases += [
        (
            [w.bos_token_id] + [rng.randrange(4, w.vocab_size) for _ in range(rng.randint(1, 12))],
            rng.randint(2, 8),
            model,
        )
        for _ in range(4)
    ]
    cases.append(([w.bos_token_id, 40, 41], 6, emits_eos))
    for prompt, n, make_step in cases:
        expected = decode_with_cache(make_step(), list(prompt), n)
        step = make_step()
        given = list(prompt)
        try:
            got = fn(step, given, n)
        except NotImplementedError:
            return not_implemented(name, decode_with_cache)
        except Exception as err:  # noqa: BLE001
            return failed(
                name,
                f"with prompt {prompt} and max_new_tokens={n} your code raised {type(err).__name__}: {err}",
                decode_with_cache,
            )
        if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            return failed(
                name, f"with prompt {prompt}: return a list of ints (token ids), got {short(got)}", decode_with_cache
            )
        if given != prompt:
            return failed(
                name,
                f"the caller's prompt {prompt} became {short(given)}: leave it as it was (keep your own "
                "list of generated tokens)",
                decode_with_cache,
            )
        need = len(prompt) + n - 1
        if step.tokens_processed != need and got == expected:
            more = step.tokens_processed - need
            why = (
                "the last generated token never needs to go through the model"
                if more == 1
                else "feed only the newest token after the prompt: the cache already holds the rest"
            )
            return failed(
                name,
                f"tokens are right, but your loop pushed {step.tokens_processed} tokens through the model for a "
                f"{len(prompt)}-token prompt and {n} new tokens; with a cache it needs {need} ({why}).",
                decode_with_cache,
            )
        if got != expected:
            hint = ""
            if isinstance(got, list) and len(got) != n:
                hint = f"\n    hint: asked for {n} new tokens, got {len(got)}"
                if w.eos_token_id in expected and len(got) < n:
                    hint += " (end-of-sequence is just a token here: the exercise returns max_new_tokens of them)"
            elif step.tokens_processed > need:
                hint = "\n    hint: the stepper remembers what it has seen; feeding the whole sequence again stores it twice"
            return failed(
                name,
                f"with prompt {prompt} and max_new_tokens={n}\n    expected: {short(expected)}\n    got:      {short(got)}{hint}",
                decode_with_cache,
            )
    return passed(name, f"{len(cases)} prompts decoded like the reference, each token fed to the model once.", fn)
