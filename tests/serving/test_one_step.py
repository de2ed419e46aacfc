"""One step for every engine: the engine and the simulator run the same ``serve_step`` and make the same
decisions; beam search and parallel sampling are served by the scheduler beside other requests; blocks are
allocated by the scheduler's reservations only, never by the forward pass."""

from __future__ import annotations

import random

import pytest
from helpers import hf_greedy

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.cache.seam import StepBatch
from lesson_utils.core.types import OutOfBlocks, Request
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.model.opt_forward import forward
from lesson_utils.serving import simulator
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.step import StepResult, serve_step


def _requests(w, n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, w.vocab_size) for _ in range(rng.randint(2, 30))]
        out.append(Request(i, 0.0, len(prompt), rng.randint(1, 24), prompt_ids=prompt))
    return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_simulator_makes_the_engines_decisions_step_by_step(tiny, mode, seed):
    """The same requests (all arriving at once, no early stop), the same kind of manager: the engine with its
    model runner and the simulator with its accounting runner admit, preempt and finish the same sequences in
    the same steps - the simulator is the engine without the model."""
    from lesson_utils.memory.swap import SwapSpace
    from lesson_utils.serving.scheduler import FCFSScheduler

    _, w = tiny
    reqs = _requests(w, 10, seed)
    space = (lambda: SwapSpace(40)) if mode == "swap" else (lambda: None)
    engine = Engine(
        w,
        PagedKVCache.for_model(w, manager=BlockManager(24, 4, watermark=0.0)),
        stop_at_eos=False,
        preemption_mode=mode,
        swap_space=space(),
    )
    seqs = [engine.add_request(r.prompt_ids, r.output_len) for r in reqs]
    engine.run()
    manager = BlockManager(24, 4, watermark=0.0)
    sch = FCFSScheduler(manager, preemption_mode=mode, swap_space=space())
    res = simulator.simulate(reqs, manager, scheduler=sch, progress=False)
    assert engine.scheduler.num_preemptions == sch.num_preemptions > 0  # memory was short: decisions mattered
    assert [(e.step, e.seq_id, e.mode) for e in engine.scheduler.events] == [
        (e.step, e.seq_id, e.mode) for e in sch.events
    ]
    sim = {s.seq_id: s for s in res.finished}
    assert [(s.admitted_step, s.finished_step, s.num_generated) for s in seqs] == [
        (sim[i].admitted_step, sim[i].finished_step, sim[i].num_generated) for i in range(len(reqs))
    ]
    assert [st.running for st in engine.stats] == list(res.running)


def test_engine_step_is_serve_step_and_a_step_must_return_its_plan(tiny):
    _, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, 40, 4))
    assert engine.step_fn is serve_step
    engine.add_request([2, 5, 6], 3)
    result = serve_step(engine.scheduler, engine.runner, 0)
    assert isinstance(result, StepResult) and result.plan.admitted and result.finished == []

    def finished_only(s, r, step):
        return serve_step(s, r, step).finished

    wrong = Engine(w, PagedKVCache.for_model(w, 40, 4), step_fn=finished_only)
    wrong.add_request([2, 5, 6], 3)
    with pytest.raises(TypeError, match=r"a step returns \(plan, finished\)"):
        wrong.step()


def test_the_forward_pass_allocates_nothing(tiny):
    """The paged cache writes only into slots the scheduler reserved; a token without one is refused, clearly."""
    _, w = tiny
    cache = PagedKVCache.for_model(w, 8, 4)
    with pytest.raises(ValueError, match="sequence 7 holds no blocks.*reserve them first"):
        forward(w, StepBatch.build([7], [[2, 5, 6]], [0]), cache)
    cache.manager.blocks.reserve(7, 3)
    free = cache.manager.num_free_blocks
    forward(w, StepBatch.build([7], [[2, 5, 6]], [0]), cache)
    assert cache.manager.num_free_blocks == free  # nothing taken during the forward pass
    with pytest.raises(ValueError, match="sequence 7 holds slots for 3 tokens.*position 3"):
        forward(w, StepBatch.build([7], [[9]], [3]), cache)


def _sharing_engine(w, num_blocks=96):
    return Engine(w, PagedKVCache.for_model(w, manager=SharingBlockManager(num_blocks, 4, max_seq_len=w.max_positions)))


def test_a_beam_search_is_served_beside_other_requests(tiny):
    """add_beam_search puts a beam group in the scheduler's queue like any request: served beside greedy
    requests, it finds the beam it finds alone, and the requests their HF tokens."""
    model, w = tiny
    prompt = [2] + [random.Random(5).randrange(4, w.vocab_size) for _ in range(11)]
    alone, _ = _sharing_engine(w).beam_search(prompt, 3, 8)
    engine = _sharing_engine(w)
    others = [engine.add_request([2, 40 + i, 7, 9], 6) for i in range(3)]
    group = engine.add_beam_search(prompt, 3, 8)
    more = engine.add_request([2, 11, 12], 5)
    engine.run()
    assert group.best is not None and group.best.output_ids == alone
    for seq in others + [more]:
        assert seq.output_ids == hf_greedy(model, seq.request.prompt_ids, seq.request.output_len, w.eos_token_id)
    m = engine.manager
    assert m.num_free_blocks == m.view.num_blocks and not m.view.tables()


def test_a_beam_search_that_runs_out_of_blocks_fails_clearly_and_leaves_nothing(tiny):
    model, w = tiny
    engine = _sharing_engine(w, num_blocks=6)  # 24 slots: 4 beams of a 12-token prompt soon need more
    with pytest.raises(OutOfBlocks, match="beam search ran out of blocks for its 4 beams"):
        engine.beam_search([2] + list(range(10, 21)), 4, 12)
    m = engine.manager
    assert m.num_free_blocks == m.view.num_blocks and not m.view.tables() and not engine.scheduler.has_work
    assert engine.generate([[2, 5, 6]], 4) == [hf_greedy(model, [2, 5, 6], 4, w.eos_token_id)]
