"""Predicted time of lesson 07's serving cells on a T4: exact step counts x ASSUMED step costs.

Run from the repository root: ``python docs/estimates/capstone_t4_time.py``. The workload is built as in the
notebook's gpu profile (lengths only: token ids do not change step counts). Step counts come from the
accounting simulator (the course engines' scheduler and memory managers) and from
``benchmark.static_batches`` (HF's static batches, each running to its longest output). The per-step costs
below are assumptions for OPT-125m in fp16 on a T4, where a step is bound by kernel launches and Python;
replace them with a measured run's numbers when one exists. Output: a prediction, never a measurement.
"""

import numpy as np

from lesson_utils import benchmark, workloads
from lesson_utils.memory import reservation
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.serving import simulator

max_len = 2048
ENGINE_STEP_MS, ENGINE_PER_SEQ_MS, HF_STEP_MS, HF_PER_ROW_MS = 12.0, 0.15, 20.0, 0.1
for n_requests, scale, rate, budget_res in [(200, 1.0, 20.0, 16), (96, 1.0, 20.0, 16)]:  # the old and the new gpu size
    stream = workloads.sharegpt_like(n_requests, rate_per_s=rate, seed=0, scale=scale)
    rng = np.random.default_rng(0)
    sys_len = int(64 * max(scale, 0.25))
    reqs = []
    for r in stream:
        shares = rng.random() < 0.5
        plen = min(1 + (sys_len if shares else 0) + r.prompt_len, max_len // 2)
        out = min(r.output_len, max_len - plen)
        reqs.append(workloads.Request(r.req_id, r.arrival_s, plen, out))
    budget = budget_res * max_len
    longest = max(r.total_len for r in reqs)
    hf_batch = max(1, budget // longest)
    batches = benchmark.static_batches(reqs, hf_batch, max_len)
    hf_steps = sum(max(r.output_len for r in b) for b in batches)
    hf_rows = sum(len(b) * max(r.output_len for r in b) for b in batches)
    res = {}
    for kind in ("naive", "paged"):
        mgr = (
            reservation.ContiguousReservationManager(budget, "max", max_seq_len=max_len)
            if kind == "naive"
            else BlockManager(budget // 16, 16, max_seq_len=max_len)
        )
        sim = simulator.simulate(reqs, mgr, step_time_s=ENGINE_STEP_MS / 1e3, progress=False)
        steps = len(sim.steps)
        seqs = int(sim.running.sum())
        res[kind] = (steps, seqs, (steps * ENGINE_STEP_MS + seqs * ENGINE_PER_SEQ_MS) / 1e3)
    hf_s = (hf_steps * HF_STEP_MS + hf_rows * HF_PER_ROW_MS) / 1e3
    out_tokens = sum(r.output_len for r in reqs)
    print(
        f"n={n_requests} scale={scale}: {out_tokens} output tokens; HF {len(batches)} batches of <= {hf_batch}, {hf_steps} steps -> {hf_s:.0f} s; "
        + "; ".join(f"{k} {s} steps ({q} seq-steps) -> {t:.0f} s" for k, (s, q, t) in res.items())
    )
