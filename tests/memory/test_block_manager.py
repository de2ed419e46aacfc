"""Lesson 03's block manager: it never loses, double-books or leaks a block (a hypothesis state machine, checked
after every step against every block id), a failed allocation changes nothing, its accounting adds up, and
inputs that can never work fail naming the problem."""

from __future__ import annotations

import pytest
from helpers.paged import make_seq, snapshot
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lesson_utils.core.types import FREE, INTERNAL, TOKEN, NeverFits, OutOfBlocks, Sequence
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import blocks_needed

# ---------------------------------------------------------------------------------------------------
# The block manager as a state machine
# ---------------------------------------------------------------------------------------------------

NUM_BLOCKS = 24


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences arrive, grow a token at a time and finish in random order; no block is ever lost,
    held twice, or both held and free, and every table holds exactly ceil(tokens / block_size) blocks."""

    def __init__(self):
        super().__init__()
        self.m: BlockManager | None = None
        self.live: dict[int, Sequence] = {}
        self.finished: list[Sequence] = []
        self.next_id = 0

    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), watermark=st.sampled_from([0.0, 0.1]))
    def setup(self, block_size, watermark):
        self.bs = block_size
        self.m = BlockManager(NUM_BLOCKS, block_size, watermark=watermark)
        assert self.m.watermark_blocks == int(watermark * NUM_BLOCKS)

    def _new_seq(self, prompt_len: int) -> Sequence:
        seq = make_seq(self.next_id, prompt_len)
        self.next_id += 1
        return seq

    @rule(data=st.data(), via_ensure=st.booleans())
    def add_sequence(self, data, via_ensure):
        # Mostly prompts of up to 4 blocks (the cache fills up after a dozen), sometimes up to the whole
        # cache and beyond (refused even when empty).
        bs = self.bs
        prompt_len = data.draw(st.integers(1, 4 * bs) | st.integers(1, (NUM_BLOCKS + 2) * bs), label="prompt_len")
        m, seq = self.m, self._new_seq(prompt_len)
        need = blocks_needed(prompt_len, self.bs)
        free_before = m.num_free_blocks
        if m.can_allocate(seq):
            assert need <= free_before
            if via_ensure:
                table = m.blocks.reserve(seq.seq_id, prompt_len)
            else:
                m.allocate(seq)
                table = m.view.tables()[seq.seq_id]
            assert table.num_tokens == prompt_len and len(table.blocks) == need
            assert m.num_free_blocks == free_before - need
            self.live[seq.seq_id] = seq
            event("admitted")
            return
        # Refused: consistently so (not enough free blocks, or only the watermark holds it back) ...
        if m.num_free_blocks == NUM_BLOCKS:
            assert need > NUM_BLOCKS
        else:
            assert need + m.watermark_blocks > free_before
        event("refused: too few free blocks" if need > free_before else "refused: watermark")
        if need > free_before:  # ... and forcing it fails without touching anything
            before = snapshot(m)
            with pytest.raises(OutOfBlocks):
                if via_ensure:
                    m.blocks.reserve(seq.seq_id, prompt_len)
                else:
                    m.allocate(seq)
            assert snapshot(m) == before, "a failed allocation changed the manager's state"
            assert seq.seq_id not in m.view.tables()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow_by_one_token(self, data):
        m = self.m
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        table = m.view.tables()[seq.seq_id]
        needs_block = seq.len % self.bs == 0
        event(f"grow: {'new' if needs_block else 'same'} block, {'some' if m.num_free_blocks else 'none'} free")
        if needs_block and m.num_free_blocks == 0:
            before = snapshot(m)
            msg = rf"needs 1 more block\(s\) for {seq.len + 1} tokens, but only 0 of the 24 blocks are free"
            with pytest.raises(OutOfBlocks, match=msg):
                m.append_slot(seq)
            assert snapshot(m) == before, "a failed append_slot changed the manager's state"
            return
        old_blocks, free_before = list(table.blocks), m.num_free_blocks
        free_ids = {b for b in range(NUM_BLOCKS) if m.view.block_is_free(b)}
        m.append_slot(seq)
        seq.num_generated += 1  # the token that slot was for has been generated
        table = m.view.tables()[seq.seq_id]  # (the view hands out copies)
        assert table.blocks[: len(old_blocks)] == old_blocks, "existing blocks moved"
        if needs_block:
            assert len(table.blocks) == len(old_blocks) + 1 and table.blocks[-1] in free_ids
            assert m.num_free_blocks == free_before - 1
        else:
            assert len(table.blocks) == len(old_blocks) and m.num_free_blocks == free_before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_sequence(self, data):
        m = self.m
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        blocks, free_before = list(m.view.tables()[seq.seq_id].blocks), m.num_free_blocks
        m.free(seq.seq_id)
        assert m.num_free_blocks == free_before + len(blocks)
        assert all(m.view.block_is_free(b) for b in blocks)
        assert seq.seq_id not in m.view.tables()
        self.finished.append(seq)

    @rule(data=st.data())
    def bad_frees(self, data):
        m = self.m
        before = snapshot(m)
        with pytest.raises(ValueError, match="holds no blocks"):
            m.free(make_seq(10_000 + self.next_id, 3).seq_id)  # never admitted
        if self.finished:
            with pytest.raises(ValueError, match="holds no blocks"):
                m.free(data.draw(st.sampled_from(self.finished)).seq_id)  # freed twice
        free_ids = [b for b in range(NUM_BLOCKS) if m.view.block_is_free(b)]
        if free_ids:
            with pytest.raises(ValueError, match="already free"):
                m.blocks.free_block(data.draw(st.sampled_from(free_ids)))
        if self.live:
            with pytest.raises(ValueError, match="already holds blocks"):
                m.allocate(self.live[data.draw(st.sampled_from(sorted(self.live)))])
        assert snapshot(m) == before, "a refused free changed the manager's state"

    @invariant()
    def every_block_is_free_or_owned_never_both_never_lost(self):
        m = self.m
        if m is None:
            return
        m.view.check_invariants()
        free_ids = {b for b in range(NUM_BLOCKS) if m.view.block_is_free(b)}
        held = [b for t in m.view.tables().values() for b in t.blocks]
        assert len(held) == len(set(held)), "a block is in two tables (or twice in one)"
        assert not free_ids & set(held), "a block is both free and held"
        assert free_ids | set(held) == set(range(NUM_BLOCKS)), "a block is neither free nor held"
        assert m.num_free_blocks == len(free_ids) == NUM_BLOCKS - len(held)
        assert set(m.view.tables()) == set(self.live)
        for sid, t in m.view.tables().items():
            assert t.num_tokens == self.live[sid].len
            assert len(t.blocks) == -(-t.num_tokens // self.bs)
        br = m.view.breakdown()
        assert sum(br.values()) == m.view.total_slots and br["reserved"] == 0
        assert br["free"] == m.num_free_blocks * self.bs
        assert br["internal fragmentation"] == sum(t.last_block_waste for t in m.view.tables().values())
        assert all(0 <= t.last_block_waste < self.bs for t in m.view.tables().values())
        held_slots = br["token states"] + br["internal fragmentation"]
        assert m.view.utilization() == (br["token states"] / held_slots if held_slots else 1.0)


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase


# ---------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_breakdown_adds_up_and_only_last_blocks_waste(block_size):
    m = BlockManager(40, block_size, watermark=0.0)
    assert m.view.breakdown() == {
        "token states": 0,
        "reserved": 0,
        "internal fragmentation": 0,
        "free": m.view.total_slots,
    }
    assert m.view.utilization() == 1.0
    lengths = [1, block_size, block_size + 1, 2 * block_size - 1, 33]
    for i, n in enumerate(lengths):
        m.allocate(make_seq(i, n))
    grown = make_seq(0, 1)
    m.append_slot(grown)  # sequence 0 grows to 2 tokens
    lengths[0] = 2
    br = m.view.breakdown()
    held = sum(blocks_needed(n, block_size) for n in lengths) * block_size
    waste = sum(blocks_needed(n, block_size) * block_size - n for n in lengths)
    assert br["token states"] == sum(lengths)
    assert br["reserved"] == 0
    assert br["internal fragmentation"] == waste == sum(t.last_block_waste for t in m.view.tables().values())
    assert br["free"] == m.num_free_blocks * block_size == m.view.total_slots - held
    assert sum(br.values()) == m.view.total_slots
    assert m.view.utilization() == pytest.approx(sum(lengths) / held)
    if block_size == 1:
        assert br["internal fragmentation"] == 0 and m.view.utilization() == 1.0
    kinds = m.view.slot_kinds()
    assert kinds.shape == (m.view.total_slots,)
    assert (kinds == TOKEN).sum() == br["token states"]
    assert (kinds == INTERNAL).sum() == br["internal fragmentation"]
    assert (kinds == FREE).sum() == br["free"]
    for sid in range(len(lengths)):
        m.free(sid)
    assert m.view.breakdown()["free"] == m.view.total_slots


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------


def test_requests_that_can_never_fit():
    m = BlockManager(4, 4, max_seq_len=100)  # 16 slots
    m.check_admissible(make_seq(0, 10, 6))  # exactly 16 tokens = 4 blocks: fine
    with pytest.raises(NeverFits, match=r"request 1 may reach 17 tokens = 5 blocks of 4.*whole cache \(4 blocks\)"):
        m.check_admissible(make_seq(1, 10, 7))
    big = BlockManager(1000, 4, max_seq_len=100)
    big.check_admissible(make_seq(2, 60, 40))
    with pytest.raises(NeverFits, match=r"request 3 may reach 101 tokens; the model allows 100"):
        big.check_admissible(make_seq(3, 60, 41))
    assert issubclass(NeverFits, ValueError)


def test_freeing_twice_or_allocating_twice_is_an_error():
    m = BlockManager(8, 2)
    seq = make_seq(5, 3)
    m.allocate(seq)
    with pytest.raises(ValueError, match="sequence 5 already holds blocks"):
        m.allocate(seq)
    m.free(seq.seq_id)
    with pytest.raises(ValueError, match="sequence 5 holds no blocks"):
        m.free(seq.seq_id)
    with pytest.raises(ValueError, match="holds no blocks"):
        m.free(99)
    assert m.num_free_blocks == 8


def test_failed_allocation_is_all_or_nothing():
    """A prompt that needs more blocks than are free raises OutOfBlocks and takes none of them."""
    m = BlockManager(6, 4, watermark=0.0)
    m.allocate(make_seq(0, 12))  # 3 blocks
    late = make_seq(1, 16)  # needs 4, 3 are free
    assert not m.can_allocate(late)
    with pytest.raises(OutOfBlocks):
        m.allocate(late)
    assert m.num_free_blocks == 3 and set(m.view.tables()) == {0}
    m.free(0)
    m.allocate(late)  # and the same sequence can be admitted once there is room
    assert len(m.view.block_table(1)) == 4


def test_watermark_holds_blocks_back_except_in_an_empty_cache():
    m = BlockManager(10, 4, watermark=0.2)  # keeps 2 blocks back
    assert m.can_allocate(make_seq(0, 40))  # empty cache: anything that fits at all
    assert not m.can_allocate(make_seq(0, 41))
    m.allocate(make_seq(1, 4))  # 9 free
    assert m.can_allocate(make_seq(2, 28)) and not m.can_allocate(make_seq(3, 29))


@pytest.mark.parametrize("block_size", [0, -1])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        BlockManager(8, block_size)


@pytest.mark.parametrize("watermark", [-0.01, 1.0, 2.0])
def test_bad_watermark(watermark):
    with pytest.raises(ValueError, match=r"watermark is a fraction of the blocks in \[0, 1\)"):
        BlockManager(8, 4, watermark=watermark)


def test_bad_number_of_blocks():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 4)
