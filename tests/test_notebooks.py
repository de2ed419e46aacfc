"""The lessons themselves, executed as CI and an instructor would: every solution notebook strictly
(checkers raise), every student notebook top to bottom (unsolved exercises reported, nothing else
failing), in the CI profile. Also: the generated notebooks have not drifted from their sources."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from lesson_utils import build, run_all

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob(run_all.LESSON_GLOB))
STUDENTS = sorted((ROOT / "notebooks").glob(run_all.LESSON_GLOB))


def test_every_lesson_has_both_notebooks():
    assert SOLUTIONS, "no lessons found"
    assert [p.name for p in SOLUTIONS] == [p.name for p in STUDENTS]


def test_generated_notebooks_have_not_drifted():
    problems = build.check(ROOT)
    assert not problems, "run `python -m lesson_utils.build`:\n" + "\n".join(map(str, problems))


def _exercises(path: Path) -> int:
    """Exercise cells (one checker each; a cell may hold several solution regions, e.g. two methods)."""
    nb = nbformat.read(path, as_version=4)
    return sum(1 for c in nb.cells if c.cell_type == "code" and "### BEGIN SOLUTION" in c.source)


@pytest.mark.notebooks
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_executes_strictly(path, tmp_path):
    (result,) = run_all.run_notebooks([path], tmp_path, profile="ci", strict=True, progress=False, root=ROOT)
    assert result.ok, f"{path.name} failed at cell {result.error_cell}:\n{result.error}"
    assert result.unsolved_count == 0
    assert result.key_lines, "a lesson ends with key findings computed in the run (KEY: lines)"
    assert result.figures, "a lesson shows figures"


@pytest.mark.notebooks
@pytest.mark.parametrize("path", STUDENTS, ids=lambda p: p.stem)
def test_student_notebook_runs_top_to_bottom(path, tmp_path):
    (result,) = run_all.run_notebooks([path], tmp_path, profile="ci", progress=False, root=ROOT)
    assert result.ok, f"{path.name} crashed at cell {result.error_cell}:\n{result.error}"
    expected = _exercises(ROOT / "solutions" / path.name)
    assert result.unsolved_count == expected, f"{expected} exercises, {result.unsolved_count} reported unsolved"


def _cell_with(nb, text):
    return next(c for c in nb.cells if c.cell_type == "code" and text in c.source)


@pytest.mark.notebooks
def test_lesson02_draws_stacked_bars_and_memory_map(tmp_path):
    path = ROOT / "solutions" / "02_measuring_fragmentation.ipynb"
    (result,) = run_all.run_notebooks([path], tmp_path, profile="ci", progress=False, root=ROOT)
    assert result.ok, result.error
    nb = nbformat.read(tmp_path / result.executed_path, as_version=4)
    for marker in ("draw_breakdown_bars(", "plotting.interactive(show_map"):
        cell = _cell_with(nb, marker)
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"no figure from the cell with {marker}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["notebooks"][0]["device_name"]


def test_editing_a_real_lesson_without_regenerating_fails_the_check(tmp_path):
    import shutil

    for folder in ("solutions", "notebooks", "lesson_utils"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "colab_links.md", tmp_path / "colab_links.md")
    assert build.check(tmp_path) == []
    path = tmp_path / "solutions" / SOLUTIONS[0].name
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and "## " in c.source)
    cell.source += "\n\nA sentence added to the lesson, and nobody regenerated the student notebook."
    nbformat.write(nb, path)
    problems = build.check(tmp_path)
    assert any(SOLUTIONS[0].name in str(p) for p in problems), problems
