"""Lesson 07's measurements: HF's static batches as they form, their waste, their simulation, the capstone's
workload, and where a decode step's time goes."""

from __future__ import annotations

import pytest

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.types import Request
from lesson_utils.lab import benchmark, workloads
from lesson_utils.lab.step_profile import profile_decode_step, weight_bytes
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.serving.cost_model import StepCost
from lesson_utils.serving.engine import Engine


def _req(i, t, p, o):
    return Request(i, t, p, o, prompt_ids=[5 + i] * p)


def test_a_static_batch_takes_what_has_arrived_and_fits():
    queue = [_req(0, 0.0, 10, 5), _req(1, 0.1, 10, 5), _req(2, 0.2, 10, 5), _req(3, 5.0, 3, 3)]
    kept = list(queue)
    assert [r.req_id for r in benchmark.next_static_batch(queue, 0.15, 8, 64)] == [0, 1]
    assert [r.req_id for r in benchmark.next_static_batch(queue, 1.0, 2, 64)] == [0, 1]  # batch size
    assert benchmark.next_static_batch(queue[3:], 1.0, 8, 64) == []  # the head has not arrived
    wide = [_req(0, 0.0, 40, 4), _req(1, 0.0, 4, 30)]  # 40 + 30 positions would pass 64 together
    assert [r.req_id for r in benchmark.next_static_batch(wide, 0.0, 8, 64)] == [0]
    assert queue == kept


def test_static_batches_are_the_offline_case():
    reqs = [_req(i, 0.0, 10 + i, 5) for i in range(5)]
    assert [[r.req_id for r in b] for b in benchmark.static_batches(reqs, 2, 64)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="positions"):
        benchmark.static_batches([_req(0, 0.0, 60, 10)], 2, 64)
    with pytest.raises(ValueError, match="batch_size"):
        benchmark.static_batches(reqs, 0, 64)


def test_padded_rows_count_the_batches_served():
    computed, useful = benchmark.padded_rows([[0, 1], [2]], {0: 3, 1: 10, 2: 4})
    assert (computed, useful) == (2 * 10 + 4, 17)


def test_simulated_static_batches():
    reqs = [_req(0, 0.0, 4, 2), _req(1, 0.0, 4, 3), _req(2, 0.5, 4, 1)]
    e2e = benchmark.simulate_hf_static(reqs, 2, 64, StepCost(1.0, 0.0, 0.0, 0.0))
    # batch [0, 1]: 3 steps of 1 s (request 0 done after 2); request 2 waits for the batch, then 1 step
    assert e2e == {0: 2.0, 1: 3.0, 2: 4.0 - 0.5}


def test_hf_static_batches_form_as_requests_arrive(tiny):
    model, w = tiny
    reqs = [_req(0, 0.0, 5, 3), _req(1, 0.0, 6, 2), _req(2, 0.3, 4, 4)]
    res = benchmark.serve_hf_static(model, reqs, 4, None, progress=True)
    assert res.batches[0] == [0, 1] and [2] in res.batches  # request 2 had not arrived when the first batch started
    assert all(len(res.outputs[r.req_id]) == r.output_len for r in reqs)
    assert len(res.steps) == 3 + 4  # each batch runs to its longest output
    assert res.steps[0][0].prefill_tokens == 2 * 6 and res.steps[1][0].decodes == 2
    assert all(res.e2e_s[r] >= res.ttft_s[r] > 0 for r in res.e2e_s)
    assert res.normalized_latency > 0


def test_serve_engine_records_latency_and_work(tiny):
    _, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, manager=BlockManager(64, 4)), stop_at_eos=False)
    reqs = [_req(0, 0.0, 5, 3), _req(1, 0.05, 6, 2)]
    res = benchmark.serve_engine("paged", engine, reqs, progress=True)
    assert len(res.steps) == len(engine.stats)
    assert sum(wk.decodes + wk.prefill_tokens for wk, _ in res.steps) == sum(st.tokens for st in engine.stats)
    assert all(res.e2e_s[r.req_id] >= res.ttft_s[r.req_id] for r in reqs)


def test_the_capstone_workload():
    reqs = workloads.system_prompt_stream(
        40, 5.0, max_model_len=128, system_prompt_len=31, vocab_size=500, bos_token_id=2, scale=0.0625, seed=3
    )
    shared = [r for r in reqs if r.shared_prefix_len]
    assert 5 < len(shared) < 35 and all(r.shared_prefix_len == 32 for r in shared)
    assert all(r.prompt_ids[:32] == shared[0].prompt_ids[:32] and r.prompt_ids[0] == 2 for r in shared)
    assert all(r.prompt_len == len(r.prompt_ids) <= 64 and r.total_len <= 128 and r.output_len >= 1 for r in reqs)
    assert all(min(r.prompt_ids[1:]) >= 4 for r in reqs)
    with pytest.raises(ValueError, match="no room"):
        workloads.system_prompt_stream(3, 1.0, max_model_len=64, system_prompt_len=31, vocab_size=500, bos_token_id=2)


def test_a_decode_step_is_profiled(tiny):
    model, w = tiny
    engine = Engine(w, PagedKVCache.for_model(w, manager=BlockManager(64, 4)), stop_at_eos=False)
    engine.add_request([2, 7, 8], 40)
    with pytest.raises(ValueError, match="none waiting"):
        profile_decode_step(engine, model)
    engine.step()
    prof = profile_decode_step(engine, model, repeats=3, copy_mib=8)
    assert prof.sequences == 1 and prof.step_s > 0 and prof.copy_gb_s > 0
    assert (
        prof.weight_bytes
        == weight_bytes(model)
        == sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    )
    shares = (prof.matmul_share, prof.other_ops_share, prof.python_share)
    assert all(0 <= s <= 1 for s in shares) and sum(shares) == pytest.approx(1.0)
    assert prof.matmul_share > 0 and prof.ops_per_step > 10 and prof.overhead_s > 0


def test_a_probe_engine_sized_exactly_admits_every_sequence_only_without_a_watermark(tiny):
    """Lesson 07's decode-step probe, as its gpu profile sized it (found on the first GPU run): k prompts that each
    fill their blocks exactly. With the default watermark the last one waits until the others finished, and the
    probe says why; with none, all k decode together."""
    from lesson_utils.lab.step_profile import prefilled_engine

    _, w = tiny
    k, prompt = 100, [w.bos_token_id] + list(range(10, 29))  # 20 tokens: one block of 32, also after 5 more

    def make(watermark):
        manager = BlockManager(k, 32, watermark=watermark, max_seq_len=w.max_positions)
        return lambda: Engine(w, PagedKVCache.for_model(w, manager=manager), stop_at_eos=False)

    with pytest.raises(ValueError, match="holds 1 of 100 sequences.*a watermark of 1 blocks"):
        prefilled_engine(make(0.01), prompt, k, repeats=1)
    assert len(prefilled_engine(make(0.0), prompt, k, repeats=1).scheduler.running) == k
