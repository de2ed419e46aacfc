"""The code is linted and formatted with ruff (configured in pyproject.toml): the same check a maintainer runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["lesson_utils", "course_tools", "tests", "docs/estimates"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (
        f"ruff {' '.join(command)} (fix with: ruff check --fix / ruff format):\n{out.stdout}{out.stderr}"
    )
