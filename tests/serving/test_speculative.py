"""Lesson 11's engine part: speculative decoding on the paged engine. The proposer, the two acceptance rules (the
sampled one checked by its output distribution), greedy speculation token-identical to the engine without it on
every engine kind and k, every block back at the end, a rollback that frees what only rejected drafts used, and the
contract (a broken proposer refused naming itself, the engine serving on)."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.lab.engine_kinds import engine_kind, engine_kinds
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving.draft_model import DraftModelProposer
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.speculative import (
    SimulatedDrafts,
    Speculation,
    accept_greedy,
    accept_sampled,
    keep_verified,
    prompt_lookup,
)
from lesson_utils.serving.token_budget import ChunkedPrefill


# ---- the proposer --------------------------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_earliest_longest_match():
    ids = [5, 6, 7, 9, 5, 6, 8, 1, 5, 6]
    assert prompt_lookup(ids, 2) == [7, 9]  # "5 6" occurs twice before: the earliest wins (vLLM v1, HF)
    assert prompt_lookup(ids, 2, prefer="latest") == [8, 1]  # the variant lesson 11 measures
    with pytest.raises(ValueError, match="prefer"):
        prompt_lookup(ids, 2, prefer="last")
    assert prompt_lookup([1, 2, 3, 4, 2, 3], 3) == [4, 2, 3]  # the longest suffix that occurs earlier: "2 3"
    assert prompt_lookup([1, 2, 3, 4], 3) == []  # the last token never occurred before
    assert prompt_lookup([4, 4], 5) == [4]  # only what exists after the match
    assert prompt_lookup([1, 2, 1], 0) == []
    ids = [3, 1, 3]
    prompt_lookup(ids, 2)
    assert ids == [3, 1, 3]


# ---- the acceptance rules ----------------------------------------------------------------------------------------
def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_targets_next_token():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_greedy([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_greedy([], [3]) == [3]


def _first_token_freqs(sampler, p, draft, trials, seed=0):
    g = torch.Generator().manual_seed(seed)
    probs = torch.stack([p] * (len(draft) + 1))
    counts = torch.zeros(len(p))
    for _ in range(trials):
        counts[sampler(draft, probs, g)[0]] += 1
    return counts / trials


def _always_accepts(draft, probs, g):
    return list(draft) + [int(torch.multinomial(probs[-1], 1, generator=g))]


@pytest.mark.parametrize("x", [0, 3])
def test_rejection_sampling_is_distributed_as_the_target(x):
    """Each output position of speculative sampling is distributed as the target's: the first token, over a
    5-token vocabulary, within 4 standard errors of p, whichever token was drafted. A sampler that keeps every
    draft fails the same test."""
    p = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    trials = 4000
    freqs = _first_token_freqs(accept_sampled, p, [x, 1], trials)
    se = (p * (1 - p) / trials).sqrt()
    assert bool(((freqs - p).abs() <= 4 * se + 1e-9).all()), (freqs, p)
    biased = _first_token_freqs(_always_accepts, p, [x, 1], 500)
    assert not bool(((biased - p).abs() <= 4 * (p * (1 - p) / 500).sqrt()).all())


def test_rejection_sampling_keeps_a_draft_the_target_is_sure_of():
    p = torch.tensor([0.0, 1.0, 0.0])
    g = torch.Generator().manual_seed(1)
    assert accept_sampled([1, 1], torch.stack([p, p, p]), g) == [1, 1, 1]


# ---- the engine: identity and every block back --------------------------------------------------------------------
def _prompts(w, n=4, seed=0):
    """Prompts that repeat themselves (prompt lookup finds matches) and some that do not."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(4, w.vocab_size) for _ in range(rng.randrange(3, 6))]
        body = motif * rng.randrange(2, 4) if i % 2 == 0 else [rng.randrange(4, w.vocab_size) for _ in range(9)]
        out.append([w.bos_token_id] + body)
    return out


def _kinds(w):
    """Every paged engine kind of the registry, as ``make(**engine_kw)``: 60 blocks of 4 (14 for the kinds that preempt),
    a token budget of 7 for the chunked ones."""
    return {k.name: partial(k.build, w, num_blocks=60, short_blocks=14, budget=7) for k in engine_kinds(paged=True)}


PAGED_KINDS = [k.name for k in engine_kinds(paged=True)]


def _all_free(engine) -> bool:
    m = engine.manager
    return m.num_free_blocks == m.view.num_blocks and not m.view.tables_now()


@pytest.mark.parametrize("kind", PAGED_KINDS)
def test_greedy_speculation_gives_the_tokens_of_greedy_decoding(tiny, kind):
    _, w = tiny
    slow = engine_kind(kind).kernels  # Triton's interpreter: a smaller case
    prompts, new = (_prompts(w, n=2), 8) if slow else (_prompts(w), 14)
    make = _kinds(w)[kind]
    plain = make(stop_at_eos=False)
    want = plain.generate(prompts, new)
    ks = (4,) if slow else (1, 2, 4, 6) if engine_kind(kind).chunked else (1, 2, 4, 8)  # (a budget of 7)
    for k in ks:
        engine = make(stop_at_eos=False, speculation=Speculation(k))
        assert engine.generate(prompts, new) == want, (kind, k)
        assert _all_free(engine), (kind, k)
        verified = engine.scheduler.verified
        assert verified and max(d for _, _, d, _ in verified) <= k
        assert sum(a for *_, a in verified) > 0, "no draft was ever accepted: the path under test did not run"
        if engine_kind(kind).short:
            assert engine.scheduler.num_preemptions > 0


def test_a_rollback_gives_back_the_blocks_only_rejected_drafts_used(tiny):
    """A proposer that drafts k wrong tokens: each step reserves k more slots and keeps one token; after it the
    table holds exactly the sequence's tokens' blocks (the newest token's slot included), and the peak shows the
    lookahead was reserved."""
    _, w = tiny
    wrong = lambda ids, k: [(ids[-1] + 1 + i) % w.vocab_size for i in range(k)]  # noqa: E731
    engine = Engine(w, PagedKVCache.for_model(w, 40, 4), stop_at_eos=False, speculation=Speculation(6, wrong))
    seq = engine.add_request([w.bos_token_id, 11, 12], 9)
    peak = 0
    while engine.scheduler.has_work:
        engine.step()
        if not seq.is_finished:
            blocks = engine.manager.view.block_table(seq.seq_id)
            assert len(blocks) == -(-seq.len // 4), (seq.len, blocks)
            assert seq.num_computed == seq.len - 1
        peak = max(peak, 40 - engine.manager.num_free_blocks)
    assert _all_free(engine) and seq.num_generated == 9
    assert peak >= -(-(3 + 1 + 6) // 4)  # a step held the newest token's slot and six drafted ones
    # the engine's records see the lookahead while a step runs, and not after it
    assert any(s.planned_held > s.kv_held for s in engine.stats)
    assert max(s.planned_held for s in engine.stats) >= 4 * -(-(3 + 1 + 6) // 4)


def test_eos_inside_an_accepted_draft_ends_the_request_there(tiny):
    model, w = tiny
    prompt = _prompts(w)[0]
    plain = Engine(w, PagedKVCache.for_model(w, 40, 4), stop_at_eos=False).generate([prompt], 10)[0]
    eos = plain[4]  # pretend the fifth token is the end of sequence
    w2 = type(w).__new__(type(w))
    w2.__dict__.update(w.__dict__)
    w2.eos_token_id = eos
    oracle = lambda ids, k: (plain + [0] * 20)[len(ids) - len(prompt) : len(ids) - len(prompt) + k]  # noqa: E731
    engine = Engine(w2, PagedKVCache.for_model(w2, 40, 4), speculation=Speculation(8, oracle))
    seq = engine.add_request(prompt, 10)
    engine.run()
    assert seq.output_ids == plain[: plain.index(eos) + 1] and _all_free(engine)


def test_max_new_tokens_inside_a_draft_is_never_passed(tiny):
    _, w = tiny
    prompt = _prompts(w)[0]
    plain = Engine(w, PagedKVCache.for_model(w, 40, 4), stop_at_eos=False).generate([prompt], 12)[0]
    oracle = lambda ids, k: (plain + [0] * 20)[len(ids) - len(prompt) : len(ids) - len(prompt) + k]  # noqa: E731
    for new in (1, 2, 5):
        engine = Engine(w, PagedKVCache.for_model(w, 40, 4), stop_at_eos=False, speculation=Speculation(8, oracle))
        assert engine.generate([prompt], new)[0] == plain[:new] and _all_free(engine)


def test_sampled_speculation_serves_and_leaks_nothing(tiny):
    _, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, 40, 4), stop_at_eos=False, speculation=Speculation(3))
    seqs = [engine.add_request(p, 8, temperature=0.8, seed=i) for i, p in enumerate(_prompts(w))]
    engine.run()
    assert all(s.num_generated == 8 for s in seqs) and _all_free(engine)


# ---- the contract -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "proposer, error, match",
    [
        (lambda ids, k: "abc", TypeError, "returns a list of token ids"),
        (lambda ids, k: [1] * (k + 1), ValueError, "was asked for at most"),
        (lambda ids, k: [10**6], ValueError, "outside the verifying model.s vocabulary"),
        (lambda ids, k: [1.5], TypeError, "token ids are ints"),
    ],
    ids=["not a list", "too many", "outside the vocabulary", "a float"],
)
def test_a_broken_proposer_is_refused_naming_itself_and_the_engine_serves_on(tiny, proposer, error, match):
    _, w = tiny
    prompts = _prompts(w)
    want = Engine(w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False).generate(prompts, 8)
    spec = Speculation(3, proposer)
    engine = Engine(w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False, speculation=spec)
    seqs = [engine.add_request(p, 8) for p in prompts]
    with pytest.raises(error, match=match):
        engine.run()
    spec.propose = prompt_lookup  # the learner fixes the proposer: the engine goes on as if nothing happened
    engine.run()
    assert [s.output_ids for s in seqs] == want and _all_free(engine)


def test_bad_speculation_settings_are_refused(tiny):
    _, w = tiny
    with pytest.raises(ValueError, match="k \\(tokens drafted per step\\) must be an int >= 0"):
        Speculation(-1)
    with pytest.raises(TypeError, match="propose must be a function"):
        Speculation(2, propose=3)
    engine = Engine(w, PagedKVCache.for_model(w, manager=SharingBlockManager(40, 4)), speculation=Speculation(2))
    with pytest.raises(ValueError, match="beam search with speculative decoding is not supported"):
        engine.add_beam_search([w.bos_token_id, 5, 6], 2, 4)
    assert not engine.scheduler.has_work


# ---- rollback, property-based --------------------------------------------------------------------------------------
def _noisy_oracle(references: list[list[int]], vocab: int, rng: random.Random, right: float):
    """A proposer that knows each request's true continuation and drafts it correctly with probability ``right`` per
    token (then random tokens): accept lengths anywhere from 0 to k."""

    def propose(ids, k):
        ref = next(r for r in references if r[: len(ids)] == ids)
        out = []
        for t in ref[len(ids) : len(ids) + k]:
            out.append(t if rng.random() < right else rng.randrange(4, vocab))
        return out

    return propose


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    k=st.integers(1, 6),
    right=st.sampled_from([0.3, 0.7, 0.95]),
    kind=st.sampled_from([k.name for k in engine_kinds(paged=True, kernels=False)] + ["forks"]),
)
def test_any_accept_lengths_give_greedy_tokens_and_leak_no_block(tiny, seed, k, right, kind):
    _, w = tiny
    rng = random.Random(seed)
    prompts, new = _prompts(w, n=3, seed=seed), 10
    kinds = _kinds(w)
    kinds["forks"] = partial(engine_kind("paged").build, w, num_blocks=30, forking=True)
    n = 2 if kind == "forks" else 1
    plain = kinds[kind](stop_at_eos=False)
    firsts = [plain.add_request(p, new, n=n) for p in prompts]
    plain.run()
    want = [[s.output_ids for s in f.samples] for f in firsts]
    refs = [p + o[0] for p, o in zip(prompts, want)]
    engine = kinds[kind](stop_at_eos=False, speculation=Speculation(k, _noisy_oracle(refs, w.vocab_size, rng, right)))
    firsts = [engine.add_request(p, new, n=n) for p in prompts]
    engine.run()
    assert [[s.output_ids for s in f.samples] for f in firsts] == want
    assert _all_free(engine)


def test_a_k_the_token_budget_cannot_hold_is_refused(tiny):
    _, w = tiny
    with pytest.raises(ValueError, match="k = 6 drafts need k \\+ 1 = 7 tokens.*over the token budget of 5"):
        Engine(w, PagedKVCache.for_model(w, 20, 4), chunked_prefill=ChunkedPrefill(5), speculation=Speculation(6))
    with pytest.raises(ValueError, match="over the token budget of 3"):
        Engine(w, PagedKVCache.for_model(w, 20, 4), max_num_batched_tokens=3, speculation=Speculation(3))
    Engine(w, PagedKVCache.for_model(w, 20, 4), chunked_prefill=ChunkedPrefill(5), speculation=Speculation(4))


# ---- the learner's rollback in the engine, and speculation in the simulator ------------------------------------
def test_the_engine_settles_verifications_with_the_learners_rollback(tiny):
    _, w = tiny
    calls = []

    def settle(seq, tokens, step, manager):
        calls.append((seq.seq_id, list(tokens)))
        keep_verified(seq, tokens, step, manager)

    prompts = _prompts(w)
    want = Engine(w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False).generate(prompts, 10)
    engine = Engine(
        w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False, speculation=Speculation(3, settle_rule=settle)
    )
    assert engine.generate(prompts, 10) == want and _all_free(engine)
    assert len(calls) == len(engine.scheduler.verified) > 0  # once per verification, never for a plain decode


def test_simulated_drafts_fitted_to_a_record_draft_and_keep_at_its_rates():
    proposals = [(4, 0)] * 25 + [(4, 2)] * 50 + [(4, 4)] * 25  # drafts in 75 % of the calls
    verified = [(0, 1, 2, 1)] * 50 + [(0, 1, 4, 0)] * 25  # judged 2 and 1 drafts: 50 kept of 125
    d = SimulatedDrafts.fitted(proposals, verified, seed=3)
    assert d.draft_share == pytest.approx(0.75) and d.acceptance == pytest.approx(50 / 125)
    assert sorted(set(d.lengths)) == [2, 4]
    drafted = [len(d.propose([], 3)) for _ in range(4000)]
    assert abs(sum(n > 0 for n in drafted) / 4000 - 0.75) < 0.03 and max(drafted) == 3  # cut to what is asked
    kept = [d.accepted(1) for _ in range(4000)]
    assert abs(sum(kept) / 4000 - 0.4) < 0.03
    assert d.propose([], 0) == [] and d.accepted(0) == 0
    with pytest.raises(ValueError, match="shares"):
        SimulatedDrafts(1.5, [1], 0.5)
    with pytest.raises(ValueError, match="lengths"):
        SimulatedDrafts(0.5, [], 0.5)


def test_a_simulated_speculating_server_serves_every_token_in_fewer_steps():
    from lesson_utils.lab import workloads
    from lesson_utils.serving import simulator
    from lesson_utils.serving.cost_model import StepCost
    from lesson_utils.serving.scheduler import FCFSScheduler

    requests = workloads.sharegpt_like(30, 4.0, seed=0, scale=0.0625)
    cost = StepCost(0.05, 0.004, 0.001, 1e-6)
    results = {}
    for name, drafts in {"plain": None, "always kept": SimulatedDrafts(1.0, [3], 1.0), "never": None}.items():
        m = BlockManager(200, 8)
        spec = None if drafts is None else Speculation.for_simulation(3, drafts)
        if name == "never":
            spec = Speculation.for_simulation(3, SimulatedDrafts(1.0, [3], 0.0))
        sched = FCFSScheduler(m, speculation=spec)
        res = simulator.simulate(requests, m, scheduler=sched, step_cost=cost, progress=False)
        assert sorted(s.num_generated for s in res.finished) == sorted(r.output_len for r in requests)
        assert m.num_free_blocks == 200
        results[name] = (len(res.steps), res.normalized_latency(), sched.verified)
    assert results["always kept"][0] < results["plain"][0]  # up to 4 tokens a step
    assert all(a == d for *_, d, a in results["always kept"][2])
    assert results["never"][2] and all(a == 0 for *_, a in results["never"][2])  # one token a verification
    assert results["never"][1] > results["plain"][1]  # ... at a higher cost per step


# ---- the draft-model proposer ------------------------------------------------------------------------------------
def _draft_engine(w, num_blocks=40, **kw):
    manager = SharingBlockManager(num_blocks, 4, enable_prefix_caching=True)
    return Engine(w, PagedKVCache.for_model(w, manager=manager), stop_at_eos=False, **kw)


def _other_tiny(seed=5):
    """A second tiny OPT of the same vocabulary with other random weights (and one layer): a different draft."""
    from lesson_utils.core.env import Profile
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

    lm = load_model(profile=Profile(name="ci", device="cpu", device_name="test"), seed=seed)
    return OPTWeights.from_hf(lm.model)


def test_the_target_drafting_for_itself_has_every_draft_kept(tiny):
    _, w = tiny
    prompts = _prompts(w)
    want = Engine(w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False).generate(prompts, 12)
    draft = DraftModelProposer(_draft_engine(w), vocab_size=w.vocab_size)
    engine = Engine(w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False, speculation=Speculation(4, draft))
    assert engine.generate(prompts, 12) == want and _all_free(engine)
    verified = engine.scheduler.verified
    assert verified and all(a == d for *_, d, a in verified)  # the same model: every draft is what it would say
    assert not draft.engine.manager.view.tables_now()  # the draft engine holds no table between calls
    assert draft.engine.manager.view.cached_prompt_tokens > 0  # later calls found their context's blocks by hash


def test_another_draft_model_keeps_greedy_identity_and_leaks_nothing(tiny):
    _, w = tiny
    prompts = _prompts(w)
    want = Engine(w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False).generate(prompts, 12)
    draft = DraftModelProposer(_draft_engine(_other_tiny()), vocab_size=w.vocab_size)
    for k in (1, 3):
        engine = Engine(w, PagedKVCache.for_model(w, 60, 4), stop_at_eos=False, speculation=Speculation(k, draft))
        assert engine.generate(prompts, 12) == want and _all_free(engine)
    assert draft.calls > 0 and draft.drafted > 0


def test_a_draft_engine_that_cannot_serve_as_one_is_refused(tiny):
    _, w = tiny
    with pytest.raises(ValueError, match="must not speculate"):
        DraftModelProposer(_draft_engine(w, speculation=Speculation(2)))
    with pytest.raises(ValueError, match="stop_at_eos=False"):
        DraftModelProposer(Engine(w, PagedKVCache.for_model(w, manager=SharingBlockManager(20, 4))))
    with pytest.raises(ValueError, match="tokenizer"):
        DraftModelProposer(_draft_engine(w), vocab_size=w.vocab_size + 1)
    with pytest.raises(ValueError, match="prefix caching"):
        DraftModelProposer(Engine(w, PagedKVCache.for_model(w, 20, 4), stop_at_eos=False))
    draft = DraftModelProposer(_draft_engine(w))
    assert draft([5, 6], 0) == [] and draft([5] * w.max_positions, 3) == []  # nothing asked, or no room left


def test_the_draft_model_run_splits_one_budget_and_checks_identity(tiny):
    from lesson_utils.lab.draft_run import kv_bytes_per_block, run_draft_model, split_budget

    _, w = tiny
    other = _other_tiny()
    per_block = kv_bytes_per_block(w, 4, 4)
    assert per_block == 2 * w.num_layers * w.num_kv_heads * w.head_dim * 4 * 4
    target, draft = split_budget(w, other, 80 * per_block, 0.25, 4, 4)
    assert target == 60 and draft * kv_bytes_per_block(other, 4, 4) <= 20 * per_block
    with pytest.raises(ValueError, match="share"):
        split_budget(w, other, 80 * per_block, 1.0, 4, 4)
    with pytest.raises(ValueError, match="without a single block"):
        split_budget(w, other, per_block, 0.25, 4, 4)
    run = run_draft_model(
        w, w, _prompts(w, n=2), 8, 3, budget_bytes=80 * per_block, dtype_bytes=4, block_size=4, repeats=1
    )
    assert run.identical and run.all_free and run.target_blocks == 60
    assert all(r in (None, 1.0) for r in run.kept_by_position)  # drafting for itself: every draft kept
    assert run.tokens_per_verify_step > 2
    assert run.speedup().median > 0


@pytest.mark.parametrize("kind", [k.name for k in engine_kinds(paged=True, kernels=False)])
def test_a_draft_model_keeps_greedy_identity_on_every_engine_kind(tiny, kind):
    _, w = tiny
    prompts, make = _prompts(w), _kinds(w)[kind]
    want = make(stop_at_eos=False).generate(prompts, 12)
    draft = DraftModelProposer(_draft_engine(_other_tiny()), vocab_size=w.vocab_size)
    for k in (2, 6):
        engine = make(stop_at_eos=False, speculation=Speculation(k, draft))
        assert engine.generate(prompts, 12) == want, (kind, k)
        assert _all_free(engine) and not draft.engine.manager.view.tables_now()
        if engine_kind(kind).short:
            assert engine.scheduler.num_preemptions > 0
