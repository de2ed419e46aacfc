"""Shared by the preemption tests: managers, the checks of who holds what after a step, an engine served step
by step under watch, and the checking scheduler and runner the randomized simulator workloads use."""

from __future__ import annotations

import random
import re

import torch

from lesson_utils.cache.paged import PagedKVCache, gather_kv
from lesson_utils.core.types import Request, Sequence
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.serving import simulator
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.scheduler import FCFSScheduler, most_recently_admitted

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
    m.view.check_invariants()
    check_swap_space(sch.swap_space)
    running = {s.seq_id for s in sch.running}
    swapped = {s.seq_id for s in sch.swapped}
    waiting = {s.seq_id for s in sch.waiting}
    assert set(m.view.tables()) == running, (sorted(m.view.tables()), sorted(running))
    if isinstance(m, SharingBlockManager):  # prefix-cache bookkeeping only for sequences holding blocks
        assert set(m._hashes) <= running, (sorted(m._hashes), sorted(running))
    assert not (running & swapped or running & waiting or swapped & waiting)
    cpu = set(sch.swap_space.cpu_tables) if sch.swap_space is not None else set()
    assert cpu == swapped, (sorted(cpu), sorted(swapped))
    for s in sch.swapped:  # a swapped sequence keeps its computed K/V (on the CPU), and its tokens' slots
        assert s.len <= sch.swap_space.cpu_tables[s.seq_id].num_tokens <= s.len + 1
    for s in sch.waiting:
        assert s.num_computed == 0


def assert_all_free(m: BlockManager, space: SwapSpace | None = None) -> None:
    m.view.check_invariants()
    assert not m.view.tables()
    assert m.num_free_blocks == m.view.num_blocks
    assert all(m.view.block_is_free(b) for b in range(m.view.num_blocks))
    if isinstance(m, SharingBlockManager):
        assert not any(m.view.ref_count(b) for b in range(m.view.num_blocks))
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
            blocks = list(manager.view.tables()[seq_id].blocks)
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
    run_feeds = engine.runner.run_feeds

    def spy(feeds):
        fed.append((sum(len(f.token_ids) for f in feeds), len(feeds)))
        return run_feeds(feeds)

    engine.runner.run_feeds = spy
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
        cache, blocks = self.engine.cache, self.engine.manager.view.tables()[seq_id].blocks
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
            self.snap[s.seq_id] = (recomputed.get(s.seq_id, 0), s.num_computed, self._kv(s.seq_id, s.num_computed))


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


def oldest_first(running: list[Sequence]) -> Sequence:
    """Another victim policy (a learner's, say): the running sequence admitted first. It can pick a sequence
    whose room for the next token was already made this step - copy-on-write included."""
    return min(running, key=lambda s: s.admitted_step)


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
        preempt = self.preemption.preempt

        def recording_preempt(victim, moved, step, swap_out):
            self.victims.append(victim.seq_id)
            if self.swap_space is not None:  # what the swap moves: its len tokens' blocks (the lookahead trimmed)
                kept = blocks_needed(victim.len, self.manager.view.block_size)
                blocks = self.manager.view.block_table(victim.seq_id)[:kept]
                self.fits_at_preemption.append(
                    self.swap_space.distinct_new_blocks(blocks, moved) <= self.swap_space.num_free
                )
            preempt(victim, moved, step, swap_out)

        self.preemption.preempt = recording_preempt

    def add(self, seq):
        n = seq.request.tags.get("n", 1)  # parallel sampling, as the engine does it: the scheduler forks after
        seq.pending_forks, seq.samples = n - 1, [seq]  # the prefill (the simulator's sequences ask for none)
        super().add(seq)

    def update_from_output(self, plan, output):
        samples = [(s, len(s.samples)) for s in plan.scheduled]
        done = super().update_from_output(plan, output)
        self.children += [c.seq_id for s, n in samples for c in s.samples[n:]]  # forked in this step
        return done

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
        bs = self.sch.manager.view.block_size
        for c, g in plan.swap_in:
            for o in range(bs):
                self.gpu[g, o] = self.cpu.get((c, o))
        for g, c in plan.swap_out:
            for o in range(bs):
                self.cpu[c, o] = self.gpu.get((g, o))

    def _shadow_step(self, plan):
        running, step = plan.scheduled, plan.step
        m = self.sch.manager
        bs = m.view.block_size
        for src, dst in plan.copies:
            for o in range(bs):
                self.gpu[dst, o] = self.gpu.get((src, o))
        for s in running:
            blocks = m.view.tables()[s.seq_id].blocks
            if s.admitted_step == step:  # just swapped in, or admitted with cached prefix blocks
                for p in range(s.num_computed):
                    got = self.gpu.get((blocks[p // bs], p % bs))
                    assert got == self.content(s, p), f"step {step}: sequence {s.seq_id} position {p} holds {got}"
                self.verified += s.num_computed
            for p in range(s.num_computed, s.len):  # the forward writes every token not yet in the cache
                self.gpu[blocks[p // bs], p % bs] = self.content(s, p)

    def execute(self, plan):
        running, step = plan.scheduled, plan.step
        sch = self.sch
        check_step(sch)
        self.apply(plan)
        self._shadow_step(plan)
        for s in running:  # room was made for the token about to be generated, and nothing more
            assert sch.manager.view.tables()[s.seq_id].num_tokens == s.len + 1
        tokens = sum(s.len - s.num_computed for s in running)
        budget = sch.max_num_batched_tokens
        # the budget holds every step. With forks (n - 1 more decodes without an admission) decodes alone may
        # exceed it, but a step that prefills (admits someone, or swaps in one that was swapped out before its
        # prefill ran) never does. One request over the budget alone runs alone.
        prefills = sch.last_admitted or any(s.len - s.num_computed > 1 for s in running)
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
        hits=manager.view.cached_prompt_tokens,
        verified=runner.verified,
        forks=len(sch.children),
        cow=manager.view.num_cow,
    )


def drive(sch: CheckedScheduler, arrivals: dict[int, list[Sequence]], steps: int) -> list[dict]:
    """Run the scheduler with the (checking) accounting runner; log what every step did."""
    runner, log = CheckingRunner(sch), []
    for step in range(steps):
        for s in arrivals.get(step, []):
            sch.add(s)
        free, ins, adm = sch.manager.num_free_blocks, len(sch.swap_ins), len(sch.admissions)
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
