"""Helpers shared by several test modules (import them: ``from helpers import hf_greedy, rejected``).

pytest puts this folder on ``sys.path`` (its default "prepend" import mode), so a plain import works.
"""

from __future__ import annotations

import torch

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.lab.identity import near_tie_threshold

# top-1 minus top-2 logit along HF's greedy path: the identity rule's fp32 near-tie threshold (fp32 noise ~1e-6)
MIN_MARGIN = near_tie_threshold(torch.float32)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None, *, check_ties: bool = True) -> list[int]:
    """HF's greedy continuation of one unpadded prompt, cut right after the first eos (generate stops there).

    With ``check_ties`` the test fails loudly if any step's top two logits are within ``MIN_MARGIN``. Tests
    then compare outputs with ``==``: that IS the identity rule (lesson_utils.lab.identity) when HF's path has no
    near-tie - in fp32 on a CPU the rule asks for every token.
    """
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=1,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    if check_ties:
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            assert (top2[0] - top2[1]).item() > MIN_MARGIN, "near-tie on HF's greedy path; pick other prompts"
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens


def assert_identical(model, prompts: list[list[int]], expected: list[list[int]], got: list[list[int]]) -> None:
    """The identity rule itself (lesson_utils.lab.identity), for comparisons whose prompts were not screened for
    near-ties: a divergence passes only where HF's top-2 margin is below the fp32 threshold."""
    from lesson_utils.lab import identity

    report = identity.compare_all(model, prompts, expected, got)
    assert report.ok, report.failures()


def merge_unchecked(holes, start, length):
    """Lesson 01's release without its double-free check: insert the range and merge touching or overlapping
    holes (the core of two plausible wrong answers)."""
    merged = []
    for h in sorted(holes + [(start, length)]):
        if merged and merged[-1][0] + merged[-1][1] >= h[0]:
            merged[-1] = (merged[-1][0], max(merged[-1][0] + merged[-1][1], h[0] + h[1]) - merged[-1][0])
        else:
            merged.append(h)
    return merged


def rejected(result, *needles) -> bool:
    """A checker's result says "wrong" (not "unsolved") and its message names every one of ``needles``."""
    assert not result.passed and result.implemented, result.message
    for needle in needles:
        assert needle in result.message, f"{needle!r} not in:\n{result.message}"
    return True


def random_step(gen, seq_ids, lens_before, *, prompt_most: int = 20, then_most: int = 4):
    """A StepBatch of random token ids: 1 to ``prompt_most - 1`` tokens for a sequence with nothing cached
    yet (its prompt), 1 to ``then_most - 1`` for one already cached (one token: a decode)."""
    from lesson_utils.cache.seam import StepBatch

    news = []
    for before in lens_before:
        n = int(torch.randint(1, prompt_most if before == 0 else then_most, (1,), generator=gen))
        news.append(torch.randint(4, 100, (n,), generator=gen).tolist())
    return StepBatch.build(seq_ids, news, lens_before)


def step_beside_dense(cache, ref, gen, lens: dict[int, int], heads: int, dim: int, **step_kw):
    """Run one random step through ``cache`` and the dense reference ``ref`` side by side: every layer's
    attention must match. Updates ``lens`` (sequence id -> tokens cached) and returns the batch."""
    ids = sorted(lens)
    batch = random_step(gen, ids, [lens[i] for i in ids], **step_kw)
    cache.prepare(batch), ref.prepare(batch)
    for layer in range(ref.num_layers):
        k, v, q = (torch.randn(batch.num_tokens, heads, dim, generator=gen) for _ in range(3))
        cache.write(layer, batch, k, v), ref.write(layer, batch, k, v)
        torch.testing.assert_close(cache.attend(layer, batch, q, 0.3), ref.attend(layer, batch, q, 0.3))
    for i, c in zip(batch.seq_ids, batch.context_lens):
        lens[i] = c
    return batch


def assert_simulation_complete(res, requests, total_slots: int) -> None:
    """A simulation finished every request with its full output, and every slot was accounted for at
    every step (token states + reserved + fragmentation + free == the whole cache)."""
    import numpy as np

    from lesson_utils.serving import simulator

    assert len(res.finished) == len(requests)
    assert sorted(s.seq_id for s in res.finished) == sorted(r.req_id for r in requests)
    assert all(s.num_generated == s.request.output_len for s in res.finished)
    assert np.all(sum(res.kinds[k] for k in simulator.KINDS) == total_slots)


class ReservesSlots:
    """Mixed into a paged cache for tests that drive the forward pass without a scheduler (``generate_greedy``, bare
    ``forward`` calls): it reserves each step's slots itself, as the scheduler would, before ``prepare``."""

    def prepare(self, batch) -> None:
        for sid, clen in zip(batch.seq_ids, batch.context_lens):
            self.manager.blocks.reserve(sid, clen)
        super().prepare(batch)


class ReservingPagedKVCache(ReservesSlots, PagedKVCache):
    """Lesson 03's paged cache that reserves its own slots (:class:`ReservesSlots`)."""


def reference_beam_search(model, prompt: list[int], k: int, max_new_tokens: int) -> list[int]:
    """Fixed-length beam search with no cache: every beam is run from scratch through HF each step."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logp = torch.stack(
                [
                    torch.log_softmax(model(torch.tensor([prompt + toks])).logits[0, -1].float(), dim=-1)
                    for toks, _ in beams
                ]
            )
            total = (torch.tensor([sc for _, sc in beams], dtype=torch.float32)[:, None] + logp).flatten()
            order = torch.argsort(-total, stable=True)
            if len(order) > k:  # who survives is well defined: no near-tie at the cut
                assert (total[order[k - 1]] - total[order[k]]).item() > MIN_MARGIN, "near-tie at the beam cut"
            vocab = logp.shape[1]
            beams = [(beams[i // vocab][0] + [i % vocab], float(total[i])) for i in order[:k].tolist()]
    scores = sorted((sc for _, sc in beams), reverse=True)
    if k > 1:  # which one is best is well defined too
        assert scores[0] - scores[1] > MIN_MARGIN, "near-tie between the best beams"
    return max(beams, key=lambda b: b[1])[0]
