"""Where a tensor lives in the device-discipline mode (:mod:`lesson_utils.core.device_discipline`): the stand-in
device, the tags the mode puts on tensors (device or host, pinned or not), which torch functions make tensors or
wait for the GPU, and the error CUDA would raise. Read by the mode (which also answers whether a device acts as a GPU: ``acts_as_gpu``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten

DEVICE = torch.device("cpu", 0)  # stands for the GPU in this mode


ENV_VAR = "COURSE_DEVICE_DISCIPLINE"


_TAG = "_course_place"  # attribute on a tensor: "device" or "host"


_PINNED = "_course_pinned"  # attribute on a host tensor: in page-locked memory (a tag: a CPU build has none)


FACTORIES = {
    "tensor",
    "as_tensor",
    "asarray",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "range",
    "linspace",
    "logspace",
    "rand",
    "randn",
    "randint",
    "randperm",
    "eye",
    "empty_strided",
    "from_numpy",
    "frombuffer",
    "tril_indices",
    "triu_indices",
    "scalar_tensor",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "new_tensor",
}


# Factories that copy their data argument: onto a device, from pageable memory, then a wait
DATA_FACTORIES = {"tensor", "as_tensor", "asarray", "new_tensor"}


# Reading a device tensor's value on the host: on CUDA each one waits for the GPU to finish.
SYNCING = {
    "item",
    "tolist",
    "__int__",
    "__float__",
    "__bool__",
    "__index__",
    "__complex__",
    "__repr__",
    "__str__",
    "__format__",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "equal",
    "allclose",
    "__array__",
}


class DeviceMismatch(RuntimeError):
    """What CUDA would have raised: a host tensor met a device tensor (see the module docstring)."""


@dataclass
class Transfer:
    """One copy between host and device memory."""

    direction: str  # "to host" or "to device"
    nbytes: int
    non_blocking: bool


def place(t) -> str | None:
    """``"device"``, ``"host"``, or None for a tensor the mode never saw made (and for non-tensors)."""
    return getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None


def _tag(t, where: str | None) -> None:
    if where is not None and isinstance(t, torch.Tensor):
        try:
            setattr(t, _TAG, where)
        except (AttributeError, RuntimeError):  # pragma: no cover - a tensor type without a __dict__
            pass


def is_pinned(t) -> bool:
    """A host tensor in pinned memory: really (CUDA), or tagged so by the mode."""
    return isinstance(t, torch.Tensor) and bool(getattr(t, _PINNED, False))


def _pin(t) -> None:
    if isinstance(t, torch.Tensor):
        try:
            setattr(t, _PINNED, True)
        except (AttributeError, RuntimeError):  # pragma: no cover
            pass


def _is_host_index(index) -> bool:
    """An index whose tensors (or lists) CUDA must first copy to the device: a host tensor that is not 0-dim, or
    a Python list (advanced indexing)."""
    parts = index if isinstance(index, tuple) else (index,)
    for p in parts:
        if isinstance(p, list):
            return True
        if isinstance(p, torch.Tensor) and place(p) == "host" and p.dim() > 0:
            return True
    return False


def place_of_device(device) -> str | None:
    """Where tensors made with ``device=device`` live in this mode."""
    if device is None:
        return "host"
    if isinstance(device, int):
        return "device"  # a bare index means a CUDA device
    d = torch.device(device)
    if d.type == "cuda" or d == DEVICE:
        return "device"
    if d.type == "cpu":
        return "host"
    return None  # meta and friends: not our business


def _describe(t: torch.Tensor) -> str:
    return f"{place(t)} tensor of shape {tuple(t.shape)}"


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in ``value`` (nested tuples, lists and dicts, as torch's pytree flattens them)."""
    found: list[torch.Tensor] = []
    _collect(value, found)
    return found


def _collect(x, found: list) -> None:
    # the mode runs on every torch call: plain containers are walked here, anything else pytree knows goes to it
    # (an order of magnitude faster than tree_flatten on the engine's calls, same tensors found)
    if isinstance(x, torch.Tensor):
        found.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _collect(y, found)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, found)
    elif type(x) in SUPPORTED_NODES:
        found.extend(y for y in tree_flatten(x)[0] if isinstance(y, torch.Tensor))


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property of Tensor: Tensor.device.__get__, Tensor.data.__set__
        return f"{getattr(getattr(func, '__self__', None), '__name__', '?')}.{name}"
    return name
