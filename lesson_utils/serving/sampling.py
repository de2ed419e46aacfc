"""Choosing a sequence's next token from its logits: greedy (argmax) or sampled with its own generator.

Model-free: torch on a logits tensor. The scheduler's ``update_from_output`` calls :func:`next_tokens` once a step,
for every row the plan says samples and every new parallel sample (its parent's row) - the only caller, lesson
09's prefill side included (it runs the same step).
"""

from __future__ import annotations

import torch

from lesson_utils.core.host_copy import to_device
from lesson_utils.core.types import Sequence


def next_tokens(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Every sequence's next token with at most two device-to-host syncs for the whole step: one for the
    greedy rows' argmax, one for the sampled rows' probabilities (each sampled on the host with its own
    generator, so a seed gives the same tokens on any device). The first read also carries whether each row is
    finite, so a NaN that reached the logits (a corrupted cache, say) is refused, naming the sequence, at no
    extra sync."""
    tokens, finite = torch.stack([logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1).long()]).tolist()
    bad = [seqs[i].seq_id for i, ok in enumerate(finite) if not ok]
    if bad:
        raise ValueError(
            f"the logits of sequence(s) {bad} hold NaN or inf: the model's activations or its KV cache are corrupted "
            "(an int8 cache on a GPU does not check its writes unless check_finite=True, which names the layer and slot)"
        )
    sampled = [i for i, s in enumerate(seqs) if s.temperature > 0]
    if sampled:
        temps = to_device([seqs[i].temperature for i in sampled], torch.float32, logits.device)[:, None]
        rows = to_device(sampled, torch.long, logits.device)
        probs = torch.softmax(logits[rows].float() / temps, dim=-1).cpu()
        for i, p in zip(sampled, probs):
            tokens[i] = int(torch.multinomial(p, 1, generator=seqs[i].generator))
    return tokens
