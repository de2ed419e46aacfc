"""Lesson 05's block sharing: the ref-counted ``BlockPool``, fork, copy-on-write and the prefix cache.

What this file proves:

* a ``SharingBlockManager`` driven like the engine drives it - sequences admitted (with prefix-cache hits),
  stepped in batches (``append_slot`` for everyone, preemption by recompute when memory runs out, the
  cache's copy-on-write copies, then the K/V writes), forked, freed and re-admitted in random order -
  keeps every invariant after every step (a hypothesis state machine, block sizes 1 / 2 / 4, 16-24
  blocks, prompts over a 3-token alphabet that share prefixes with earlier sequences so hits really
  happen). A *shadow cache* records which token each slot holds, moved by the same copies and writes the
  real cache would make, and shows that:

  - every reference count equals the number of tables holding the block; no block is lost, leaked, or
    both free and held;
  - every sequence's computed K/V, read through its own block table, are its own tokens: copy-on-write
    and prefix hits never mix sequences' data; a write never lands in a shared or a cached block, and the
    forward pass never needs a block that ``append_slot`` did not already take;
  - a cached block's contents are the tokens it was hashed from, and its hash is the ``block_hash``
    chain of its whole prefix;
  - freeing never forgets a cached prefix: a free cached block is hit again (exactly the hits an
    independent model predicts) until the allocator hands it out again, which is the only eviction;
  - blocks are reused least recently freed first, and a sequence's tail blocks are freed (so evicted)
    before its head blocks;

* unit cases: ``BlockPool`` counts and its errors; the free queue's operations cost the same at 2 000
  and 100 000 blocks (O(1)); token verification rejects a hash collision; eviction takes the tail block
  first; the last prompt token is always recomputed; fork never allocates; copy-on-write repoints only
  the writer; ``n`` holders of one partial block cost ``n - 1`` copies (the last holder writes in place).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import pytest
from helpers.sharing import ALPHABET, chain_hash, make_seq
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from lesson_utils.core.types import OutOfBlocks, Sequence
from lesson_utils.memory.block_pool import BlockPool
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.memory.sharing import SharingBlockManager

# ---------------------------------------------------------------------------------------------------
# The sharing block manager as a state machine, with a shadow of the cache's contents
# ---------------------------------------------------------------------------------------------------

COVERAGE: dict[str, int] = {}


def _seen(what: str) -> None:
    event(what)
    COVERAGE[what] = COVERAGE.get(what, 0) + 1


class SharingMachine(RuleBasedStateMachine):
    """The engine's use of the manager, step by step, against a model of what the cache holds.

    Sequence states: *admitted* (holds its prompt's blocks, ``num_computed`` = prefix hits, not computed yet),
    *running* (computed up to its newest token, whose K/V are written next step: ``num_computed == len - 1``),
    *waiting* (preempted: no blocks, ``num_computed == 0``, keeps its tokens).

    Models kept beside the manager: ``shadow[b]`` - the token in each slot of block ``b`` (None =
    never written); ``lru`` - the free queue, in the order blocks must be reused; ``cached`` - block ->
    (hash, whole prefix) of every block the prefix cache must still know.
    """

    def __init__(self):
        super().__init__()
        self.m: SharingBlockManager | None = None
        self.next_id = 0
        self.admitted: dict[int, Sequence] = {}
        self.running: dict[int, Sequence] = {}
        self.waiting: list[Sequence] = []
        self.history: list[list[int]] = []  # token lists seen so far: new prompts extend their prefixes
        self.processed: dict[int, int] = {}  # seq -> its full blocks already offered to the prefix cache

    # ---- set-up: the manager, and spies that check the pool against the LRU model --------------------
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(16, 24))
    def setup(self, block_size, num_blocks):
        self.bs, self.n = block_size, num_blocks
        # the test builds the pool and hands it in, so it can watch the pool's own counts (the manager's door is
        # its view; the pool is a part this test composes)
        pool = self.pool = BlockPool(num_blocks, enable_caching=True)
        self.m = SharingBlockManager(num_blocks, block_size, enable_prefix_caching=True, watermark=0.0, pool=pool)
        self.shadow: dict[int, list] = {b: [None] * block_size for b in range(num_blocks)}
        self.lru: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, tuple[int, tuple[int, ...]]] = {}
        allocate, incref, decref = pool.allocate, pool.incref, pool.decref

        def spy_allocate():
            b = allocate()
            oldest = next(iter(self.lru))
            assert b == oldest, f"allocate handed out block {b}, but block {oldest} was freed longer ago"
            del self.lru[b]
            if self.cached.pop(b, None) is not None:  # reuse is the one and only eviction
                _seen("evicted a cached block")
            return b

        def spy_incref(b):
            revived = pool.ref_count[b] == 0
            incref(b)
            if revived:
                del self.lru[b]

        def spy_decref(b):
            decref(b)
            if pool.ref_count[b] == 0:
                self.lru[b] = None  # the newest end of the queue

        pool.allocate, pool.incref, pool.decref = spy_allocate, spy_incref, spy_decref

    # ---- helpers --------------------------------------------------------------------------------
    def _state(self):
        """Everything a refused operation must leave untouched."""
        m = self.m
        tables = {sid: (tuple(t.blocks), t.num_tokens) for sid, t in m.view.tables().items()}
        return tables, tuple(self.pool.ref_count), dict(self.pool.hash_of), self.pool.num_free

    def _expected_hits(self, tokens: list[int]) -> list[int]:
        """The hits the cache model predicts: whole blocks, chained, the last token left out, verified
        against the shadow contents (what the blocks really hold)."""
        by_hash = {h: b for b, (h, _) in self.cached.items()}
        hits = []
        for i in range((len(tokens) - 1) // self.bs):
            b = by_hash.get(chain_hash(tokens[: (i + 1) * self.bs], self.bs))
            if b is None or self.shadow[b] != tokens[i * self.bs : (i + 1) * self.bs]:
                break
            hits.append(b)
        return hits

    def _offer(self, seq: Sequence) -> None:
        """``cache_computed``: full computed blocks not offered before are registered, unless their hash
        (or the block) is known already."""
        m, bs = self.m, self.bs
        table, tokens = m.view.tables()[seq.seq_id], seq.token_ids
        full = min(seq.num_computed, len(tokens), table.num_tokens) // bs
        m.cache_computed(seq)
        known = {h for h, _ in self.cached.values()}
        for i in range(self.processed[seq.seq_id], full):
            prefix = tuple(tokens[: (i + 1) * bs])
            h, b = chain_hash(prefix, bs), table.blocks[i]
            if b in self.cached:
                assert self.cached[b][0] == h, f"block {b} is cached as another prefix than the one it holds"
            elif h not in known:
                self.cached[b] = (h, prefix)
                known.add(h)
        self.processed[seq.seq_id] = max(self.processed[seq.seq_id], full)

    def _admit(self, seq: Sequence, label: str) -> None:
        m, pool = self.m, self.pool
        hits = self._expected_hits(seq.token_ids)
        revived = [b for b in hits if pool.ref_count[b] == 0]
        need = blocks_needed(seq.len, self.bs) - len(hits) + len(revived)
        whole = seq.len % self.bs == 0 and chain_hash(seq.token_ids, self.bs) in {h for h, _ in self.cached.values()}
        can = m.can_allocate(seq)
        assert can == (need <= (self.n if pool.num_used == 0 else pool.num_free))
        if not can:
            _seen(f"{label}: refused")
            before = self._state()
            with pytest.raises(OutOfBlocks):
                m.allocate(seq)
            assert self._state() == before, "a refused admission changed the manager"
            return
        free_before = pool.num_free
        m.allocate(seq)
        table = m.view.tables()[seq.seq_id]
        assert table.blocks[: len(hits)] == hits, "prefix hits differ from the blocks that hold the prefix"
        assert seq.num_computed == len(hits) * self.bs < seq.len, "the last prompt token must be recomputed"
        assert table.num_tokens == seq.len and pool.num_free == free_before - need
        self.admitted[seq.seq_id] = seq
        self.processed[seq.seq_id] = len(hits)
        self.history.append(seq.token_ids)
        _seen(f"{label}: {'hit' if hits else 'no hit'}")
        if revived:
            _seen("hit a free cached block")
        if whole:
            _seen("whole prompt cached: its last block recomputed")

    def _prompt(self, data) -> list[int]:
        """Mostly an earlier sequence's tokens (prompt and generated), cut anywhere, often at a block
        boundary or not at all, plus a few fresh tokens; now and then one no cache could ever hold."""
        bs = self.bs
        base = []
        if self.history and data.draw(st.integers(0, 3), label="fresh prompt?"):
            base = data.draw(st.sampled_from(self.history[-12:]), label="shares a prefix with")
        longest = min(len(base), 6 * bs)
        cut = data.draw(st.sampled_from([longest, longest - longest % bs]) | st.integers(0, longest), label="cut")
        tail = data.draw(st.lists(st.sampled_from(ALPHABET), min_size=0 if cut else 1, max_size=2 * bs), label="tail")
        if data.draw(st.integers(0, 19), label="huge?") == 0:
            tail = tail + [0] * ((self.n + 1) * bs)
        return base[:cut] + tail

    def _preempt(self, seq: Sequence) -> None:
        self.m.free(seq.seq_id)
        self.admitted.pop(seq.seq_id, None)
        self.running.pop(seq.seq_id, None)
        seq.num_computed = 0
        seq.preemptions += 1
        self.waiting.append(seq)
        _seen("preempted")

    # ---- rules ----------------------------------------------------------------------------------
    # (No preconditions: a rule that does not apply returns at once. Hypothesis gives up on a test case
    # when most rules are disabled, as they are whenever the cache is empty.)
    @rule(data=st.data())
    def add_sequence(self, data):
        seq = make_seq(self.next_id, self._prompt(data))
        self.next_id += 1
        self._admit(seq, "add")

    @rule()
    def readmit_preempted(self):
        """The scheduler's queue head first: recompute, but start from whatever prefix is still cached."""
        if not self.waiting:
            return
        seq = self.waiting[0]
        self._admit(seq, "readmit")
        if seq.seq_id in self.admitted:
            self.waiting.pop(0)

    @rule(data=st.data())
    def step(self, data):
        """One engine step over the admitted sequences and some running ones."""
        while self.waiting and self.m.can_allocate(self.waiting[0]):  # preempted ones come back first
            self.readmit_preempted()
        if not (self.running or self.admitted):
            return
        m, pool, bs = self.m, self.pool, self.bs
        batch = [s for s in self.running.values() if data.draw(st.booleans(), label="runs")]
        batch += list(self.admitted.values())
        # the scheduler: room for the token each one is about to generate; when memory runs out, a victim
        # is preempted - any of the batch, possibly one that already made room (and copied-on-write)
        i = 0
        while i < len(batch):
            seq = batch[i]
            before = self._state()
            try:
                m.append_slot(seq)
                i += 1
            except OutOfBlocks:
                assert self._state() == before, "a failed append_slot changed the manager"
                index = data.draw(st.sampled_from([len(batch) - 1, 0]) | st.integers(0, len(batch) - 1), label="victim")
                if index < i:
                    i -= 1
                    _seen("preempted a sequence that already made room")
                self._preempt(batch.pop(index))
        for seq in batch:
            table = m.view.tables()[seq.seq_id]
            assert table.num_tokens == seq.len + 1
            for p in (seq.len - 1, seq.len):  # the blocks written this step and next are exclusive
                b = table.blocks[p // bs]
                assert pool.ref_count[b] == 1 and b not in pool.hash_of
        copies = m.pop_copies()
        # the cache's prepare: the same _make_writable, which must find nothing left to copy
        free_before = pool.num_free
        for seq in batch:
            m._make_writable(seq.seq_id, seq.num_computed, seq.len)
        assert m.pop_copies() == [] and pool.num_free == free_before, "the forward pass would need blocks"
        for src, dst in copies:  # copy_block, in order, before any write
            # (a preempted victim's copy may land in a block it freed: harmless, nobody has written there yet)
            assert pool.ref_count[dst] <= 1 and dst not in pool.hash_of
            self.shadow[dst] = list(self.shadow[src])
            _seen("copy-on-write")
        # the forward: every token not yet in the cache is written through the table
        for seq in batch:
            table, tokens = m.view.tables()[seq.seq_id], seq.token_ids
            for p in range(seq.num_computed, seq.len):
                b = table.blocks[p // bs]
                assert pool.ref_count[b] == 1, f"position {p} of sequence {seq.seq_id} written into shared block {b}"
                assert b not in pool.hash_of, f"position {p} of sequence {seq.seq_id} overwrote cached block {b}"
                self.shadow[b][p % bs] = tokens[p]
        # sampling, then the engine registers the computed blocks
        for seq in batch:
            seq.num_computed = seq.len
            seq.output_ids.append(data.draw(st.sampled_from(ALPHABET), label="token"))
            seq.num_generated += 1
            self._offer(seq)
            self.admitted.pop(seq.seq_id, None)
            self.running[seq.seq_id] = seq
            self.history.append(seq.token_ids)

    @rule(data=st.data())
    def fork(self, data):
        """Parallel sampling / beam search: the child shares every block; its newest token may differ."""
        if not self.running:
            return
        m, pool = self.m, self.pool
        parent = self.running[data.draw(st.sampled_from(sorted(self.running)), label="parent")]
        token = data.draw(st.sampled_from(ALPHABET), label="child's token")
        child = Sequence(
            replace(parent.request, req_id=self.next_id),
            num_generated=parent.num_generated,
            output_ids=parent.output_ids[:-1] + [token],
            num_computed=parent.num_computed,
        )
        self.next_id += 1
        counts, free_before = list(pool.ref_count), pool.num_free
        m.fork(parent.seq_id, child.seq_id)
        pt, ct = m.view.tables()[parent.seq_id], m.view.tables()[child.seq_id]
        assert pool.num_free == free_before, "fork allocated"
        assert ct.blocks == pt.blocks and ct.blocks is not pt.blocks and ct.num_tokens == pt.num_tokens
        for b in range(self.n):
            assert pool.ref_count[b] == counts[b] + pt.blocks.count(b)
        self.running[child.seq_id] = child
        self.processed[child.seq_id] = self.processed[parent.seq_id]
        _seen("fork")

    @rule(data=st.data())
    def free(self, data):
        if not (self.running or self.admitted):
            return
        m, pool = self.m, self.pool
        live = {**self.running, **self.admitted}
        seq = live[data.draw(st.sampled_from(sorted(live)), label="finishes")]
        blocks, counts = list(m.view.tables()[seq.seq_id].blocks), list(pool.ref_count)
        m.free(seq.seq_id)
        self.running.pop(seq.seq_id, None)
        self.admitted.pop(seq.seq_id, None)
        for b in set(blocks):
            assert pool.ref_count[b] == counts[b] - blocks.count(b)
        released = [b for b in reversed(blocks) if counts[b] == 1]
        assert all(pool.is_free(b) for b in released)
        if released:  # the newest end of the free queue, tail block first: the tail is evicted first
            assert list(self.lru)[-len(released) :] == released
        with pytest.raises(ValueError, match="holds no blocks"):
            m.free(seq.seq_id)

    # ---- after every step -----------------------------------------------------------------------
    @invariant()
    def counts_contents_and_cache_agree(self):
        m = self.m
        if m is None:
            return
        pool, bs = self.pool, self.bs
        m.view.check_invariants()
        # counts: equal to holders; free exactly at zero; the free set is the LRU model's
        held: dict[int, int] = {}
        for t in m.view.tables().values():
            for b in t.blocks:
                held[b] = held.get(b, 0) + 1
        assert [pool.ref_count[b] for b in range(self.n)] == [held.get(b, 0) for b in range(self.n)]
        assert {b for b in range(self.n) if pool.is_free(b)} == set(self.lru) == set(range(self.n)) - set(held)
        assert pool.num_free == len(self.lru) and pool.num_used == len(held)
        # who holds what
        assert set(m.view.tables()) == set(self.running) | set(self.admitted)
        assert not set(self.running) & set(self.admitted)
        assert all(s.seq_id not in m.view.tables() and s.num_computed == 0 for s in self.waiting)
        for sid, seq in self.running.items():
            assert m.view.tables()[sid].num_tokens == seq.len and seq.num_computed == seq.len - 1
        for sid, seq in self.admitted.items():
            assert (
                m.view.tables()[sid].num_tokens == seq.len and seq.num_computed % bs == 0 and seq.num_computed < seq.len
            )
        # contents: each sequence reads its own tokens through its own table
        for sid, t in m.view.tables().items():
            seq = self.running.get(sid) or self.admitted[sid]
            tokens = seq.token_ids
            got = [self.shadow[t.blocks[p // bs]][p % bs] for p in range(seq.num_computed)]
            assert got == tokens[: seq.num_computed], f"sequence {sid} reads K/V that are not its own"
        # the prefix cache: what the model says, and every entry's contents match its hash
        assert {b: h for b, (h, _) in self.cached.items()} == pool.hash_of
        assert {h: b for b, h in pool.hash_of.items()} == pool.block_of
        assert set(pool.tokens_of) == set(pool.hash_of)
        for b, (h, prefix) in self.cached.items():
            assert len(prefix) % bs == 0 and prefix
            assert pool.tokens_of[b] == tuple(prefix[-bs:]) == tuple(self.shadow[b]), f"cached block {b} changed"
            assert h == chain_hash(prefix, bs)
        assert pool.num_cached_free == sum(1 for b in self.lru if b in self.cached)
        # accounting adds up
        br = m.view.breakdown()
        assert sum(br.values()) == m.view.total_slots and br["free"] == pool.num_free * bs
        logical, physical = m.view.sharing()
        assert logical == sum(len(t.blocks) for t in m.view.tables().values()) and physical == len(held)


MACHINE_SETTINGS = settings(max_examples=50, stateful_step_count=60, deadline=None)
SharingMachine.TestCase.settings = MACHINE_SETTINGS
TestSharingBlockManager = SharingMachine.TestCase


INTERESTING = (
    "add: hit",
    "readmit: hit",
    "hit a free cached block",
    "evicted a cached block",
    "whole prompt cached: its last block recomputed",
    "copy-on-write",
    "fork",
    "preempted",
    "preempted a sequence that already made room",
    "add: refused",
)


def test_the_state_machine_reaches_the_interesting_cases():
    """Hits on free cached blocks, evictions, copy-on-write, forks and preemption all really happen
    (otherwise the machine above would prove little about them). Derandomized, yet which examples a derandomized
    run draws was seen to change with what the process imported before (one import order gave 2 preemptions in
    30 examples, another 9): so the check runs rounds of longer runs, counting the cases over all of them, until
    every case has happened - the longer runs fill the cache, where preemption and readmission live."""
    COVERAGE.clear()
    for steps in (60, 100, 150):
        run_state_machine_as_test(
            SharingMachine,
            settings=settings(
                MACHINE_SETTINGS, max_examples=30, stateful_step_count=steps, derandomize=True, database=None
            ),
        )
        if all(COVERAGE.get(what, 0) for what in INTERESTING):
            break
    for what in INTERESTING:
        assert COVERAGE.get(what, 0) > 0, f"never happened: {what} ({COVERAGE})"


def test_a_preempted_sequence_is_readmitted_on_its_own_cached_prefix():
    """Recompute after preemption starts from whatever of its prefix is still cached: its full computed blocks
    were registered, freed on preemption (cached, not erased), and hit again on readmission - all but the last
    prompt token's block, which is recomputed."""
    bs = 4
    m = SharingBlockManager(8, bs, watermark=0.0)
    seq = make_seq(0, [ALPHABET[i % len(ALPHABET)] for i in range(9)])  # 9 tokens: two full blocks and one token
    m.allocate(seq)
    seq.num_computed = seq.len
    m.cache_computed(seq)
    held = list(m.view.block_table(0))
    m.free(0)  # preempted by recompute
    seq.num_computed = 0
    assert m.num_free_blocks == 8
    m.allocate(seq)
    assert seq.num_computed == 2 * bs and m.view.block_table(0)[:2] == held[:2]
