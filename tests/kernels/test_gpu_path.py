"""The GPU path, checked on a CPU. Each test names the T4 failure it guards against.

Most of them run the course's code in the device-discipline mode (:mod:`lesson_utils.core.device_discipline`):
the model and caches live on ``cpu:0``, which stands for the GPU, tensors made without that device are
"host" tensors, and mixing the two raises as CUDA would. Without the mode these bugs are invisible on a
CPU, because every tensor is in the same memory.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from course_tools.gpu_checks import engine_kinds, is_exact, is_preempted
from lesson_utils.cache import attention, paged
from lesson_utils.cache import contiguous as contiguous_cache
from lesson_utils.cache.host_blocks import HostBlocks
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.checks import lesson01, lesson03, lesson04
from lesson_utils.core import device_discipline as dd
from lesson_utils.core.device_discipline import DEVICE, DeviceMismatch, discipline
from lesson_utils.core.env import Profile
from lesson_utils.core.types import Request
from lesson_utils.kernels import paged_attention as K
from lesson_utils.lab import benchmark
from lesson_utils.memory import contiguous
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.model.generate import generate_greedy
from lesson_utils.model.opt_forward import OPTWeights
from lesson_utils.serving.engine import Engine

N_NEW = 6


@pytest.fixture(scope="module")
def on_device():
    """The ci profile's tiny OPT loaded onto the stand-in device, inside the mode (so its tensors are tagged):
    ``(hf_model, OPTWeights)``. Tests enter the mode again to use it."""
    from lesson_utils.model.loading import load_model

    with discipline():
        lm = load_model(profile=Profile(name="ci", device=str(DEVICE), device_name="device discipline"))
        w = OPTWeights.from_hf(lm.model)
    return lm.model, w


def _prompts(w, lengths=(1, 9, 17, 30)):
    g = torch.Generator().manual_seed(3)
    return [[w.bos_token_id] + torch.randint(4, w.vocab_size, (n - 1,), generator=g).tolist() for n in lengths]


# --- 1. lesson 07's HF static baseline: a padded batch must fit the model's positions -------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 400), st.integers(1, 400)), min_size=1, max_size=30),
    st.integers(1, 8),
)
def test_static_batches_never_need_more_positions_than_the_model_has(lengths, batch_size):
    max_positions = 512
    requests = [Request(i, 0.1 * i, p, o) for i, (p, o) in enumerate(lengths) if p + o <= max_positions]
    batches = benchmark.static_batches(requests, batch_size, max_positions)
    assert [r.req_id for b in batches for r in b] == [r.req_id for r in requests]  # arrival order, each once
    for b in batches:
        assert 1 <= len(b) <= batch_size
        assert max(r.prompt_len for r in b) + max(r.output_len for r in b) <= max_positions


def test_static_batches_refuse_a_request_longer_than_the_model():
    with pytest.raises(ValueError, match="request 7 needs 500 \\+ 20 positions"):
        benchmark.static_batches([Request(7, 0.0, 500, 20)], 4, 512)


def test_hf_static_baseline_serves_requests_whose_padded_batch_would_overflow(tiny):
    """On the gpu-profile stream, batches needed 2062-2248 of OPT's 2048 positions: an IndexError on a CPU, a
    device-side assert that poisons every later cell on CUDA. Here 300 + 250 > the tiny model's 512."""
    model, w = tiny
    g = torch.Generator().manual_seed(0)
    reqs = [Request(0, 0.0, 300, 20), Request(1, 0.0, 40, 250), Request(2, 0.0, 30, 10)]
    for r in reqs:
        r.prompt_ids = [w.bos_token_id] + torch.randint(4, w.vocab_size, (r.prompt_len - 1,), generator=g).tolist()
    res = benchmark.serve_hf_static(model, reqs, batch_size=3, eos_token_id=None, progress=False)
    assert [len(res.outputs[r.req_id]) for r in reqs] == [20, 250, 10]
    assert res.outputs[0] == hf_greedy(model, reqs[0].prompt_ids, 20, None, check_ties=False)  # alone in its batch


def test_hf_clock_waits_for_the_device_before_reading_the_time(tiny, monkeypatch):
    """Without a synchronize, a GPU's first step time is taken when the prefill is queued, not done."""
    model, w = tiny
    waited = []
    monkeypatch.setattr(benchmark, "_synchronize", lambda t: waited.append(t.shape))
    reqs = [Request(0, 0.0, 3, 4, prompt_ids=[2, 7, 8]), Request(1, 0.0, 2, 6, prompt_ids=[2, 9])]
    benchmark.serve_hf_static(model, reqs, batch_size=1, eos_token_id=None, progress=False)
    assert len(waited) == 4 + 6  # once per generation step, before its time is noted


# --- 2. lesson 01's slot mapping: made on the host, it passed its check and crashed in the CUDA cache ----------


def _host_slot_mapping(batch, region_starts):  # what the solution did, and what learners will write
    starts = torch.tensor(region_starts, dtype=torch.long)
    return starts.repeat_interleave(torch.tensor(batch.query_lens)) + batch.positions


def _host_slots_from_lists(batch, region_starts):  # right values, but a host tensor
    return torch.tensor(
        [s + p for s, q, c in zip(region_starts, batch.query_lens, batch.context_lens) for p in range(c - q, c)]
    )


def test_lesson01_slot_mapping_made_on_the_host_fails_its_check(not_strict):
    with discipline():
        bad = lesson01.check_slot_mapping(_host_slot_mapping)
        assert not bad.passed and "DeviceMismatch" in bad.message
        quiet = lesson01.check_slot_mapping(_host_slots_from_lists)
        assert not quiet.passed and "device=" in quiet.message
        assert lesson01.check_slot_mapping(contiguous_cache.slot_mapping).passed


def test_lesson03_checks_build_their_cases_on_the_device(not_strict):

    def host_slots(batch, tables, block_size):
        return paged.slot_mapping(batch, tables, block_size).cpu()

    with discipline():
        assert not lesson03.check_slot_mapping(host_slots).passed
        assert lesson03.check_slot_mapping(paged.slot_mapping).passed
        assert lesson03.check_gather_kv(attention.gather_kv).passed


def test_a_host_slot_mapping_crashes_the_device_cache(on_device):
    model, w = on_device
    with discipline():
        cache = contiguous_cache.ContiguousKVCache.for_model(
            w, 200, default_reservation=50, slot_mapping_fn=_host_slot_mapping
        )
        with pytest.raises(DeviceMismatch):
            generate_greedy(w, cache, _prompts(w)[:2], 2)


# --- 3. lesson 01's fragmentation demo: an arena made without a device, for a model on the GPU --------------


def test_an_arena_on_the_host_fails_where_a_gpu_would_and_for_model_follows_the_model(on_device):
    model, w = on_device
    with discipline():
        host_arena = contiguous_cache.ContiguousKVCache(
            w.num_layers, 16, w.num_heads, w.head_dim, default_reservation=8
        )
        with pytest.raises(DeviceMismatch):
            generate_greedy(w, host_arena, [[2, 5, 6, 7]], 8, stop_at_eos=False)
        tiny_arena = contiguous_cache.ContiguousKVCache.for_model(w, 16, default_reservation=8)
        assert tiny_arena.k.device == DEVICE and tiny_arena.k.dtype == w.dtype
        with pytest.raises(contiguous.NeverFits):  # what the lesson's cell catches
            generate_greedy(w, tiny_arena, [[2, 5, 6, 7]], 8, stop_at_eos=False)


# --- 4. lesson 04's checkers: their cases went to the compiled kernel as CPU tensors ---------------------------


def test_lesson04_checkers_pass_the_reference_blocks_on_the_device(not_strict):
    with discipline():
        assert lesson04.check_block_slots(K.block_slots).passed
        assert lesson04.check_online_softmax_update(K.online_softmax_update).passed


def test_the_kernels_name_a_host_argument(on_device):
    with discipline():
        kc = torch.zeros(4, 16, 2, 8, device=DEVICE)
        tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
        lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match="q is a host tensor.*Pointer argument"):
            K.paged_attention_decode(torch.zeros(1, 2, 8), kc, kc, tables, lens)
        with pytest.raises(ValueError, match="slot_mapping is a host tensor"):
            K.write_kv_to_cache(
                torch.zeros(1, 2, 8, device=DEVICE),
                torch.zeros(1, 2, 8, device=DEVICE),
                kc,
                kc,
                torch.zeros(1, dtype=torch.int32),
            )


# --- 6. the Triton interpreter follows the profile, not the hardware -----------------------------------------


@pytest.mark.parametrize("profile, expected", [("cpu", "1"), ("ci", "1"), ("gpu", None)])
def test_triton_interpreter_follows_the_profile_on_a_machine_with_cuda(profile, expected):
    """COURSE_PROFILE=cpu on a GPU machine gives CPU tensors: compiled kernels cannot read them."""
    code = (
        "import os, torch\n"
        "torch.cuda.is_available = lambda: True  # a GPU machine, as far as the course can tell\n"
        "import lesson_utils.kernels  # picks Triton's mode before defining its kernels\n"
        "print(os.environ.get('TRITON_INTERPRET'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", dd.ENV_VAR)}
    env["COURSE_PROFILE"] = profile
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(expected)


# --- 7 and 12. host syncs: out of the kernels' hot path, at most 2 per engine step ---------------------------


def test_kernels_without_validation_never_read_back_from_the_device():
    with discipline():
        g = torch.Generator().manual_seed(0)
        kc = torch.randn(6, 8, 2, 16, generator=g).to(DEVICE)
        q = torch.randn(2, 4, 16, generator=g).to(DEVICE)
        tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([9, 16], dtype=torch.int32, device=DEVICE)
        with dd.count_syncs() as checked:
            K.paged_attention_decode(q, kc, kc, tables, lens)
        want = attention.paged_attention_reference(q, kc, kc, tables, lens)
        slots = torch.tensor([3, 40], device=DEVICE)  # a blocking copy itself: made before the count
        with dd.count_syncs() as unchecked:
            out = K.paged_attention_decode(q, kc, kc, tables, lens, validate=False)
            K.write_kv_to_cache(q[:, :2], q[:, :2], kc, kc, slots, validate=False)
        assert checked.n == 1 and unchecked.n == 0, (checked.why, unchecked.why)  # all checks in one read-back
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(kc.view(-1, 2, 16)[40], q[1, :2])


def test_every_engine_serves_on_the_device_with_at_most_two_syncs_a_step(on_device):
    """On a GPU the host syncs, not the kernels, set a small model's step time: one ``.tolist()`` per sequence
    per step and three checks per layer used to be there. Budget: 2 per step (the next tokens, and sampling),
    counting both directions - a host-to-device copy from pageable memory, or one that is not non_blocking, waits
    too (issue 23). A step that swaps blocks out adds one deliberate wait: the host must not read the staging
    buffer before it has landed."""
    _serve_every_engine_kind_on_the_device(*on_device)


@pytest.fixture(scope="module")
def llama_on_device():
    """The ci profile's tiny Llama (SmolLM2's family: RoPE, RMSNorm, grouped-query attention) on the stand-in device."""
    from lesson_utils.model import weights_from_hf
    from lesson_utils.model.loading import MODERN_MODEL, load_model

    with discipline():
        lm = load_model(MODERN_MODEL, profile=Profile(name="ci", device=str(DEVICE), device_name="device discipline"))
        w = weights_from_hf(lm.model)
    return lm.model, w


def test_a_llama_family_model_serves_on_the_device_with_at_most_two_syncs_a_step(llama_on_device):
    """The same budget and identity for the Llama forward: its RoPE tables, its grouped K/V and its norms are made
    on the model's device, and nothing in a step reads back more than the course's forward does."""
    _serve_every_engine_kind_on_the_device(*llama_on_device)


def _serve_every_engine_kind_on_the_device(model, w):
    workloads = {False: (_prompts(w), N_NEW), True: (_prompts(w, (12, 20, 25, 31, 9)), 20)}  # True: preempted
    want = {k: [hf_greedy(model, p, n, w.eos_token_id) for p in ps] for k, (ps, n) in workloads.items()}
    with discipline() as mode:
        for name, engine in engine_kinds(w):
            short = is_preempted(name)
            prompts, n_new = workloads[short]
            seqs = [engine.add_request(p, n_new) for p in prompts]
            per_step, swapped_out = [], []
            while engine.scheduler.has_work:
                out_before = engine.scheduler.swap_space.blocks_out if engine.scheduler.swap_space else 0
                first = len(mode.transfers)
                with dd.count_syncs() as c:
                    engine.step()
                swapped = (
                    engine.scheduler.swap_space is not None and engine.scheduler.swap_space.blocks_out > out_before
                )
                per_step.append((c.n - swapped, c.why))
                swapped_out.append(swapped)
                to_device = [t for t in mode.transfers[first:] if t.direction == "to device"]
                assert all(t.non_blocking for t in to_device), (name, to_device)
            assert max(n for n, _ in per_step) <= 2, (name, [why for n, why in per_step if n > 2][:1])
            if is_exact(name):  # (a quantized cache is held to lesson 10's bound, not to HF's tokens)
                assert [s.output_ids for s in seqs] == want[short], name
            if short:
                assert engine.scheduler.num_preemptions > 0, name
            assert any(swapped_out) == (engine.swap_space is not None), name


def test_swaps_make_one_copy_each_way_and_restore_every_block(on_device):
    """Swap used to copy per layer, K and V apart, through pageable memory: 2 x layers waits per swap."""
    model, w = on_device
    with discipline() as mode:
        cache = PagedKVCache.for_model(w, num_blocks=8, block_size=4)
        space = HostBlocks.for_cache(cache, 6)
        for layer in range(w.num_layers):
            cache.k_cache[layer].copy_(torch.randn(cache.k_cache[layer].shape).to(DEVICE))
            cache.v_cache[layer].copy_(torch.randn(cache.v_cache[layer].shape).to(DEVICE))
        before = [(k.clone(), v.clone()) for k, v in zip(cache.k_cache, cache.v_cache)]
        first = len(mode.transfers)
        with dd.count_syncs() as out_syncs:
            cache.swap_out([(5, 0), (2, 3), (7, 1)], space)
        out_moves = mode.transfers[first:]
        for layer in range(w.num_layers):
            cache.k_cache[layer].zero_(), cache.v_cache[layer].zero_()
        first = len(mode.transfers)
        with dd.count_syncs() as in_syncs:
            cache.swap_in([(0, 1), (3, 6), (1, 4)], space)
        in_moves = mode.transfers[first:]
    # one copy of the K/V each way; besides it only block indices (3 longs) travel, without a wait
    index_bytes = 3 * 8
    assert [(t.direction, t.non_blocking) for t in out_moves if t.nbytes > index_bytes] == [("to host", True)]
    assert [(t.direction, t.non_blocking) for t in in_moves if t.nbytes > index_bytes] == [("to device", True)]
    assert all(t.non_blocking for t in out_moves + in_moves)
    # the swap-out waits once, on purpose (its staging buffer must land before the host reads it); nothing else waits
    assert out_syncs.why == ["synchronize: a swap-out's blocks must land before the host reads them"], out_syncs.why
    assert in_syncs.n == 0, in_syncs.why
    for layer, (k, v) in enumerate(before):
        for src, dst in [(5, 1), (2, 6), (7, 4)]:
            assert torch.equal(cache.k_cache[layer][dst], k[src]) and torch.equal(cache.v_cache[layer][dst], v[src])


def test_preemption_by_swap_on_the_device_keeps_outputs(on_device):
    model, w = on_device
    prompts = _prompts(w, (12, 20, 25, 31, 9))
    want = [hf_greedy(model, p, 20, w.eos_token_id) for p in prompts]
    with discipline():
        for mode in ("swap", "recompute"):
            cache = PagedKVCache.for_model(w, num_blocks=7, block_size=8)
            engine = Engine(w, cache, preemption_mode=mode, swap_space=SwapSpace(40) if mode == "swap" else None)
            assert engine.generate(prompts, 20) == want, mode
            assert engine.scheduler.num_preemptions > 0, mode


def test_the_int8_cache_serves_on_the_device_through_its_kernels(on_device):
    """Lesson 10 on a GPU: the quantizing write kernel and the int8 decode kernel, every tensor on the device (the
    mode fails a host tensor handed to a kernel), the same tokens as the gather + dequantize path."""
    from lesson_utils.cache.int8_paged import Int8PagedKVCache

    model, w = on_device
    prompts = _prompts(w, (5, 11))
    with discipline():
        kernels = Engine(w, Int8PagedKVCache.for_model(w, 20, 8, use_kernels=True))
        torch_path = Engine(w, Int8PagedKVCache.for_model(w, 20, 8, use_kernels=False))
        assert kernels.generate(prompts, 4) == torch_path.generate(prompts, 4)
        assert kernels.manager.num_free_blocks == 20


def test_a_refused_step_is_restored_on_the_device_too(on_device):
    """Every step of the preempting engines refused once after its forward pass and update, then served: the
    restore (the saved blocks' data copied back, the swap space's host blocks too) follows a GPU's rules, and every
    output is still HF's."""
    from lesson_utils.serving.step import serve_step

    model, w = on_device
    prompts = _prompts(w, (12, 20, 25, 31, 9))
    want = [hf_greedy(model, p, 20, w.eos_token_id) for p in prompts]
    seen: set[int] = set()

    def fails_once(scheduler, runner, step):
        result = serve_step(scheduler, runner, step)
        if step not in seen:
            seen.add(step)
            raise RuntimeError("refused once")
        return result

    with discipline():
        for name, engine in engine_kinds(w):
            if not is_preempted(name):
                continue
            seen.clear()
            engine.step_fn = fails_once
            seqs = [engine.add_request(p, 20) for p in prompts]
            refused = 0
            while engine.scheduler.has_work:
                try:
                    engine.step()
                except RuntimeError:
                    refused += 1
            assert refused == len(engine.stats) and engine.scheduler.num_preemptions > 0, name
            assert [s.output_ids for s in seqs] == want, name
            assert engine.manager.num_free_blocks == engine.manager.view.num_blocks, name


def test_speculative_decoding_on_the_device_keeps_greedy_tokens_and_the_sync_budget(on_device):
    """Lesson 11 on the stand-in device: drafts, verification and rollback mix no host tensor into device work,
    and a verifying step waits no more than a decode step (two syncs: the tokens, and sampling)."""
    from lesson_utils.serving.speculative import Speculation

    model, w = on_device
    prompts = [[w.bos_token_id] + [9, 10, 11] * 3, [w.bos_token_id] + [40, 41] * 4]
    with discipline():
        want = Engine(w, PagedKVCache.for_model(w, 40, 4, batched_decode=True), stop_at_eos=False).generate(prompts, 8)
        engine = Engine(
            w, PagedKVCache.for_model(w, 40, 4, batched_decode=True), stop_at_eos=False, speculation=Speculation(4)
        )
        seqs = [engine.add_request(p, 8) for p in prompts]
        while engine.scheduler.has_work:
            with dd.count_syncs() as c:
                engine.step()
            assert c.n <= 2, c.why
    assert [s.output_ids for s in seqs] == want
    assert any(d for _, _, d, _ in engine.scheduler.verified)
