"""Which torch the set-up commands install, and installing it (standard library only: it runs before the course).

* a torch already in the environment is kept, whatever it is (a CUDA build you installed yourself, say);
* Linux without an NVIDIA GPU: the CPU-only build from PyTorch's own CPU wheel index (about 200 MB instead of the
  several GB of the default Linux wheel, which brings CUDA and its nvidia-* wheels along). Where that index cannot
  be reached, one line says so and the default index is used instead;
* Linux with an NVIDIA GPU, macOS, Windows: the default build (CUDA on Linux; macOS's is CPU/MPS).

``COURSE_TORCH=cpu`` or ``COURSE_TORCH=default`` overrides the choice. An explicit ``COURSE_TORCH=cpu`` means the CPU
build or nothing: where PyTorch's CPU index cannot be reached it stops, saying how to install a CPU torch, and never
falls back to the default index (whose Linux wheel is the several-GB CUDA build). Run by scripts/_venv.sh.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from typing import Callable, NamedTuple

TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class Choice(NamedTuple):
    build: str  # "cpu" or "default"
    why: str
    explicit: bool = False  # asked for by COURSE_TORCH: no fallback to another build


def has_nvidia_gpu(run: Callable = subprocess.run, which: Callable = shutil.which) -> bool:
    """An NVIDIA driver answers (``nvidia-smi -L`` lists a GPU)."""
    if which("nvidia-smi") is None:
        return False
    try:
        out = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def choose(system: str, gpu: bool, override: str | None) -> Choice:
    if override:
        if override not in ("cpu", "default"):
            raise SystemExit(f"COURSE_TORCH is 'cpu' or 'default', got {override!r}")
        return Choice(override, f"COURSE_TORCH={override}", explicit=True)
    if system == "Linux" and not gpu:
        return Choice("cpu", "Linux without an NVIDIA GPU: the CPU-only build")
    if system == "Linux":
        return Choice("default", "an NVIDIA GPU answered: the default (CUDA) build")
    return Choice("default", f"{system}: the default build")


def pip_commands(choice: Choice) -> list[list[str]]:
    """The pip installs to try in order: the first that succeeds is kept."""
    base = [sys.executable, "-m", "pip", "install"]
    if choice.build == "cpu":
        from_cpu_index = base + ["--index-url", CPU_INDEX, "--retries", "1", "--timeout", "15", TORCH]
        return [from_cpu_index] if choice.explicit else [from_cpu_index, base + [TORCH]]
    return [base + [TORCH]]


def cpu_only_advice() -> str:
    """What to do when COURSE_TORCH=cpu was asked for and PyTorch's CPU index cannot be reached."""
    return (
        f"torch: COURSE_TORCH=cpu asks for the CPU-only build, and PyTorch's CPU wheel index ({CPU_INDEX}) could not "
        "be reached (or has no wheel for this Python). Stopping rather than installing the default build, which on "
        "Linux is the CUDA one (several GB). Either install a CPU torch into .venv yourself and run the command again "
        f"(a torch already there is kept): '.venv/bin/pip install {TORCH} --index-url {CPU_INDEX}' from a network "
        "that reaches the index, or '.venv/bin/pip install /path/to/torch-2.13.0+cpu-<python>-<platform>.whl' from a "
        "downloaded wheel; or unset COURSE_TORCH to let the default index choose."
    )


def install(
    torch_present: bool,
    system: str,
    gpu: Callable[[], bool],
    override: str | None,
    run: Callable[[list[str]], int],
    say: Callable[[str], None] = print,
) -> int:
    """Install the chosen torch; returns pip's exit code (0 when a torch was already there)."""
    if torch_present:
        say("torch: keeping the one already installed in this environment")
        return 0
    choice = choose(system, gpu(), override)
    say(f"torch: installing {TORCH} ({choice.why}; COURSE_TORCH=cpu|default chooses)")
    commands = pip_commands(choice)
    code = run(commands[0])
    if code != 0 and choice.build == "cpu" and choice.explicit:
        say(cpu_only_advice())
        return code
    if code != 0 and len(commands) > 1:
        say(
            "torch: installing from PyTorch's CPU wheel index failed (unreachable, or no wheel for this Python); "
            "installing from the default index instead - on Linux that is the CUDA build, several GB"
        )
        code = run(commands[1])
    return code


def main() -> int:
    import importlib.util

    return install(
        importlib.util.find_spec("torch") is not None,
        platform.system(),
        has_nvidia_gpu,
        os.environ.get("COURSE_TORCH") or None,
        lambda cmd: subprocess.run(cmd).returncode,
    )


if __name__ == "__main__":
    sys.exit(main())
