"""Where the course is running, and the profile that sizes every experiment.

Three profiles, chosen once per process:

* ``gpu`` - a CUDA device (a Colab T4, say): real OPT-125m sizes, fp16, compiled Triton kernels.
* ``cpu`` - a CPU runtime or a laptop: OPT-125m geometry, fp32, Triton in interpreter mode.
* ``ci``  - the smallest sizes, fp32, a tiny random OPT, so the whole course executes in minutes.

The profile comes from the ``COURSE_PROFILE`` environment variable (``gpu`` / ``cpu`` / ``ci``); left
unset it is ``gpu`` when CUDA is available, ``ci`` when the ``CI`` variable is set, else ``cpu``.

:func:`configure_triton` sets ``TRITON_INTERPRET=1`` unless the profile is ``gpu`` (a ``cpu`` or ``ci`` run on a
GPU machine has CPU tensors, which compiled kernels cannot read). Triton reads that variable when a kernel is
*defined*, so :func:`setup` (every notebook's first cell) and importing :mod:`lesson_utils.kernels` call it;
importing this module changes no environment variable.

With ``COURSE_DEVICE_DISCIPLINE=1`` (CI) the profile's device is ``cpu:0`` and importing this module turns on
:mod:`lesson_utils.core.device_discipline`, which makes a CPU run fail where a GPU run would (tensors made on the
wrong device) and counts device-to-host syncs.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lesson_utils.core import device_discipline

PROFILES = ("gpu", "cpu", "ci")

# Versions the course is tested with (inclusive lower bound, exclusive upper bound on the major.minor).
# Outside this range the course warns; it never reinstalls anything.
TESTED_RANGES = {
    "python": ((3, 10), (3, 14)),
    "torch": ((2, 4), (2, 15)),
    "triton": ((3, 0), (3, 10)),
    "transformers": ((4, 45), (5, 30)),
}


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is required by every lesson
        return False
    return torch.cuda.is_available()


def in_colab() -> bool:
    """True inside a Google Colab runtime."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def _choose_profile() -> str:
    requested = os.environ.get("COURSE_PROFILE", "").strip().lower()
    if requested:
        if requested not in PROFILES:
            raise ValueError(f"COURSE_PROFILE={requested!r} is not a profile; choose one of {', '.join(PROFILES)}")
        if requested == "gpu" and not _cuda_available():
            raise RuntimeError("COURSE_PROFILE=gpu was requested but torch sees no CUDA device")
        return requested
    if _cuda_available():
        return "gpu"
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        return "ci"
    return "cpu"


def interpreter_wanted(profile_name: str) -> bool:
    """Triton runs interpreted in every profile but ``gpu``: only there are the tensors on a CUDA device."""
    return profile_name != "gpu"


def configure_triton() -> None:
    """Set ``TRITON_INTERPRET=1`` for every profile but ``gpu``, unless the variable is set already (an explicit
    ``0`` is kept: :mod:`lesson_utils.kernels.aot` compiles that way). Triton reads it when a kernel is
    *defined*, so this runs before any is: in :func:`setup` (every notebook's first cell, before a learner's
    kernel) and when :mod:`lesson_utils.kernels` is imported (before the course's)."""
    try:
        name = _choose_profile()
    except (ValueError, RuntimeError):  # a bad COURSE_PROFILE: get_profile() raises it where it is asked for
        return
    if interpreter_wanted(name):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_interpreted() -> bool:
    """Whether this process's Triton kernels run in the interpreter (what :func:`configure_triton` sets)."""
    value = os.environ.get("TRITON_INTERPRET")
    if value is not None:
        return value == "1"
    try:
        return interpreter_wanted(_choose_profile())
    except (ValueError, RuntimeError):
        return False


if device_discipline.requested():
    device_discipline.enable()


@dataclass(frozen=True)
class Profile:
    """The device and sizes one run of the course uses."""

    name: str  # "gpu", "cpu" or "ci"
    device: str  # "cuda", "cpu", or "cpu:0" in the device-discipline mode (a CPU that stands for the GPU)
    device_name: str  # e.g. "Tesla T4" or "CPU (x86_64, 2 cores)"

    @property
    def dtype(self):
        """fp16 on a GPU (a T4 has no bf16), fp32 on a CPU."""
        import torch

        return torch.float16 if self.device == "cuda" else torch.float32

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def pick(self, *, gpu: Any, cpu: Any, ci: Any) -> Any:
        """Choose a size by profile: ``n = P.pick(gpu=4096, cpu=512, ci=64)``."""
        return {"gpu": gpu, "cpu": cpu, "ci": ci}[self.name]

    def label(self) -> str:
        """Short text for plot titles and printed measurements: says what ran it."""
        return f"{self.device_name}, {self.name} profile"


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


@lru_cache(maxsize=1)
def get_profile() -> Profile:
    """The profile of this process (computed once)."""
    name = _choose_profile()
    device = "cuda" if name == "gpu" else "cpu"
    device_name = _device_name(device)
    if name != "gpu" and device_discipline.requested():
        device, device_name = str(device_discipline.DEVICE), device_name + " [device discipline]"
    return Profile(name=name, device=device, device_name=device_name)


def supports_bf16() -> bool:
    """Native bf16 only from compute capability 8.0. (A T4 reports bf16 'supported' through emulation.)"""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def _version_tuple(text: str) -> tuple[int, int]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def versions() -> dict[str, str]:
    """Versions of what the course depends on; 'missing' where a package is not installed."""
    found = {"python": platform.python_version()}
    for module in ("torch", "triton", "transformers", "numpy", "ipywidgets"):
        try:
            found[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - a broken install is reported, not raised
            found[module] = "missing"
    return found


def version_warnings(found: dict[str, str] | None = None) -> list[str]:
    """One line per package outside the tested range (or missing), and one per known clash between versions. Without
    ``found``, this process's versions and Triton mode; a ``found`` dict may say ``"interpreted": True``."""
    interpreted = triton_interpreted() if found is None else bool(found.get("interpreted", False))
    found = versions() if found is None else found
    problems = []
    for name, (low, high) in TESTED_RANGES.items():
        text = found.get(name, "missing")
        if text == "missing":
            problems.append(f"{name} is not installed")
            continue
        got = _version_tuple(text)
        if not (low <= got < high):
            problems.append(f"{name} {text} is outside the tested range {low[0]}.{low[1]} to below {high[0]}.{high[1]}")
    if interpreted and _known_interpreter_clash(found.get("triton", "missing"), found.get("numpy", "missing")):
        problems.append(
            f"triton {found['triton']}'s interpreter with numpy {found['numpy']}: Triton 3.6's interpreter (checked) turns a "
            "loop bound loaded in a kernel into an int in a way numpy 2.4 refuses, so every kernel that loops over a "
            "context length stops with 'only 0-dimensional arrays can be converted'; Triton 3.9 does not. Install "
            "numpy below 2.4 ('pip install \"numpy<2.4\"', then restart the runtime)"
        )
    return problems


def _known_interpreter_clash(triton_version: str, numpy_version: str) -> bool:
    """Triton's interpreter before 3.9 (3.6 checked) with numpy 2.4 or newer: kernels with a loop over a loaded bound
    fail."""
    if "missing" in (triton_version, numpy_version):
        return False
    return _version_tuple(triton_version) < (3, 9) and _version_tuple(numpy_version) >= (2, 4)


def banner() -> str:
    """One line: device, profile and versions. Every notebook prints it at the top."""
    p = get_profile()
    v = versions()
    where = "Colab" if in_colab() else "local"
    mode = "interpreter" if triton_interpreted() else "compiled"
    return (
        f"{p.device_name} | profile {p.name} ({str(p.dtype).replace('torch.', '')}) | {where}\n"
        f"python {v['python']}, torch {v['torch']}, triton {v['triton']} ({mode}), "
        f"transformers {v['transformers']}"
    )


def setup(seed: int = 0) -> Profile:
    """Print the banner, warn about untested versions, seed the RNGs; returns the profile."""
    import random

    import numpy as np
    import torch

    p = get_profile()
    configure_triton()
    print(banner())
    for line in version_warnings():
        warnings.warn(f"{line}. The course may still work; it was not tested with it.", stacklevel=2)
    if p.name == "ci":
        # CI executes two notebooks at once on two cores: a second intra-op thread per process only
        # oversubscribes them.
        torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    show_first_widget(p)
    return p


def is_headless() -> bool:
    """True when the notebook runs without a browser (``COURSE_HEADLESS=1``, set by the course's runner)."""
    return os.environ.get("COURSE_HEADLESS", "").lower() not in ("", "0", "false")


def show_first_widget(p: Profile) -> bool:
    """In a live Jupyter kernel, display one small widget; returns whether it did.

    JupyterLab shows the cell that displays a kernel's *first* widget as "Idle" while it runs (measured: the
    second widget cell shows "Busy"), and the first such cell is often a long one (its progress bar is the
    widget). Displaying one here, in the quick setup cell, makes every later long cell show "Busy". It also
    displays :data:`OUTPUT_WRAP_STYLE` (printed lines break between words). Nothing is shown headless (the
    course's runner, CI) or outside Jupyter."""
    if is_headless():
        return False
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
            return False
        from IPython.display import HTML, display
    except ImportError:
        return False
    display(HTML(OUTPUT_WRAP_STYLE))  # needs no widgets
    try:
        import ipywidgets
    except ImportError:
        return False
    display(ipywidgets.HTML(value=f"<small>widgets ready - {p.label()}</small>"))
    return True


# JupyterLab's output area breaks long printed lines anywhere (``word-break: break-all``): "1.88x" became "1.88" and
# "x" on two lines. This rule, more specific than JupyterLab's, breaks them between words; a word longer than the
# whole line still breaks (overflow-wrap). It is an invisible output of the setup cell, saved with the notebook.
OUTPUT_WRAP_STYLE = (
    "<style>.jp-OutputArea .jp-OutputArea-output pre, .jp-OutputArea .jp-OutputArea-output.jp-RenderedText pre "
    "{word-break: normal; overflow-wrap: anywhere;}</style>"
)
