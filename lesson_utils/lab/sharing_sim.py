"""Lesson 05: how much memory sharing saves, by exact block accounting (the paper's §6.3 and Fig. 15).

Saving is the paper's definition: blocks saved by sharing / blocks needed without sharing, here summed over
every decode step of every request (a time average). Each request runs alone through a
:class:`~lesson_utils.memory.sharing.SharingBlockManager` - the same fork and copy-on-write code the engine uses:

* **parallel sampling**: the prompt is prefilled once, then ``n - 1`` siblings fork from it; every sample
  generates the request's output length (our assumption: the paper's samples have their own lengths);
* **beam search**: each step, ``width`` new beams each pick a parent among the current beams, uniformly at
  random (our assumption: real beams follow the model's scores); a parent picked twice is forked, a parent
  never picked is freed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from lesson_utils.core.types import Request, Sequence
from lesson_utils.memory.block_table import blocks_needed
from lesson_utils.memory.sharing import SharingBlockManager


def _manager(r: Request, width: int, block_size: int) -> SharingBlockManager:
    need = width * (blocks_needed(r.prompt_len + r.output_len, block_size) + 1) + 1
    return SharingBlockManager(need, block_size, enable_prefix_caching=False, watermark=0.0)


def parallel_sampling_saving(requests: list[Request], n: int, block_size: int = 16) -> float:
    logical = physical = 0
    for r in requests:
        mgr = _manager(r, n, block_size)
        root = Sequence(r)
        mgr.allocate(root)
        mgr.append_slot(root)
        root.num_generated = 1
        seqs = [root]
        for i in range(1, n):
            child = Sequence(replace(r, req_id=r.req_id * 1000 + i), num_generated=1)
            mgr.fork(root.seq_id, child.seq_id)
            seqs.append(child)
        for _ in range(r.output_len):
            lg, ph = mgr.view.sharing()
            logical, physical = logical + lg, physical + ph
            if seqs[0].num_generated >= r.output_len:
                break
            for s in seqs:
                mgr.append_slot(s)
                s.num_generated += 1
    return 1.0 - physical / logical


def beam_search_saving(requests: list[Request], width: int, block_size: int = 16, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    logical = physical = 0
    next_id = 10**9
    for r in requests:
        mgr = _manager(r, width, block_size)
        root = Sequence(r)
        mgr.allocate(root)
        beams = [root]
        for _ in range(r.output_len):
            for b in beams:
                mgr.append_slot(b)
            parents = sorted(rng.integers(0, len(beams), width).tolist())
            used, new = set(), []
            for p in parents:  # forks first: a fork copies its parent before it grows
                parent = beams[p]
                if p in used:
                    child = Sequence(replace(r, req_id=next_id), num_generated=parent.num_generated)
                    next_id += 1
                    mgr.fork(parent.seq_id, child.seq_id)
                    new.append(child)
                else:
                    used.add(p)
                    new.append(parent)
            for i, b in enumerate(beams):
                if i not in used:
                    mgr.free(b.seq_id)
            for b in new:
                b.num_generated += 1
            beams = new
            lg, ph = mgr.view.sharing()
            logical, physical = logical + lg, physical + ph
    return 1.0 - physical / logical
