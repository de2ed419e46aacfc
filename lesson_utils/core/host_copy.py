"""Step metadata to the device without making the host wait for it.

A step's metadata (token ids, positions, slot mapping, block tables, context lengths) is built on the host
from Python lists. On CUDA, ``torch.tensor(values, device="cuda")`` or a ``.to("cuda")`` from ordinary
(pageable) memory is a copy followed by a wait: the host stops until every kernel queued before it has run, so
the step can no longer prepare its next launches while the GPU works. The way round it, as vLLM's input batch
does: make the host tensor in page-locked (pinned) memory and copy it with ``non_blocking=True``; the copy is
queued on the stream like a kernel, and PyTorch keeps the pinned buffer alive until the copy has read it.

Invariant kept by every function here: on a GPU (or the device-discipline mode's stand-in for one) the
result is a device tensor made by one pinned, non-blocking copy, which the mode does not count as a sync; on a
plain CPU device it is the host tensor itself (nothing to copy).
"""

from __future__ import annotations

import torch

from lesson_utils.core.device_discipline import acts_as_gpu


def wants_pinned(device) -> bool:
    """True when a host tensor bound for ``device`` should live in pinned memory: a CUDA device, or the
    device-discipline mode's stand-in (where "pinned" is a tag the mode keeps, a CPU build having no pinned
    memory)."""
    return acts_as_gpu(device)


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of ``values`` (a list, nested lists or a scalar) on ``device``, the host never waiting."""
    if not wants_pinned(device):
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def move(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor (computed on the host, say a padded index) on ``device``, the host never waiting."""
    if not wants_pinned(device):
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
