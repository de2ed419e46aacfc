"""Loaded before any test module: lesson_utils.env must switch Triton to its interpreter (on a machine
without CUDA) before anything imports triton - Triton fixes the mode when its own library is imported."""

import lesson_utils.env  # noqa: F401  (first: before anything imports triton)

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
    from lesson_utils.env import Profile
    from lesson_utils.model.loading import load_model
    from lesson_utils.model.opt_forward import OPTWeights

    lm = load_model(profile=Profile(name="ci", device="cpu", device_name="test"))
    return lm.model, OPTWeights.from_hf(lm.model)
