"""Predicted time of lesson 07's serving cells on a T4: the simulator's exact decisions x ASSUMED step costs.

Run from the repository root: ``python docs/estimates/capstone_t4_time.py``. The workload is built as in the
notebook's gpu profile (lengths only: token ids do not change the decisions). The course engines are replayed by
the simulator (their scheduler and memory managers) with a step cost, HF's static batches by
``benchmark.simulate_hf_static``. The costs below are assumptions for OPT-125m in fp16 on a T4, where a step is
bound by kernel launches and Python rather than by the GPU; replace them with the fits a real run prints
(lesson 07's "step cost" lines). Output: a prediction, never a measurement.
"""

from dataclasses import replace

from lesson_utils.lab import benchmark, workloads
from lesson_utils.memory import reservation
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving import simulator
from lesson_utils.serving.cost_model import StepCost

# the notebook's gpu profile
SCALE, BLOCK, RESERVATIONS, N, RATE, SYSTEM, REPEATS = 0.25, 16, 8, 96, 16.0, 63, 3
MAX_LEN = int(2048 * SCALE)
BUDGET = RESERVATIONS * MAX_LEN
# ASSUMED costs: fixed, per decoding sequence, per prompt token, per context token (seconds)
ENGINE = StepCost(12e-3, 0.15e-3, 0.02e-3, 0.0)
HF = StepCost(20e-3, 0.1e-3, 0.02e-3, 0.0)

reqs = workloads.system_prompt_stream(
    N, RATE, max_model_len=MAX_LEN, system_prompt_len=SYSTEM, vocab_size=50272, bos_token_id=2, scale=SCALE
)
offline = [replace(r, arrival_s=0.0) for r in reqs]
hf_batch = max(1, BUDGET // max(r.total_len for r in reqs))
managers = {
    "naive": lambda: reservation.ContiguousReservationManager(BUDGET, "max", max_seq_len=MAX_LEN),
    "paged": lambda: BlockManager(BUDGET // BLOCK, BLOCK, max_seq_len=MAX_LEN),
    "paged + prefix": lambda: SharingBlockManager(BUDGET // BLOCK, BLOCK, max_seq_len=MAX_LEN),
}
total = 0.0
for name, make in managers.items():
    online_s = simulator.simulate(reqs, make(), step_cost=ENGINE, progress=False).wall_s()
    offline_s = simulator.simulate(offline, make(), step_cost=ENGINE, progress=False).wall_s()
    total += online_s + REPEATS * offline_s
    print(f"{name}: online {online_s:.0f} s, offline {offline_s:.0f} s per repeat")
for label, wl in (("online", reqs), ("offline", offline)):
    e2e = benchmark.simulate_hf_static(wl, hf_batch, MAX_LEN, HF)
    seconds = max(r.arrival_s + e2e[r.req_id] for r in wl)
    total += seconds * (1 if label == "online" else REPEATS)
    print(f"HF (batches of {hf_batch}): {label} {seconds:.0f} s" + (" per repeat" if label == "offline" else ""))
print(f"serving in all (one online run, {REPEATS} offline repeats): about {total / 60:.1f} min (predicted)")
