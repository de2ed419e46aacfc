"""Device discipline on a machine without a GPU: make CUDA's device rules visible on a CPU.

On a CPU every tensor lives in the same memory, so code that forgets a ``device=`` runs fine here and
crashes on a T4 ("Expected all tensors to be on the same device", or Triton's "Pointer argument cannot be
accessed from Triton (cpu tensor?)"). This module gives CI a way to see those bugs without a GPU.

In this mode (``COURSE_DEVICE_DISCIPLINE=1``, or :func:`discipline` in a test) the profile's device is
:data:`DEVICE`, ``torch.device("cpu", 0)``: still the CPU, but a name that can be told apart from plain
``"cpu"``. A ``TorchFunctionMode`` tags every tensor it sees made as **device** or **host**:

* a factory (``torch.tensor``, ``zeros``, ``arange``, ...) with ``device=`` :data:`DEVICE` (or ``"cuda"``)
  makes a device tensor; one without a device, or with ``device="cpu"``, a host tensor; ``*_like`` and
  ``new_*`` follow their input unless given a device;
* ``.to(DEVICE)`` / ``.cuda()`` make device tensors, ``.to("cpu")`` / ``.cpu()`` host ones;
* every other op passes its inputs' tag on to its outputs; ``t.device`` answers :data:`DEVICE` for a
  device tensor, so ``device=t.device`` keeps working as it does on a GPU.

and applies CUDA's rules, raising :class:`DeviceMismatch` where CUDA would raise:

* an op may not mix a device tensor with a host tensor, except a 0-dim host tensor (Python scalars and
  0-dim CPU tensors mix on CUDA too) and ``copy_`` / ``.to`` (which move data);
* a device tensor may be indexed with a host index; a host tensor may not be indexed with a device one;
  an indexed assignment with tensor indices needs its values on the tensor's device;
* ``.numpy()`` of a device tensor fails; a kernel launch (:func:`check_kernel_args`) needs device tensors.

It also counts what would make the host wait for a GPU (:attr:`DeviceDiscipline.syncs`), in both directions:

* device to host: ``.item()``, ``.tolist()``, ``int()``/``float()``/``bool()`` of a device tensor, a blocking
  copy to the host (or a non-blocking one into pageable memory), ``nonzero`` and boolean-mask indexing,
  ``repeat_interleave`` without ``output_size``, ``torch.equal``, :func:`synchronize`...;
* host to device: ``torch.tensor(values, device=...)`` (Python data goes through pageable memory), a ``.to``,
  ``.cuda()`` or ``copy_`` to the device that is not ``non_blocking`` or whose source is not pinned, an
  assignment of host values into a device tensor, and indexing a device tensor with a host index tensor or
  a list (CUDA copies the index over and waits). On CUDA each is a copy followed by a stream synchronize.

Pinned memory is a tag here (a CPU build of torch has no pinned allocator): ``pin_memory=True`` in a factory,
``.pin_memory()``, and the result of a non-blocking ``.to("cpu")`` (pinned on CUDA too) make a host tensor
that ``is_pinned()``. Tests use the count to hold the engine's step to a budget of syncs.

Tensors the mode never saw made (created before it was entered, or inside C++ without a torch call) are
untagged and mix with anything: the mode can miss a bug, but it does not invent one.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from lesson_utils.core.device_places import (  # noqa: F401 - re-exported: the mode's public names in one place
    DATA_FACTORIES,
    DEVICE,
    ENV_VAR,
    FACTORIES,
    SYNCING,
    DeviceMismatch,
    Transfer,
    _describe,
    _is_host_index,
    _name,
    _pin,
    _tag,
    _tensors,
    is_pinned,
    place,
    place_of_device,
)


class DeviceDiscipline(TorchFunctionMode):
    """The mode itself: tags tensors, enforces CUDA's mixing rules, counts syncs (module docstring)."""

    def __init__(self):
        super().__init__()
        self.sync_log: list[str] = []  # why each sync (either direction) happened, in order
        self.transfers: list[Transfer] = []
        self._paused = 0

    @contextlib.contextmanager
    def paused(self):
        """Let torch calls through untouched (a Triton interpreter launch moves tensors internally)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def syncs(self) -> int:
        return len(self.sync_log)

    def _sync(self, why: str) -> None:
        self.sync_log.append(why)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = _name(func)
        if name == "device.__get__":
            return DEVICE if place(args[0]) == "device" else func(*args, **kwargs)
        if name == "data.__set__":
            result = func(*args, **kwargs)
            _tag(args[0], place(args[1]))
            return result
        if name == "is_pinned":
            return is_pinned(args[0]) or (place(args[0]) is None and func(*args, **kwargs))
        if name in FACTORIES:
            return self._factory(name, func, args, kwargs)
        if name == "to":
            return self._to(func, args, kwargs)
        if name in ("cpu", "cuda", "pin_memory"):
            return self._move(name, func, args, kwargs)
        if name == "copy_":
            return self._copy(func, args, kwargs)
        if name == "numpy" and place(args[0]) == "device":
            raise DeviceMismatch(
                "can't convert a device tensor to numpy (as CUDA: 'can't convert cuda:0 device type tensor to "
                "numpy'); use .cpu() first"
            )
        if name == "__getitem__":
            return self._getitem(func, args, kwargs)
        if name == "__setitem__":
            return self._setitem(func, args, kwargs)
        if name in SYNCING and any(place(t) == "device" for t in _tensors((args, kwargs))):
            self._sync(name)
        if name == "repeat_interleave" and "output_size" not in kwargs:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if place(repeats) == "device":
                self._sync("repeat_interleave without output_size")
        where = self._check_mix(name, _tensors((args, kwargs)))
        result = func(*args, **kwargs)
        if where is not None:
            for t in _tensors(result):
                _tag(t, where)
        return result

    # -- the rules ------------------------------------------------------------------------------------

    def _check_mix(self, name: str, tensors: list[torch.Tensor]) -> str | None:
        device = [t for t in tensors if place(t) == "device"]
        host = [t for t in tensors if place(t) == "host"]
        big_host = [t for t in host if t.dim() > 0]
        if device and big_host:
            raise DeviceMismatch(
                f"{name}: Expected all tensors to be on the same device, but found a {_describe(big_host[0])} "
                f"and a {_describe(device[0])} (device-discipline mode: on a GPU this is 'found at least two "
                f"devices, cuda:0 and cpu'). Make the host tensor on the device (device=...)."
            )
        if device:
            return "device"
        return "host" if host else None

    def _factory(self, name, func, args, kwargs):
        if "device" in kwargs:
            where = place_of_device(kwargs["device"])
        elif name.endswith("_like") or name.startswith("new_"):
            where = place(args[0])
        elif name in ("as_tensor", "asarray", "tensor") and args and isinstance(args[0], torch.Tensor):
            where = place(args[0])
        else:
            where = "host"
        pinned = bool(kwargs.get("pin_memory", False))
        if pinned:  # a CPU build has no pinned allocator: the mode keeps a tag instead
            kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        if name in DATA_FACTORIES and where == "device":
            data = args[1] if name == "new_tensor" else (args[0] if args else kwargs.get("data"))
            if place(data) != "device":
                self._sync(f"torch.{name}(..., device=) copies host data to the device from pageable memory")
        result = func(*args, **kwargs)
        _tag(result, where)
        if pinned and where == "host":
            _pin(result)
        return result

    def _target_of_to(self, args, kwargs) -> str | None:
        target = kwargs.get("device")
        other = kwargs.get("other")
        for a in args[1:]:
            if isinstance(a, torch.Tensor):
                other = a
            elif isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                target = a
        if other is not None:
            return place(other)
        if target is not None:
            return place_of_device(target)
        return place(args[0])

    def _record_move(self, src: torch.Tensor, where: str | None, non_blocking: bool, dst=None) -> None:
        """A copy between host and device; ``dst`` is the host tensor a ``copy_`` writes into (a ``.to`` makes
        its own, pinned when non-blocking)."""
        if place(src) == "device" and where == "host":
            self.transfers.append(Transfer("to host", src.numel() * src.element_size(), non_blocking))
            if not non_blocking:
                self._sync("blocking copy to the host")
            elif dst is not None and not is_pinned(dst):
                self._sync("copy to the host into pageable memory (CUDA waits for it)")
        elif place(src) == "host" and where == "device":
            self.transfers.append(Transfer("to device", src.numel() * src.element_size(), non_blocking))
            if not non_blocking:
                self._sync("blocking copy to the device (not non_blocking)")
            elif not is_pinned(src):
                self._sync("copy to the device from pageable memory (pin the host tensor)")

    def _moved(self, src, result, where):
        if result is src and where != place(src):  # CUDA would have copied: keep the original's tag apart
            with self.paused():
                result = src.clone()
        _tag(result, where)
        return result

    def _to(self, func, args, kwargs):
        src = args[0]
        where = self._target_of_to(args, kwargs)
        non_blocking = bool(kwargs.get("non_blocking", False))
        self._record_move(src, where, non_blocking)
        result = self._moved(src, func(*args, **kwargs), where)
        if non_blocking and place(src) == "device" and where == "host":
            _pin(result)  # CUDA makes a non-blocking copy to the host into pinned memory
        return result

    def _move(self, name, func, args, kwargs):
        src = args[0]
        where = "device" if name == "cuda" else "host"
        if name in ("cuda", "pin_memory"):  # no CUDA here: the device stand-in is the CPU, pinning a tag
            with self.paused():
                result = src.to(DEVICE) if name == "cuda" else src.clone()
        else:
            result = func(*args, **kwargs)
        self._record_move(src, where, bool(kwargs.get("non_blocking", False)))
        result = self._moved(src, result, where)
        if name == "pin_memory":
            _pin(result)
        return result

    def _copy(self, func, args, kwargs):
        dst, src = args[0], args[1]
        if isinstance(src, torch.Tensor):
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            self._record_move(src, place(dst), non_blocking, dst=dst)
        return func(*args, **kwargs)

    def _getitem(self, func, args, kwargs):
        src, index = args[0], args[1]
        idx = _tensors(index)
        if place(src) == "host" and any(place(t) == "device" for t in idx):
            raise DeviceMismatch(
                f"indexing a {_describe(src)} with a device index: on a GPU this fails ('indices should be either "
                "on cpu or on the same device as the indexed tensor'). Keep the indexed tensor on the device."
            )
        if place(src) == "device" and any(t.dtype == torch.bool and place(t) == "device" for t in idx):
            self._sync("boolean-mask indexing")
        if place(src) == "device" and _is_host_index(index):
            self._sync("a host index into a device tensor (CUDA copies it over and waits)")
        result = func(*args, **kwargs)
        _tag(result, place(src) or next((place(t) for t in idx if place(t)), None))
        return result

    def _setitem(self, func, args, kwargs):
        dst, index, value = args[0], args[1], args[2]
        idx = _tensors(index)
        advanced = bool(idx)
        if place(dst) == "host" and any(place(t) == "device" for t in idx):
            raise DeviceMismatch(
                f"assigning into a {_describe(dst)} at a device index: on a GPU this fails. Make the indexed "
                "tensor on the device (device=...)."
            )
        if (
            isinstance(value, torch.Tensor)
            and value.dim() > 0
            and place(value)
            and place(dst)
            and place(value) != place(dst)
        ):
            if advanced:
                raise DeviceMismatch(
                    f"assigning a {_describe(value)} into a {_describe(dst)} through tensor indices: on a GPU the "
                    "values must be on the indexed tensor's device."
                )
            self._record_move(value, place(dst), False)
        if place(dst) == "device" and any(t.dtype == torch.bool and place(t) == "device" for t in idx):
            self._sync("boolean-mask assignment")
        if place(dst) == "device" and _is_host_index(index):
            self._sync("a host index into a device tensor (CUDA copies it over and waits)")
        return func(*args, **kwargs)


# -- the one mode of this process ---------------------------------------------------------------------

_active: DeviceDiscipline | None = None


def requested() -> bool:
    """True when the environment asks for the mode (``COURSE_DEVICE_DISCIPLINE=1``)."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")


def active() -> DeviceDiscipline | None:
    """The mode in force in this process, or None."""
    return _active


def acts_as_gpu(device) -> bool:
    """True for a CUDA device, and for :data:`DEVICE` while the mode is on: code that picks its GPU path by the
    device (batched decode attention, say) takes that path in CI too, where the mode can check it."""
    d = torch.device(device)
    return d.type == "cuda" or (_active is not None and d == DEVICE)


def enable() -> DeviceDiscipline:
    """Enter the mode for the rest of the process (a notebook kernel run by CI). Idempotent."""
    global _active
    if _active is None:
        _active = DeviceDiscipline()
        _active.__enter__()
    return _active


@contextlib.contextmanager
def discipline():
    """The mode for a ``with`` block (tests): yields it, and its sync counter and transfers."""
    global _active
    if _active is not None:  # already on for the whole process: share it
        yield _active
        return
    mode = DeviceDiscipline()
    _active = mode
    try:
        with mode:
            yield mode
    finally:
        _active = None


def synchronize(device, why: str) -> None:
    """Wait for ``device``'s stream (CUDA); in the mode, count it as a sync. The one way the course's code
    waits for the GPU on purpose (a swap-out's staging buffer must land before the host reads it)."""
    d = torch.device(device)
    if d.type == "cuda":
        torch.cuda.current_stream(d).synchronize()
    elif _active is not None and d == DEVICE:
        _active._sync(f"synchronize: {why}")


@dataclass
class SyncCount:
    """What :func:`count_syncs` saw: how many syncs, and why each happened."""

    n: int = 0
    why: list[str] = field(default_factory=list)


@contextlib.contextmanager
def count_syncs():
    """Counts the syncs of a block, both directions (0 outside the mode): ``with count_syncs() as c: ...; c.n``."""
    mode = _active
    count = SyncCount()
    start = mode.syncs if mode else 0
    try:
        yield count
    finally:
        if mode:
            count.why = mode.sync_log[start:]
            count.n = len(count.why)


@contextlib.contextmanager
def kernel_launch():
    """Around a Triton launch: the interpreter moves tensors itself, which is not the caller's doing."""
    if _active is None:
        yield
    else:
        with _active.paused():
            yield


def check_kernel_args(kernel: str, **tensors: torch.Tensor) -> None:
    """A kernel reads its pointer arguments on the GPU: each must be a device tensor.

    On a real GPU a CPU tensor makes Triton fail with "Pointer argument cannot be accessed from Triton (cpu
    tensor?)"; this says which argument, on the GPU and in the device-discipline mode alike.
    """
    devices = {name: t.device for name, t in tensors.items()}
    if any(d.type == "cuda" for d in devices.values()):
        on_host = [n for n, d in devices.items() if d.type != "cuda"]
    else:
        on_host = [n for n, t in tensors.items() if place(t) == "host"] if _active is not None else []
    if on_host:
        raise ValueError(
            f"{kernel}: {', '.join(on_host)} {'is a host tensor' if len(on_host) == 1 else 'are host tensors'}; a "
            "Triton kernel reads its arguments on the GPU (Triton would say 'Pointer argument cannot be accessed "
            "from Triton (cpu tensor?)'). Make them on the device of the cache (device=k_cache.device)."
        )
