"""Lesson 06: preemption by recompute and by swapping, under memory that runs out.

What this file proves:

* through the real ``Engine`` (the ci profile's tiny random OPT, fp32), with a cache far too small for the
  batch, in both preemption modes (``"recompute"``, ``"swap"``) and on lesson 03's ``BlockManager`` and
  lesson 05's ``SharingBlockManager`` (prefix cache on and off): preemptions really happen, and of the mode
  asked for; every request still finishes with exactly the tokens of an unconstrained run and of Hugging
  Face ``generate`` (greedy, prompt by prompt); swapping never prefills a token twice, recompute does; after
  every step the managers' invariants hold, running sequences hold GPU tables, swapped ones CPU tables and
  waiting ones neither, every CPU block's count equals the number of CPU tables holding it, and every
  running sequence's cached K/V (read through its block table) are bit-for-bit the ones it had computed -
  swap-out/swap-in, copy-on-write and forks move K/V but never change them (a direct check: the tiny random
  model's near-uniform attention would hide corrupted K from a token comparison); at the end every GPU and
  every CPU block is free;
* parallel sampling (``n = 3`` forked samples sharing their prompt's blocks) under swap pressure: siblings
  swapped out in the same step copy their shared blocks once (fewer copies than blocks in the victims'
  tables), come back sharing them again, and still produce HF's tokens - also with another victim policy
  plugged in (oldest first), which preempts samples that already made room (copy-on-write included) this
  step;
* the same scheduler in the simulator, over 400 seeded random workloads (block sizes 1 / 2 / 4 / 8, both
  modes, prefix cache on and off, parallel sampling, swap spaces from 0 blocks up, token budgets or none,
  random arrivals, the default victim policy or another): every request and sample finishes with exactly
  its output length; invariants hold after every step (GPU and CPU side); a shadow of every slot's contents,
  moved by the copies the engine would make in its order, shows that sequences coming back from swap or
  starting on cached prefix blocks find their own K/V; every step's batch keeps to the token budget (unless
  one request alone exceeds it); nothing leaks; with the default policy the victim is always the latest
  admitted, swapped sequences return in the order they left and before anyone new is admitted; a fallback
  to recompute happens exactly when the swap space cannot hold the victim, with a note saying so;
  preemptions, swaps, fallbacks, prefix hits and forks all happen in a good share of the workloads;
* errors and limits: a request larger than the whole cache is refused at ``Engine.add_request``,
  ``FCFSScheduler.add`` and by the simulator (``NeverFits``, a clear message); ``"swap"`` without a swap
  space, an unknown mode, ``SwapSpace(-1)`` and a non-positive token budget are ``ValueError``; a swap space
  too small for any victim serves every request correctly (by recompute, with the note); the engine never
  batches more tokens than ``max_num_batched_tokens`` allows, a prompt that waits for the budget is not
  overtaken, and a sequence swapped out before its prefill ran counts its whole prompt when it comes back
  (and waits for the budget as a new request would);
* the victim is the most recently admitted sequence (ties: the later in the batch), and swapped sequences
  come back, in the order they left, before any new request is admitted (even one that would fit).
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from helpers import hf_greedy

from lesson_utils.cache.paged import PagedKVCache, gather_kv
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.serving import simulator
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.scheduler import FCFSScheduler, most_recently_admitted
from lesson_utils.types import NeverFits, Request, Sequence

FALLBACK = "fell back to recompute"


# ---------------------------------------------------------------------------------------------------
# Helpers: managers, invariants on both sides of the swap, an engine driven step by step
# ---------------------------------------------------------------------------------------------------

MANAGERS = ["paged", "sharing", "prefix-cache"]


def make_manager(kind: str, num_blocks: int, block_size: int, max_seq_len: int | None = None) -> BlockManager:
    """Watermark 0, so that the tests decide exactly how tight memory is."""
    if kind == "paged":
        return BlockManager(num_blocks, block_size, watermark=0.0, max_seq_len=max_seq_len)
    caching = {"sharing": False, "prefix-cache": True}[kind]
    return SharingBlockManager(
        num_blocks, block_size, watermark=0.0, max_seq_len=max_seq_len, enable_prefix_caching=caching
    )


def check_swap_space(space: SwapSpace | None) -> None:
    """A CPU block's count equals the number of CPU tables holding it; held + free == all."""
    if space is None:
        return
    held: dict[int, int] = {}
    for t in space.cpu_tables.values():
        assert len(t.blocks) == blocks_needed(t.num_tokens, t.block_size), "a CPU table has the wrong size"
        for b in t.blocks:
            held[b] = held.get(b, 0) + 1
    if space.num_blocks:
        for b in range(space.num_blocks):
            count = space.pool.ref_count[b]
            assert count == held.get(b, 0), f"CPU block {b}: count {count}, held by {held.get(b, 0)} tables"
    else:
        assert not held, "a zero-block swap space holds a block"
    assert len(held) + space.num_free == space.num_blocks, "a CPU block was lost"


def check_step(sch: FCFSScheduler) -> None:
    """Who holds what, after a step: running -> GPU table, swapped -> CPU table, waiting -> nothing."""
    m = sch.manager
    m.check_invariants()
    check_swap_space(sch.swap_space)
    running = {s.seq_id for s in sch.running}
    swapped = {s.seq_id for s in sch.swapped}
    waiting = {s.seq_id for s in sch.waiting}
    assert set(m.tables) == running, (sorted(m.tables), sorted(running))
    if isinstance(m, SharingBlockManager):  # prefix-cache bookkeeping only for sequences holding blocks
        assert set(m._hashes) <= running, (sorted(m._hashes), sorted(running))
    assert not (running & swapped or running & waiting or swapped & waiting)
    cpu = set(sch.swap_space.cpu_tables) if sch.swap_space is not None else set()
    assert cpu == swapped, (sorted(cpu), sorted(swapped))
    for s in sch.swapped:  # a swapped sequence keeps its computed K/V (on the CPU), and its tokens' slots
        assert s.len <= sch.swap_space.cpu_tables[s.seq_id].num_tokens <= s.len + 1
    for s in sch.waiting:
        assert s.kv_len == 0


def assert_all_free(m: BlockManager, space: SwapSpace | None = None) -> None:
    m.check_invariants()
    assert not m.tables
    assert m.allocator.num_free == m.num_blocks
    assert all(m.allocator.is_free(b) for b in range(m.num_blocks))
    if isinstance(m, SharingBlockManager):
        assert not any(m.pool.ref_count) and not m._hashes
    if space is not None:
        check_swap_space(space)
        assert not space.cpu_tables
        assert space.num_free == space.num_blocks
        if space.num_blocks:
            assert not any(space.pool.ref_count)


class SwapSpy:
    """Wraps a swap space's ``swap_out``/``swap_in``: per (step, seq): blocks in the table, copies made."""

    def __init__(self, engine: Engine):
        self.engine, space = engine, engine.swap_space
        self.out: list[tuple[int, int, list[int], list]] = []
        self.back: list[tuple[int, int, list[int], list]] = []
        real_out, real_in = space.swap_out, space.swap_in

        def swap_out(manager, seq_id, already):
            blocks = list(manager.tables[seq_id].blocks)
            copies = real_out(manager, seq_id, already)
            self.out.append((engine._step, seq_id, blocks, copies))
            return copies

        def swap_in(manager, seq_id, already):
            blocks = list(space.cpu_tables[seq_id].blocks)
            copies = real_in(manager, seq_id, already)
            self.back.append((engine._step, seq_id, blocks, copies))
            return copies

        space.swap_out, space.swap_in = swap_out, swap_in

    @staticmethod
    def by_step(records) -> dict[int, tuple[int, int, int]]:
        """step -> (victims, blocks in their tables, copies made)."""
        steps: dict[int, list[int]] = {}
        for step, _, blocks, copies in records:
            v = steps.setdefault(step, [0, 0, 0])
            v[0] += 1
            v[1] += len(blocks)
            v[2] += len(copies)
        return {k: tuple(v) for k, v in steps.items()}


def count_batched_tokens(engine: Engine) -> list[tuple[int, int]]:
    """Record (tokens fed, sequences) of every forward step (prefill + decode), by wrapping the runner."""
    fed: list[tuple[int, int]] = []
    logits = engine.runner.logits

    def spy(seqs, counts=None):
        fed.append((sum(counts) if counts is not None else sum(len(s.token_ids) - s.kv_len for s in seqs), len(seqs)))
        return logits(seqs, counts)

    engine.runner.logits = spy
    return fed


class KVWatch:
    """After every step, each running sequence's computed K/V, read through its block table, must be exactly
    what they were at the end of its previous step (positions already computed then): swapping out and back
    in, copy-on-write and forks move K/V between blocks but never change them. (Only a recompute, which
    computes them again, resets this.) A direct check on the cache's contents: the tiny random model's
    near-uniform attention would hide corrupted K from a token comparison."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.snap: dict[int, tuple[int, int, list[torch.Tensor]]] = {}
        self.checked = 0

    def _kv(self, seq_id: int, n: int) -> list[torch.Tensor]:
        cache, blocks = self.engine.cache, self.engine.manager.tables[seq_id].blocks
        return [gather_kv(c, blocks, n).clone() for c in cache.k_cache + cache.v_cache]

    def after_step(self) -> None:
        sch = self.engine.scheduler
        recomputed: dict[int, int] = {}
        for e in sch.events:
            if e.mode == "recompute":
                recomputed[e.seq_id] = recomputed.get(e.seq_id, 0) + 1
        for s in sch.running:
            old = self.snap.get(s.seq_id)
            if old is not None and old[0] == recomputed.get(s.seq_id, 0):
                now = self._kv(s.seq_id, old[1])
                assert all(torch.equal(a, b) for a, b in zip(now, old[2])), (
                    f"step {self.engine._step - 1}: sequence {s.seq_id}'s cached K/V changed"
                )
                self.checked += 1
            self.snap[s.seq_id] = (recomputed.get(s.seq_id, 0), s.kv_len, self._kv(s.seq_id, s.kv_len))


def serve(
    w,
    prompts,
    n_new,
    *,
    kind="paged",
    mode="recompute",
    num_blocks=64,
    block_size=4,
    swap_blocks=None,
    budget=None,
    n=1,
    **scheduler_kw,
):
    """Serve ``prompts`` step by step, checking who holds what after every step; returns the engine and
    each prompt's outputs (a list of the ``n`` samples' outputs when ``n > 1``)."""
    manager = make_manager(kind, num_blocks, block_size, w.max_positions)
    space = SwapSpace(swap_blocks) if swap_blocks is not None else None
    victim_log: list[tuple[list[Sequence], Sequence]] = []
    if "choose_victim" in scheduler_kw:  # record every choice of a plugged-in policy
        policy = scheduler_kw["choose_victim"]

        def logged(running):
            victim_log.append((list(running), policy(running)))
            return victim_log[-1][1]

        scheduler_kw["choose_victim"] = logged
    engine = Engine(
        w,
        PagedKVCache.for_model(w, manager=manager),
        preemption_mode=mode,
        swap_space=space,
        max_num_batched_tokens=budget,
        scheduler_kw=scheduler_kw,
    )
    spy = SwapSpy(engine) if space is not None else None
    fed = count_batched_tokens(engine)
    seqs = [engine.add_request(p, n_new, n=n) for p in prompts]
    watch = KVWatch(engine)
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        check_step(engine.scheduler)
        watch.after_step()
        steps += 1
        assert steps < 2000, "the engine is not making progress"
    finished = engine.scheduler.finished
    assert len(finished) == len(prompts) * n and len({s.seq_id for s in finished}) == len(finished)
    assert all(s.is_finished for s in finished)
    assert_all_free(manager, space)
    outs = [[s.output_ids for s in seq.samples] if n > 1 else seq.output_ids for seq in seqs]
    engine.spy, engine.fed, engine.watch, engine.victim_log = spy, fed, watch, victim_log
    return engine, outs


# ---------------------------------------------------------------------------------------------------
# 1. The engine under memory pressure: token-identical in both modes, on every manager
# ---------------------------------------------------------------------------------------------------

N_NEW = 12
BLOCK = 4
# Prompts 3..17 tokens; three start with the same 9 tokens (two whole blocks of 4 for the prefix cache).
PROMPT_LENS = [9, 3, 14, 6, 17, 11]
SHARED = 9


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    _, w = tiny
    rng = random.Random(6)
    shared = [rng.randrange(4, w.vocab_size) for _ in range(SHARED)]
    out = [[rng.randrange(4, w.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    for i in (2, 4, 5):
        out[i][:SHARED] = shared
    return out


@pytest.fixture(scope="module")
def expected(tiny, prompts) -> list[list[int]]:
    model, w = tiny
    return [hf_greedy(model, p, N_NEW, w.eos_token_id) for p in prompts]


def tight_blocks(prompts, n_new: int, block_size: int) -> int:
    """Just enough for the longest request alone (plus one block), far from the batch's needs."""
    return max(blocks_needed(len(p) + n_new, block_size) for p in prompts) + 1


def test_prompts_make_a_demanding_workload(tiny, prompts, expected):
    """The reference really needs several blocks per request, and the tight cache holds a fraction of them."""
    assert all(len(o) >= 4 for o in expected)
    need = sum(blocks_needed(len(p) + len(o), BLOCK) for p, o in zip(prompts, expected))
    assert tight_blocks(prompts, N_NEW, BLOCK) * 3 < need


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_engine_matches_unconstrained_run_and_hf(tiny, prompts, expected, kind, mode):
    _, w = tiny
    _, roomy = serve(w, prompts, N_NEW, kind=kind, num_blocks=128)
    assert roomy == expected

    swap = 64 if mode == "swap" else None
    engine, got = serve(
        w, prompts, N_NEW, kind=kind, mode=mode, num_blocks=tight_blocks(prompts, N_NEW, BLOCK), swap_blocks=swap
    )
    sch = engine.scheduler
    assert sch.events, "no preemption: the cache was not tight enough to test anything"
    assert {e.mode for e in sch.events} == {mode}
    assert all(e.note == "" for e in sch.events)  # the swap space was large enough every time
    assert sum(s.preempted for s in engine.stats) == sch.num_preemptions
    assert got == expected
    assert engine.watch.checked > 0
    if mode == "swap":
        spy = engine.spy
        assert len(spy.out) == len(sch.events) and len(spy.back) == len(spy.out)  # every swapped sequence came back
        assert engine.swap_space.blocks_in >= engine.swap_space.blocks_out > 0
    once = sum(len(p) + len(o) - 1 for p, o in zip(prompts, expected))  # every token fed exactly once...
    if kind == "paged" or kind == "sharing":
        fed = sum(t for t, _ in engine.fed)
        assert (fed == once) if mode == "swap" else (fed > once)  # ...unless recomputed
    if kind == "prefix-cache" and mode == "recompute":
        assert engine.manager.cached_prompt_tokens > 0  # readmissions and shared prompts hit the cache


@pytest.mark.parametrize("kind", ["sharing", "prefix-cache"])
def test_parallel_samples_swap_their_shared_blocks_once(tiny, prompts, expected, kind):
    """n = 3 greedy samples per prompt: all equal HF's continuation; shared blocks cross the bus once."""
    _, w = tiny
    picked = [0, 2, 4]
    batch = [prompts[i] for i in picked]
    engine, got = serve(
        w, batch, N_NEW, kind=kind, mode="swap", num_blocks=tight_blocks(batch, N_NEW, BLOCK) + 3, swap_blocks=64, n=3
    )
    assert got == [[expected[i]] * 3 for i in picked]
    sch, spy = engine.scheduler, engine.spy
    assert sch.events and {e.mode for e in sch.events} == {"swap"}
    out_steps, in_steps = SwapSpy.by_step(spy.out), SwapSpy.by_step(spy.back)
    # some step swapped out several sequences that shared blocks: fewer copies than blocks in their tables
    assert any(victims > 1 and copies < blocks for victims, blocks, copies in out_steps.values()), out_steps
    assert any(victims > 1 and copies < blocks for victims, blocks, copies in in_steps.values()), in_steps
    # a copy per distinct block, never more; totals agree with the swap space's counters
    assert engine.swap_space.blocks_out == sum(c for _, _, c in out_steps.values())
    assert engine.swap_space.blocks_in == sum(c for _, _, c in in_steps.values())
    assert engine.swap_space.blocks_out < sum(b for _, b, _ in out_steps.values())


def oldest_first(running: list[Sequence]) -> Sequence:
    """Another victim policy (a learner's, say): the running sequence admitted first. It can pick a sequence
    whose room for the next token was already made this step - copy-on-write included."""
    return min(running, key=lambda s: s.admitted_step)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("kind", ["sharing", "prefix-cache"])
def test_a_pluggable_victim_policy_keeps_outputs_and_kv_exact(tiny, prompts, expected, kind, mode):
    """With ``choose_victim=oldest_first`` the victim is often a sample that already copied-on-write its last
    block this step (the copy itself happens in the forward, after the swap copies): its swapped-out K/V must
    still be the ones it computed."""
    _, w = tiny
    batch = prompts[:4]
    engine, got = serve(
        w,
        batch,
        N_NEW,
        kind=kind,
        mode=mode,
        num_blocks=tight_blocks(batch, N_NEW, BLOCK) + 3,
        swap_blocks=64 if mode == "swap" else None,
        n=3,
        choose_victim=oldest_first,
    )
    assert got == [[e] * 3 for e in expected[:4]]
    assert engine.scheduler.events and {e.mode for e in engine.scheduler.events} == {mode}
    assert engine.manager.num_cow > 0 and engine.watch.checked > 0
    assert any(v is not most_recently_admitted(r) for r, v in engine.victim_log)  # the policy really differed


# ---------------------------------------------------------------------------------------------------
# 2. The simulator: randomized workloads, both modes, every manager, every swap-space size
# ---------------------------------------------------------------------------------------------------


class CheckedScheduler(FCFSScheduler):
    """Checks the scheduler's promises as it goes:

    * the victim is the running sequence admitted last (the latest in the running list among equals);
    * swapped sequences come back in the order they left, and while any is left in swap nobody new is
      admitted; new ones are admitted from the head of the queue (no overtaking);
    * a fallback to recompute happens exactly when the swap space cannot hold the victim.

    ``victim`` plugs in another policy (then only that policy's choice is used, unchecked).
    """

    def __init__(self, *args, victim=None, **kw):
        super().__init__(*args, choose_victim=victim or self._checked_victim, **kw)
        self.fits_at_preemption: list[bool] = []
        self.victims: list[int] = []
        self.swap_ins: list[int] = []
        self.admissions: list[int] = []
        self.last_admitted: list[Sequence] = []
        self.children: list[int] = []
        self._next_id = 10_000  # forked samples get ids far from the requests'

    def add(self, seq):
        n = seq.request.tags.get("n", 1)  # parallel sampling, as the engine does it: the scheduler forks after
        seq.pending_forks, seq.samples = n - 1, [seq]  # the prefill (the simulator's sequences ask for none)
        super().add(seq)

    def _fork_samples(self, parent, logits):
        super()._fork_samples(parent, logits)
        self.children += [c.seq_id for c in parent.samples[1:]]

    def schedule(self, step):
        swapped, waiting = list(self.swapped), list(self.waiting)
        plan = super().schedule(step)
        back = [s.seq_id for s in swapped if s.admitted_step == step]  # (admission sets admitted_step; a
        admitted = [s for s in waiting if s.admitted_step == step]  # preemption never resets it)
        assert back == [s.seq_id for s in swapped][: len(back)], f"swapped in {back}, out of order"
        if len(back) < len(swapped):
            assert not admitted, "a new request was admitted while a swapped one waits"
        assert [s.seq_id for s in admitted] == [s.seq_id for s in waiting][: len(admitted)], (
            "a request overtook the head"
        )
        self.swap_ins += back
        self.admissions += [s.seq_id for s in admitted]
        self.last_admitted = admitted
        return plan

    @staticmethod
    def _checked_victim(running):
        victim = most_recently_admitted(running)
        i = next(k for k, s in enumerate(running) if s is victim)
        latest = max(s.admitted_step for s in running)
        assert victim.admitted_step == latest, f"victim admitted at step {victim.admitted_step}, the latest at {latest}"
        assert all(s.admitted_step < latest for s in running[i + 1 :]), "not the last of those admitted latest"
        return victim

    def _preempt(self, victim, moved):
        self.victims.append(victim.seq_id)
        if self.swap_space is not None:
            need = self.swap_space.distinct_new_blocks(self.manager.tables[victim.seq_id].blocks, moved)
            self.fits_at_preemption.append(need <= self.swap_space.num_free)
        super()._preempt(victim, moved)


class CheckingRunner(simulator.AccountingRunner):
    """The accounting runner, checking invariants and the token budget every step before it 'runs'.

    It also keeps a *shadow* of what every GPU and CPU slot would hold (a token's K/V are named by the
    prompt prefix they were computed from, or by (sequence, position) for generated tokens), moved by the
    copies the engine would make in the engine's order - swap-ins, swap-outs, copy-on-write - and written
    like the forward would write. A sequence swapped in or admitted with prefix-cache hits must find its own
    K/V there.
    """

    def __init__(self, sch: FCFSScheduler):
        self.sch, self.steps = sch, 0
        self.gpu: dict[tuple[int, int], object] = {}
        self.cpu: dict[tuple[int, int], object] = {}
        self.verified = 0

    @staticmethod
    def content(seq: Sequence, p: int):
        prompt = seq.request.prompt_ids
        if prompt is None:  # no token ids: nothing is shared, every position is the sequence's own
            return ("own", seq.seq_id, p)
        return ("prompt", tuple(prompt[: p + 1])) if p < len(prompt) else ("generated", seq.seq_id, p)

    def apply(self, plan):  # the plan's swap copies, in the engine's order: swap-ins, then swap-outs
        bs = self.sch.manager.block_size
        for c, g in plan.swap_in:
            for o in range(bs):
                self.gpu[g, o] = self.cpu.get((c, o))
        for g, c in plan.swap_out:
            for o in range(bs):
                self.cpu[c, o] = self.gpu.get((g, o))

    def _shadow_step(self, plan):
        running, step = plan.scheduled, plan.step
        m = self.sch.manager
        bs = m.block_size
        for src, dst in plan.copies:
            for o in range(bs):
                self.gpu[dst, o] = self.gpu.get((src, o))
        for s in running:
            blocks = m.tables[s.seq_id].blocks
            if s.admitted_step == step:  # just swapped in, or admitted with cached prefix blocks
                for p in range(s.kv_len):
                    got = self.gpu.get((blocks[p // bs], p % bs))
                    assert got == self.content(s, p), f"step {step}: sequence {s.seq_id} position {p} holds {got}"
                self.verified += s.kv_len
            for p in range(s.kv_len, s.len):  # the forward writes every token not yet in the cache
                self.gpu[blocks[p // bs], p % bs] = self.content(s, p)

    def execute(self, plan):
        running, step = plan.scheduled, plan.step
        sch = self.sch
        check_step(sch)
        self.apply(plan)
        self._shadow_step(plan)
        for s in running:  # room was made for the token about to be generated, and nothing more
            assert sch.manager.tables[s.seq_id].num_tokens == s.len + 1
        tokens = sum(s.len - s.kv_len for s in running)
        budget = sch.max_num_batched_tokens
        # the budget holds every step. With forks (n - 1 more decodes without an admission) decodes alone may
        # exceed it, but a step that prefills (admits someone, or swaps in one that was swapped out before its
        # prefill ran) never does. One request over the budget alone runs alone.
        prefills = sch.last_admitted or any(s.len - s.kv_len > 1 for s in running)
        if budget is not None and (not sch.children or prefills):
            assert tokens <= budget or len(running) == 1, f"step {step}: {tokens} tokens over the budget {budget}"
        self.steps += 1
        return super().execute(plan)


ALPHA = (4, 5, 6)  # prompts over a tiny alphabet share prefixes, so the prefix cache really hits


def random_workload(seed: int):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    kind = rng.choice(MANAGERS)
    mode = rng.choice(["recompute", "swap", "swap"])
    n = rng.randint(3, 10)
    roots = [[rng.choice(ALPHA) for _ in range(rng.randint(1, 40))] for _ in range(2)]
    reqs = []
    for i in range(n):
        plen = rng.randint(1, 40)
        if kind == "prefix-cache" and rng.random() < 0.7:
            root = rng.choice(roots)
            cut = rng.randint(0, min(plen, len(root)))
            ids = root[:cut] + [rng.choice(ALPHA) for _ in range(plen - cut)]
        else:
            ids = [rng.choice(ALPHA) for _ in range(plen)]
        samples = rng.choice([1, 1, 2, 3]) if kind != "paged" else 1  # parallel sampling: forks share blocks
        reqs.append(
            Request(
                i,
                rng.choice([0.0, 0.0, rng.uniform(0, 0.4)]),
                plen,
                rng.randint(1, 40),
                prompt_ids=ids,
                tags={"n": samples},
            )
        )
    biggest = max(blocks_needed(r.total_len, bs) for r in reqs)
    total = sum(blocks_needed(r.total_len, bs) * r.tags["n"] for r in reqs)
    num_blocks = rng.randint(biggest, max(biggest, min(total - 1, biggest + biggest // 2)))
    swap = rng.choice([0, 1, 2, rng.randint(1, biggest), rng.randint(biggest, 2 * biggest), 4 * total, 4 * total])
    swap = swap if mode == "swap" else None
    budget = rng.choice([None, rng.randint(1, 20), rng.randint(5, 60), rng.randint(20, 120)])
    policy = rng.choice(["latest"] * 4 + ["oldest", "random"])
    return dict(bs=bs, kind=kind, mode=mode, reqs=reqs, num_blocks=num_blocks, swap=swap, budget=budget, policy=policy)


def victim_policy(name: str, seed: int):
    if name == "latest":
        return None  # the default, checked
    if name == "oldest":
        return oldest_first
    rng = random.Random(seed)
    return lambda running: rng.choice(running)


def run_workload(seed: int) -> dict:
    wl = random_workload(seed)
    manager = make_manager(wl["kind"], wl["num_blocks"], wl["bs"])
    space = SwapSpace(wl["swap"]) if wl["swap"] is not None else None
    sch = CheckedScheduler(
        manager,
        preemption_mode=wl["mode"],
        swap_space=space,
        max_num_batched_tokens=wl["budget"],
        victim=victim_policy(wl["policy"], seed),
    )
    runner = CheckingRunner(sch)
    reqs = wl["reqs"]
    res = simulator.simulate(
        reqs, manager, scheduler=sch, runner=runner, progress=False, step_time_s=0.02, max_steps=20_000
    )
    assert not sch.has_work, "unfinished work after 20 000 steps (livelock?)"
    assert sorted(s.seq_id for s in res.finished) == [r.req_id for r in reqs] + sch.children, "a request was lost"
    assert len(sch.children) == sum(r.tags["n"] - 1 for r in reqs)
    assert all(s.num_generated == s.request.output_len for s in res.finished)
    assert_all_free(manager, space)
    for e in sch.events:
        assert e.mode in ("recompute", "swap")
        if wl["mode"] == "recompute":
            assert e.mode == "recompute" and e.note == ""
        elif e.mode == "recompute":
            assert FALLBACK in e.note, e.note
            m = re.search(r"\((\d+) of (\d+) CPU blocks free\)", e.note)
            assert m and int(m.group(2)) == wl["swap"] and int(m.group(1)) <= wl["swap"], e.note
        else:
            assert e.note == ""
    if space is not None:  # a fallback exactly when the victim did not fit in the swap space
        assert sch.fits_at_preemption == [e.mode == "swap" for e in sch.events]
        # every CPU block is copied out once and in at least once (twice if its holders return in different steps)
        assert space.blocks_in >= space.blocks_out if wl["kind"] != "paged" else space.blocks_in == space.blocks_out
    if wl["swap"] == 0:
        assert all(e.mode == "recompute" for e in sch.events)
    return dict(
        wl,
        events=sch.events,
        hits=getattr(manager, "cached_prompt_tokens", 0),
        verified=runner.verified,
        forks=len(sch.children),
        cow=getattr(manager, "num_cow", 0),
    )


SEEDS = range(400)
CHUNKS = 4


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_workloads_in_the_simulator(chunk):
    stats = dict.fromkeys(
        ["runs", "preempted", "swapped", "fell back", "prefix hits", "other victims", "shadow checked"], 0
    )
    for seed in SEEDS[chunk::CHUNKS]:
        try:
            out = run_workload(seed)
        except AssertionError as e:
            wl = random_workload(seed)
            desc = {k: v for k, v in wl.items() if k != "reqs"}
            raise AssertionError(f"seed {seed} ({desc}): {e}") from e
        stats["runs"] += 1
        stats["preempted"] += bool(out["events"])
        stats["swapped"] += any(e.mode == "swap" for e in out["events"])
        stats["fell back"] += any(FALLBACK in e.note for e in out["events"])
        stats["prefix hits"] += out["hits"] > 0
        stats["other victims"] += out["policy"] != "latest" and bool(out["events"])
        stats["shadow checked"] += out["verified"] > 0
    # the workloads really exercise what they are meant to
    assert stats["preempted"] >= 0.6 * stats["runs"], stats
    assert stats["swapped"] >= 0.15 * stats["runs"], stats
    assert stats["fell back"] >= 0.05 * stats["runs"], stats
    assert stats["prefix hits"] >= 0.1 * stats["runs"], stats
    assert stats["other victims"] >= 0.1 * stats["runs"], stats
    assert stats["shadow checked"] >= 0.25 * stats["runs"], stats


# ---------------------------------------------------------------------------------------------------
# 3. Errors and limits
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_larger_than_the_whole_cache_never_fits(tiny, kind, mode):
    _, w = tiny
    message = r"may reach 17 tokens = 5 blocks of 4, more than the whole cache \(4 blocks\)"
    space = SwapSpace(64) if mode == "swap" else None
    engine = Engine(
        w,
        PagedKVCache.for_model(w, manager=make_manager(kind, 4, 4, w.max_positions)),
        preemption_mode=mode,
        swap_space=space,
    )
    with pytest.raises(NeverFits, match=message):
        engine.add_request([5] * 10, 7)
    assert not engine.scheduler.has_work  # nothing half-added
    sch = FCFSScheduler(make_manager(kind, 4, 4), preemption_mode=mode, swap_space=space)
    with pytest.raises(NeverFits, match=message):
        sch.add(Sequence(Request(0, 0.0, 10, 7)))
    assert not sch.has_work
    with pytest.raises(NeverFits, match="more than the whole cache"):  # the simulator fails fast, too
        simulator.simulate([Request(0, 0.0, 10, 7)], sch.manager, scheduler=sch, progress=False)
    # exactly the whole cache is fine, even though it must then run alone
    assert len(engine.generate([[5] * 10, [6] * 9], 6)) == 2
    assert_all_free(engine.manager, space)


def test_bad_settings_are_refused(tiny):
    _, w = tiny
    m = BlockManager(8, 4)
    with pytest.raises(ValueError, match="preemption_mode='swap' needs a swap_space"):
        FCFSScheduler(m, preemption_mode="swap")
    with pytest.raises(ValueError, match="needs a swap_space"):
        Engine(w, PagedKVCache.for_model(w, 8, 4), preemption_mode="swap")
    for mode in ("lru", "Swap", "", None):
        with pytest.raises(ValueError, match=r"preemption_mode is 'recompute' or 'swap', got"):
            FCFSScheduler(m, preemption_mode=mode, swap_space=SwapSpace(4))
    for bad in (-1, -10, 2.5, "4", None):
        with pytest.raises(ValueError, match="non-negative number of blocks"):
            SwapSpace(bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_num_batched_tokens must be a positive int, got {bad}"):
            FCFSScheduler(m, max_num_batched_tokens=bad)
        with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive int"):
            Engine(w, PagedKVCache.for_model(w, 8, 4), max_num_batched_tokens=bad)
    empty = SwapSpace(0)
    assert empty.num_blocks == 0 and empty.num_free == 0 and not empty.cpu_tables


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("swap_blocks", [0, 2])
def test_a_swap_space_too_small_falls_back_to_recompute(tiny, prompts, expected, kind, swap_blocks):
    """0 CPU blocks: every victim is recomputed; 2: whoever does not fit is. Outputs stay exact."""
    _, w = tiny
    engine, got = serve(
        w,
        prompts,
        N_NEW,
        kind=kind,
        mode="swap",
        num_blocks=tight_blocks(prompts, N_NEW, BLOCK),
        swap_blocks=swap_blocks,
    )
    assert got == expected
    events = engine.scheduler.events
    fallbacks = [e for e in events if e.mode == "recompute"]
    assert fallbacks, "no victim was too large for the swap space"
    for e in fallbacks:
        assert re.fullmatch(rf"swap space full \(\d+ of {swap_blocks} CPU blocks free\): {FALLBACK}", e.note), e.note
    assert all(e.note == "" for e in events if e.mode == "swap")
    if swap_blocks == 0:
        assert len(fallbacks) == len(events) and engine.spy.out == [] and engine.swap_space.blocks_out == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_engine_keeps_to_the_token_budget(tiny, prompts, expected, mode):
    """Budget 10: prefill + decode tokens per step stay within it, except a prompt longer than the budget,
    which then runs alone (else it could never start). Outputs are unchanged."""
    _, w = tiny
    budget = 10
    roomy, unlimited = serve(w, prompts, N_NEW, num_blocks=128)
    assert roomy.fed[0] == (sum(map(len, prompts)), len(prompts))  # without a budget: everyone at once
    engine, got = serve(
        w,
        prompts,
        N_NEW,
        kind="prefix-cache",
        mode=mode,
        budget=budget,
        num_blocks=tight_blocks(prompts, N_NEW, BLOCK),
        swap_blocks=64 if mode == "swap" else None,
    )
    assert got == expected == unlimited
    fed = engine.fed
    assert all(tokens <= budget or seqs == 1 for tokens, seqs in fed), fed
    assert any(tokens > budget and seqs == 1 for tokens, seqs in fed)  # the 14- and 17-token prompts, alone
    assert engine.scheduler.events


def test_admission_stops_at_the_token_budget():
    """Budget 10. Four 4-token prompts (3 new tokens each), a 7-token one, a 1-token one:
    step 0 admits two (8 tokens), step 1 two more (2 decodes + 8), step 2 nobody - the 7-token prompt does
    not fit beside 4 decodes, and the 1-token one, which would, does not overtake it - step 3 both (2 decodes
    + 7 + 1), once two have finished."""
    m = BlockManager(64, 4, watermark=0.0)
    sch = CheckedScheduler(m, max_num_batched_tokens=10)
    lens = [(4, 3)] * 4 + [(7, 2), (1, 1)]
    for i, (p, o) in enumerate(lens):
        sch.add(Sequence(Request(i, 0.0, p, o)))
    runner, admitted = CheckingRunner(sch), []  # the runner checks the budget every step
    for step in range(4):
        plan = sch.schedule(step)
        admitted.append([s.seq_id for s in plan.admitted])
        sch.update_from_output(plan, runner.execute(plan))
    assert admitted == [[0, 1], [2, 3], [], [4, 5]]
    assert [s.seq_id for s in sch.finished] == [0, 1, 2, 3, 5]


def test_a_sequence_swapped_out_before_its_prefill_counts_its_prompt_against_the_budget():
    """Budget 5, 11 one-token blocks. A (5 + 3 tokens) runs; B (4-token prompt) is admitted at step 1 and
    swapped out in the same step, before its prefill ran (A needs the block); it comes back at step 2 and is
    swapped out again. At step 3 A is done: B comes back with its whole prompt still to compute (4 tokens,
    not 1), so C (another 4) must wait a step - the budget holds every step (the runner checks)."""
    m = BlockManager(11, 1, watermark=0.0)
    sch = CheckedScheduler(m, preemption_mode="swap", swap_space=SwapSpace(64), max_num_batched_tokens=5)
    a, b, c = Sequence(Request(0, 0.0, 5, 3)), Sequence(Request(1, 0.0, 4, 1)), Sequence(Request(2, 0.0, 4, 1))
    log = _drive(sch, {0: [a], 1: [b], 3: [c]}, 20)
    assert [(e.step, e.seq_id, e.mode) for e in sch.events] == [(1, 1, "swap"), (2, 1, "swap")]
    assert log[1]["admitted"] == [1] and log[1]["swapped"] == [1] and b.kv_len == 4
    assert log[3]["back"] == [1] and log[3]["admitted"] == [] and log[4]["admitted"] == [2]
    assert all(s.is_finished for s in (a, b, c)) and not sch.has_work
    assert_all_free(m, sch.swap_space)


def test_a_swapped_sequence_waits_for_the_budget_like_a_new_one():
    """Budget 7, 14 one-token blocks. R1 (3 + 7 tokens) runs from step 0. At step 5, R0 (a 5-token prompt, 2
    samples) and R2 (a 1-token prompt, 3 samples) are admitted (1 + 5 + 1 = 7 tokens), and both are swapped out
    before their prefill ran. R2 comes back at step 6 and forks: 3 samples decode. At step 7 there is memory
    for R0 again, but its 5 prompt tokens beside 3 decodes would make 8: R0 waits a step, as a new request
    would (the runner checks the budget in every step that prefills)."""
    m = make_manager("sharing", 14, 1)
    sch = CheckedScheduler(m, preemption_mode="swap", swap_space=SwapSpace(100), max_num_batched_tokens=7)
    r1 = Sequence(Request(1, 0.0, 3, 7, prompt_ids=[4, 5, 6]))
    r0 = Sequence(Request(0, 0.0, 5, 6, prompt_ids=[5] * 5, tags={"n": 2}))
    r2 = Sequence(Request(2, 0.0, 1, 2, prompt_ids=[6], tags={"n": 3}))
    log = _drive(sch, {0: [r1], 5: [r0, r2]}, 40)
    assert [(e.step, e.seq_id, e.mode) for e in sch.events][:2] == [(5, 2, "swap"), (5, 0, "swap")]
    assert log[5]["admitted"] == [0, 2] and log[5]["swapped"] == [2, 0]
    assert log[6]["back"] == [2] and 1 in log[6]["running"]  # R1 runs its last step beside R2
    assert log[6]["running after"] == [2, 10_000, 10_001]  # R1 is done; R2 and its two forked samples decode
    assert log[7]["back"] == [] and log[7]["free_before"] >= 5 and log[7]["swapped"] == [0]
    assert log[8]["back"] == [0]
    assert len(sch.finished) == 1 + 2 + 3 and not sch.has_work
    assert_all_free(m, sch.swap_space)


# ---------------------------------------------------------------------------------------------------
# 4. Victim choice and the order of return
# ---------------------------------------------------------------------------------------------------


def test_most_recently_admitted_picks_the_latest_admission():
    seqs = [Sequence(Request(i, 0.0, 1, 1), admitted_step=a) for i, a in enumerate([0, 3, 1, 3, 2])]
    assert most_recently_admitted(seqs) is seqs[3]  # of the two admitted at step 3, the later in the batch
    assert most_recently_admitted(seqs[:3]) is seqs[1]
    assert most_recently_admitted(seqs[:1]) is seqs[0]
    shuffled = [seqs[4], seqs[1], seqs[0]]
    assert most_recently_admitted(shuffled) is seqs[1]


def _drive(sch: CheckedScheduler, arrivals: dict[int, list[Sequence]], steps: int) -> list[dict]:
    """Run the scheduler with the (checking) accounting runner; log what every step did."""
    runner, log = CheckingRunner(sch), []
    for step in range(steps):
        for s in arrivals.get(step, []):
            sch.add(s)
        free, ins, adm = sch.manager.allocator.num_free, len(sch.swap_ins), len(sch.admissions)
        plan = sch.schedule(step)
        entry = dict(step=step, free_before=free, back=sch.swap_ins[ins:], admitted=sch.admissions[adm:])
        output = runner.execute(plan)
        entry.update(
            running=[s.seq_id for s in sch.running],
            swapped=[s.seq_id for s in sch.swapped],
            waiting=[s.seq_id for s in sch.waiting],
        )
        log.append(entry)
        sch.update_from_output(plan, output)
        entry["running after"] = [s.seq_id for s in sch.running]
        if not sch.has_work:
            break
    return log


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_latest_admitted_is_preempted_and_comes_back_before_anyone_new(mode):
    """10 one-token blocks. A, B, D (3-token prompts, ids 0, 1, 2) start together at step 0 and grow.

    Step 0: B cannot grow -> D, the latest admitted (a tie at step 0: the later in the batch), is preempted.
    Step 1: C (id 3, one token) arrives; 2 blocks are free, enough for C, but C waits: D is ahead of it
    (swapped: swapped sequences come back first; recompute: D heads the queue and nobody overtakes).
    Step 2: A cannot grow -> B, now the latest admitted, is preempted. A finishes.
    Step 3: the preempted come back - swapped ones in the order they left (D, B); recomputed ones from the
    queue's front (B, re-queued last, goes first) - and only then is C admitted.
    """
    m = BlockManager(10, 1, watermark=0.0)
    space = SwapSpace(16) if mode == "swap" else None
    sch = CheckedScheduler(m, preemption_mode=mode, swap_space=space)
    a, b, d = (Sequence(Request(i, 0.0, 3, n)) for i, n in ((0, 3), (1, 6), (2, 6)))
    c = Sequence(Request(3, 0.0, 1, 1))
    log = _drive(sch, {0: [a, b, d], 1: [c]}, 60)
    assert [(e.step, e.seq_id, e.mode) for e in sch.events][:2] == [(0, 2, mode), (2, 1, mode)]
    assert log[0]["admitted"] == [0, 1, 2] and log[0]["running"] == [0, 1]
    assert log[1]["free_before"] >= 1 and log[1]["admitted"] == [] and 3 not in log[1]["running"]
    if mode == "swap":
        assert log[0]["swapped"] == [2] and log[1]["swapped"] == [2] and log[1]["waiting"] == [3]
        assert log[2]["swapped"] == [2, 1]
        assert log[3]["back"] == [2, 1] and log[3]["admitted"] == [3]
    else:
        assert log[1]["waiting"] == [2, 3] and log[2]["waiting"] == [1, 2, 3]
        assert log[3]["admitted"] == [1, 2, 3]
    assert all(s.is_finished for s in (a, b, c, d)) and not sch.has_work
    assert_all_free(m, space)
