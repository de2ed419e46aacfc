"""A step is all or nothing (``Engine.step`` and :mod:`lesson_utils.serving.checkpoint`).

A request whose prompt holds a token whose embedding is NaN poisons only its own K/V and logits. Added at a random
step of a random workload, on every engine kind, it must be refused by name in the step that meets it - with every
sequence, queue, block table, count and free queue left exactly as before that step - and once it is aborted, the
other requests must get exactly the tokens they get in a run without it, and every block must be free at the end.
The same holds when a learner's plan function or step function fails half-way, and when the forward pass raises.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.cache.quantize import KVQuantError
from lesson_utils.core.types import SequenceStatus, SlotKind
from lesson_utils.lab.engine_kinds import EngineKind, engine_kind, engine_kinds
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.speculative import Speculation
from lesson_utils.serving.step import serve_step

POISON = 7  # the token id whose embedding row is NaN


@pytest.fixture(scope="module")
def poisoned(tiny):
    _, w = tiny
    w = copy.copy(w)
    w.embed_tokens = w.embed_tokens.clone()
    w.embed_tokens[POISON] = float("nan")
    return w


def _kinds(w):
    """Every registered engine kind, and this test's variants of them (the workload's forks, beams and drafts; int8
    swapping its scales; the prefix cache short of memory), as factories of fresh engines."""
    size = dict(num_blocks=40, short_blocks=9, budget=6, swap_blocks=40, max_seq_len=40)
    kinds = {k.name: partial(k.build, w, **size) for k in engine_kinds()}
    paged = engine_kind("paged")
    kinds.update(
        {
            "prefix cache, short": partial(engine_kind("prefix cache").build, w, **dict(size, num_blocks=9)),
            "int8, swap": partial(EngineKind("int8, swap", format="int8", preemption="swap").build, w, **size),
            "forks": partial(paged.build, w, **dict(size, num_blocks=14), forking=True),
            "beams": partial(paged.build, w, **dict(size, num_blocks=60), forking=True),
            "speculative (k = 3)": partial(paged.build, w, **size, speculation=Speculation(3)),
        }
    )
    return kinds


SLOW = {k.name for k in engine_kinds(kernels=True)}  # Triton's interpreter: fewer examples


def fingerprint(engine) -> dict:
    """Everything a refused step must leave as it was: queues, every sequence's counts and tokens, every table,
    the allocator's free queue and counts, the prefix cache, the swap space, the engine's step counter."""
    sch, m = engine.scheduler, engine.manager
    seqs = list(sch.waiting) + list(sch.running) + list(sch.swapped)
    seqs += [x for s in seqs for x in s.samples if x not in seqs]
    out = {
        "queues": [[s.seq_id for s in q] for q in (sch.waiting, sch.running, sch.swapped, sch.finished)],
        "seqs": {
            s.seq_id: (
                s.num_computed,
                s.num_generated,
                list(s.output_ids),
                s.status,
                s.admitted_step,
                s.preemptions,
                s.pending_forks,
                [x.seq_id for x in s.samples],
                list(s.token_steps),
            )
            for s in seqs
        },  # fmt: skip
        "events": len(sch.events),
        "verified": list(sch.verified),
        "step": (engine._step, len(engine.stats)),
        "free": m.num_free_blocks,
    }
    if isinstance(m, BlockManager):
        out["tables"] = {sid: (list(t.blocks), t.num_tokens) for sid, t in m.view.tables().items()}
        out["free queue"] = m.view.free_queue()
        out["pool"] = ([m.view.ref_count(b) for b in range(m.view.num_blocks)], m.view.cached_blocks())
    else:
        # every slot's kind shows where each reservation starts and ends, and where the holes are
        out["reservations"] = ({s.seq_id: m.placement(s.seq_id) for s in sch.running}, m.view.slot_kinds().tolist())
    if engine.swap_space is not None:
        sp = engine.swap_space
        out["swap"] = ({s: list(t.blocks) for s, t in sp.cpu_tables.items()}, list(sp.pool._free_queue))
    return out


def kv_contents(engine) -> dict:
    """Every computed token's cached data (every kind the cache keeps per slot) of every sequence holding blocks,
    on the GPU side and in the swap space: what a refused step must also leave as it was."""
    m, cache, out = engine.manager, engine.cache, {}
    seqs = {s.seq_id: s for s in engine.scheduler.running}
    for sid, table in m.view.tables().items():
        n = seqs[sid].num_computed if sid in seqs else table.num_tokens
        for kind in cache.slot_tensors:
            for layer, (k, v) in enumerate(zip(kind.k, kind.v)):
                flat = [
                    table.blocks[p // m.view.block_size] * m.view.block_size + p % m.view.block_size for p in range(n)
                ]
                out[(sid, kind.name, layer)] = torch.stack([k.flatten(0, 1)[flat], v.flatten(0, 1)[flat]]).clone()
    space = engine.swap_space
    if space is not None:
        for sid, table in space.cpu_tables.items():
            for i, host in enumerate(engine.host_blocks.tensors):
                out[("cpu", sid, i)] = host[:, :, table.blocks].clone()
    return out


def _same_contents(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _serve(engine, workload, poison_at, poison_prompt, kind):
    """Serve ``workload`` (``(arrival step, prompt, new tokens)``); with a poisoned request added at ``poison_at``,
    check the refusal and abort it. Returns every request's tokens (forks: every sample's), in order."""
    seqs, arrivals, step, refused = [], sorted(workload, key=lambda r: r[0]), 0, None
    pending = list(arrivals)
    bad = None
    while pending or engine.scheduler.has_work or (poison_prompt is not None and bad is None):
        while pending and pending[0][0] <= step:
            _, prompt, n = pending.pop(0)
            if kind == "forks":
                seqs.append(engine.add_request(prompt, n, n=2, temperature=1.0, seed=len(seqs)))
            elif kind == "beams":
                seqs.append(engine.add_beam_search(prompt, 2, n))
            else:
                seqs.append(engine.add_request(prompt, n))
        if poison_prompt is not None and bad is None and step >= poison_at:
            bad = engine.add_request(poison_prompt, 4)
        before = fingerprint(engine)
        try:
            engine.step()
        except (ValueError, KVQuantError) as err:
            assert bad is not None and refused is None, f"refused without the poisoned request: {err}"
            assert str(bad.seq_id) in str(err), f"the error does not name sequence {bad.seq_id}: {err}"
            assert fingerprint(engine) == before, "the refused step changed the engine's state"
            refused = err
            engine.abort_request(bad)
            assert bad.status is SequenceStatus.ABORTED
            continue
        step += 1
        assert step < 400
    if poison_prompt is not None:
        assert refused is not None, "the poisoned request was served without an error"
    if kind == "beams":
        return [group.best.output_ids for group in seqs]
    return [[s.output_ids for s in seq.samples] for seq in seqs]


def _all_free(engine) -> None:
    m = engine.manager
    if isinstance(m, BlockManager):
        m.view.check_invariants()
        assert not m.view.tables() and m.num_free_blocks == m.view.num_blocks
    else:
        assert m.view.breakdown()[SlotKind.FREE] == m.view.total_slots
    if engine.swap_space is not None:
        assert not engine.swap_space.cpu_tables


token = st.integers(10, 300)  # never the poison, nor OPT's special ids


@st.composite
def workloads(draw, shared_prefix: bool):
    prefix = draw(st.lists(token, min_size=8, max_size=8)) if shared_prefix else []
    reqs = draw(
        st.lists(
            st.tuples(st.integers(0, 6), st.lists(token, min_size=1, max_size=10), st.integers(1, 8)),
            min_size=1,
            max_size=4,
        )
    )
    reqs = [(a, prefix + p, n) for a, p, n in reqs]
    poison = draw(st.lists(token, min_size=1, max_size=9))
    poison.insert(draw(st.integers(0, len(poison))), POISON)
    return reqs, draw(st.integers(0, 8)), prefix + poison


def _check_kind(poisoned, kind, data):
    make = _kinds(poisoned)[kind]
    reqs, at, poison = data.draw(workloads(shared_prefix=kind.startswith("prefix")))
    alone = make()
    expected = _serve(alone, reqs, at, None, kind)
    engine = make()
    assert _serve(engine, reqs, at, poison, kind) == expected
    _all_free(engine)


@pytest.mark.parametrize("kind", [k for k in _kinds(None) if k not in SLOW])
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_poisoned_request_is_refused_and_the_others_are_served_as_if_alone(poisoned, kind, data):
    _check_kind(poisoned, kind, data)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(SLOW))
@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_poisoned_request_is_refused_on_the_kernel_paths_too(poisoned, kind, data):
    _check_kind(poisoned, kind, data)


def test_a_beam_search_beside_a_poisoned_request(poisoned):
    w = poisoned
    make = lambda: Engine(w, PagedKVCache.for_model(w, manager=SharingBlockManager(40, 4, max_seq_len=64)))  # noqa: E731
    alone = make()
    group = alone.add_beam_search([20, 30, 40], 3, 6)
    alone.run()
    engine = make()
    group2 = engine.add_beam_search([20, 30, 40], 3, 6)
    engine.step()
    bad = engine.add_request([11, POISON, 12], 3)
    before = fingerprint(engine)
    with pytest.raises(ValueError, match=str(bad.seq_id)):
        engine.step()
    assert fingerprint(engine) == before
    engine.abort_request(bad)
    engine.run()
    assert group2.best.output_ids == group.best.output_ids
    _all_free(engine)


def _plan_that_fails_after_admitting(state, queue, budget, admit):
    for item in list(queue):
        admit(item.seq_id)
    raise RuntimeError("a learner's plan function failed half-way")


def _step_that_fails_after_the_forward(scheduler, runner, step):
    plan = scheduler.schedule(step)
    runner.execute(plan)
    raise RuntimeError("a learner's step function failed after the forward pass")


@pytest.mark.parametrize("how", ["plan function", "step function", "forward pass"])
def test_a_step_that_fails_anywhere_changes_nothing(tiny, how, monkeypatch):
    """The step's other refusals: a learner's plan or step function raising half-way, an error in the forward."""
    _, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, 9, 4))  # short: steps preempt
    seqs = [engine.add_request([20 + i, 30, 40, 50, 60], 10) for i in range(3)]
    for _ in range(6):
        engine.step()
    late = engine.add_request([90, 91, 92], 3)
    before = fingerprint(engine)
    if how == "plan function":
        monkeypatch.setattr(engine.scheduler, "plan_fn", _plan_that_fails_after_admitting)
    elif how == "step function":
        engine.step_fn = _step_that_fails_after_the_forward
    else:
        monkeypatch.setattr(engine.cache, "attend", lambda *a: (_ for _ in ()).throw(RuntimeError("kernel error")))
    with pytest.raises(RuntimeError):
        engine.step()
    assert fingerprint(engine) == before
    monkeypatch.undo()
    engine.step_fn = serve_step
    engine.run()
    reference = Engine(w, PagedKVCache.for_model(w, 40, 4)).generate([s.request.prompt_ids for s in seqs + [late]], 10)
    assert [s.output_ids for s in seqs] == reference[:3] and late.output_ids == reference[3][:3]
    _all_free(engine)


class _FailsOnceEachStep:
    """A step function that runs each step whole - schedule, forward, update (frees, forks, prefix cache) - then
    raises, the first time it sees that step: every step of a run is refused once and then served."""

    def __init__(self):
        self.seen: set[int] = set()

    def __call__(self, scheduler, runner, step):
        result = serve_step(scheduler, runner, step)
        if step not in self.seen:
            self.seen.add(step)
            raise RuntimeError(f"step {step} refused once")
        return result


def _step_and_retry_once(engine) -> int:
    """One step; if it is refused, check that it changed nothing (tables, counts and every computed token's data)
    and run it again. Returns how many times it was refused (0 or 1)."""
    before, data = fingerprint(engine), kv_contents(engine)
    try:
        engine.step()
        return 0
    except RuntimeError:
        assert fingerprint(engine) == before and _same_contents(kv_contents(engine), data)
        engine.step()
        return 1


PRESSURED = ["recompute", "swap", "prefix cache, short", "int8, swap", "forks", "speculative (k = 3)"]


@pytest.mark.parametrize("kind", PRESSURED)
def test_every_step_refused_once_changes_no_token(poisoned, kind):
    """Under memory pressure a step hands a block it freed (a preempted sequence's, a cached prefix, a CPU block a
    swap-in freed) to another sequence, which writes into it: a refused step must put that data back too (compared
    slot by slot: a retried step that makes the same decisions would hide lost data in the tokens)."""
    make = _kinds(poisoned)[kind]
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [prefix + [20 + i, 30 + i] for i in range(4)] + [[40, 41, 42], prefix + [50]]
    add = (lambda e, p, i: e.add_request(p, 7, n=2, temperature=1.0, seed=i)) if kind == "forks" else (
        lambda e, p, i: e.add_request(p, 7))  # fmt: skip
    runs = []
    for failing in (False, True):
        engine = make()
        if failing:
            engine.step_fn = _FailsOnceEachStep()
        seqs, refusals = [], 0
        for i, p in enumerate(prompts):
            seqs.append(add(engine, p, i))
            for _ in range(2 if i < 3 else 4):  # arrivals spread over the run; later ones meet a busy cache
                refusals += _step_and_retry_once(engine)
        while engine.scheduler.has_work:
            refusals += _step_and_retry_once(engine)
        runs.append([[s.output_ids for s in seq.samples] for seq in seqs])
        _all_free(engine)
        if failing:
            assert refusals == len(engine.stats)
    assert runs[1] == runs[0]


def test_a_refused_step_that_evicted_a_cached_prefix_puts_its_data_back(poisoned):
    """The poisoned prompt's admission takes the least recently freed blocks, a cached system prompt's among them,
    and writes its K/V there before it is refused: the restored prefix cache finds that block again, so its data
    must be what it was - the next request with the system prompt gets the tokens it gets without the refusal."""
    w = poisoned
    system = [11, 12, 13, 14, 15, 16, 17, 18]  # two blocks of 4

    def serve(with_poison: bool):
        engine = Engine(w, PagedKVCache.for_model(w, manager=SharingBlockManager(6, 4, max_seq_len=64)))
        engine.generate([system + [20]], 2)  # its blocks are free now, the system prompt's still cached
        if with_poison:
            bad = engine.add_request([30 + i for i in range(17)] + [POISON], 1)  # 5 blocks: evicts a cached one
            with pytest.raises(ValueError, match=str(bad.seq_id)):
                engine.step()
            engine.abort_request(bad)
        hits_before = engine.manager.view.prefix_cache_stats().hits
        out = engine.generate([system + [21]], 6)
        assert engine.manager.view.prefix_cache_stats().hits - hits_before == 2  # both system-prompt blocks found
        return out

    assert serve(True) == serve(False)
