"""The README's set-up commands: which torch they install (scripts/install_torch.py, the GPU probe and the index
faked), and the learner's working copy that JupyterLab opens (course_tools.workspace)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("install_torch", ROOT / "scripts" / "install_torch.py")
install_torch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_torch)


class FakePip:
    """Records every pip command; fails the ones naming PyTorch's CPU index when that index is 'unreachable'."""

    def __init__(self, cpu_index_reachable: bool = True):
        self.reachable, self.calls = cpu_index_reachable, []

    def __call__(self, cmd: list[str]) -> int:
        self.calls.append(cmd)
        return 1 if (install_torch.CPU_INDEX in cmd and not self.reachable) else 0


def _install(pip, *, present=False, system="Linux", gpu=False, override=None):
    said = []
    code = install_torch.install(present, system, lambda: gpu, override, pip, said.append)
    return code, said


def test_linux_without_a_gpu_gets_the_cpu_build_from_pytorchs_cpu_index():
    pip = FakePip()
    code, said = _install(pip)
    assert code == 0 and len(pip.calls) == 1
    cmd = pip.calls[0]
    assert cmd[cmd.index("--index-url") + 1] == install_torch.CPU_INDEX and cmd[-1] == install_torch.TORCH
    assert "CPU-only" in said[0]


def test_an_unreachable_cpu_index_falls_back_to_the_default_index_with_one_line():
    pip = FakePip(cpu_index_reachable=False)
    code, said = _install(pip)
    assert code == 0 and len(pip.calls) == 2
    assert "--index-url" not in pip.calls[1] and pip.calls[1][-1] == install_torch.TORCH
    assert sum("failed (unreachable" in line for line in said) == 1


@pytest.mark.parametrize("system, gpu", [("Linux", True), ("Darwin", False), ("Windows", False)])
def test_a_gpu_machine_or_another_system_gets_the_default_build(system, gpu):
    pip = FakePip()
    assert _install(pip, system=system, gpu=gpu)[0] == 0
    assert pip.calls == [[sys.executable, "-m", "pip", "install", install_torch.TORCH]]


def test_an_explicit_cpu_request_never_falls_back_to_the_default_build():
    """COURSE_TORCH=cpu with PyTorch's CPU index unreachable: one pip call (the CPU index), a non-zero exit, and
    advice that names how to install a CPU torch - never the default index's CUDA build."""
    pip = FakePip(cpu_index_reachable=False)
    code, said = _install(pip, override="cpu")
    assert code != 0 and len(pip.calls) == 1 and install_torch.CPU_INDEX in pip.calls[0]
    assert any("Stopping rather than installing the default build" in line for line in said)
    assert any(f"--index-url {install_torch.CPU_INDEX}" in line and ".whl" in line for line in said)
    pip = FakePip(cpu_index_reachable=True)
    assert _install(pip, override="cpu")[0] == 0 and len(pip.calls) == 1


def test_a_torch_already_installed_is_kept():
    pip = FakePip()
    code, said = _install(pip, present=True, gpu=True)
    assert code == 0 and pip.calls == [] and "keeping" in said[0]


def test_course_torch_overrides_the_choice_and_a_wrong_value_is_refused():
    pip = FakePip()
    _install(pip, gpu=True, override="cpu")
    assert install_torch.CPU_INDEX in pip.calls[0]
    pip = FakePip()
    _install(pip, gpu=False, override="default")
    assert install_torch.CPU_INDEX not in pip.calls[0]
    with pytest.raises(SystemExit, match="COURSE_TORCH is 'cpu' or 'default'"):
        _install(FakePip(), override="cuda")


def test_the_gpu_probe():
    answer = lambda out, code=0: lambda *a, **k: subprocess.CompletedProcess(a, code, out, "")  # noqa: E731
    assert not install_torch.has_nvidia_gpu(answer("GPU 0: Tesla T4"), which=lambda _: None)  # no nvidia-smi
    assert install_torch.has_nvidia_gpu(answer("GPU 0: Tesla T4 (UUID: GPU-1)"), which=lambda _: "/usr/bin/nvidia-smi")
    assert not install_torch.has_nvidia_gpu(answer("", 9), which=lambda _: "/usr/bin/nvidia-smi")  # driver missing

    def broken(*a, **k):
        raise subprocess.TimeoutExpired("nvidia-smi", 20)

    assert not install_torch.has_nvidia_gpu(broken, which=lambda _: "/usr/bin/nvidia-smi")
