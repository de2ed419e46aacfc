"""Lessons 00 and 07: exact KV-cache byte accounting from a model config, and what a budget holds.

Every token of every layer stores one key and one value vector per KV head:
``bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element``.
For OPT-125m in fp16 that is 2 x 12 x 12 x 64 x 2 = 36,864 B (36 KiB), as the paper's §3 computes
800 KB for OPT-13B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from lesson_utils.memory.block_table import blocks_needed

GiB = 2**30
MiB = 2**20
KiB = 2**10

T4_VISIBLE_BYTES = 15 * GiB  # what Colab shows of a T4's 16 GB
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def kv_heads_of(config) -> int:
    """KV heads of a Hugging Face config (grouped-query models say so; OPT has one per query head)."""
    kv = getattr(config, "num_key_value_heads", None)
    return int(kv) if kv else int(config.num_attention_heads)


def head_dim_of(config) -> int:
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else int(config.hidden_size) // int(config.num_attention_heads)


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of K and V one token occupies across all layers (the reference for exercise 00-1)."""
    return 2 * int(config.num_hidden_layers) * kv_heads_of(config) * head_dim_of(config) * int(dtype_bytes)


def count_parameters(config) -> int:
    """Parameters of an OPT, Llama, Qwen2 or Qwen3 model from its config (a tied output layer counted once)."""
    if getattr(config, "model_type", "opt") != "opt":
        return _count_llama_family(config)
    h, f, L, V = config.hidden_size, config.ffn_dim, config.num_hidden_layers, config.vocab_size
    proj = getattr(config, "word_embed_proj_dim", h)
    embed = V * proj + (config.max_position_embeddings + 2) * h
    if proj != h:
        embed += 2 * proj * h  # project_in and project_out
    per_layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h  # attention, FFN, two layer norms
    final_ln = (
        2 * h
        if getattr(config, "do_layer_norm_before", True) and not getattr(config, "_remove_final_layer_norm", False)
        else 0
    )
    return embed + L * per_layer + final_ln


def _count_llama_family(config) -> int:
    """Llama (optional attention/MLP biases), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms)."""
    h, i, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    q, kv = config.num_attention_heads * head_dim_of(config), kv_heads_of(config) * head_dim_of(config)
    qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if qkv_bias else 0)
    attn += h if getattr(config, "attention_bias", False) else 0  # Llama's attention_bias covers o_proj too
    mlp = 3 * h * i + ((2 * i + h) if getattr(config, "mlp_bias", False) else 0)
    norms = 2 * h + (2 * head_dim_of(config) if config.model_type == "qwen3" else 0)
    embed = V * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return embed + L * (attn + mlp + norms) + h


@dataclass(frozen=True)
class KVBudget:
    """How a GPU's memory splits between weights, a reserve for activations, and the KV cache."""

    gpu_bytes: int
    weight_bytes: int
    reserve_bytes: int
    kv_bytes: int
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return self.kv_bytes // self.bytes_per_token

    def requests_at(self, tokens_per_request: int) -> int:
        return self.tokens // tokens_per_request


def kv_budget(
    config,
    dtype_bytes: int = 2,
    gpu_bytes: int = T4_VISIBLE_BYTES,
    utilization: float = 0.9,
    activation_reserve_bytes: int = 0,
) -> KVBudget:
    """KV budget the way vLLM sizes it: ``utilization`` of the GPU, minus weights and a reserve.

    ``utilization`` = 0.9 is vLLM's default ``gpu_memory_utilization``; the rest is left for the CUDA
    context and allocator slack. ``activation_reserve_bytes`` is the peak activation memory of a
    forward pass, measured or estimated; 0 by default.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must lie in (0, 1], got {utilization}")
    weights = count_parameters(config) * dtype_bytes
    kv = int(gpu_bytes * utilization) - weights - activation_reserve_bytes
    if kv <= 0:
        raise ValueError("the weights and reserve leave no memory for the KV cache")
    return KVBudget(gpu_bytes, weights, activation_reserve_bytes, kv, kv_bytes_per_token(config, dtype_bytes))


def t4_slots_for_opt125m() -> int:
    """Token slots of KV a 15 GiB T4 leaves next to OPT-125m in fp16 (lessons 02, 03, 05, 06 use it)."""
    from transformers import OPTConfig

    return kv_budget(OPTConfig(), dtype_bytes=2).tokens


class Capacity(NamedTuple):
    """What a KV budget holds at one moment of a memory-bound steady state (lesson 07's prediction)."""

    naive_running: int  # requests the naive engine runs at once
    naive_utilization: float  # share of the whole budget holding token states, naive engine
    paged_running: int  # requests the paged engine runs at once
    paged_utilization: float  # share of the whole budget holding token states, paged engine


def predict_capacity(budget_slots: int, max_model_len: int, block_size: int, tokens_held: list[int]) -> Capacity:
    """Reference for exercise 07-2: lesson 01's reservation and lesson 03's blocks, applied to a queue.

    ``tokens_held[i]`` is what request ``i`` of the line holds (prompt and tokens generated so far), first come
    first. The naive engine reserves ``max_model_len`` slots per request; the paged engine gives each request
    whole blocks of ``block_size`` slots, and the budget holds only whole blocks. Both admit in order while the
    next request fits: one that does not fit stops the line (first come, first served). Utilization is the
    share of the whole budget holding token states. ``tokens_held`` is not changed; a request holding fewer
    than 1 or more than ``max_model_len`` tokens is a ``ValueError``.
    """
    for i, t in enumerate(tokens_held):
        if not 1 <= t <= max_model_len:
            raise ValueError(f"request {i} holds {t} tokens; a request holds 1 to max_model_len={max_model_len}")
    naive = min(len(tokens_held), budget_slots // max_model_len)
    blocks_left, paged = budget_slots // block_size, 0
    for t in tokens_held:
        need = blocks_needed(t, block_size)
        if need > blocks_left:
            break
        blocks_left -= need
        paged += 1
    return Capacity(naive, sum(tokens_held[:naive]) / budget_slots, paged, sum(tokens_held[:paged]) / budget_slots)


def predict_running(config, budget_bytes: int, dtype_bytes: int, block_size: int, tokens_held: list[int]) -> int:
    """Reference for exercise 12-2: how many requests of a first-come line run at once in a KV budget of
    ``budget_bytes``, for the model ``config`` describes. The budget holds whole blocks of ``block_size`` tokens at
    :func:`kv_bytes_per_token` each (K and V, every layer, the KV heads - not the query heads); request ``i`` holds
    ``tokens_held[i]`` tokens in whole blocks; requests are admitted in order while the next one fits, and one that
    does not fit stops the line. ``tokens_held`` is not changed."""
    blocks_left = budget_bytes // (block_size * kv_bytes_per_token(config, dtype_bytes))
    running = 0
    for held in tokens_held:
        need = -(-held // block_size)
        if need > blocks_left:
            break
        blocks_left -= need
        running += 1
    return running


# ---- lesson 10: the bytes of an int8 cache, by where its scales live ------------------------------------------

KV_LAYOUTS = ("fp16", "int8, separate scales", "int8, inline scales")
SCALE_BYTES = 4  # one float32 scale per token and head
INLINE_ALIGN = 16  # a head's bytes start on a 16-byte boundary when its scale is stored inline (vector loads)


def int8_kv_bytes_per_token(config, layout: str) -> int:
    """Bytes one token's K and V occupy across all layers, in one of :data:`KV_LAYOUTS` (exercise 10-2's reference):

    * ``"fp16"``: lesson 00's formula with 2 bytes per element;
    * ``"int8, separate scales"``: 1 byte per element, plus a float32 scale per head in a tensor of its own,
      indexed by the same slots;
    * ``"int8, inline scales"``: the scale stored at the end of each head's bytes, each head's bytes rounded up to
      a multiple of :data:`INLINE_ALIGN` so that the next head starts aligned (OPT-125m: 64 + 4 -> 80 bytes).
    """
    per_head = {
        "fp16": 2 * head_dim_of(config),
        "int8, separate scales": head_dim_of(config) + SCALE_BYTES,
        "int8, inline scales": -(-(head_dim_of(config) + SCALE_BYTES) // INLINE_ALIGN) * INLINE_ALIGN,
    }
    if layout not in per_head:
        raise ValueError(f"unknown layout {layout!r}; choose one of {KV_LAYOUTS}")
    return 2 * int(config.num_hidden_layers) * kv_heads_of(config) * per_head[layout]
