"""Shared by the sharing tests: sequences over a tiny alphabet, chained hashes, a computed prefill."""

from __future__ import annotations

from lesson_utils.core.types import Request, Sequence
from lesson_utils.memory.block_pool import NO_PARENT, block_hash
from lesson_utils.memory.sharing import SharingBlockManager

ALPHABET = (0, 1, 2)  # few distinct tokens: prompts share prefixes, so the prefix cache really hits


def make_seq(seq_id: int, prompt: list[int], output_len: int = 10**6) -> Sequence:
    return Sequence(Request(seq_id, 0.0, len(prompt), output_len, prompt_ids=list(prompt)))


def chain_hash(prefix, block_size: int):
    """The hash of the last full block of ``prefix``: ``block_hash`` chained from the first block."""
    h = NO_PARENT
    for i in range(len(prefix) // block_size):
        h = block_hash(h, prefix[i * block_size : (i + 1) * block_size])
    return h


def compute(m: SharingBlockManager, seq: Sequence) -> None:
    """Admit ``seq`` and compute its whole prompt (no token sampled), registering its full blocks."""
    m.allocate(seq)
    seq.num_computed = seq.len
    m.cache_computed(seq)
