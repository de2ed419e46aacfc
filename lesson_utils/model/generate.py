"""Greedy decoding of several prompts at once through any cache: the course's smallest engine (lessons 01-04).

Works for every model ``weights_from_hf`` returns (OPT, Llama, Qwen2, Qwen3): it calls only the step ``forward``.
"""

from __future__ import annotations

from lesson_utils.cache.seam import KVCache, StepBatch
from lesson_utils.model.weights import ModelWeights, forward


def generate_greedy(
    w: ModelWeights,
    cache: KVCache,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    stop_at_eos: bool = True,
    seq_ids: list[int] | None = None,
) -> list[list[int]]:
    """Greedy decoding of several prompts at once; returns each prompt's generated ids (not the prompt).

    Step 1 prefills every prompt in one ``StepBatch``; each later step feeds one token per unfinished
    sequence. A sequence finishes after ``max_new_tokens`` tokens or, with ``stop_at_eos``, right after
    emitting eos (which is kept in its output, as HF ``generate`` does), and is then freed from
    ``cache``. ``seq_ids`` name the sequences in the cache (default ``0 .. len(prompts) - 1``).
    """
    seq_ids = list(range(len(prompts))) if seq_ids is None else list(seq_ids)
    _check_generation(w, prompts, max_new_tokens, seq_ids)
    device = w.lm_head.device
    out: list[list[int]] = [[] for _ in prompts]

    batch = StepBatch.build(seq_ids, prompts, [0] * len(prompts), device=device)
    active = list(range(len(prompts)))  # indices of the prompts still generating
    while True:
        next_tokens = forward(w, batch, cache).argmax(dim=-1).tolist()
        still = []
        for i, token in zip(active, next_tokens):
            out[i].append(token)
            if len(out[i]) == max_new_tokens or (stop_at_eos and token == w.eos_token_id):
                cache.free(seq_ids[i])
            else:
                still.append(i)
        active = still
        if not active:
            return out
        batch = StepBatch.build(
            [seq_ids[i] for i in active],
            [[out[i][-1]] for i in active],
            [len(prompts[i]) + len(out[i]) - 1 for i in active],  # the newest token is not cached yet
            device=device,
        )


def _check_generation(w: ModelWeights, prompts, max_new_tokens: int, seq_ids: list[int]) -> None:
    if not prompts:
        raise ValueError("no prompts to generate from")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if len(seq_ids) != len(prompts) or len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"need {len(prompts)} distinct seq_ids, one per prompt; got {seq_ids}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (OPT's is bos)")
        if len(prompt) + max_new_tokens > w.max_positions:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it would need "
                f"{len(prompt) + max_new_tokens} positions, but the model has {w.max_positions}"
            )
