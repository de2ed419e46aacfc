"""The seam between the model and a KV cache.

The compact OPT forward (``lesson_utils.opt_forward``) never stores keys and values itself: each step it
hands them to a cache object and asks the same object for attention. Lesson 01 plugs in a contiguous
arena, lesson 03 a paged cache, lesson 04 a Triton kernel; this module holds the interface they share,
the plain-torch attention every cache is checked against, and the simplest possible cache.

A step processes a *flat* batch of new tokens from several sequences at once: a whole prompt for a
sequence being prefilled, one token for a sequence being decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class DecodeGroup:
    """The sequences of a step that decode one token each, served together by one batched attention call.

    ``indices`` are their places in the batch; ``rows`` their rows in the flat batch and ``context_lens``
    their context lengths, both on the cache's device; ``slot_index`` (``[n, max_ctx]`` cache slots of their
    context tokens) is built by the first layer that needs it and reused by the others.
    """

    indices: list[int]
    rows: torch.Tensor
    context_lens: torch.Tensor
    slot_index: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """What a cache works out once per step, in ``prepare``, and reads in every layer's ``write``/``attend``.

    ``slots``: the flat cache slot of every new token (``torch.long``, on the cache's device);
    ``block_tables``: each sequence's physical blocks (paged caches; None for contiguous ones);
    ``decode``: the sequences served together (:func:`mark_decodes`), None when there are none.
    """

    slots: torch.Tensor
    block_tables: list[list[int]] | None = None
    decode: DecodeGroup | None = None


@dataclass
class StepBatch:
    """The new tokens of one forward step, flattened across sequences.

    Invariants: ``len(seq_ids) == len(query_lens) == len(context_lens)``;
    ``input_ids.shape == positions.shape == (sum(query_lens),)``; sequence ``i``'s new tokens are the
    contiguous run ``input_ids[starts[i] : starts[i] + query_lens[i]]`` and sit at positions
    ``context_lens[i] - query_lens[i] ... context_lens[i] - 1`` of that sequence.
    """

    seq_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]  # tokens held for the sequence once this step's K/V are written
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | None = None  # set by the cache's prepare(), for its own write() and attend()

    @property
    def starts(self) -> list[int]:
        out, total = [], 0
        for n in self.query_lens:
            out.append(total)
            total += n
        return out

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    def new_positions(self) -> list[range]:
        """Each sequence's new-token positions, from the host-side lengths: no read-back of ``positions``."""
        return [range(c - q, c) for q, c in zip(self.query_lens, self.context_lens)]

    @classmethod
    def build(cls, seq_ids, new_tokens, context_before, device="cpu") -> "StepBatch":
        """Make a step from each sequence's new token ids and how many tokens it already had cached."""
        if not (len(seq_ids) == len(new_tokens) == len(context_before)):
            raise ValueError("seq_ids, new_tokens and context_before must have the same length")
        ids, pos, qlens, clens = [], [], [], []
        for toks, before in zip(new_tokens, context_before):
            if len(toks) == 0:
                raise ValueError("every sequence in a step needs at least one new token")
            ids.extend(int(t) for t in toks)
            pos.extend(range(before, before + len(toks)))
            qlens.append(len(toks))
            clens.append(before + len(toks))
        return cls(
            seq_ids=list(seq_ids),
            query_lens=qlens,
            context_lens=clens,
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(pos, dtype=torch.long, device=device),
        )


class KVCache(Protocol):
    """What the model needs from a cache. ``k``/``v``/``q`` are ``[num_tokens, heads, head_dim]``."""

    def prepare(self, batch: StepBatch) -> None:
        """Find room for this step's new tokens (called once per step, before layer 0)."""

    def write(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' keys and values for ``layer``."""

    def attend(self, layer: int, batch: StepBatch, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of each new token over its own sequence's cached tokens."""

    def free(self, seq_id: int) -> None:
        """Forget a finished sequence and give its memory back."""


def _check_shapes(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int]:
    """``(q_len, ctx, query heads per kv head)`` of one sequence's attention, or a clear error."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    if ctx < q_len:
        raise ValueError(f"context ({ctx}) is shorter than the queries ({q_len})")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} kv heads")
    return q_len, ctx, heads // kv_heads


def attention_over_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference attention for one sequence.

    ``q``: ``[q_len, heads, d]`` - the last ``q_len`` tokens of the sequence;
    ``k``, ``v``: ``[ctx, kv_heads, d]`` - all of its tokens, ``ctx >= q_len``; ``heads`` a multiple of
    ``kv_heads`` (grouped-query attention). Query ``j`` sees keys ``0 .. ctx - q_len + j``.
    Computed in fp32, returned in ``q``'s dtype.
    """
    q_len, ctx, group = _check_shapes(q, k)
    kf = k.float().repeat_interleave(group, dim=1)  # [ctx, heads, d]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    first_query_pos = ctx - q_len
    query_pos = torch.arange(q_len, device=q.device)[:, None] + first_query_pos
    key_pos = torch.arange(ctx, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, -math.inf)
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vf)
    return out.to(q.dtype)


def fused_attention_over_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`attention_over_context` through PyTorch's fused ``scaled_dot_product_attention`` (what the
    caches call; the einsum version stays as the readable reference the tests compare with).

    Same shapes and causal rule; computed in ``q``'s dtype. Fused means no ``[heads, q_len, ctx]`` score
    tensor and no fp32 copies of K and V: on a CPU those copies, not the arithmetic, dominated attention.
    Hugging Face's OPT attends through the same function.
    """
    q_len, ctx, group = _check_shapes(q, k)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = None
    if 1 < q_len < ctx:  # queries are the last q_len tokens: query j sees keys 0 .. ctx - q_len + j
        mask = (
            torch.arange(ctx, device=q.device)[None, :] <= torch.arange(q_len, device=q.device)[:, None] + ctx - q_len
        )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.to(q.dtype).transpose(0, 1),
        v.to(q.dtype).transpose(0, 1),
        attn_mask=mask,
        is_causal=q_len == ctx and q_len > 1,
        scale=scale,
    )
    return out.transpose(0, 1)


def mark_decodes(batch: StepBatch, enabled: bool, device) -> DecodeGroup | None:
    """The sequences of ``batch`` that decode one token this step, to serve all at once (None when there are
    none, or when not ``enabled``). A cache calls it in ``prepare``; ``attend`` then serves the other
    sequences one by one and these together."""
    decode = [i for i, n in enumerate(batch.query_lens) if n == 1] if enabled else []
    if not decode:
        return None
    starts = batch.starts
    return DecodeGroup(
        decode,
        torch.tensor([starts[i] for i in decode], device=device),
        torch.tensor([batch.context_lens[i] for i in decode], device=device),
    )


def decode_slot_index(first_slots_or_tables, context_lens: list[int], block_size: int | None, device) -> torch.Tensor:
    """Flat cache slot of every context token of every decoding sequence, padded: ``[num_seqs, max_ctx]``.

    Paged caches pass block tables and their ``block_size``: token ``p`` lives in slot
    ``table[p // block_size] * block_size + p % block_size``. A contiguous arena passes each sequence's first
    slot and ``block_size=None``: token ``p`` lives in slot ``first + p``. Entries past a sequence's context
    repeat its last slot (any valid slot would do: :func:`decode_attention` masks them out).
    """
    max_ctx = max(context_lens)
    pos = torch.arange(max_ctx)[None, :].minimum(torch.tensor(context_lens)[:, None] - 1)  # [num_seqs, max_ctx]
    if block_size is None:
        index = torch.tensor(first_slots_or_tables)[:, None] + pos
    else:
        width = max(len(t) for t in first_slots_or_tables)
        tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in first_slots_or_tables])
        index = tables.gather(1, pos // block_size) * block_size + pos % block_size
    return index.to(device)


def decode_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slot_index: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence, all sequences at once (the decode half of a step).

    ``q``: ``[num_seqs, heads, d]``; ``k_flat``/``v_flat``: a layer's cache viewed as ``[num_slots, kv_heads, d]``;
    ``slot_index``: ``[num_seqs, max_ctx]`` from :func:`decode_slot_index`; ``context_lens``: ``[num_seqs]``.
    Keys at positions ``>= context_lens[i]`` are masked. Same maths as :func:`attention_over_context` with
    ``q_len == 1`` per sequence, through the fused attention (computed in ``q``'s dtype), but one gather and
    one call instead of a Python loop over sequences - the better trade on a GPU, where every call in that
    loop is a kernel launch. On a CPU the loop wins (see :mod:`lesson_utils.paged_cache`).
    """
    n, heads, d = q.shape
    kv_heads = k_flat.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} kv heads")
    group = heads // kv_heads
    k = k_flat[slot_index].to(q.dtype).transpose(1, 2)  # [n, kv_heads, max_ctx, d]
    v = v_flat[slot_index].to(q.dtype).transpose(1, 2)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    keep = torch.arange(slot_index.shape[1], device=q.device)[None, :] < context_lens.to(q.device)[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=keep[:, None, None, :], scale=scale)
    return out[:, :, 0, :]


class DenseKVCache:
    """The simplest cache: one growing tensor per sequence and layer (``torch.cat`` on every step).

    Not a memory manager at all - it is the reference the real caches are compared with.
    Invariant: ``self.k[layer][seq].shape[0]`` equals the sequence's context length after each write.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.k: list[dict[int, torch.Tensor]] = [dict() for _ in range(num_layers)]
        self.v: list[dict[int, torch.Tensor]] = [dict() for _ in range(num_layers)]

    def prepare(self, batch: StepBatch) -> None:
        for sid, qlen, clen in zip(batch.seq_ids, batch.query_lens, batch.context_lens):
            have = self.k[0][sid].shape[0] if sid in self.k[0] else 0
            if have != clen - qlen:
                raise ValueError(f"sequence {sid} has {have} cached tokens, the step expects {clen - qlen}")

    def write(self, layer, batch, k, v):
        for sid, start, n in zip(batch.seq_ids, batch.starts, batch.query_lens):
            new_k, new_v = k[start : start + n], v[start : start + n]
            if sid in self.k[layer]:
                new_k = torch.cat([self.k[layer][sid], new_k])
                new_v = torch.cat([self.v[layer][sid], new_v])
            self.k[layer][sid], self.v[layer][sid] = new_k, new_v

    def attend(self, layer, batch, q, scale):
        out = torch.empty_like(q)
        for sid, start, n in zip(batch.seq_ids, batch.starts, batch.query_lens):
            out[start : start + n] = attention_over_context(
                q[start : start + n], self.k[layer][sid], self.v[layer][sid], scale
            )
        return out

    def free(self, seq_id: int) -> None:
        if seq_id not in self.k[0]:
            raise KeyError(f"sequence {seq_id} holds nothing in this cache (never written, or freed twice)")
        for layer in range(self.num_layers):
            del self.k[layer][seq_id], self.v[layer][seq_id]
