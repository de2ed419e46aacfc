"""The course's forward against Hugging Face's on the trained model (SmolLM2-135M-Instruct, 4-bit GGUF weights).

``python -m course_tools.bench_trained`` times, on this machine's device and the profile's dtype:

* a **decode step** (ms per step) at batch 1, 4 and 16 (every sequence 128 tokens in, one new token each; HF's
  ``DynamicCache`` against the course's dense cache, its paged cache as the engine builds it on this device (on a CPU:
  each sequence's K/V gathered and attended on its own) and the paged cache serving every decode through one padded
  gather (a GPU's default));
* a **256-token prefill** of one sequence.

The protocol is the course's (:func:`lesson_utils.lab.timing.measure`): one warm-up per variant, ``--repeats`` rounds
in alternating order, medians with min-max. Each sample times ``--steps`` decode steps (or one prefill) from a state
built before the clock starts, so no copy is timed. It is a benchmark, not a test: it prints a table and the ratio
course / HF per point (the goal is at most 1.1x), and the contention probe's warning when another process was busy.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Callable

import torch


class Bench:
    """Samplers for one loaded model: each ``*_sampler`` builds a state (untimed) and returns a call that times its
    work on that state, in seconds, waiting for the device before the clock stops."""

    def __init__(self, profile):
        from lesson_utils.model import weights_from_hf
        from lesson_utils.model.loading import TRAINED_MODEL, load_model

        self.lm = load_model(TRAINED_MODEL, profile=profile)
        self.w = weights_from_hf(self.lm.model)
        self.dev = self.w.device
        self.gen = torch.Generator().manual_seed(0)

    def prompts(self, batch: int, n: int) -> list[list[int]]:
        return torch.randint(100, self.w.vocab_size, (batch, n), generator=self.gen).tolist()

    def _clock(self, work: Callable[[], object]) -> float:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        work()
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _hf_prefill(self, ids):
        with torch.inference_mode():
            out = self.lm.model(torch.tensor(ids, device=self.dev), use_cache=True)
        return out.past_key_values, out.logits[:, -1:].argmax(-1)

    def hf_decode(self, ids, steps: int) -> Callable[[], float]:
        cache, nxt = self._hf_prefill(ids)
        state = {"cache": copy.deepcopy(cache), "next": nxt}

        def work() -> None:
            with torch.inference_mode():
                for _ in range(steps):
                    out = self.lm.model(state["next"], past_key_values=state["cache"], use_cache=True)
                    state["cache"], state["next"] = out.past_key_values, out.logits[:, -1:].argmax(-1)

        return lambda: self._clock(work)

    def _course_cache(self, kind: str, batch: int, tokens: int):
        from lesson_utils.cache.dense import DenseKVCache
        from lesson_utils.cache.paged import PagedKVCache
        from lesson_utils.memory.block_table import blocks_needed

        if kind == "dense":
            return DenseKVCache(self.w.num_layers)
        batched = {"paged": None, "paged, batched": True}[kind]  # None: the engine's choice for this device
        cache = PagedKVCache.for_model(self.w, batch * (blocks_needed(tokens, 16) + 1), 16, batched_decode=batched)
        for s in range(batch):
            cache.manager.blocks.reserve(s, tokens)
        return cache

    def course_decode(self, ids, steps: int, kind: str) -> Callable[[], float]:
        from lesson_utils.cache.seam import StepBatch

        b, n = len(ids), len(ids[0])
        cache = self._course_cache(kind, b, n + steps)
        logits = self.w.forward_step(StepBatch.build(list(range(b)), ids, [0] * b, device=self.dev), cache)
        state = {"next": logits.argmax(-1).tolist()}

        def work() -> None:
            for j in range(steps):
                batch = StepBatch.build(list(range(b)), [[t] for t in state["next"]], [n + j] * b, device=self.dev)
                state["next"] = self.w.forward_step(batch, cache).argmax(-1).tolist()

        return lambda: self._clock(work)

    def hf_prefill(self, ids) -> Callable[[], float]:
        return lambda: self._clock(lambda: self._hf_prefill(ids))

    def course_prefill(self, ids, kind: str) -> Callable[[], float]:
        from lesson_utils.cache.seam import StepBatch

        cache = self._course_cache(kind, 1, len(ids[0]))
        return lambda: self._clock(lambda: self.w.forward_step(StepBatch.build([0], ids, [0], device=self.dev), cache))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per sample")
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args(argv)

    from lesson_utils.core.env import get_profile
    from lesson_utils.lab import timing

    profile = get_profile()
    bench = Bench(profile)
    points = [(f"decode, batch {b}", bench.prompts(b, args.context), b) for b in (1, 4, 16)]
    points.append(("prefill, 256 tokens", bench.prompts(1, 256), None))
    print(f"{bench.lm.source}; {profile.label()}; {args.repeats} repeats after 1 warm-up, alternating order")
    kinds = ("dense", "paged", "paged, batched")
    print(
        f"{'point':<22}{'HF':>34}"
        + "".join(f"{'course ' + k:>34}" for k in kinds)
        + "".join(f"{k + ' / HF':>30}" for k in kinds)
    )
    for label, ids, batch in points:
        if batch:  # a fresh state per sample (built before its clock starts): no sample decodes on another's cache
            per = args.steps
            variants = {"HF": lambda ids=ids: bench.hf_decode(ids, args.steps)()}
            variants.update({k: lambda ids=ids, k=k: bench.course_decode(ids, args.steps, k)() for k in kinds})
        else:
            per = 1
            variants = {"HF": lambda ids=ids: bench.hf_prefill(ids)()}
            variants.update({k: lambda ids=ids, k=k: bench.course_prefill(ids, k)() for k in kinds})
        m = timing.measure(
            variants, repeats=args.repeats, value=lambda seconds, _wall, per=per: seconds * 1e3 / per, unit="ms"
        )
        cells = "".join(f"{m[v].text(digits=1):>34}" for v in ("HF", *kinds))
        ratios = "".join(f"{m.ratio(v, 'HF').text():>30}" for v in kinds)
        print(f"{label:<22}{cells}{ratios}")
        if m.warning():
            print("   " + m.warning())


if __name__ == "__main__":
    main()
