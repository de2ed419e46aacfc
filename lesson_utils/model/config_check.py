"""Checking a Hugging Face config before anything is built from it.

Every refusal names the config field and its value, and happens before any cache memory is allocated
(``weights_from_hf`` and ``load_model`` call :func:`check_config` first).
"""

from __future__ import annotations

from typing import NamedTuple

from lesson_utils.model.families import FAMILIES, attention_variants_refused, family
from lesson_utils.model.rope import check_rope

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)  # (the registry's: lesson_utils.model.families)
# The course's kernels keep a [tile, head_dim] K and V tile per program: above 256 a tile of 16 tokens in fp16
# no longer fits a T4's 64 KiB of shared memory beside its scores (the compile report, lesson 04).
MAX_HEAD_DIM = 256


class Geometry(NamedTuple):
    """What a KV cache needs to know of a model's attention: query heads, KV heads, channels per head."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def check_config(cfg) -> Geometry:
    """The attention geometry of a supported config, or a ValueError naming the offending field and value."""
    fam = family(getattr(cfg, "model_type", None))
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}: "
            "grouped-query attention needs every KV head to serve the same number of query heads"
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    refused = attention_variants_refused(cfg, fam)
    if refused:
        raise ValueError(refused)
    if fam.forward == "opt":
        if cfg.hidden_size % heads:
            raise ValueError(f"hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads={heads}")
        if cfg.activation_function != "relu":
            raise ValueError(f"activation_function {cfg.activation_function!r} is not supported (OPT's is 'relu')")
        return Geometry(heads, kv_heads, head_dim)
    if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim={head_dim} is not supported: RoPE rotates channel pairs (an even head_dim) and the "
            f"kernels take at most {MAX_HEAD_DIM}"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (the SwiGLU MLP here uses 'silu')")
    check_rope(cfg)
    return Geometry(heads, kv_heads, head_dim)
