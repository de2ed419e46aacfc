"""Checker for lesson 07 (the capstone's engine step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.model_runner import ModelRunner
from lesson_utils.serving.step import serve_step
from lesson_utils.types import OutOfBlocks

from .core import CheckResult, failed, not_implemented, passed

MAX_STEPS = 400


class _LogitsRunner(ModelRunner):
    """The model runner, keeping every step's logits: a wrong step can leave the tokens of the tiny ci model
    unchanged (its argmax rarely moves) while the computation under them is wrong."""

    def __init__(self, w, cache):
        super().__init__(w, cache)
        self.logged: list[tuple[list[int], torch.Tensor]] = []

    def logits(self, seqs, counts=None):
        out = super().logits(seqs, counts)
        self.logged.append(([s.seq_id for s in seqs], out.float().cpu()))
        return out


@dataclass
class _Run:
    outputs: list[list[int]]
    finished_per_step: list[list[int]]  # seq ids returned as finished, step by step
    hits: int  # prompt tokens served from the prefix cache
    registered: set  # hashes of the blocks registered in the prefix cache
    logits: list[tuple[list[int], torch.Tensor]]


def _run(w, step_fn, prompts, max_new, num_blocks) -> _Run:
    manager = SharingBlockManager(num_blocks, 4, max_seq_len=w.max_positions)
    cache = PagedKVCache.for_model(w, manager=manager)
    engine = Engine(w, cache, step_fn=step_fn)
    engine.runner = runner = _LogitsRunner(w, cache)
    seqs = [engine.add_request(p, max_new) for p in prompts]  # the later prompts share the first's prefix
    finished = []
    while engine.scheduler.has_work:
        finished.append(sorted(s.seq_id for s in engine.step()))
        if len(finished) > MAX_STEPS:
            raise TimeoutError(f"still running after {MAX_STEPS} steps")
    return _Run(
        [s.output_ids for s in seqs], finished, manager.cached_prompt_tokens, set(manager.pool.block_of), runner.logged
    )


def check_engine_step(fn, w) -> CheckResult:
    """Exercise 07-1: schedule (admit, make room), run, register computed blocks, retire - in that order."""
    name = "engine_step"
    g = torch.Generator().manual_seed(7)
    shared = [w.bos_token_id] + torch.randint(4, w.vocab_size, (12,), generator=g).tolist()
    prompts = [shared + torch.randint(4, w.vocab_size, (n,), generator=g).tolist() for n in (1, 3, 6, 2)]
    ref = _run(w, serve_step, prompts, 6, 12)
    try:
        got = _run(w, fn, prompts, 6, 12)
    except NotImplementedError:
        return not_implemented(name, serve_step)
    except TimeoutError as err:
        return failed(name, f"{err}: do finished sequences ever leave the batch?", serve_step)
    except OutOfBlocks as err:
        return failed(
            name,
            f"the model ran out of blocks ({err}): was there room for every running sequence's next "
            "token before the model ran? (the scheduler can make it, preempting if memory is short)",
            serve_step,
        )
    except Exception as err:  # noqa: BLE001
        return failed(name, f"your step raised {type(err).__name__}: {err}", serve_step)
    if got.outputs != ref.outputs:
        bad = next(i for i, (a, b) in enumerate(zip(got.outputs, ref.outputs)) if a != b)
        return failed(name, f"request {bad} generated {got.outputs[bad]}; expected {ref.outputs[bad]}", serve_step)
    if got.hits != ref.hits or got.registered != ref.registered:
        return failed(
            name,
            f"outputs are right, but the prefix cache served {got.hits} prompt tokens (expected "
            f"{ref.hits}) and holds {len(got.registered)} registered blocks (expected {len(ref.registered)}): "
            "when are computed blocks registered?",
            serve_step,
        )
    if len(got.finished_per_step) > len(ref.finished_per_step):
        return failed(
            name,
            f"serving took {len(got.finished_per_step)} steps instead of {len(ref.finished_per_step)}: "
            "in which step is a new request prefilled with your order of phases?",
            serve_step,
        )
    if got.finished_per_step != ref.finished_per_step:
        step = next(i for i, (a, b) in enumerate(zip(got.finished_per_step, ref.finished_per_step)) if a != b)
        return failed(
            name,
            f"at step {step} your step returned sequences {got.finished_per_step[step]} as finished; "
            f"expected {ref.finished_per_step[step]} (what should a step return?)",
            serve_step,
        )
    for (ids, g), (ref_ids, r) in zip(got.logits, ref.logits):
        if ids != ref_ids or g.shape != r.shape or not torch.allclose(g, r, atol=1e-4, rtol=1e-4):
            return failed(
                name,
                "same tokens, but the model computed other logits along the way: is every step "
                "running the model once, over the right sequences?",
                serve_step,
            )
    return passed(
        name,
        f"same outputs, logits, finished sequences per step, {len(got.finished_per_step)} steps and "
        "prefix-cache hits as the course's engine.",
        fn,
    )
