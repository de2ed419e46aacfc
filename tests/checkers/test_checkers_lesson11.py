"""Lesson 11's checkers: the references pass; plausible wrong proposers and acceptance rules are rejected with the
property they break."""

from __future__ import annotations

import pytest
import torch
from helpers import rejected

from lesson_utils.checks import lesson11
from lesson_utils.lab.spec_math import expected_tokens_per_step, pick_k
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.serving.speculative import accept_greedy, accept_sampled, keep_verified, prompt_lookup

pytestmark = pytest.mark.usefixtures("not_strict")


def test_the_references_pass():
    assert lesson11.check_prompt_lookup(prompt_lookup).passed
    assert lesson11.check_accept_greedy(accept_greedy).passed
    result = lesson11.check_accept_sampled(accept_sampled)
    assert result.passed and "Nothing later in this notebook runs it" in result.message  # the pass message is true
    assert "From here on the notebook uses your code" not in result.message
    assert lesson11.check_keep_verified(keep_verified).passed
    assert lesson11.check_pick_k(pick_k).passed


def test_unsolved_exercises_say_so():
    def stub(*args):
        raise NotImplementedError

    for check in (
        lesson11.check_prompt_lookup,
        lesson11.check_accept_greedy,
        lesson11.check_accept_sampled,
        lesson11.check_keep_verified,
        lesson11.check_pick_k,
    ):
        result = check(stub)
        assert not result.passed and not result.implemented


# ---- wrong proposers ------------------------------------------------------------------------------------------
def latest_match(ids, k):
    """The rule lesson 11 used before it followed vLLM and Hugging Face: the latest earlier occurrence."""
    return prompt_lookup(ids, k, prefer="latest")


def shortest_first(ids, k):
    for n in range(1, min(3, len(ids) - 1) + 1):
        for start in range(0, len(ids) - n):
            if ids[start : start + n] == ids[-n:]:
                return ids[start + n : start + n + k]
    return []


def includes_the_match(ids, k):
    out = prompt_lookup(ids, k + 1)
    return out[:k] if not out else ([ids[-1]] + out)[:k]


def pads_to_k(ids, k):
    out = prompt_lookup(ids, k)
    return out + [0] * (k - len(out))


def eats_the_context(ids, k):
    out = prompt_lookup(ids, k)
    ids.append(0)
    return out


def a_tuple(ids, k):
    return tuple(prompt_lookup(ids, k))


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (latest_match, "which one does prompt lookup use"),
        (shortest_first, "which match length is tried first"),
        (includes_the_match, "expected"),
        (pads_to_k, "expected"),
        (eats_the_context, "changed its input `token_ids`"),
        (a_tuple, "list"),
    ],
)
def test_wrong_proposers_are_rejected(wrong, needle):
    assert rejected(lesson11.check_prompt_lookup(wrong), needle)


# ---- wrong greedy acceptance --------------------------------------------------------------------------------------
def no_bonus(draft, targets):
    return accept_greedy(draft, targets)[:-1]


def counts_matches_anywhere(draft, targets):
    kept = [d for d, t in zip(draft, targets) if d == t]
    return kept + [targets[len(kept)]]


def keeps_the_draft_at_the_mismatch(draft, targets):
    out = accept_greedy(draft, targets)
    a = len(out) - 1
    return out[:-1] + [draft[a]] if a < len(draft) else out


def bonus_from_the_wrong_row(draft, targets):
    out = accept_greedy(draft, targets)
    return out[:-1] + [targets[-1]]


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (no_bonus, "comes for free"),
        (counts_matches_anywhere, "expected"),
        (keeps_the_draft_at_the_mismatch, "whose token is right"),
        (bonus_from_the_wrong_row, "expected"),
    ],
)
def test_wrong_greedy_acceptance_is_rejected(wrong, needle):
    assert rejected(lesson11.check_accept_greedy(wrong), needle)


# ---- wrong rejection sampling ------------------------------------------------------------------------------------
def always_keeps(draft, probs, g):
    return list(draft) + [int(torch.multinomial(probs[len(draft)], 1, generator=g))]


def resamples_from_p(draft, probs, g):
    """On a rejection, draws from p itself rather than p without the rejected token."""
    out = []
    for i, x in enumerate(draft):
        if float(torch.rand(1, generator=g)) < float(probs[i, x]):
            out.append(x)
            continue
        out.append(int(torch.multinomial(probs[i], 1, generator=g)))
        return out
    return out + [int(torch.multinomial(probs[len(draft)], 1, generator=g))]


def judges_every_draft_with_the_first_row(draft, probs, g):
    return accept_sampled(draft, torch.stack([probs[0]] * len(probs)), g)


def greedy_bonus(draft, probs, g):
    out = accept_sampled(draft, probs, g)
    if len(out) == len(draft) + 1:
        out[-1] = int(probs[len(draft)].argmax())
    return out


def changes_probs(draft, probs, g):
    probs[0, draft[0]] = 0
    return accept_sampled(draft, probs, g)


def returns_a_tensor(draft, probs, g):
    return torch.tensor(accept_sampled(draft, probs, g))


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (always_keeps, "which distribution is the replacement drawn from"),
        (resamples_from_p, "which distribution is the replacement drawn from"),
        (judges_every_draft_with_the_first_row, "judged with row 2 of probs"),
        (greedy_bonus, "where does the last token come from"),
        (changes_probs, "changed `probs`"),
        (returns_a_tensor, "a non-empty list of token ids"),
    ],
)
def test_wrong_rejection_sampling_is_rejected(wrong, needle):
    assert rejected(lesson11.check_accept_sampled(wrong), needle)


# ---- wrong rollbacks ---------------------------------------------------------------------------------------------
def _append(seq, tokens, step):
    for t in tokens:
        seq.append_token(t, step)
        if seq.is_finished:
            break


def keeps_the_computed_count(seq, tokens, step, manager):
    _append(seq, tokens, step)
    if not seq.is_finished:
        manager.trim(seq.seq_id, seq.len)


def counts_the_newest_as_computed(seq, tokens, step, manager):
    _append(seq, tokens, step)
    seq.num_computed = seq.len
    if not seq.is_finished:
        manager.trim(seq.seq_id, seq.len)


def subtracts_the_rejected(seq, tokens, step, manager):
    """Right until eos or the last allowed token cuts the kept tokens short."""
    rejected_drafts = len(seq.draft) - (len(tokens) - 1)
    _append(seq, tokens, step)
    seq.num_computed -= rejected_drafts
    if not seq.is_finished:
        manager.trim(seq.seq_id, seq.len)


def keeps_the_lookahead_slots(seq, tokens, step, manager):
    _append(seq, tokens, step)
    seq.num_computed = seq.len - 1


def trims_the_newest_slot_too(seq, tokens, step, manager):
    _append(seq, tokens, step)
    seq.num_computed = seq.len - 1
    if not seq.is_finished:
        manager.trim(seq.seq_id, seq.len - 1)


def adds_past_eos(seq, tokens, step, manager):
    for t in tokens:
        if seq.num_generated < seq.request.output_len:
            seq.append_token(t, step)
    seq.num_computed = seq.len - 1
    if not seq.is_finished:
        manager.trim(seq.seq_id, seq.len)


def drops_the_finishing_token(seq, tokens, step, manager):
    for t in tokens:
        if t == seq.eos_token_id or seq.num_generated + 1 >= seq.request.output_len:
            break
        seq.append_token(t, step)
    seq.num_computed = seq.len - 1
    manager.trim(seq.seq_id, seq.len)


def frees_blocks_by_hand(seq, tokens, step, manager):
    _append(seq, tokens, step)
    seq.num_computed = seq.len - 1
    if not seq.is_finished:
        table = manager._tables[seq.seq_id]  # a learner reaching past the manager's doors
        keep = blocks_needed(seq.len, manager.view.block_size)
        del table.blocks[keep:]
        table.num_tokens = seq.len


def allocates_afresh(seq, tokens, step, manager):
    _append(seq, tokens, step)
    if not seq.is_finished:
        manager.free(seq.seq_id)
        manager.allocate(seq)
    seq.num_computed = seq.len - 1


def stamps_step_zero(seq, tokens, step, manager):
    _append(seq, tokens, 0)
    seq.num_computed = seq.len - 1
    if not seq.is_finished:
        manager.trim(seq.seq_id, seq.len)


def trims_even_when_finished(seq, tokens, step, manager):
    """A correct variant: a finished sequence's table is freed whole anyway."""
    _append(seq, tokens, step)
    seq.num_computed = seq.len - 1
    manager.trim(seq.seq_id, seq.len)


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (keeps_the_computed_count, "`num_computed` came back"),
        (counts_the_newest_as_computed, "is the newest token's computed"),
        (subtracts_the_rejected, "`num_computed` came back"),
        (keeps_the_lookahead_slots, "drafts the model rejected"),
        (trims_the_newest_slot_too, "where will its K/V go"),
        (adds_past_eos, "what happens to the tokens after it"),
        (drops_the_finishing_token, "which did your code miss"),
        (frees_blocks_by_hand, "never by hand"),
        (allocates_afresh, "not the blocks the sequence had"),
        (stamps_step_zero, "which step produced it"),
    ],
)
def test_wrong_rollbacks_are_rejected(wrong, needle):
    assert rejected(lesson11.check_keep_verified(wrong), needle)


def test_a_rollback_that_also_trims_a_finished_sequence_passes():
    assert lesson11.check_keep_verified(trims_even_when_finished).passed


# ---- wrong choices of k -------------------------------------------------------------------------------------------
def _best(a, cost, tokens=expected_tokens_per_step, index=lambda k: k + 1, start=(0, 1.0), ties=False):
    best = start
    for k in range(1, max(cost)):
        s = tokens(a, k) * cost[1] / cost[index(k)]
        if s > best[1] or (ties and s == best[1]):
            best = (k, s)
    return best


def counts_only_the_drafts(a, cost):
    return _best(a, cost, tokens=lambda a, k: expected_tokens_per_step(a, k) - 1)


def formula_without_a_equal_1(a, cost):
    return _best(a, cost, tokens=lambda a, k: (1 - a ** (k + 1)) / (1 - a))


def the_largest_of_equals(a, cost):
    return _best(a, cost, ties=True)


def cost_of_k_tokens(a, cost):
    return _best(a, cost, index=lambda k: k)


def never_turns_it_off(a, cost):
    return _best(a, cost, start=(1, expected_tokens_per_step(a, 1) * cost[1] / cost[2]))


def ignores_the_cost(a, cost):
    k = max(cost) - 1
    return k, expected_tokens_per_step(a, k) * cost[1] / cost[k + 1]


def returns_only_k(a, cost):
    return pick_k(a, cost)[0]


def sorts_the_costs_in_place(a, cost):
    for n in cost:
        cost[n] = round(cost[n], 1)
    return pick_k(a, cost)


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (counts_only_the_drafts, "is it the best"),
        (formula_without_a_equal_1, "when every draft is kept"),
        (the_largest_of_equals, "fewer lookahead slots"),
        (cost_of_k_tokens, "costs what next to a decode step"),
        (never_turns_it_off, "no speculation"),
        (ignores_the_cost, "is it the best"),
        (returns_only_k, "return (k, predicted speedup)"),
        (sorts_the_costs_in_place, "changed `cost`"),
    ],
)
def test_wrong_choices_of_k_are_rejected(wrong, needle):
    assert rejected(lesson11.check_pick_k(wrong), needle)


def uses_the_global_generator(draft, probs, g):
    return accept_sampled(draft, probs, None)


def changes_probs_only_on_rejection(draft, probs, g):
    out = accept_sampled(draft, probs, g)
    if len(out) <= len(draft) and out[-1] != draft[len(out) - 1]:
        probs[len(out) - 1, draft[len(out) - 1]] = 0  # an in-place residual
    return out


def test_a_sampler_that_ignores_its_generator_or_edits_probs_later_is_rejected():
    assert rejected(lesson11.check_accept_sampled(uses_the_global_generator), "generators seeded alike")
    assert rejected(lesson11.check_accept_sampled(changes_probs_only_on_rejection), "changed `probs`")


def cuts_the_continuation_at_the_tail(ids, k):
    out = prompt_lookup(ids, k)
    for n in range(min(3, len(ids) - 1), 0, -1):
        for start in range(0, len(ids) - n):
            if ids[start : start + n] == ids[-n:]:
                return out[: max(0, len(ids) - n - (start + n))] if out else out
    return out


def test_a_continuation_cut_at_the_tail_gets_its_own_hint():
    assert rejected(lesson11.check_prompt_lookup(cuts_the_continuation_at_the_tail), "run into the tail")


def predicts_nan(a, cost):
    return pick_k(a, cost)[0], float("nan")


def test_a_nan_prediction_is_rejected():
    assert rejected(lesson11.check_pick_k(predicts_nan), "you predict nan")


# ---- wrong answers the earlier cases let through (issue 43) -------------------------------------------------------
def tails_up_to_two(ids, k):
    return prompt_lookup(ids, k, max_ngram=2)


def tails_up_to_four(ids, k):
    return prompt_lookup(ids, k, max_ngram=4)


def searches_the_text(ids, k):
    """Right for one-digit ids: "1 2" also matches inside "11 2"."""
    if k <= 0:
        return []
    body = " ".join(map(str, ids[:-1]))
    for n in range(min(3, len(ids) - 1), 0, -1):
        pos = body.find(" ".join(map(str, ids[-n:])))
        if pos >= 0:
            start = body[:pos].count(" ")
            return ids[start + n : start + n + k]
    return []


def looks_back_32_tokens(ids, k):
    return prompt_lookup(ids[-32:], k)


def compares_with_is(draft, targets):
    a = 0
    while a < len(draft) and draft[a] is targets[a]:
        a += 1
    return list(draft[:a]) + [targets[a]]


def forgets_the_extra_token(draft, probs, g):
    out = accept_sampled(draft, probs, g)
    return out[: len(draft)] if len(out) == len(draft) + 1 else out


def argmax_over_the_drafts(a, cost):
    ks = range(1, max(cost))
    k = max(ks, key=lambda k: expected_tokens_per_step(a, k) * cost[1] / cost[k + 1])
    s = expected_tokens_per_step(a, k) * cost[1] / cost[k + 1]
    return (k, s) if s > 1.0 else (0, 1.0)


def reads_costs_by_position(a, cost):
    values, best = list(cost.values()), (0, 1.0)
    for k in range(1, len(values)):
        s = expected_tokens_per_step(a, k) * values[0] / values[k]
        if s > best[1]:
            best = (k, s)
    return best


@pytest.mark.parametrize(
    "check, wrong, needle",
    [
        (lesson11.check_prompt_lookup, tails_up_to_two, "which match length is tried first"),
        (lesson11.check_prompt_lookup, tails_up_to_four, "at most 3 tokens"),
        (lesson11.check_prompt_lookup, searches_the_text, "as ids"),
        (lesson11.check_prompt_lookup, looks_back_32_tokens, "whole context"),
        (lesson11.check_accept_greedy, compares_with_is, "not identity (is)"),
        (lesson11.check_accept_sampled, forgets_the_extra_token, "where does the last token come from"),
        (lesson11.check_pick_k, argmax_over_the_drafts, "max() arg is an empty sequence"),
        (lesson11.check_pick_k, reads_costs_by_position, "out of order"),
    ],
)
def test_wrong_answers_the_old_cases_let_through_are_rejected(check, wrong, needle):
    assert rejected(check(wrong), needle)


# ---- what a learner tried after issue 43's cases (a helper's review) ------------------------------------------------
def cached_by_tail():
    cache = {}

    def propose(ids, k):
        key = (tuple(ids[-3:]), k)
        if key not in cache:
            cache[key] = prompt_lookup(ids, k)
        return list(cache[key])

    return propose


def bonus_row_for_two_drafts(draft, probs, g):
    out = accept_sampled(draft, probs, g)
    if len(out) == len(draft) + 1:  # the bonus drawn from row 2 whatever the draft's length
        out[-1] = int(torch.multinomial(probs[min(2, len(probs) - 1)], 1, generator=g))
    return out


def never_speculates_at_zero(a, cost):
    return (0, 1.0) if a == 0 else pick_k(a, cost)


@pytest.mark.parametrize(
    "check, wrong, needle",
    [
        (lesson11.check_prompt_lookup, cached_by_tail(), "expected"),
        (lesson11.check_accept_sampled, bonus_row_for_two_drafts, "where does the last token come from"),
        (lesson11.check_pick_k, never_speculates_at_zero, "is it the best"),
    ],
)
def test_wrong_answers_a_reviewer_found_are_rejected(check, wrong, needle):
    assert rejected(check(wrong), needle)


# ---- exercise 4: why the rejection rule keeps the distribution ---------------------------------------------------
def _mass_reference(p, q):
    from lesson_utils.lab.spec_math import kept_and_replaced

    return kept_and_replaced(p, q)


def mass_returns_p(p, q):
    return p.clone(), torch.zeros_like(p)


def mass_divides_by_q(p, q):
    return q * torch.clamp(p / q, max=1), (p - q).clamp_min(0)


def mass_residual_normalized(p, q):
    kept = torch.minimum(p, q)
    residual = (p - q).clamp_min(0)
    return kept, residual / residual.sum()


def mass_a_list(p, q):
    return list(_mass_reference(p, q))


def mass_in_float64(p, q):
    return tuple(t.double() for t in _mass_reference(p, q))


def mass_changes_p(p, q):
    out = _mass_reference(p.clone(), q)
    p.zero_()
    return out


def mass_kept_is_q(p, q):
    return q.clone(), (p - q).clamp_min(0)


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (mass_returns_p, "drafts y (q(y)) AND the rule keeps it"),
        (mass_divides_by_q, "without dividing"),
        (mass_residual_normalized, "how likely is a rejection at all"),
        (mass_a_list, "tuple (kept, replaced)"),
        (mass_in_float64, "p's dtype"),
        (mass_changes_p, "changed its input `p`"),
        (mass_kept_is_q, "drafts y (q(y)) AND the rule keeps it"),
    ],
)
def test_wrong_probability_splits_are_rejected(wrong, needle):
    assert rejected(lesson11.check_kept_and_replaced(wrong), needle)


def test_the_probability_split_passes_the_rule_and_never_crashes_on_nonsense():
    assert lesson11.check_kept_and_replaced(_mass_reference).passed
    for nonsense in (lambda p, q: None, lambda p, q: (p,), lambda p, q: 1 / 0, lambda p, q: (p[:2], q[:2])):
        assert not lesson11.check_kept_and_replaced(nonsense).passed
