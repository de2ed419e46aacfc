"""Lesson 07's view of one step: the plan flattened as the runner flattens it, consistent with the block tables,
and changing nothing."""

from __future__ import annotations

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.lab.step_view import flatten_plan
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving.engine import Engine


def test_a_mixed_step_flattens_into_rows_that_match_the_block_tables(tiny):
    _, w = tiny
    manager = SharingBlockManager(32, 4, max_seq_len=w.max_positions)
    engine = Engine(w, PagedKVCache.for_model(w, manager=manager), stop_at_eos=False)
    first = [1] + list(range(10, 23))  # 14 tokens
    engine.add_request(first, 4)
    engine.add_request([1] + list(range(40, 69)), 4)  # 30 tokens
    engine.step()
    engine.add_request([1] + list(range(80, 88)), 4)  # 9 new tokens
    engine.add_request(first[:8] + [100, 101, 102], 4)  # 8 tokens from the prefix cache, 3 new
    plan = engine.scheduler.schedule(1)
    before = [(s.num_computed, list(s.token_ids)) for s in plan.scheduled]
    flat = flatten_plan(plan, engine.cache)
    assert [(s.num_computed, list(s.token_ids)) for s in plan.scheduled] == before  # nothing changed
    assert flat.cached_before == [14, 30, 0, 8]
    assert flat.query_start == [0, 1, 2, 11, 14] and flat.context_lens == [15, 31, 9, 11]
    assert flat.kinds[3] == "prefill, 8 from prefix cache" and flat.kinds[0].startswith("decode")
    assert flat.block_tables[3][:2] == flat.block_tables[0][:2]  # the shared prefix's two blocks
    for i in range(4):
        for r in range(flat.query_start[i], flat.query_start[i + 1]):
            p = flat.positions[r]
            assert flat.slots[r] == flat.block_tables[i][p // 4] * 4 + p % 4
        assert flat.positions[flat.query_start[i + 1] - 1] + 1 == flat.context_lens[i]
    assert flat.logits_rows == [flat.query_start[i + 1] - 1 for i in plan.sampling]
    assert "rows that get logits" in flat.table()
    out = engine.runner.execute(plan)  # the step still runs as planned
    engine.scheduler.update_from_output(plan, out)
    assert [s.num_computed for s in plan.scheduled] == flat.context_lens
