"""Lesson 11's exercise 5, the rollback: one verifying sequence settled on a real block manager (prefix caching on,
forked siblings sharing blocks) and compared, property by property, with a rollback through ``manager.trim``."""

from __future__ import annotations

import random

from .core import CheckResult, call_learner, failed, not_implemented, passed

# ---- the rollback: one verifying sequence settled on a real block manager (prefix caching on, forks sharing) ----
_EOS = 2


def _settle_cases() -> list[tuple]:
    """``(block_size, context, draft, tokens, output_len, sibling)``: a sequence whose newest token is the context's
    last, verified with ``draft``; ``tokens`` is what the acceptance rule kept (the kept drafts, then the target's)."""
    cases = [
        (4, [7, 8, 9, 10, 11, 12], [13, 14, 15, 16], [13, 20], 20, False),  # one kept: two slots and a block go back
        (3, [7, 8, 9, 10, 11], [12, 13, 14, 15], [30], 20, False),  # none kept (block size 3: not a power of two)
        (5, [7, 8, 9, 10, 11, 12, 13], [14, 15, 16], [14, 15, 16, 17], 20, False),  # all kept: nothing goes back
        (4, [7, 8, 9, 10, 11], [12, _EOS, 14], [12, _EOS, 14, 15], 20, False),  # eos inside the kept drafts
        (3, [7, 8, 9, 10], [12, 13, 14, 15], [12, 13, 14, 15, 16], 4, False),  # the request's last token inside them
        (4, [7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18], [14, 40], 20, True),  # a forked sibling shares blocks
        (1, [7, 8, 9], [10, 11, 12], [10, 11, 50], 20, True),  # block size 1, a sibling
        (6, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [18, 19], [18, 19, 20], 20, False),  # a block fills up
    ]
    rng = random.Random(14)
    for _ in range(24):
        bs = rng.choice([1, 2, 3, 4, 5, 7])
        ctx = [rng.randrange(5, 60) for _ in range(rng.randrange(2, 14))]
        k = rng.randrange(1, 7)
        draft = [rng.randrange(5, 60) for _ in range(k)]
        a = rng.randrange(0, k + 1)
        own = rng.randrange(5, 60) if a == k else next(t for t in range(5, 60) if t != draft[a])
        tokens = draft[:a] + [own]
        if rng.random() < 0.2:  # eos among the kept tokens
            tokens[rng.randrange(len(tokens))] = _EOS
        output_len = rng.choice([20, 1 + rng.randrange(1, len(tokens) + 1)])
        cases.append((bs, ctx, draft, tokens, output_len, rng.random() < 0.3))
    return cases


def _verified_state(case):
    """A block manager and the sequence just after its verify step (plus its forked sibling, or None)."""
    from lesson_utils.core.types import Request, Sequence
    from lesson_utils.memory.sharing import SharingBlockManager

    bs, ctx, draft, _, output_len, sibling = case
    manager = SharingBlockManager(40, bs, enable_prefix_caching=True, watermark=0.0)
    request = Request(1, 0.0, len(ctx) - 1, output_len, prompt_ids=list(ctx[:-1]))
    seq = Sequence(request, eos_token_id=_EOS, output_ids=[ctx[-1]], num_generated=1, token_steps=[0])
    manager.allocate(seq)
    seq.num_computed = seq.len - 1
    manager.cache_computed(seq)
    sib = None
    if sibling:
        manager.fork(seq.seq_id, 2)
        sib = seq.fork(2)
    seq.draft = list(draft)
    manager.append_slot(seq, len(draft))  # the lookahead slots, as the scheduler reserves them
    manager.pop_copies()
    seq.num_computed += len(draft) + 1  # the runner computed the newest token and every draft
    return manager, seq, sib


def _settled(manager, seq) -> dict:
    """What the engine would see after the learner's settle, the prefix cache registration and (if finished) the
    release - every property the check compares, in the order its hints go."""
    out = {
        "tokens": seq.token_ids,
        "steps": list(seq.token_steps),
        "finished": seq.is_finished,
        "num_computed": seq.num_computed,
    }
    try:
        manager.view.check_invariants()
        out["invariants"] = None
    except AssertionError as e:
        out["invariants"] = str(e)
    table = manager.view.table_of(seq.seq_id)
    # a finished sequence's table is freed whole next, trimmed or not
    out["table"] = None if table is None or seq.is_finished else (list(table.blocks), table.num_tokens)
    sibling = manager.view.table_of(2)
    out["sibling"] = None if sibling is None else (list(sibling.blocks), sibling.num_tokens)
    if out["invariants"] is None and table is not None:
        manager.cache_computed(seq)  # what update_from_output does next
        if seq.is_finished:
            manager.free(seq.seq_id)
    out["free"] = manager.num_free_blocks
    out["refs"] = [manager.view.ref_count(b) for b in range(manager.view.num_blocks)]
    out["prefix cache"] = manager.view.cached_blocks()
    return out


def _settle_hint(want: dict, got: dict) -> str | None:
    """Which property differs, said as a question; None when none does."""
    if got["tokens"] != want["tokens"]:
        if len(got["tokens"]) > len(want["tokens"]):
            return (
                f"the sequence came back with {len(got['tokens'])} tokens, but a kept token ended the request before "
                "that: when one does (eos, or the request's last allowed token), what happens to the tokens after it?"
            )
        return "every kept token up to the one that ends the request is added, in order: which did your code miss?"
    if got["steps"] != want["steps"]:
        return "a token is added with `seq.append_token(token, step)`: which step produced it?"
    if got["num_computed"] != want["num_computed"]:
        return (
            f"`num_computed` came back {got['num_computed']} for a sequence of {len(want['tokens'])} tokens: whose K/V "
            "are in the cache and still the sequence's after the rejected drafts - and is the newest token's computed?"
        )
    if got["invariants"] is not None:
        return (
            f"the block manager's invariant broke ({got['invariants']}): blocks go back through the block manager "
            "(`manager.trim`), never by hand"
        )
    if got["sibling"] != want["sibling"]:
        return "the forked sibling's table changed: another sequence's rollback must never touch a block it shares"
    if got["table"] != want["table"] and want["table"] is not None:
        held, n = (got["table"][1] if got["table"] else 0), len(want["tokens"])
        if held > want["table"][1]:
            return (
                f"the table still holds slots for {held} tokens while the sequence has {n}: what happens to the "
                "slots reserved for drafts the model rejected?"
            )
        if held < n:
            return (
                f"the table holds slots for {held} tokens while the sequence has {n}: the newest token is fed next "
                "step - where will its K/V go?"
            )
        return (
            "the table holds the right number of slots, but not the blocks the sequence had: the kept tokens' K/V "
            "are in those blocks - what gives back only the ones past them?"
        )
    if got["free"] != want["free"] or got["refs"] != want["refs"]:
        return "the free blocks or the blocks' reference counts differ from a rollback through `manager.trim`"
    if got["prefix cache"] != want["prefix cache"]:
        return "the prefix cache registered a block as full that holds a token whose K/V is not the sequence's"
    if got != want:  # pragma: no cover - every property above
        return "the state after your rollback differs from the reference's"
    return None


def check_keep_verified(fn) -> CheckResult:
    """Exercise 11-5: ``keep_verified(seq, tokens, step, manager)`` - add the kept tokens up to the one that ends the
    request, roll the computed count back to the tokens whose K/V are the sequence's, and give back the slots (and the
    blocks) only rejected drafts used through ``manager.trim``; checked on a real block manager with prefix caching on
    and forked siblings sharing blocks, at block sizes 1 to 7."""
    from lesson_utils.serving.speculative import keep_verified

    name = "keep_verified"
    for case in _settle_cases():
        tokens = case[3]
        ref_manager, ref_seq, _ = _verified_state(case)
        keep_verified(ref_seq, list(tokens), 5, ref_manager)
        want = _settled(ref_manager, ref_seq)
        manager, seq, _ = _verified_state(case)
        try:
            _, err = call_learner(fn, seq, list(tokens), 5, manager)
        except NotImplementedError:
            return not_implemented(name, keep_verified)
        bs, ctx, draft = case[0], case[1], case[2]
        where = (
            f"a sequence of {len(ctx)} tokens (block size {bs}{', sharing blocks with a forked sibling' if case[5] else ''}) "
            f"verified the draft {draft} and the rule kept {tokens}"
        )
        if err is not None:
            return failed(name, f"for {where}, your code raised {type(err).__name__}: {err}", keep_verified)
        problem = _settle_hint(want, _settled(manager, seq))
        if problem:
            return failed(name, f"for {where}: {problem}", keep_verified)
    return passed(
        name,
        f"on {len(_settle_cases())} verifications (block sizes 1 to 7, eos and the last allowed token inside the "
        "kept drafts, forked siblings sharing blocks, prefix caching on) the tokens, the computed count, the tables, "
        "the free blocks and the prefix cache match a rollback through `manager.trim`.",
        fn,
    )
