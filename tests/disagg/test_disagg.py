"""Lesson 09 groundwork: moving a request's KV blocks between two caches, and two workers over gloo.

* the transfer plan, packing and adoption: after unpack and adoption, the decode side's table gathers exactly
  the K/V the prefill side's table held;
* two spawned processes on the loopback (gloo): the decode worker's outputs are HF's tokens, the bytes sent are
  the KV formula rounded up to blocks, every block is free at the end;
* a prefill worker that dies mid-transfer: a clear error within a bounded time, and the decode worker gave back
  every block it held.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from helpers import hf_greedy

from lesson_utils.cache.attention import gather_kv
from lesson_utils.cache.block_copy import pack_blocks, unpack_blocks
from lesson_utils.core.types import OutOfBlocks
from lesson_utils.disagg.launch import DisaggConfig, DisaggError, Faults, run_disaggregated
from lesson_utils.disagg.transfer import transfer_plan
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.block_table import blocks_needed


@pytest.mark.parametrize("num_tokens", [1, 4, 9, 16])
def test_plan_pack_unpack_adopt_moves_exactly_the_requests_kv(num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    layers, bs, heads, d = 3, 4, 2, 8
    src_k = [torch.randn(10, bs, heads, d, generator=g) for _ in range(layers)]
    src_v = [torch.randn(10, bs, heads, d, generator=g) for _ in range(layers)]
    src_table = torch.randperm(10, generator=g)[:5].tolist()
    dst_k = [torch.zeros(12, bs, heads, d) for _ in range(layers)]
    dst_v = [torch.zeros(12, bs, heads, d) for _ in range(layers)]
    manager = BlockManager(12, bs, watermark=0.0)
    manager.blocks.reserve(99, 3)  # the decode side is not empty: its fresh blocks are not 0, 1, ...
    plan = transfer_plan(7, src_table, num_tokens, bs, manager.blocks.allocate_block, manager.blocks.free_block)
    assert plan.src_blocks == src_table[: blocks_needed(num_tokens, bs)] and len(plan.dst_blocks) == plan.num_blocks
    packed = pack_blocks(src_k, src_v, plan.src_blocks)
    assert packed.shape == (2, layers, plan.num_blocks, bs, heads, d)
    unpack_blocks(packed, dst_k, dst_v, plan.dst_blocks)
    table = manager.blocks.adopt(7, plan.dst_blocks, num_tokens)
    for layer in range(layers):
        assert torch.equal(
            gather_kv(dst_k[layer], table.blocks, num_tokens), gather_kv(src_k[layer], src_table, num_tokens)
        )
        assert torch.equal(
            gather_kv(dst_v[layer], table.blocks, num_tokens), gather_kv(src_v[layer], src_table, num_tokens)
        )
    manager.view.check_invariants()


def test_adoption_and_planning_refuse_what_does_not_fit():
    manager = BlockManager(3, 4, watermark=0.0)
    with pytest.raises(OutOfBlocks):
        transfer_plan(1, [0, 1, 2, 3], 16, 4, manager.blocks.allocate_block, manager.blocks.free_block)
    assert manager.num_free_blocks == 3  # nothing kept
    with pytest.raises(ValueError, match="need 3 blocks"):
        transfer_plan(1, [0, 1], 9, 4, manager.blocks.allocate_block, manager.blocks.free_block)
    fresh = BlockManager(4, 4, watermark=0.0)
    with pytest.raises(ValueError, match="must be allocated first"):
        fresh.blocks.adopt(1, [0, 1], 5)
    b = [fresh.blocks.allocate_block() for _ in range(2)]
    with pytest.raises(ValueError, match="take 2 blocks of 4 \\(block count\\), got 1"):
        fresh.blocks.adopt(1, b[:1], 5)


@pytest.fixture(scope="module")
def saved_model(tiny, tmp_path_factory):
    model, _ = tiny
    path = tmp_path_factory.mktemp("tiny-opt")
    model.save_pretrained(path)
    return str(path)


def _requests(seed=0):
    rng = random.Random(seed)
    return [(i, [2] + [rng.randrange(4, 320) for _ in range(n)], 6) for i, n in enumerate([5, 40, 17])]


@pytest.mark.slow
def test_two_workers_serve_hfs_tokens_warmed_up_quietly_with_the_hand_over_timed_in_stages(tiny, saved_model, capfd):
    """One run of the two workers (each launch costs seconds of start-up, so one run serves every check here):

    * every request gets HF's tokens, its token times rise from its arrival, and exactly the KV bytes of lesson 00
      (whole blocks) cross the wire;
    * a request of one new token is ended by the prefill's token: the decode side decodes nothing more;
    * each worker serves one request of its own before the barrier (its cold start is not in the first TTFT), the
      workers print nothing while loading (no loading bar, no notice), and every hand-over is reported as staging +
      transfer + unpack, the parts of the TTFT adding up;
    * then a run without the warm-up gives the same tokens."""
    model, w = tiny
    arriving = [(r, p, n, 0.1 * r) for r, p, n in _requests()]  # arriving 0, 0.1 and 0.2 s after the start
    at_start = [(10 + r, p, n, 0.0) for r, p, n in _requests(1)]
    one_token = [(20, [2, 9, 40, 77, 5], 1, 0.0), (21, [2, 11, 12, 13, 14, 15, 16], 4, 0.0), (22, [2, 30], 1, 0.0)]
    requests = arriving + at_start + one_token
    cfg = DisaggConfig(model_dir=saved_model, num_blocks=48, block_size=4, timeout_s=20)
    result = run_disaggregated(cfg, requests)
    per_token = 2 * w.num_layers * w.num_kv_heads * w.head_dim * 4  # K and V of every layer, fp32
    for req_id, prompt, n, arrival in requests:
        times = result.token_times[req_id]
        assert result.outputs[req_id] == hf_greedy(model, prompt, n, w.eos_token_id), f"request {req_id}"
        assert times[0] >= arrival and times == sorted(times) and len(times) == len(result.outputs[req_id])
        assert result.bytes_sent[req_id] == blocks_needed(len(prompt), 4) * 4 * per_token
        stages = (result.pack_s[req_id], result.recv_s[req_id], result.unpack_s[req_id])
        assert all(s > 0 for s in stages) and result.handover_s(req_id) == pytest.approx(sum(stages))
        if arrival == 0.0:
            parts = result.ttft_parts(req_id, 0.0)
            assert parts["queue"] >= 0 and parts["prefill"] > 0 and parts["decode side's wait"] > -1e-3
            assert sum(parts.values()) == pytest.approx(times[0])  # the parts add up to the TTFT
    assert len(result.outputs[20]) == 1 and len(result.outputs[22]) == 1
    assert set(result.warmup_s) == {"prefill", "decode"} and all(s > 0 for s in result.warmup_s.values())
    assert result.warm_before_start and result.all_blocks_free
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "NOTICE" not in out + err, (out + err)[-2000:]
    cold_requests = [(r, p, n) for r, p, n, _ in at_start]
    cold = run_disaggregated(
        DisaggConfig(model_dir=saved_model, num_blocks=32, block_size=4, timeout_s=20, warmup=False), cold_requests
    )
    assert cold.warmup_s == {} and cold.outputs == {r: result.outputs[r] for r, *_ in at_start}


@pytest.mark.slow
def test_a_worker_dying_mid_transfer_fails_clearly_within_a_bounded_time(saved_model):
    start = time.monotonic()
    with pytest.raises(DisaggError) as err:
        run_disaggregated(
            DisaggConfig(model_dir=saved_model, num_blocks=32, block_size=4, timeout_s=5),
            _requests(),
            Faults(prefill_dies_after_messages=4),
        )
    assert time.monotonic() - start < 90
    message = str(err.value)
    assert "the prefill worker exited with code 17" in message
    assert "the decode worker failed" in message and "it freed its blocks: True" in message


def test_serve_engine_records_every_tokens_time(tiny):
    """The colocated side of lesson 09's comparison: per-token times from the engine's own steps."""
    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.core.types import Request
    from lesson_utils.lab import benchmark
    from lesson_utils.serving.engine import Engine

    _, w = tiny
    reqs = [Request(i, 0.0, len(p), n, prompt_ids=p) for i, (_, p, n) in enumerate(_requests())]
    engine = Engine(w, PagedKVCache.for_model(w, 40, 4), stop_at_eos=False)
    res = benchmark.serve_engine("t", engine, reqs, progress=False)
    for r in reqs:
        times = res.token_times[r.req_id]
        assert len(times) == r.output_len and times == sorted(times) and times[0] > 0
    gaps = benchmark.inter_token_gaps(res.token_times, [0, 1])
    assert len(gaps) == 2 * (6 - 1) and (gaps >= 0).all()
    assert len(benchmark.inter_token_gaps(res.token_times, [])) == 0


@pytest.mark.slow
def test_a_decode_worker_dying_fails_clearly_and_the_prefill_side_frees_its_blocks(saved_model):
    start = time.monotonic()
    with pytest.raises(DisaggError) as err:
        run_disaggregated(
            DisaggConfig(model_dir=saved_model, num_blocks=32, block_size=4, timeout_s=5),
            [(r, p, n, 0.5 * r) for r, p, n in _requests()],  # the second request is sent after the decode side died
            Faults(decode_dies_after_adopting=1),
        )
    assert time.monotonic() - start < 90
    message = str(err.value)
    assert "the decode worker exited with code 18" in message
    assert "the prefill worker failed" in message and "it freed its blocks: True" in message


@pytest.mark.slow
def test_a_slow_start_is_bounded_by_the_startup_budget_not_the_transfer_timeout(tiny, saved_model):
    """A cold runtime (CUDA loading in two spawned processes) can take tens of seconds to start: that must not
    trip the per-wait timeout, which only bounds the transfers once both workers have started."""
    model, w = tiny
    requests = _requests(2)
    slow = Faults(prefill_start_delay_s=4.5)  # longer than the 3 s per-wait timeout
    result = run_disaggregated(
        DisaggConfig(model_dir=saved_model, num_blocks=32, block_size=4, timeout_s=3, startup_s=40), requests, slow
    )
    for req_id, prompt, n in requests:
        assert result.outputs[req_id] == hf_greedy(model, prompt, n, w.eos_token_id), f"request {req_id}"
    assert result.all_blocks_free


@pytest.mark.slow
def test_a_start_past_the_budget_fails_saying_what_to_raise(saved_model):
    start = time.monotonic()
    with pytest.raises(DisaggError) as err:
        run_disaggregated(
            DisaggConfig(model_dir=saved_model, num_blocks=32, block_size=4, timeout_s=3, startup_s=4),
            _requests(),
            Faults(prefill_start_delay_s=12.0),
        )
    assert time.monotonic() - start < 60
    assert "startup_s" in str(err.value), str(err.value)


def test_the_startup_budget_follows_the_profile(monkeypatch):
    from lesson_utils.core import env

    cfg = DisaggConfig(model_dir="unused")
    for name, want in (("ci", 60), ("cpu", 90)):
        monkeypatch.setenv("COURSE_PROFILE", name)
        env.get_profile.cache_clear()
        assert cfg.startup_budget_s() == want and cfg.deadline_s() == want + 2 * cfg.timeout_s + 60
    env.get_profile.cache_clear()
    assert DisaggConfig(model_dir="unused", startup_s=5).startup_budget_s() == 5


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


@pytest.mark.slow
def test_the_two_workers_end_cleanly_under_cpu_contention(saved_model):
    """Another process spins on the cores while the two-worker path runs: the run returns its result and both
    workers exit 0. Before the workers left deterministically (process groups destroyed, reports flushed, os._exit), the
    decode worker aborted at interpreter exit in about 1 run in 15 here ("terminate called without an active
    exception", exit code -6) after delivering every output, and the run was reported as failed. One run per CI run
    (two cost 8 s more): CI's repeated runs, and every other two-worker test here, keep looking for that end."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinner = ctx.Process(target=_spin, args=(stop,), daemon=True)
    spinner.start()
    try:
        requests = _requests(seed=0)
        cfg = DisaggConfig(model_dir=saved_model, num_blocks=32, block_size=4, timeout_s=20, warmup=False)
        result = run_disaggregated(cfg, requests)
        assert sorted(result.outputs) == [r for r, _, _ in requests] and result.all_blocks_free
        assert result.exit_codes == {"prefill": 0, "decode": 0}  # a clean end, not only a forgiven one
    finally:
        stop.set()
        spinner.join(timeout=10)
