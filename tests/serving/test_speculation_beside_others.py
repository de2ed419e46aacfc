"""Speculation beside everything else a step settles: a request with ``n > 1`` samples (greedy or seeded sampling)
admitted while another sequence verifies drafts is forked in the step that finishes its prompt and settled by the same
rules as in an engine that does not speculate; a victim swapped out keeps no slot reserved for its drafts; a proposer's
refusal names the sequence; one ``Speculation`` serves two engines, each bounded by its own vocabulary."""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.lab.engine_kinds import engine_kinds
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.model.catalog import random_causal_lm, tiny_config
from lesson_utils.model.weights import weights_from_hf
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.speculative import ProposerError, Speculation, prompt_lookup

MARK = 300  # a prompt's second token: the proposer drafts only for prompts that carry it


def _sharing(w, num_blocks: int, **kw) -> SharingBlockManager:
    return SharingBlockManager(num_blocks, 4, max_seq_len=w.max_positions, **kw)


def _forking_kinds(w) -> dict:
    """Every paged engine kind of the registry, on a manager that can fork (parallel sampling needs one)."""
    size = dict(num_blocks=90, short_blocks=24, budget=7, forking=True)
    return {k.name: partial(k.build, w, **size) for k in engine_kinds(paged=True)}


def _drafts_for_marked(ids: list[int], k: int) -> list[int]:
    """Prompt lookup for a marked prompt (repeating, so some drafts are kept), a wrong guess when it finds nothing;
    no draft for any other sequence (so its tokens are drawn exactly as without speculation)."""
    if len(ids) < 2 or ids[1] != MARK:
        return []
    return prompt_lookup(ids, k) or [ids[-1]] * k


def _workload(rng: random.Random, vocab: int, n_spec: int, n_multi: int):
    """``(arrival step, prompt, n, temperature, seed)``: speculating greedy requests (marked, repeating) and ``n > 1``
    requests - greedy or seeded sampled - arriving over the first steps."""
    out = []
    for _ in range(n_spec):
        motif = [rng.randrange(4, 250) for _ in range(rng.randrange(2, 4))]
        out.append((rng.randrange(0, 2), [2, MARK] + motif * rng.randrange(2, 4), 1, 0.0, None))
    for _ in range(n_multi):
        temperature = rng.choice([0.0, 1.0])
        prompt = [2] + [rng.randrange(4, 250) for _ in range(rng.randrange(3, 9))]
        out.append((rng.randrange(1, 5), prompt, rng.choice([2, 3, 4]), temperature, rng.randrange(1000)))
    return out


def _serve(engine: Engine, workload, new: int):
    """Add each request at its step, step until done; every request's samples' tokens, in workload order."""
    firsts: list = [None] * len(workload)
    step = 0
    while step < 200 and (engine.scheduler.has_work or any(f is None for f in firsts)):
        for i, (at, prompt, n, temperature, seed) in enumerate(workload):
            if at == step:
                firsts[i] = engine.add_request(prompt, new, n=n, temperature=temperature, seed=seed)
        if engine.scheduler.has_work:
            engine.step()
        step += 1
    assert not engine.scheduler.has_work
    return [[s.output_ids for s in f.samples] for f in firsts]


def _all_free(engine) -> bool:
    m = engine.manager
    return m.num_free_blocks == m.view.num_blocks and not m.view.tables_now()


def _check_beside_speculation(w, kind: str, workload, new: int, k: int) -> None:
    make = _forking_kinds(w)[kind]
    want = _serve(make(stop_at_eos=False), workload, new)
    engine = make(stop_at_eos=False, speculation=Speculation(k, _drafts_for_marked))
    got = _serve(engine, workload, new)
    for (_, _, n, _, _), samples in zip(workload, got):
        assert len(samples) == n and all(len(s) == new for s in samples), (kind, n, samples)
    assert got == want, kind
    assert _all_free(engine), kind
    assert engine.scheduler.verified, "nothing was verified: the case under test did not happen"


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    k=st.integers(1, 4),
    kind=st.sampled_from([k.name for k in engine_kinds(paged=True, kernels=False)]),
)
def test_parallel_samples_beside_a_speculating_sequence_are_those_of_an_engine_without_it(tiny, seed, k, kind):
    """Random workloads: speculating requests and ``n > 1`` requests (greedy, or sampled with a seed) that arrive while
    drafts are being verified. Every request gets its ``n`` samples, each the tokens the same engine gives without
    speculation (the samples that do not draft draw from their own generators exactly as there)."""
    _, w = tiny
    rng = random.Random(seed)
    _check_beside_speculation(w, kind, _workload(rng, w.vocab_size, rng.randrange(1, 3), rng.randrange(1, 3)), 8, k)


@pytest.mark.parametrize("kind", [k.name for k in engine_kinds(paged=True, kernels=True)])
def test_parallel_samples_beside_speculation_on_the_kernel_kinds(tiny, kind):
    _, w = tiny
    workload = [(0, [2, MARK, 40, 41, 40, 41], 1, 0.0, None), (1, [2, 9, 10], 2, 0.0, None), (1, [2, 12], 2, 1.0, 5)]
    _check_beside_speculation(w, kind, workload, 3, 2)


def test_the_issues_reproduction_forks_every_sample(tiny):
    """The report's case: one request decoding with drafts for one step, then ``n=3`` greedy and ``n=4`` sampled
    requests. Before the fix the sampled ones came back as one sample, or four that shared their first tokens."""
    _, w = tiny
    engine = _forking_kinds(w)["paged"](stop_at_eos=False, speculation=Speculation(2, lambda ids, k: [7] * k))
    engine.add_request([2, 5, 6, 7], 12)
    engine.step()
    a = engine.add_request([2, 9, 10, 11], 6, n=3)
    b = engine.add_request([2, 19, 10, 11], 6, n=4, temperature=1.0, seed=3)
    engine.run()
    assert len(a.samples) == 3 and len(b.samples) == 4
    assert len({tuple(s.output_ids[:2]) for s in b.samples}) == 4, "samples drawn as copies of one another"
    assert _all_free(engine)


# ---- sampled samples that draft: distributed as the target ------------------------------------------------------
def _randomized_pit(model, samples, prompt, temperature: float, rng: torch.Generator) -> list[float]:
    """For every sampled token ``x`` at its position, with the vocabulary ordered from the most to the least likely
    token there under the target (teacher-forced by HF): ``P(tokens before x) + U * p(x)``. Uniform on [0, 1] exactly
    when each token is drawn from the target; tokens the target finds unlikely push it towards 1."""
    out = []
    for tokens in samples:
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
        probs = torch.softmax(logits / temperature, dim=-1)
        for row, x in zip(probs, tokens):
            below = float(row[row > row[x]].sum())
            out.append(below + float(torch.rand(1, generator=rng, dtype=torch.float64)) * float(row[x]))
    return out


TEMPERATURE = 0.5  # peaked enough (about 2.7 nats on the tiny model) that a wrong token stands out


def _sampled_with_drafts(w, sampled_rule=None) -> list[tuple[list[int], list[list[int]]]]:
    """Sampled ``n = 4`` requests that draft (a fixed wrong guess and prompt lookup, so drafts are kept and rejected),
    admitted while a greedy request speculates."""
    engine = Engine(
        w,
        PagedKVCache.for_model(w, manager=_sharing(w, 120)),
        stop_at_eos=False,
        speculation=Speculation(3, lambda ids, k: prompt_lookup(ids, k) or [ids[-1]] * k, sampled_rule=sampled_rule),
    )
    engine.add_request([2, 40, 41, 40, 41], 12)
    engine.step()
    firsts = []
    for i in range(6):
        prompt = [2, 50 + i, 60, 50 + i, 60]
        firsts.append((prompt, engine.add_request(prompt, 10, n=4, temperature=TEMPERATURE, seed=100 + i)))
    engine.run()
    assert _all_free(engine)
    return [(p, [s.output_ids for s in f.samples]) for p, f in firsts]


def _keeps_every_draft(draft, probs, generator):
    return list(draft) + [int(torch.multinomial(probs[len(draft)], 1, generator=generator))]


def test_drafting_samples_are_distributed_as_the_target(tiny):
    """The sampled requests that do draft: every token, mapped through the target's CDF at its position (randomized
    for a discrete distribution), is uniform (Kolmogorov-Smirnov, 240 tokens); a rule that keeps every draft fails."""
    model, w = tiny
    for rule, should_pass in ((None, True), (_keeps_every_draft, False)):
        g = torch.Generator().manual_seed(0)
        runs = _sampled_with_drafts(w, rule)
        assert all(len(samples) == 4 for _, samples in runs)
        u = [x for prompt, samples in runs for x in _randomized_pit(model, samples, prompt, TEMPERATURE, g)]
        p = stats.kstest(u, "uniform").pvalue
        assert (p > 1e-3) == should_pass, (rule, p)


# ---- a victim's draft reservation -----------------------------------------------------------------------------
def _oldest_first(running):
    return min(running, key=lambda s: (s.admitted_step, s.seq_id))


def _swap_engine(w, num_blocks: int, block_size: int, oldest: bool, **kw) -> Engine:
    manager = SharingBlockManager(num_blocks, block_size, max_seq_len=w.max_positions)
    policy = {"scheduler_kw": {"choose_victim": _oldest_first}} if oldest else {}
    cache = PagedKVCache.for_model(w, manager=manager)
    return Engine(w, cache, stop_at_eos=False, preemption_mode="swap", swap_space=SwapSpace(60), **policy, **kw)


def _check_swapped_tables(engine: Engine, block_size: int) -> int:
    """Every swapped sequence's CPU table holds exactly its ``len`` tokens' slots; returns how many were seen."""
    seen = 0
    for s in engine.scheduler.swapped:
        table = engine.swap_space.cpu_tables[s.seq_id]
        seen += 1
        assert table.num_tokens == s.len and len(table.blocks) == math.ceil(s.len / block_size), (
            s.len, table.num_tokens, len(table.blocks))  # fmt: skip
    return seen


def test_a_swapped_victim_holds_exactly_its_tokens_slots(tiny):
    """Lesson 06's pluggable policy choosing the oldest sequence, whose drafts' slots were reserved earlier in the step:
    it goes to the swap space with exactly its ``len`` tokens' slots (the between-steps table), not its draft's
    lookahead; nothing leaks, and the tokens are those of the same engine without speculation."""
    _, w = tiny
    swapped = 0
    for num_blocks, block_size in ((3, 4), (5, 2), (6, 2), (8, 2)):
        outputs = []
        for spec in (Speculation(3, lambda ids, k: [7] * k), None):
            engine = _swap_engine(w, num_blocks, block_size, True, speculation=spec)
            firsts = [engine.add_request([2, 5, 6], 6), engine.add_request([2, 8], 6)]
            while engine.scheduler.has_work:
                engine.step()
                swapped += _check_swapped_tables(engine, block_size)
            assert _all_free(engine) and engine.swap_space.num_free == engine.swap_space.num_blocks
            outputs.append([[x.output_ids for x in f.samples] for f in firsts])
        assert outputs[0] == outputs[1]
    assert swapped, "no sequence was swapped: the case under test did not happen"


def test_with_the_default_policy_forked_samples_swap_out_their_tokens_slots_only(tiny):
    """The default victim policy meets it when forked samples run beside drafting sequences (a workload found by a
    random search that held 8 slots for a 7-token sequence before the fix)."""
    _, w = tiny
    arrivals = {0: ([2, 8, 4, 8], 1, 5), 1: ([2, 7], 3, 7), 3: ([2, 5, 7], 2, 5)}  # step: (prompt, n, max_new_tokens)
    outputs, swapped = [], 0
    for spec in (Speculation(3, lambda ids, k: prompt_lookup(ids, k) or [7] * k), None):
        engine = _swap_engine(w, 8, 4, False, speculation=spec)
        firsts = []
        for step in range(80):
            if step in arrivals:
                prompt, n, new = arrivals[step]
                firsts.append(engine.add_request(prompt, new, n=n))
            if engine.scheduler.has_work:
                engine.step()
                swapped += _check_swapped_tables(engine, 4)
        assert _all_free(engine) and engine.swap_space.num_free == engine.swap_space.num_blocks
        outputs.append([[x.output_ids for x in f.samples] for f in firsts])
    assert outputs[0] == outputs[1] and [len(f) for f in outputs[0]] == [1, 3, 2]
    assert swapped, "no sequence was swapped: the case under test did not happen"


# ---- the proposer's contract ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "proposer, error, match",
    [
        (lambda ids, k: "abc", TypeError, "returned str; a proposer returns a list of token ids"),
        (lambda ids, k: None, TypeError, "returned NoneType"),
        (lambda ids, k: torch.tensor([1]), TypeError, "returned Tensor"),
        (lambda ids, k: [1] * (k + 1), ValueError, "was asked for at most"),
        (lambda ids, k: [10**6], ValueError, "outside the verifying model's vocabulary of 320 ids"),
        (lambda ids, k: [-1], ValueError, "outside the verifying model's vocabulary"),
        (lambda ids, k: [1.5], TypeError, "token ids are ints"),
        (lambda ids, k: [True], TypeError, "token ids are ints"),
        (lambda ids, k: [][5], ProposerError, "raised IndexError"),
    ],
    ids=["str", "None", "tensor", "too many", "too large", "negative", "float", "bool", "raises"],
)
def test_every_refused_draft_names_the_sequence(tiny, proposer, error, match):
    _, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, 40, 4), stop_at_eos=False, speculation=Speculation(3, proposer))
    seq = engine.add_request([2, 5, 6, 5, 6], 6)
    with pytest.raises(error, match=match) as info:
        engine.run()
    assert f"for sequence {seq.seq_id}" in str(info.value) and "<lambda>" in str(info.value)
    engine.abort_request(seq)  # the advice: abort what the error names; nothing is left behind
    assert _all_free(engine) and not engine.scheduler.has_work


def test_one_speculation_serves_two_engines_each_in_its_own_vocabulary(tiny):
    """The same ``Speculation`` in an engine of 320 ids and one of 100: drafts valid for both are verified by both;
    a draft valid only for the larger one is refused by the smaller engine naming its vocabulary (never an
    ``IndexError`` from the embedding), and the larger engine goes on serving."""
    _, big = tiny
    small = weights_from_hf(random_causal_lm(tiny_config("llama", vocab_size=100), seed=3))
    spec = Speculation(2, lambda ids, k: [ids[-1]] * k)
    engines = {
        w.vocab_size: Engine(w, PagedKVCache.for_model(w, 40, 4), stop_at_eos=False, speculation=spec)
        for w in (small, big)
    }
    for e in engines.values():
        assert len(e.generate([[2, 5, 6, 5]], 6)[0]) == 6 and e.scheduler.verified
    spec.propose = lambda ids, k: [250] * k
    seq = engines[100].add_request([2, 5, 6], 4)
    with pytest.raises(ValueError, match="returned 250 as token 0, outside the verifying model's vocabulary of 100"):
        engines[100].run()
    engines[100].abort_request(seq)
    assert len(engines[320].generate([[2, 5, 6]], 4)[0]) == 4
    assert all(_all_free(e) for e in engines.values())
