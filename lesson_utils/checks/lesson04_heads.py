"""Checker for lesson 04's exercise 3: which query heads a KV head's program serves (grouped-query attention).

The learner's ``group_query_heads`` runs first alone, in a probe kernel that only stores what it returns: a wrong
head index used inside the real kernel would load and store outside ``q`` and ``out`` (the interpreter does not
bounds-check, and a stray store can kill the Python process). Only a mapping that passes the probe runs in the
decode kernel, against the plain-torch reference.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from lesson_utils.core.device_discipline import kernel_launch
from lesson_utils.kernels import paged_attention as K

from .core import CheckResult, case_device, failed, not_implemented
from .lesson04 import _case, _run_cases


@triton.jit
def _probe_heads(heads_ptr, mask_ptr, HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                 NUM_KV_HEADS: tl.constexpr):  # fmt: skip
    kv_head = tl.program_id(0)
    heads, head_mask = HEADS(kv_head, GROUP, GROUP_P, NUM_KV_HEADS)
    g = tl.arange(0, GROUP_P)
    tl.store(heads_ptr + kv_head * GROUP_P + g, heads.to(tl.int64))
    tl.store(mask_ptr + kv_head * GROUP_P + g, head_mask.to(tl.int32))


def _probe(fn) -> str:
    """'' when ``fn`` gives every KV head exactly its group's query heads (in any order); else what was wrong."""
    dev = case_device()
    for group, num_kv in [(1, 4), (3, 2), (4, 2), (2, 3), (8, 1)]:
        group_p = triton.next_power_of_2(group)
        heads = torch.zeros(num_kv * group_p, dtype=torch.int64, device=dev)
        mask = torch.zeros(num_kv * group_p, dtype=torch.int32, device=dev)
        with np.errstate(all="ignore"), kernel_launch():
            _probe_heads[(num_kv,)](heads, mask, HEADS=fn, GROUP=group, GROUP_P=group_p, NUM_KV_HEADS=num_kv)
        heads, mask = heads.cpu().view(num_kv, group_p), mask.cpu().view(num_kv, group_p).bool()
        case = f"{group * num_kv} query heads over {num_kv} KV heads ({group} per KV head, GROUP_P={group_p})"
        served = []
        for kv in range(num_kv):
            mine = heads[kv][mask[kv]].tolist()
            served += mine
            if len(mine) != group:
                return (
                    f"{case}: KV head {kv}'s mask lets {len(mine)} lanes through, but each KV head serves {group} "
                    f"query heads; lanes past GROUP would load another group's query (or one that does not exist)."
                )
            wrong = sorted(h for h in mine if not 0 <= h < group * num_kv or h // group != kv)
            if wrong:
                return (
                    f"{case}: KV head {kv} served query heads {sorted(mine)}, but in Hugging Face's layout "
                    f"query head(s) {wrong} read another KV head (or do not exist). repeat_kv repeats each KV head "
                    f"{group} times in a row: which query heads does that give KV head {kv}?"
                )
        if sorted(served) != list(range(group * num_kv)):
            return f"{case}: some query heads are served twice and others never: {sorted(served)}"
    return ""


def check_group_query_heads(fn) -> CheckResult:
    """Exercise 04-3: the query heads of one KV head's program, and which lanes exist."""
    name = "group_query_heads"
    try:
        problem = _probe(fn)
    except NotImplementedError:
        return not_implemented(name, K.group_query_heads)
    except Exception as err:  # noqa: BLE001 - compile or runtime errors become feedback
        if "NotImplementedError" in repr(err) or "not solved yet" in str(err):
            return not_implemented(name, K.group_query_heads)
        return failed(
            name, f"running your mapping alone raised {type(err).__name__}: {str(err)[:400]}", K.group_query_heads
        )
    if problem:
        return failed(name, f"your mapping, run alone in a probe kernel: {problem}", K.group_query_heads)
    cases = [
        ("3:1, as SmolLM2-135M", "6 query heads over 2 KV heads, GROUP_P 4", "tiled", _case(31, [9, 20], heads=6, kv_heads=2)),
        ("8:1", "8 query heads over 1 KV head", "simple", _case(32, [5, 17], heads=8, kv_heads=1)),
        ("1:1, as OPT", "multi-head attention: each KV head serves one query head", "simple", _case(33, [12], heads=3, kv_heads=3)),
    ]  # fmt: skip
    result = _run_cases(name, cases, {"heads_fn": fn}, K.group_query_heads)
    if result.passed:
        result.use = fn
    return result
