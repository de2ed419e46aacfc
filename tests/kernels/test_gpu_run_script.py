"""The GPU run script (course_tools.gpu_run, issue 23 item 4): it cannot run here, so its CPU-runnable parts are
tested on a CPU - the kernel benchmarks through the interpreter at tiny sizes, the sync count per engine step through
the device-discipline mode, the identity statistics on the tiny model, the report - and it must refuse clearly
without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from course_tools import gpu_checks as G
from course_tools import gpu_run
from lesson_utils.core import device_discipline as dd
from lesson_utils.core.device_discipline import DEVICE, discipline


def test_it_refuses_without_cuda_naming_what_to_do_instead():
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_DEVICE_DISCIPLINE",)}
    out = subprocess.run(
        [sys.executable, "-m", "course_tools.gpu_run", "--skip-notebooks"], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "needs an NVIDIA GPU with CUDA" in out.stderr and "--profile cpu --record" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_record_folder_is_named_for_the_device():
    assert gpu_run.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_run.default_out("Tesla T4", "2026-12-02").name == "2026-12-02-gpu-tesla-t4"


def test_the_kernel_benchmarks_check_and_time_every_way_at_tiny_sizes():
    timer = G.perf_counter_timer(repeats=1)
    copy = G.copy_bandwidth("cpu", timer, mib=8)
    assert copy > 0
    kw = dict(heads=2, head_dim=16, block_size=4)
    rows = G.decode_kernel_bench("cpu", torch.float32, timer, copy, batch=2, contexts=(7, 16), **kw)
    kinds = {"paged (simple)", "paged (tiled)", "gather + SDPA", "contiguous SDPA", "paged int8 (tiled)"}
    assert {r.kernel for r in rows} == kinds
    assert len(rows) == 10 and all(r.max_error < 1e-4 and 0 < r.ms_low <= r.ms <= r.ms_high for r in rows)
    int8 = next(r for r in rows if r.kernel == "paged int8 (tiled)")  # 1 byte per value and a 4-byte scale per head
    assert int8.gb_per_s == pytest.approx(2 * 2 * 7 * 2 * (16 + 4) / (int8.ms * 1e-3) / 1e9)
    r = rows[0]  # the bytes are K and V of every context token
    assert r.gb_per_s == pytest.approx(2 * 2 * 7 * 2 * 16 * 4 / (r.ms * 1e-3) / 1e9)
    assert r.share_of_copy == pytest.approx(r.gb_per_s / copy)
    rows = G.gqa_decode_bench("cpu", torch.float32, timer, copy, batch=2, contexts=(9,), head_dim=16, block_size=4)
    assert len(rows) == 3 and all(r.max_error < 1e-4 for r in rows)
    assert rows[0].gb_per_s == pytest.approx(2 * 2 * 9 * 3 * 16 * 4 / (rows[0].ms * 1e-3) / 1e9)  # 3 KV heads, once
    rows = G.unified_kernel_bench("cpu", torch.float32, timer, copy, cases=((2, 1, 8), (1, 4, 8)), **kw)
    assert [r.kernel for r in rows] == ["unified", "decode kernel", "unified", "gather + SDPA"]
    assert all(r.max_error < 1e-4 and 0 < r.ms_low <= r.ms <= r.ms_high for r in rows)


@pytest.fixture(scope="module")
def on_device():
    from lesson_utils.core.env import Profile
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

    with discipline():
        lm = load_model(profile=Profile(name="ci", device=str(DEVICE), device_name="device discipline"))
        return lm.model, OPTWeights.from_hf(lm.model)


def test_syncs_per_step_counts_each_step_and_sets_swap_outs_apart(on_device):
    """Three of the registry's engine kinds (the budget test in test_gpu_path.py serves all of them through the same
    engine_kinds): a plain one, a Triton one and one that swaps out."""
    from lesson_utils.lab.engine_kinds import ENGINE_KINDS

    model, w = on_device
    prompts = gpu_run._prompts(w.vocab_size, w.bos_token_id)
    with discipline():
        kinds = dict(G.engine_kinds(w))
        assert list(kinds) == [k.name for k in ENGINE_KINDS]
        stats = {n: G.syncs_per_step(n, kinds[n], prompts, 20, G.discipline_sync_counter)
                 for n in ("paged", "Triton decode kernel", "swap")}  # fmt: skip
    assert all(s.max_per_step <= 2 and s.steps >= 20 for s in stats.values()), stats
    assert stats["swap"].swap_out_steps > 0 and stats["paged"].swap_out_steps == 0


def test_a_step_that_waits_more_is_reported(on_device):
    """The count can fail: an engine whose step reads two tensors back more shows 3."""
    model, w = on_device
    with discipline():
        name, engine = next(G.engine_kinds(w))
        step = engine.step

        def step_with_a_read():
            step()
            engine.cache.k_cache[0].sum().item()  # a greedy step reads once: two more make three
            engine.cache.v_cache[0].sum().item()

        engine.step = step_with_a_read
        s = G.syncs_per_step(name, engine, [[2, 5, 7]], 3, G.discipline_sync_counter)
    assert s.max_per_step == 3 and "item" in s.worst


def test_identity_stats_cover_every_engine_with_a_calibrated_threshold(tiny):
    model, w = tiny
    prompts = gpu_run._prompts(w.vocab_size, w.bos_token_id, lengths=(9, 12))
    stats = G.identity_stats(model, w, prompts, 6)
    assert len(stats) == 9 and all(s.ok and s.excusable_share is not None for s in stats)
    assert all("calibrated in this run" in s.summary for s in stats)


def test_the_report_says_what_ran_it_and_when_the_weights_are_random(tmp_path):
    results = {
        "created": "2026-12-02T00:00:00+00:00",
        "environment": {
            "device": "Tesla T4",
            "capability": "sm_75",
            "versions": "torch 2.11",
            "weights": "random",
            "random_weights": True,
        },  # fmt: skip
        "copy_gbs": 250.0,
        "decode_kernels": [
            {
                "kernel": "paged (tiled)",
                "case": "decode, 32 seqs x 1024 tokens",
                "context": 1024,
                "ms": 0.1,
                "ms_low": 0.09,
                "ms_high": 0.12,
                "gb_per_s": 200.0,
                "share_of_copy": 0.8,
                "max_error": 1e-3,
            }  # fmt: skip
        ],
        "syncs": [{"engine": "paged", "steps": 10, "max_per_step": 3, "median_per_step": 1, "swap_out_steps": 0}],
        "identity_fp32": [{"engine": "paged", "summary": "5/5 token-identical"}],
        "skipped": ["the notebooks (--skip-notebooks)"],
    }
    gpu_run.save(results, tmp_path)
    text = (tmp_path / "gpu_checks.md").read_text()
    assert "# GPU checks: Tesla T4" in text and "**Random weights**" in text
    assert "| paged (tiled) | decode, 32 seqs x 1024 tokens | 100.0 (90.0-120.0) | 200 | 80 % |" in text
    assert "missed: paged has 3" in text and "5/5 token-identical" in text and "--skip-notebooks" in text
    assert (tmp_path / "gpu_checks.json").exists()


def test_the_cuda_counter_needs_cuda():
    """set_sync_debug_mode is CUDA's; the script refuses before it is reached (test above). Here it fails loudly."""
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine
        pytest.skip("a GPU is here: the real counter works")
    with pytest.raises(RuntimeError, match="the CUDA sync counter needs CUDA"):
        with G.cuda_sync_counter():
            pass


def test_the_counts_agree_with_the_mode_on_a_plain_read(on_device):
    with discipline():
        with G.discipline_sync_counter() as found:
            torch.ones(2, device=DEVICE).sum().item()
    assert found == ["item"] and dd.active() is None
