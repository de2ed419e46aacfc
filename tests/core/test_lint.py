"""The code is linted and formatted with ruff (configured in pyproject.toml): the same check a maintainer runs.
The notebooks' code - what learners read most - is linted too (solutions and the generated student notebooks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["lesson_utils", "course_tools", "tests", "docs/estimates"]
NOTEBOOKS = ["solutions", "notebooks"]


@pytest.mark.parametrize(
    "command, paths",
    [(["check"], PATHS), (["format", "--check"], PATHS), (["check"], NOTEBOOKS)],
    ids=["lint", "format", "notebooks"],
)
def test_ruff(command, paths):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *paths], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (
        f"ruff {' '.join(command)} (fix with: ruff check --fix / ruff format):\n{out.stdout}{out.stderr}"
    )
