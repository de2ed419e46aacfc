"""Loaded before any test module: Triton must be in its interpreter (on a machine without CUDA) before any
test defines a kernel - Triton fixes the mode when a kernel is defined."""

from lesson_utils.core import env

env.configure_triton()

# isort: split
import torch  # noqa: E402

# pytest -n 2 runs two workers on two cores: one intra-op thread each avoids oversubscription.
torch.set_num_threads(1)

import pytest  # noqa: E402

# The longest test files, in the order they should start. pytest-xdist's loadfile scheduling hands out whole files
# in collection order (pyproject.toml turns its reordering by test count off), one per free worker: the solutions'
# notebooks go to one worker and the students' to the other at once, the disaggregated workers' tests to whichever
# frees first, and the many short files fill in behind them - instead of the long files starting last.
LONGEST_FIRST = (
    "tests/notebooks/test_notebooks.py",
    "tests/checkers/test_check_verdicts.py",
    "tests/disagg/test_disagg.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every file keeps its own order


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
