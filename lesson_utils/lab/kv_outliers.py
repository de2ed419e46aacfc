"""Lesson 10: keys with outlier channels, and where a quantizer's scale should run.

KIVI (Liu et al., ICML 2024, arXiv 2402.02750) reports that in Llama, Falcon and Mistral the key cache has a few
fixed channels whose magnitudes stay large for every token, while values show no such structure; it quantizes keys
per channel and values per token. A random-weight model has no such channels, so offline lesson 10 measures the
choice on a **synthetic** key set built to that description (:func:`synthetic_outlier_keys`); with a pretrained
model it measures the model's own keys.

Keys here are ``[tokens, heads, head_dim]``. "Per token" is lesson 10's rule (one scale per token and head, the
maximum over ``head_dim``); "per channel" is one scale per head and channel, the maximum over the tokens.
"""

from __future__ import annotations

import torch

SCALE_AXES = {"per token": -1, "per channel": 0}


def fake_quantize(x: torch.Tensor, along: str, bits: int) -> torch.Tensor:
    """``x`` quantized symmetrically to ``bits`` bits (levels -qmax..qmax, qmax = 2**(bits-1) - 1) with one scale
    per token and head (``along="per token"``) or per head and channel (``"per channel"``), then dequantized."""
    if along not in SCALE_AXES:
        raise ValueError(f"along must be one of {sorted(SCALE_AXES)}, got {along!r}")
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be between 2 and 8, got {bits}")
    qmax = 2 ** (bits - 1) - 1
    xf = x.float()
    scale = xf.abs().amax(dim=SCALE_AXES[along], keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(xf / safe).clamp(-qmax, qmax) * scale


def relative_error(x: torch.Tensor, along: str, bits: int) -> float:
    """``||dequantized - x|| / ||x||`` over the whole tensor (Frobenius norms)."""
    xf = x.float()
    return float((fake_quantize(xf, along, bits) - xf).norm() / xf.norm().clamp_min(1e-30))


def channel_outlier_ratio(x: torch.Tensor) -> float:
    """How much the largest channel stands out: per head, the largest channel's mean |x| over the tokens divided by
    the median channel's, averaged over heads (about 1-2 for Gaussian noise; the outlier gain for KIVI-like keys)."""
    per_channel = x.float().abs().mean(dim=0)  # [heads, head_dim]
    return float((per_channel.amax(dim=-1) / per_channel.median(dim=-1).values.clamp_min(1e-30)).mean())


def synthetic_outlier_keys(
    n_tokens: int, heads: int, head_dim: int, *, outlier_channels: int = 4, gain: float = 20.0, seed: int = 0
) -> torch.Tensor:
    """SYNTHETIC keys ``[n_tokens, heads, head_dim]`` with KIVI's structure: standard normal values, and in each
    head ``outlier_channels`` fixed channels whose magnitude stays about ``gain`` for every token (a per-channel
    sign and offset, plus the same unit noise). Not any model's keys: a stand-in to show the effect offline."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_tokens, heads, head_dim, generator=g)
    for h in range(heads):
        channels = torch.randperm(head_dim, generator=g)[:outlier_channels]
        signs = torch.randint(0, 2, (outlier_channels,), generator=g).float() * 2 - 1
        keys[:, h, channels] += gain * signs
    return keys


def scale_study(x: torch.Tensor, bits: tuple[int, ...] = (8, 4)) -> dict[tuple[int, str], float]:
    """Relative error of ``x`` quantized per token and per channel at each width: ``{(bits, along): error}``."""
    return {(b, along): relative_error(x, along, b) for b in bits for along in SCALE_AXES}
