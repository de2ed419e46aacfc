"""Lesson 11: speculative decoding - a proposer drafts tokens, the target model verifies them in one forward pass.

A decoding sequence normally feeds one token a step and gets one back. With speculation the scheduler asks a
proposer for up to ``k`` draft tokens (:meth:`Speculation.draft_for`), reserves their slots beside the newest
token's (``manager.append_slot(seq, lookahead=len(draft))``), and the runner feeds the newest token and the drafts
together - a query of ``k + 1`` tokens, as lesson 08's chunks are - returning the target's logits at each of those
positions. ``update_from_output`` then keeps the drafts the target agrees with and one token of the target's own
after them (:func:`accept_greedy`, or :func:`accept_sampled` for temperature > 0: the rejection rule of Leviathan
et al., ICML 2023, and Chen et al., 2023), and rolls back the rest: the computed count, and the blocks only rejected
tokens used (``manager.trim``). Greedy speculation therefore produces exactly the tokens greedy decoding would.

The proposer here is prompt lookup (:func:`prompt_lookup`): the tokens that followed the earliest occurrence of the
context's last few tokens - the rule of vLLM v1's n-gram proposer and of Hugging Face's prompt-lookup decoding - with
no second model, so it runs in every profile. Lesson 11 measures it against the latest occurrence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from lesson_utils.core.types import Sequence, is_int


def prompt_lookup(
    token_ids: list[int], k: int, *, max_ngram: int = 3, min_ngram: int = 1, prefer: str = "earliest"
) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the context's last ``n`` tokens, for the
    longest ``n`` from ``max_ngram`` down to ``min_ngram`` that occurs earlier; ``[]`` when none does (a plain
    decode step then). The continuation may run into the tail itself. ``token_ids`` is not changed.

    The earliest occurrence is what vLLM v1's n-gram proposer (``vllm/v1/spec_decode/ngram_proposer.py``) and Hugging
    Face's ``PromptLookupCandidateGenerator`` take; ``prefer="latest"`` takes the latest instead, the variant lesson 11
    measures against it."""
    if prefer not in ("earliest", "latest"):
        raise ValueError(f"prefer is 'earliest' or 'latest', got {prefer!r}")
    if k <= 0:
        return []
    for n in range(min(max_ngram, len(token_ids) - 1), min_ngram - 1, -1):
        tail = token_ids[-n:]
        starts = range(len(token_ids) - n)  # every earlier place; the tail itself starts at len - n
        for start in reversed(starts) if prefer == "latest" else starts:
            if token_ids[start : start + n] == tail:
                return list(token_ids[start + n : start + n + k])
    return []


def acceptance_rate(verified: list[tuple[int, int, int, int]]) -> float:
    """The share of judged drafts the target kept over ``scheduler.verified`` records - the ``a`` of the independent
    model (a draft after the first rejection is never judged, so it does not count)."""
    judged = sum(min(a + 1, d) for _, _, d, a in verified)
    if not judged:
        raise ValueError("no draft was judged: did the engine speculate?")
    return sum(a for *_, a in verified) / judged


@dataclass
class SimulatedDrafts:
    """A proposer and the target's verdicts, for the simulator (which has no token ids and no logits), fitted to a
    real run: a decoding sequence drafts with probability ``draft_share`` (prompt lookup finds no match otherwise),
    ``lengths`` are the draft lengths it proposed when it did (one drawn, then cut to what the step allows), and
    each draft is kept with probability ``acceptance`` until the first rejection - the independent-acceptance model
    behind ``(1 - a^(k+1)) / (1 - a)``. A model: the lesson checks the simulation it drives against real runs."""

    draft_share: float
    lengths: list[int]
    acceptance: float
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.draft_share <= 1 or not 0 <= self.acceptance <= 1:
            raise ValueError("draft_share and acceptance are shares in [0, 1]")
        if self.draft_share > 0 and not (self.lengths and all(is_int(n) and n > 0 for n in self.lengths)):
            raise ValueError("lengths are the positive draft lengths a real run proposed")
        self._rng = random.Random(self.seed)

    @classmethod
    def fitted(cls, proposals: list[tuple[int, int]], verified: list[tuple[int, int, int, int]], seed: int = 0):
        """From a real run: ``proposals`` - ``(asked, proposed)`` per proposer call - and the scheduler's
        ``verified`` record; the acceptance is the share of judged drafts kept (a draft after a rejection is not
        judged)."""
        if not proposals:
            raise ValueError("no proposer call was recorded")
        lengths = [n for _, n in proposals if n > 0]
        return cls(len(lengths) / len(proposals), lengths, acceptance_rate(verified) if verified else 0.0, seed)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0 or self._rng.random() >= self.draft_share:
            return []
        return [0] * min(k, self._rng.choice(self.lengths))  # ids are a simulation's placeholders

    def accepted(self, drafted: int) -> int:
        """How many of ``drafted`` drafts the target keeps this time."""
        a = 0
        while a < drafted and self._rng.random() < self.acceptance:
            a += 1
        return a


class ProposerError(RuntimeError):
    """A proposer raised while drafting for a sequence (its own error is the ``__cause__``); the message names the
    sequence, so the caller can abort it and serve the others (the step that asked changed nothing)."""


@dataclass
class Speculation:
    """How a scheduler speculates: at most ``k`` drafted tokens per decoding sequence and step, from ``propose``
    (``propose(token_ids, k) -> list of token ids``). A draft never runs past the request's ``max_new_tokens`` (the
    target's own token after the drafts is always the last one it may add), and its ids are checked against the
    vocabulary of the model that verifies it - the scheduler passes its own (``FCFSScheduler(vocab_size=...)``,
    set by the engine), so one ``Speculation`` may serve several engines, each bounded by its own model."""

    k: int
    propose: Callable[[list[int], int], list[int]] = prompt_lookup
    greedy_rule: Callable | None = None  # accept(draft, targets) -> tokens; None: accept_greedy (lesson 11's 2)
    sampled_rule: Callable | None = None  # accept(draft, probs, generator) -> tokens; None: accept_sampled (3)
    settle_rule: Callable | None = None  # settle(seq, tokens, step, manager); None: keep_verified (lesson 11's 5)
    simulated: SimulatedDrafts | None = None  # in a simulation (no ids, no logits): who drafts and what is kept

    @classmethod
    def for_simulation(cls, k: int, drafts: SimulatedDrafts) -> "Speculation":
        """Speculation in the accounting simulator: ``drafts`` decides each step's draft length and how much of it is
        kept, from a real run's record."""
        return cls(k, drafts.propose, simulated=drafts)

    def __post_init__(self):
        if not is_int(self.k) or self.k < 0:
            raise ValueError(f"k (tokens drafted per step) must be an int >= 0, got {self.k!r}")
        if not callable(self.propose):
            raise TypeError(f"propose must be a function (token_ids, k) -> token ids, got {self.propose!r}")

    def draft_for(self, seq: Sequence, budget: int | None = None, vocab_size: int | None = None) -> list[int]:
        """``seq``'s draft for this step, checked: a list (or tuple) of at most ``k`` ints, at most what the request may
        still add minus one, at most ``budget`` (the token budget left), each in ``0 .. vocab_size - 1`` (the verifying
        model's vocabulary; unchecked when None, as in a simulation). Every refusal names the proposer, the sequence
        and what was wrong; an error the proposer raises comes back as :class:`ProposerError` naming the sequence."""
        room = min(self.k, seq.request.output_len - seq.num_generated - 1)
        if budget is not None:
            room = min(room, budget)
        if room <= 0:
            return []
        name = getattr(self.propose, "__name__", type(self.propose).__name__)
        who = f"the proposer {name}, drafting for sequence {seq.seq_id}"
        try:
            draft = self.propose(list(seq.token_ids), room)
        except NotImplementedError:  # an exercise not solved yet: its own polite message
            raise
        except Exception as err:
            raise ProposerError(f"{who}, raised {type(err).__name__}: {err}") from err
        if not isinstance(draft, (list, tuple)):
            raise TypeError(f"{who}, returned {type(draft).__name__}; a proposer returns a list of token ids")
        if len(draft) > room:
            raise ValueError(
                f"{who}, returned {len(draft)} tokens, but was asked for at most {room} (k = {self.k}, and the "
                "request's remaining tokens)"
            )
        for i, t in enumerate(draft):
            if not is_int(t):
                raise TypeError(f"{who}, returned {t!r} ({type(t).__name__}) as token {i}: token ids are ints")
            if vocab_size is not None and not 0 <= t < vocab_size:
                raise ValueError(
                    f"{who}, returned {t} as token {i}, outside the verifying model's vocabulary of {vocab_size} ids"
                )
        return [int(t) for t in draft]

    def draft_running(self, running: list[Sequence], budget: int | None, vocab_size: int | None = None) -> None:
        """Set each plain decoding sequence's draft (not a beam, not one with uncomputed tokens or samples still to
        fork), the drafts together within ``budget`` tokens when one is given, ids within ``vocab_size``."""
        for s in running:
            if s.beam is not None or s.pending_forks or s.num_computed != s.len - 1 or not s.num_generated:
                continue
            s.draft = self.draft_for(s, budget, vocab_size)
            if budget is not None:
                budget -= len(s.draft)


def keep_verified(seq: Sequence, tokens: list, step: int, manager) -> None:
    """Settle one verifying sequence after its step (the runner computed its newest token and every draft):
    append ``tokens`` (the kept drafts and the target's own token) in order, stopping after one that finishes the
    request (eos, or its last allowed token - never a token past it); then roll back what the rejected drafts took:
    the computed count (every token but the newest has its K/V; rejected drafts' K/V no longer count) and, unless it
    finished (its blocks are freed whole), the slots past its tokens - ``manager.trim`` gives back blocks only
    rejected drafts used, one reference each, so a block a forked sibling shares stays with it.

    Invariant afterwards: ``num_computed == len - 1`` and the table holds exactly ``len`` tokens' slots."""
    for t in tokens:
        seq.append_token(t, step)
        if seq.is_finished:
            break
    seq.num_computed = min(seq.num_computed, seq.len - 1)
    if not seq.is_finished:
        manager.trim(seq.seq_id, seq.len)


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """Greedy verification: ``targets[i]`` is the target's argmax after the newest token and the first ``i`` drafts
    (``len(draft) + 1`` of them). Keeps the longest prefix of ``draft`` that equals ``targets``, then the target's own
    token after it - at least one token, at most ``len(draft) + 1``."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return list(draft[:a]) + [int(targets[a])]


def accept_sampled(draft: list[int], probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """Rejection sampling with a deterministic proposer (its distribution ``q`` is one-hot on each draft token):
    draft token ``x`` at position ``i`` is kept with probability ``min(1, p_i(x) / q_i(x)) = p_i(x)``; at the first
    rejection the token is drawn from ``max(0, p_i - q_i)`` normalized - ``p_i`` without ``x`` - and the rest is
    dropped; when every draft is kept one more token is drawn from ``p_{len(draft)}``. The output is distributed as
    sampling from the target alone. ``probs`` is ``[len(draft) + 1, vocab]`` on the host."""
    out = []
    for i, x in enumerate(draft):
        if float(torch.rand(1, generator=generator)) < float(probs[i, x]):
            out.append(int(x))
            continue
        residual = probs[i].clone()
        residual[x] = 0
        total = float(residual.sum())
        if total <= 0:  # p was one-hot on x: a rejection has probability 0 there
            out.append(int(x))
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out
