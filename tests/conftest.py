"""Loaded before any test module: Triton must be in its interpreter (on a machine without CUDA) before any
test defines a kernel - Triton fixes the mode when a kernel is defined."""

from lesson_utils.core import env

env.configure_triton()

# isort: split
import torch  # noqa: E402

# pytest -n 2 runs two workers on two cores: one intra-op thread each avoids oversubscription.
torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture
def not_strict(monkeypatch):
    """Checker tests look at results, so a failing checker must not raise (COURSE_STRICT unset)."""
    monkeypatch.delenv("COURSE_STRICT", raising=False)


@pytest.fixture(scope="session")
def tiny():
    """The ci profile's tiny random OPT (2 layers, hidden 64, vocab 320, 512 positions) and its weights,
    as ``(hf_model, OPTWeights)``: loaded once per test process (each xdist worker has its own)."""
    from lesson_utils.core.env import Profile
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

    lm = load_model(profile=Profile(name="ci", device="cpu", device_name="test"))
    return lm.model, OPTWeights.from_hf(lm.model)
