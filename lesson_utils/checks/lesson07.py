"""Checker for lesson 07 (the capstone's engine step)."""

from __future__ import annotations

import torch

from ..block_allocator import OutOfBlocks
from ..engine import Engine, default_step
from ..paged_cache import PagedKVCache
from ..sharing import SharingBlockManager
from .core import CheckResult, failed, not_implemented, passed

MAX_STEPS = 400


def _run(w, step_fn, prompts, max_new, num_blocks):
    manager = SharingBlockManager(num_blocks, 4, max_seq_len=w.max_positions)
    cache = PagedKVCache.for_model(w, manager=manager, dtype=w.embed_tokens.dtype, device=str(w.embed_tokens.device))
    engine = Engine(w, cache, step_fn=step_fn)
    seqs = []
    for p in prompts:  # the later prompts share the first's prefix and arrive after it finished
        seqs.append(engine.add_request(p, max_new))
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        steps += 1
        if steps > MAX_STEPS:
            raise TimeoutError(f"still running after {MAX_STEPS} steps")
    return [s.output_ids for s in seqs], steps, manager


def check_engine_step(fn, w) -> CheckResult:
    """Exercise 07-1: admit, make room, run, register computed blocks, retire - in that order."""
    name = "engine_step"
    g = torch.Generator().manual_seed(7)
    shared = [w.bos_token_id] + torch.randint(4, w.vocab_size, (12,), generator=g).tolist()
    prompts = [shared + torch.randint(4, w.vocab_size, (n,), generator=g).tolist() for n in (1, 3, 6, 2)]
    want, want_steps, ref_mgr = _run(w, default_step, prompts, 6, 12)
    try:
        got, steps, mgr = _run(w, fn, prompts, 6, 12)
    except NotImplementedError:
        return not_implemented(name, default_step)
    except TimeoutError as err:
        return failed(name, f"{err}: finished sequences must leave the batch (scheduler.retire_finished(step))", default_step)
    except OutOfBlocks as err:
        return failed(name, f"the model ran out of blocks ({err}): make room for every running sequence's next token "
                      "(scheduler.reserve_next_slots()) before running the model - it preempts when memory is short", default_step)
    except Exception as err:  # noqa: BLE001
        return failed(name, f"your step raised {type(err).__name__}: {err}", default_step)
    if got != want:
        bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        return failed(name, f"request {bad} generated {got[bad]}; expected {want[bad]}", default_step)
    if ref_mgr.cached_prompt_tokens and not mgr.cached_prompt_tokens:
        return failed(name, "outputs are right, but the prefix cache never hit: after running the model, register each "
                      "running sequence's computed blocks (manager.cache_computed(seq))", default_step)
    if steps > want_steps:
        return failed(name, f"serving took {steps} steps instead of {want_steps}: admit new requests before running the "
                      "model, so they are prefilled in the step they are admitted", default_step)
    return passed(name, f"same outputs, same {steps} steps and the same prefix-cache hits as the course's engine.", fn)
