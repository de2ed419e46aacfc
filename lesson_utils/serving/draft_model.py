"""Lesson 11's second proposer: a smaller model of the same family (one tokenizer) drafts by decoding greedily.

The draft model runs on an :class:`~lesson_utils.serving.engine.Engine` of its own, with its own paged cache - a
share of the KV budget the target's cache does not get. Its block manager keeps prefix caching on, so each call
recomputes a sequence's context only past its last full block: the blocks of a context the draft has seen before
are found by their hashes, and only the tail and the ``k`` drafted tokens are computed (then freed, still findable).
vLLM's draft-model worker keeps a draft KV cache per sequence in the same spirit.
"""

from __future__ import annotations

from lesson_utils.core.types import is_int


class DraftModelProposer:
    """``propose(token_ids, k)``: the ``k`` tokens the draft engine's model decodes greedily after ``token_ids``.

    Invariant: between calls the draft engine serves nothing and holds no block of any table (its freed blocks stay
    in its prefix cache until evicted). The draft engine must not speculate itself, must not stop at eos (a draft is
    exactly ``k`` tokens; the target decides where a request ends) and must share the target's vocabulary."""

    def __init__(self, draft_engine, vocab_size: int | None = None):
        if draft_engine.speculation is not None:
            raise ValueError("the draft engine must not speculate itself: give it no Speculation")
        if draft_engine.stop_at_eos:
            raise ValueError("the draft engine must not stop at eos (stop_at_eos=False): the target decides the end")
        if vocab_size is not None and draft_engine.w.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_engine.w.vocab_size} ids) is not the target's ({vocab_size}): "
                "a draft model must share the target's tokenizer"
            )
        if not draft_engine.manager.view.can_fork:
            raise ValueError("the draft engine needs a sharing block manager with prefix caching (lesson 05's)")
        self.engine = draft_engine
        self.calls = 0
        self.drafted = 0

    @property
    def __name__(self) -> str:
        return "draft model"

    def __call__(self, token_ids: list[int], k: int) -> list[int]:
        if not is_int(k) or k <= 0:
            return []
        room = self.engine.w.max_positions - len(token_ids)
        k = min(k, room)
        if k <= 0:
            return []
        draft = self.engine.generate([list(token_ids)], k)[0]
        self.calls += 1
        self.drafted += len(draft)
        return draft
