"""Lesson 04: compile the course's kernels ahead of time for the GPUs the course may meet, no GPU needed: a T4
(sm_75, Colab's free GPU), an A100 (sm_80), an L4 (sm_89, Colab and clouds) and an H100 (sm_90).

``triton.compile`` with a ``GPUTarget`` produces real PTX and a real cubin (assembled by Triton's bundled
ptxas), so "does this kernel build for a T4, and does it fit?" is answerable on any machine. The report
says, per configuration: registers per thread and spills (from ``cuobjdump`` on the cubin), shared memory
(must fit a T4 block's 48 KiB), and whether the PTX uses tensor-core ``mma`` instructions (never on sm_75).

Compiling must happen in a process where ``TRITON_INTERPRET`` is off (Triton fixes the mode when a kernel
is defined), so :func:`compile_report` runs ``python -m lesson_utils.kernels.aot`` in a subprocess with it set to 0.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

T4_SHARED_LIMIT = 48 * 1024


TARGETS = {"sm_75": 75, "sm_80": 80, "sm_89": 89, "sm_90": 90}  # name -> compute capability
TARGET_GPUS = {"sm_75": "T4", "sm_80": "A100", "sm_89": "L4", "sm_90": "H100"}


@dataclass(frozen=True)
class KernelConfig:
    """One compiled specialisation of a course kernel."""

    kernel: str  # "decode-simple", "decode-tiled", "write-kv", "unified" (lesson 08) or "write-int8" (lesson 10)
    dtype: str  # "fp16" or "fp32" (the queries'; "int8" for lesson 10's caches: fp16 queries, int8 K/V + scales)
    head_dim: int
    block_size: int = 16
    group: int = 1
    num_kv_heads: int = 12
    block_q: int = 16  # "unified": query tokens per program

    @property
    def label(self) -> str:
        if self.kernel in ("write-kv", "write-int8"):
            return f"{self.kernel} {self.dtype} row={self.num_kv_heads}x{self.head_dim}"
        if self.kernel == "unified":
            return f"{self.kernel} {self.dtype} d={self.head_dim} bs={self.block_size} gqa={self.group}:1 q-tile={self.block_q}"
        return f"{self.kernel} {self.dtype} d={self.head_dim} bs={self.block_size} gqa={self.group}:1"


def course_configs() -> list[KernelConfig]:
    """Every configuration the course runs: OPT-125m's on a T4 (fp16) and the tests' sizes (fp32/fp16)."""
    configs = []
    for kernel in ("decode-simple", "decode-tiled"):
        configs.append(KernelConfig(kernel, "fp16", 64, 16, 1))  # OPT-125m on a T4
        configs.append(KernelConfig(kernel, "fp32", 64, 16, 1))  # OPT-125m geometry on a CPU profile
    for head_dim in (64, 80, 96, 128):  # the tests' head dims, grouped-query 4:1
        configs.append(KernelConfig("decode-tiled", "fp16", head_dim, 16, 4))
    for block_size in (8, 32, 64):  # the tests' other block sizes
        configs.append(KernelConfig("decode-tiled", "fp16", 64, block_size, 4))
    configs += modern_configs()
    configs.append(KernelConfig("write-kv", "fp16", 64, num_kv_heads=12))  # OPT-125m: 768, not a power of two
    configs.append(KernelConfig("write-kv", "fp32", 64, num_kv_heads=12))
    configs.append(KernelConfig("write-kv", "fp16", 80, num_kv_heads=2))
    return configs


# The modern models' attention geometries (lesson 00's table): (name, head_dim, query heads per KV head, KV heads).
MODERN_GEOMETRIES = (("SmolLM2-135M", 64, 3, 3), ("Qwen3-0.6B", 128, 2, 8), ("Llama-3.2-1B", 64, 4, 8))


def modern_configs() -> list[KernelConfig]:
    """The decode kernel (both variants) and the KV write at the geometries of SmolLM2-135M, Qwen3-0.6B and
    Llama-3.2-1B in fp16: grouped-query attention as a T4 would serve them."""
    configs = []
    for _, head_dim, group, kv_heads in MODERN_GEOMETRIES:
        for kernel in ("decode-simple", "decode-tiled"):
            configs.append(KernelConfig(kernel, "fp16", head_dim, 16, group, num_kv_heads=kv_heads))
        configs.append(KernelConfig("write-kv", "fp16", head_dim, num_kv_heads=kv_heads))
    return configs


def unified_configs() -> list[KernelConfig]:
    """Lesson 08's unified kernel as the course runs it: OPT-125m on a T4 (fp16), decode-only (a query tile of 1)
    and chunked (8) steps, fp32 for the CPU profiles' geometry, and a grouped-query case with head_dim 128."""
    return [
        KernelConfig("unified", "fp16", 64, 16, 1, block_q=8),
        KernelConfig("unified", "fp16", 64, 16, 1, block_q=1),
        KernelConfig("unified", "fp32", 64, 16, 1, block_q=8),
        KernelConfig("unified", "fp16", 128, 16, 4, block_q=2),  # 2 tokens x 4 heads: the 8 rows the engine runs
        KernelConfig("unified", "fp16", 64, 16, 3, block_q=2),  # SmolLM2-135M's 3:1 (4 rows per token, padded)
    ]


def int8_configs() -> list[KernelConfig]:
    """Lesson 10: OPT-125m's geometry on a T4 with an int8 cache - the quantizing write, the decode kernel (both
    variants) and the unified kernel reading int8 tiles and their scales."""
    return [
        KernelConfig("write-int8", "int8", 64, num_kv_heads=12),
        KernelConfig("decode-simple", "int8", 64, 16, 1),
        KernelConfig("decode-tiled", "int8", 64, 16, 1),
        KernelConfig("unified", "int8", 64, 16, 1, block_q=8),
    ]


@dataclass
class CompileResult:
    config: KernelConfig
    target: str
    ok: bool
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    tensor_cores: bool | None = None
    error: str | None = None

    @property
    def fits_t4(self) -> bool:
        return self.ok and (self.shared_bytes or 0) <= T4_SHARED_LIMIT


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, spill bytes) from Triton's bundled cuobjdump; (None, None) if it is unavailable."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return (int(regs.group(1)) if regs else None, int(stack.group(1)) if stack else None)


def _compile_one(cfg: KernelConfig, target: str) -> CompileResult:
    """One kernel configuration compiled ahead of time for one target. Long on purpose: it spells out each kernel's signature and constants for Triton's ``ASTSource`` in one place."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lesson_utils.kernels import paged_attention as kernels

    ptr = "*fp32" if cfg.dtype == "fp32" else "*fp16"  # queries and outputs (fp16 beside an int8 cache)
    cache = "*i8" if cfg.dtype == "int8" else ptr
    scales = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    load = kernels.load_tile
    if cfg.dtype == "int8":
        from lesson_utils.kernels import int8_kv

        load = int8_kv.load_int8_tile
    if cfg.kernel == "write-int8":
        from lesson_utils.kernels import int8_kv

        fn = int8_kv.write_int8_kv_kernel
        signature = {"k_ptr": "*fp16", "v_ptr": "*fp16", "k_cache_ptr": "*i8", "v_cache_ptr": "*i8", **scales}
        signature |= {"slot_mapping_ptr": "*i32", "stride_k_token": "i32", "stride_v_token": "i32"}
        signature |= {name: "constexpr" for name in ("HEADS", "HEADS_P", "HEAD_DIM", "HEAD_DIM_P")}
        constexprs = {
            "HEADS": cfg.num_kv_heads,
            "HEADS_P": triton.next_power_of_2(cfg.num_kv_heads),
            "HEAD_DIM": cfg.head_dim,
            "HEAD_DIM_P": triton.next_power_of_2(cfg.head_dim),
        }
    elif cfg.kernel == "write-kv":
        row = cfg.num_kv_heads * cfg.head_dim
        fn = kernels.write_kv_kernel
        signature = {
            "k_ptr": ptr,
            "v_ptr": ptr,
            "k_cache_ptr": ptr,
            "v_cache_ptr": ptr,
            "slot_mapping_ptr": "*i32",
            "stride_k_token": "i32",
            "stride_v_token": "i32",
            "stride_cache_slot": "i32",
            "ROW": "constexpr",
            "ROW_P": "constexpr",
        }
        constexprs = {"ROW": row, "ROW_P": triton.next_power_of_2(row)}
    elif cfg.kernel == "unified":
        from lesson_utils.kernels import unified_attention as unified

        fn = unified.unified_attention_kernel
        signature = {
            "out_ptr": ptr,
            "q_ptr": ptr,
            "k_cache_ptr": cache,
            "v_cache_ptr": cache,
            **scales,
            "block_tables_ptr": "*i32",
            "query_start_ptr": "*i32",
            "context_lens_ptr": "*i32",
            "scale": "fp32",
            "stride_q_token": "i32",
            "stride_q_head": "i32",
            "stride_o_token": "i32",
            "stride_o_head": "i32",
            "stride_bt_seq": "i32",
            "stride_slot": "i32",
            "stride_kv_head": "i32",
            "stride_scale_slot": "i32",
            "GROUP": "constexpr",
            "GROUP_P": "constexpr",
            "HEAD_DIM": "constexpr",
            "HEAD_DIM_P": "constexpr",
            "BLOCK_SIZE": "constexpr",
            "BLOCK_Q": "constexpr",
            "TILE": "constexpr",
            "MASK": "constexpr",
            "LOAD": "constexpr",
        }
        constexprs = {
            "GROUP": cfg.group,
            "GROUP_P": triton.next_power_of_2(cfg.group),
            "HEAD_DIM": cfg.head_dim,
            "HEAD_DIM_P": triton.next_power_of_2(cfg.head_dim),
            "BLOCK_SIZE": cfg.block_size,
            "BLOCK_Q": cfg.block_q,
            "TILE": cfg.block_size,
            "MASK": unified.causal_mask,
            "LOAD": load,
        }
    else:
        fn = kernels.paged_decode_kernel
        signature = {
            "out_ptr": ptr,
            "q_ptr": ptr,
            "k_cache_ptr": cache,
            "v_cache_ptr": cache,
            **scales,
            "block_tables_ptr": "*i32",
            "context_lens_ptr": "*i32",
            "scale": "fp32",
            "stride_q_seq": "i32",
            "stride_q_head": "i32",
            "stride_o_seq": "i32",
            "stride_o_head": "i32",
            "stride_bt_seq": "i32",
            "stride_slot": "i32",
            "stride_kv_head": "i32",
            "stride_scale_slot": "i32",
            "NUM_KV_HEADS": "constexpr",
            "GROUP": "constexpr",
            "GROUP_P": "constexpr",
            "HEAD_DIM": "constexpr",
            "HEAD_DIM_P": "constexpr",
            "BLOCK_SIZE": "constexpr",
            "TILE": "constexpr",
            "SLOTS": "constexpr",
            "UPDATE": "constexpr",
            "LOAD": "constexpr",
            "HEADS": "constexpr",
        }
        tile = kernels.tile_tokens(cfg.kernel.removeprefix("decode-"), cfg.block_size, cfg.head_dim, cfg.group)
        constexprs = {
            "NUM_KV_HEADS": cfg.num_kv_heads,
            "GROUP": cfg.group,
            "GROUP_P": triton.next_power_of_2(cfg.group),
            "HEAD_DIM": cfg.head_dim,
            "HEAD_DIM_P": triton.next_power_of_2(cfg.head_dim),
            "BLOCK_SIZE": cfg.block_size,
            "TILE": tile,
            "SLOTS": kernels.block_slots,
            "UPDATE": kernels.online_softmax_update,
            "LOAD": load,
            "HEADS": kernels.group_query_heads,
        }
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", TARGETS[target], 32), options={"num_warps": 4})
    except Exception as err:  # noqa: BLE001 - a failed compile is a result to report
        return CompileResult(cfg, target, ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    ptx = compiled.asm["ptx"]
    regs, spill = _resource_usage(compiled.asm["cubin"])
    return CompileResult(
        cfg,
        target,
        ok=f".target {target}" in ptx and bool(compiled.asm["cubin"]),
        registers=regs,
        spill_bytes=spill,
        shared_bytes=int(compiled.metadata.shared),
        tensor_cores=bool(re.search(r"\bmma\.", ptx) or "wgmma" in ptx),
    )


def _main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: the interpreter cannot compile")
    wanted = json.loads(sys.stdin.read() or "null")
    configs = [KernelConfig(**c) for c in wanted] if wanted else course_configs()
    results = []
    for cfg in configs:
        for target in TARGETS:
            results.append(asdict(_compile_one(cfg, target)))
            print(f"{PROGRESS_MARK} {len(results)} {len(configs) * len(TARGETS)}", file=sys.stderr, flush=True)
    print(json.dumps(results))


PROGRESS_MARK = "aot-progress"  # the child's stderr line after each compile: "aot-progress DONE TOTAL"


def compile_report(
    configs: list[KernelConfig] | None = None, timeout: int = 900, progress: bool = True
) -> list[CompileResult]:
    """Compile ``configs`` (default: :func:`course_configs`) for every target of ``TARGETS`` (sm_75, sm_80, sm_89,
    sm_90) in a clean subprocess; ``progress`` shows a bar that moves with every compile (a few seconds each)."""
    environ = dict(
        os.environ, TRITON_INTERPRET="0"
    )  # "0", not unset: lesson_utils.core.env only fills it in when absent
    environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    payload = json.dumps([asdict(c) for c in configs] if configs else None)
    bar, other = None, []
    if progress:  # before the child starts: its imports and first compile take seconds too
        from tqdm.auto import tqdm

        total = len(configs or course_configs()) * len(TARGETS)
        bar = tqdm(total=total, desc="compiling for " + ", ".join(TARGETS), unit="kernel", leave=False)
    with tempfile.TemporaryFile("w+") as stdout:  # a file, not a pipe: the child never blocks on what it prints
        proc = subprocess.Popen(
            [sys.executable, "-m", "lesson_utils.kernels.aot"],
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
            for line in proc.stderr:
                if line.startswith(PROGRESS_MARK):
                    if bar is not None:
                        bar.update(int(line.split()[1]) - bar.n)
                else:
                    other.append(line)
            code = proc.wait()
        finally:
            timer.cancel()
            if bar is not None:
                bar.close()
        stdout.seek(0)
        text = stdout.read()
    if code != 0:
        raise RuntimeError(f"the ahead-of-time compile process failed:\n{''.join(other)[-3000:]}")
    out = []
    for row in json.loads(text.strip().splitlines()[-1]):
        row["config"] = KernelConfig(**row["config"])
        out.append(CompileResult(**row))
    return out


def format_report(results: list[CompileResult]) -> str:
    lines = [
        f"{'kernel configuration':44s} {'target':6s} {'ok':3s} {'regs':>4s} {'spill':>5s} {'shared':>7s} {'fits T4':7s} tensor cores"
    ]
    for r in results:
        if not r.ok:
            lines.append(f"{r.config.label:44s} {r.target:6s} NO   {r.error}")
            continue
        lines.append(
            f"{r.config.label:44s} {r.target:6s} yes {r.registers if r.registers is not None else '?':>4} "
            f"{r.spill_bytes if r.spill_bytes is not None else '?':>5} {r.shared_bytes:>7d} "
            f"{'yes' if r.fits_t4 else 'NO':7s} {'mma' if r.tensor_cores else 'no (FMA)'}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    _main()
