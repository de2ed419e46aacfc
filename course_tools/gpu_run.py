"""One command for a person with any NVIDIA GPU: a recorded run of the course on it (issue 23).

    python -m course_tools.gpu_run                  # everything, into docs/recorded_runs/<date>-gpu-<device>/
    python -m course_tools.gpu_run --skip-notebooks # the measurements below only (about 2 minutes)

What it records, each stage written to ``gpu_checks.md`` / ``gpu_checks.json`` as soon as it ends (a crash
keeps what came before):

1. the device, its compute capability, the versions, and where the weights came from (offline by default:
   ``HF_HUB_OFFLINE=1``, so OPT-125m's random-weights fallback unless it is in the local HF cache - said in the
   report; ``--hub`` lets it download);
2. the device's copy bandwidth, and the kernels against it: lesson 04's decode kernel and lesson 08's unified
   kernel against gather + SDPA (:mod:`course_tools.gpu_checks`), timed by ``triton.testing.do_bench``; the decode
   kernel also at SmolLM2-135M's grouped-query geometry (9:3), with the bytes a step reads and their share of the
   copy bandwidth;
3. the real syncs of every engine kind's steps, from ``torch.cuda.set_sync_debug_mode`` (the course holds itself
   to two a step; a swap-out's deliberate wait is counted apart);
4. the identity rule on every engine in fp16, its threshold calibrated in the run (the share of steps it could
   excuse), and again in fp32, where the rule is sharp: a real bug cannot hide behind fp16 there;
5. every solution notebook (thirteen) in the ``gpu`` profile (``course_tools.run_all --record``), unless skipped.

It refuses to start without CUDA. Aimed at 10 minutes on a data-centre GPU; ``--budget-min`` stops before the
notebooks when the measurements alone have used the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class NoCuda(SystemExit):
    """Raised (exit status 2) when there is no CUDA GPU to run on."""


def require_cuda() -> str:
    """The CUDA device's name, or a clear refusal: this script measures a GPU and has nothing to say without one."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        print(
            "course_tools.gpu_run needs an NVIDIA GPU with CUDA: torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, built with {built}). On a machine without a GPU, record a CPU run instead: "
            "python -m course_tools.run_all --profile cpu --record docs/recorded_runs/<date>-cpu",
            file=sys.stderr,
        )
        raise NoCuda(2)
    return torch.cuda.get_device_name()


def slug(text: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``: a folder name."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def default_out(device_name: str, today: str | None = None) -> Path:
    today = today or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return ROOT / "docs" / "recorded_runs" / f"{today}-gpu-{slug(device_name)}"


# ---- the report ---------------------------------------------------------------------------------------------


def render(results: dict) -> str:
    """``gpu_checks.md`` from what the stages have recorded so far."""
    env = results.get("environment", {})
    lines = [
        f"# GPU checks: {env.get('device', '?')}",
        "",
        f"Recorded {results.get('created', '?')} by `python -m course_tools.gpu_run`. Device: **{env.get('device', '?')}** "
        f"(compute capability {env.get('capability', '?')}); {env.get('versions', '')}.",
        "",
        f"Weights: {env.get('weights', '?')}."
        + (
            " **Random weights**: text is gibberish and accuracy numbers say nothing about a trained model; every "
            "timing, memory and identity check still holds (they depend on shapes and on the implementations agreeing)."
            if env.get("random_weights")
            else ""
        ),
        "",
    ]
    if "copy_gbs" in results:
        lines += [f"## Kernels (one layer, fp16; copy bandwidth measured: {results['copy_gbs']:.0f} GB/s)", ""]
        lines += [
            "| kernel | case | µs, median (p10-p90) | GB/s of K/V (median) | share of copy bandwidth | max error |",
            "|---|---|---|---|---|---|",
        ]
        for r in (
            results.get("decode_kernels", []) + results.get("unified_kernels", []) + results.get("gqa_kernels", [])
        ):
            lines.append(
                f"| {r['kernel']} | {r['case']} | {r['ms'] * 1e3:.1f} ({r['ms_low'] * 1e3:.1f}-{r['ms_high'] * 1e3:.1f}) | "
                f"{r['gb_per_s']:.0f} | "
                f"{100 * r['share_of_copy']:.0f} % | {r['max_error']:.1e} |"
            )
        lines.append("")
    if "syncs" in results:
        lines += ["## Syncs per engine step (torch.cuda.set_sync_debug_mode)", ""]
        lines += [
            "| engine | steps | max per step | median | steps that swapped out (+1 each) |",
            "|---|---|---|---|---|",
        ]
        for r in results["syncs"]:
            lines.append(
                f"| {r['engine']} | {r['steps']} | {r['max_per_step']} | {r['median_per_step']:g} | {r['swap_out_steps']} |"
            )
        worst = max(results["syncs"], key=lambda r: r["max_per_step"])
        verdict = "met" if worst["max_per_step"] <= 2 else f"missed: {worst['engine']} has {worst['max_per_step']}"
        lines += ["", f"Budget of 2 syncs a step: {verdict}.", ""]
    for dtype in ("fp16", "fp32"):
        key = f"identity_{dtype}"
        if key in results:
            lines += [f"## Identity with HF generate, {dtype}", ""]
            lines += [f"- **{r['engine']}**: {r['summary']}" for r in results[key]]
            lines.append("")
    if "notebooks" in results:
        nb = results["notebooks"]
        lines += ["## Notebooks (gpu profile)", "", f"{nb['summary']} - see [report.md](report.md).", ""]
    if results.get("skipped"):
        lines += ["## Not run", ""] + [f"- {s}" for s in results["skipped"]] + [""]
    return "\n".join(lines)


def save(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_checks.json").write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    (out / "gpu_checks.md").write_text(render(results), encoding="utf-8")


# ---- the stages ---------------------------------------------------------------------------------------------


def _prompts(vocab: int, bos: int, lengths=(12, 20, 25, 31, 9)) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(3)
    return [[bos] + torch.randint(4, vocab, (n - 1,), generator=g).tolist() for n in lengths]


def run_checks(out: Path, *, notebooks: bool, only: str | None, budget_s: float) -> dict:
    import torch

    from course_tools import gpu_checks as G
    from lesson_utils.core import env
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

    t0 = time.perf_counter()
    results: dict = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "skipped": []}
    profile = env.get_profile()
    lm = load_model(profile=profile)
    results["environment"] = {
        "device": torch.cuda.get_device_name(),
        "capability": "sm_%d%d" % torch.cuda.get_device_capability(),
        "versions": ", ".join(f"{k} {v}" for k, v in env.versions().items()),
        "weights": lm.source,
        "random_weights": not lm.is_pretrained,
        "profile": profile.name,
    }
    save(results, out)

    print("1/4 copy bandwidth and kernels ...", flush=True)
    timer = G.do_bench_timer()
    copy_gbs = G.copy_bandwidth("cuda", timer)
    results["copy_gbs"] = copy_gbs
    results["decode_kernels"] = [asdict(r) for r in G.decode_kernel_bench("cuda", torch.float16, timer, copy_gbs)]
    results["unified_kernels"] = [asdict(r) for r in G.unified_kernel_bench("cuda", torch.float16, timer, copy_gbs)]
    results["gqa_kernels"] = [asdict(r) for r in G.gqa_decode_bench("cuda", torch.float16, timer, copy_gbs)]
    save(results, out)

    print("2/4 syncs per engine step ...", flush=True)
    w = OPTWeights.from_hf(lm.model)
    prompts = _prompts(w.vocab_size, w.bos_token_id)
    results["syncs"] = [
        asdict(G.syncs_per_step(name, engine, prompts, 20, G.cuda_sync_counter)) for name, engine in G.engine_kinds(w)
    ]
    save(results, out)

    print("3/4 identity, fp16 (calibrated) and fp32 ...", flush=True)
    results["identity_fp16"] = [asdict(s) for s in G.identity_stats(lm.model, w, prompts, 20)]
    save(results, out)
    model32 = lm.model.float()  # the same weights in fp32: the rule is sharp there
    w32 = OPTWeights.from_hf(model32)
    results["identity_fp32"] = [asdict(s) for s in G.identity_stats(model32, w32, prompts, 20)]
    del model32, w32, lm, w
    torch.cuda.empty_cache()
    save(results, out)
    results["measurements_s"] = round(time.perf_counter() - t0, 1)

    if not notebooks:
        results["skipped"].append("the notebooks (--skip-notebooks)")
    elif time.perf_counter() - t0 > budget_s:
        results["skipped"].append(f"the notebooks: the measurements alone took {time.perf_counter() - t0:.0f} s")
    else:
        print("4/4 the solution notebooks, gpu profile ...", flush=True)
        from course_tools import run_all

        argv = ["--root", str(ROOT), "--profile", "gpu", "--record", str(out), "--out", str(ROOT / "runs" / out.name)]
        status = run_all.main(argv + (["--only", only] if only else []))
        summary = run_all.load_summary(out)
        passed = sum(n["ok"] for n in summary["notebooks"])
        results["notebooks"] = {"status": status, "summary": f"{passed}/{len(summary['notebooks'])} passed"}
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    save(results, out)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.gpu_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="record folder (default: docs/recorded_runs/<date>-gpu-<device>)")
    parser.add_argument("--skip-notebooks", action="store_true", help="the measurements only")
    parser.add_argument("--only", help="run only the notebooks whose name contains this text")
    parser.add_argument("--hub", action="store_true", help="allow downloading OPT-125m (default: offline)")
    parser.add_argument("--budget-min", type=float, default=10.0, help="skip the notebooks past this (default 10)")
    args = parser.parse_args(argv)
    if not args.hub:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["COURSE_PROFILE"] = "gpu"
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.pop("COURSE_DEVICE_DISCIPLINE", None)
    device = require_cuda()
    out = Path(args.out) if args.out else default_out(device)
    print(f"GPU run on {device}, recording into {out}", flush=True)
    results = run_checks(out, notebooks=not args.skip_notebooks, only=args.only, budget_s=60 * args.budget_min)
    print(render(results))
    worst = max((r["max_per_step"] for r in results.get("syncs", [])), default=0)
    identity_ok = all(r["ok"] for k in ("identity_fp16", "identity_fp32") for r in results.get(k, []))
    notebooks_ok = results.get("notebooks", {}).get("status", 0) == 0
    return 0 if worst <= 2 and identity_ok and notebooks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
