"""Lesson 04's exercise 3 (which query heads a KV head serves): the reference passes; the plausible wrong mappings
are rejected by name, in the probe kernel, before any of them runs inside the decode kernel."""

from __future__ import annotations

import triton
import triton.language as tl
from helpers import rejected

from lesson_utils.checks.lesson04_heads import check_group_query_heads
from lesson_utils.kernels import paged_attention as K


@triton.jit
def modulo(kv_head, GROUP: tl.constexpr, GROUP_P: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    g = tl.arange(0, GROUP_P)  # query head h -> KV head h % num_kv_heads: interleaved, not HF's layout
    return kv_head + g * NUM_KV_HEADS, g < GROUP


@triton.jit
def no_mask(kv_head, GROUP: tl.constexpr, GROUP_P: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    g = tl.arange(0, GROUP_P)  # GROUP_P lanes, GROUP of them real: a 3:1 group reads the next group's first head
    return kv_head * GROUP + g, g < GROUP_P


@triton.jit
def stride_by_padded(kv_head, GROUP: tl.constexpr, GROUP_P: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    g = tl.arange(0, GROUP_P)  # right only when GROUP is a power of two
    return kv_head * GROUP_P + g, g < GROUP


@triton.jit
def every_head_reads_kv_zero(kv_head, GROUP: tl.constexpr, GROUP_P: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    g = tl.arange(0, GROUP_P)
    return g, g < GROUP


@triton.jit
def unsolved(kv_head, GROUP: tl.constexpr, GROUP_P: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    raise NotImplementedError("exercise 3 not solved yet")


def test_the_reference_passes():
    assert check_group_query_heads(K.group_query_heads).passed


def test_wrong_mappings_are_rejected_by_name(not_strict):
    assert rejected(check_group_query_heads(modulo), "read another KV head", "repeat_kv")
    assert rejected(check_group_query_heads(no_mask), "lets 4 lanes through")
    assert rejected(check_group_query_heads(stride_by_padded), "read another KV head")
    assert rejected(check_group_query_heads(every_head_reads_kv_zero), "read another KV head")


def test_an_unsolved_exercise_says_so(not_strict):
    result = check_group_query_heads(unsolved)
    assert not result.passed and "not" in result.message.lower()
