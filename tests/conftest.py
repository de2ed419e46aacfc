"""Loaded before any test module: lesson_utils.env must switch Triton to its interpreter (on a machine
without CUDA) before anything imports triton - Triton fixes the mode when its own library is imported."""

import lesson_utils.env  # noqa: F401

import torch  # noqa: E402

# pytest -n 2 runs two workers on two cores: one intra-op thread each avoids oversubscription.
torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture
def not_strict(monkeypatch):
    """Checker tests look at results, so a failing checker must not raise (COURSE_STRICT unset)."""
    monkeypatch.delenv("COURSE_STRICT", raising=False)
