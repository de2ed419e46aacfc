"""Rotary position embeddings (RoPE) as Llama, Qwen2 and Qwen3 use them in Hugging Face ``transformers``.

A key is *rotated by its position before it is written to the cache*: pairs of its channels turn by an angle
``position * inv_freq[i]``. The dot product of a rotated query at position ``m`` and a rotated key at position
``n`` depends only on ``m - n``, so a cached key never needs touching again - but it is only right at the
position it was written for (a cached prefix is reusable at the same positions only).

Convention: "rotate half". Channel ``i`` pairs with channel ``i + head_dim / 2`` (not with ``i + 1``, the
interleaved convention of the original paper and of Meta's reference code, whose checkpoints HF permutes when
it converts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_parameters(config) -> dict:
    """The config's RoPE settings as one dict with ``rope_type`` and ``rope_theta``, whichever way this
    ``transformers`` version stores them (``rope_parameters`` from 5.0; ``rope_theta`` + ``rope_scaling`` before)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
    else:
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def check_rope(config) -> None:
    """Refuse a RoPE this module does not implement, naming the field and its value."""
    params = rope_parameters(config)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {params['rope_type']!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported (only 1.0)")


def inverse_frequencies(config, head_dim: int) -> torch.Tensor:
    """``inv_freq[i] = theta ** (-2i / head_dim)`` for ``i < head_dim / 2`` (fp32), with Llama 3's scaling
    where the config asks for it: wavelengths longer than ``original_max_position_embeddings / low_freq_factor``
    are stretched by ``factor``, shorter than ``.../ high_freq_factor`` kept, and the band between blended."""
    check_rope(config)
    params = rope_parameters(config)
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if params["rope_type"] == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last axis: the 90-degree turn of each pair ``(i, i + d/2)``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class Rope:
    """A model's rotary embedding: ``inv_freq`` ``[head_dim / 2]`` fp32, on the model's device."""

    inv_freq: torch.Tensor

    @classmethod
    def for_config(cls, config, head_dim: int, device) -> "Rope":
        return cls(inverse_frequencies(config, head_dim).to(device))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[num_tokens, head_dim]`` for these positions, computed in fp32 and then cast (as HF)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by its tokens' angles (``cos``/``sin`` ``[num_tokens, head_dim]``)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rotate_at(x: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` rotated as a token at ``position``: the angles ``position * inv_freq`` in fp32,
    their cos and sin cast to ``x``'s dtype, then ``x * cos + rotate_half(x) * sin``. A new tensor; ``x`` is not
    changed. Reference for lesson 12's exercise 1 (what ``apply_rope`` does to every token of a step)."""
    freqs = position * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1).to(x.device)
    return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)
