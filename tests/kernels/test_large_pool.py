"""A pool past 2**31 elements per layer (about 2.8M OPT-125m slots: a large GPU's memory): the read kernels'
``slot * stride_slot`` must not wrap in int32. On the CPU the interpreter reads through the wrapped (negative)
offset and crashes the process, so each case runs in a subprocess. The cache is ``torch.empty`` of 4 GiB per
tensor: only the pages of the blocks written are touched (about 0.3 GB resident)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    from lesson_utils.core import env
    env.configure_triton()
    import torch
    from lesson_utils.cache import attention
    from lesson_utils.kernels.paged_attention import paged_attention_decode, write_kv_to_cache
    from lesson_utils.kernels.unified_attention import unified_attention

    bs, heads, d = 16, 1, 64
    nb = 2**31 // (bs * heads * d) + 8  # the last blocks' slot * stride_slot (64) pass 2**31
    assert (nb - 1) * bs * heads * d >= 2**31
    k = torch.empty(nb, bs, heads, d, dtype=torch.float16)
    v = torch.empty(nb, bs, heads, d, dtype=torch.float16)
    g = torch.Generator().manual_seed(0)
    table = [nb - 3, 5, nb - 1]  # blocks past the int32 boundary, and one below it
    for b in table:
        k[b] = torch.randn(bs, heads, d, generator=g).half()
        v[b] = torch.randn(bs, heads, d, generator=g).half()
    new_k, new_v = torch.randn(1, heads, d, generator=g).half(), torch.randn(1, heads, d, generator=g).half()
    slot = torch.tensor([(nb - 1) * bs + 7], dtype=torch.int64)  # token 39: block nb - 1, offset 7
    write_kv_to_cache(new_k, new_v, k, v, slot)
    assert torch.equal(k[nb - 1, 7], new_k[0]) and torch.equal(v[nb - 1, 7], new_v[0])
    bt = torch.tensor([table], dtype=torch.int32)
    ctx = torch.tensor([40], dtype=torch.int32)
    q = torch.randn(1, heads, d, generator=g).half()
    want = attention.paged_attention_reference(q, k, v, bt, ctx)
    got = paged_attention_decode(q, k, v, bt, ctx)
    assert (got.float() - want.float()).abs().max() < 1e-2, "decode kernel"
    qs = torch.randn(3, heads, d, generator=g).half()  # a 3-token chunk ending at 40
    want = attention.unified_attention_reference(qs, k, v, bt, torch.tensor([0, 3], dtype=torch.int32), ctx)
    got = unified_attention(qs, k, v, bt, torch.tensor([0, 3], dtype=torch.int32), ctx, 3)
    assert (got.float() - want.float()).abs().max() < 1e-2, "unified kernel"
    print("ok")
    """
)


@pytest.mark.slow
def test_the_read_kernels_use_64_bit_offsets_past_2_31_elements():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (
        f"exit code {run.returncode} (-11: the kernel read through a wrapped 32-bit offset)\\n{run.stderr[-2000:]}"
    )
