"""Every student notebook, run once, top to bottom, as a learner's "Run all" - and, in the same run, proof that a
check's verdict depends only on the learner's code.

Each student notebook is executed (through the instructor's own command, ``run_all.run_notebooks``) with its first
exercise answered wrongly (each stub's ``raise NotImplementedError`` replaced by ``return None``), the others left
unsolved, and every check cell run twice in a row. Then:

* nothing crashes: the rest of the notebook runs on the course's references ("Run all" never crashes);
* both runs of the first check say "try again", both runs of the others "not solved", none says "passed" (a check
  cell that rebound the exercise's own name to the reference made the second run pass the reference);
* every exercise of the lesson printed a verdict, and "not implemented yet" appears once per "not solved".

One run feeds both checks (they used to be two runs of every student notebook). This file lives beside the
checkers' tests, not in ``tests/notebooks/``: under ``pytest -n 2 --dist loadfile`` the solutions' run
(``tests/notebooks/test_notebooks.py``) and this one then usually land on different workers.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat
import pytest

from course_tools import run_all

ROOT = Path(__file__).resolve().parents[2]
STUDENTS = sorted((ROOT / "notebooks").glob(run_all.LESSON_GLOB))
STUB = re.compile(r"raise NotImplementedError\(\"Exercise '[^']+' is not solved yet\"\)")
WORK = ROOT / "runs" / "ci-students"  # git-ignored: the prepared notebooks, then their executed copies


def _is_check(cell) -> bool:
    return (
        cell.cell_type == "code"
        and re.search(r"\bchecks\w*\.check_", cell.source) is not None
        and ".use" in cell.source
    )


def _with_wrong_first_exercise_and_checks_twice(nb):
    nb = copy.deepcopy(nb)
    exercises = [c for c in nb.cells if c.cell_type == "code" and STUB.search(c.source)]
    exercises[0].source = STUB.sub("return None", exercises[0].source)
    cells = []
    for cell in nb.cells:
        cells.append(cell)
        if _is_check(cell):
            twin = copy.deepcopy(cell)
            twin.id = f"{cell.id}-again"
            cells.append(twin)
    nb.cells = cells
    return nb


def _verdicts(cell) -> list[tuple[str, str]]:
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    return re.findall(r"\[(passed|try again|not solved)\] Exercise '([^']+)'", text)


def _exercises(path: Path) -> int:
    nb = nbformat.read(path, as_version=4)
    return sum(1 for c in nb.cells if c.cell_type == "code" and "### BEGIN SOLUTION" in c.source)


@pytest.fixture(scope="module")
def ran():
    """Every student notebook, prepared as the module docstring says and executed once (not strict, the plain CPU
    path). Returns {lesson file name: (result, executed notebook)}."""
    folder = WORK / "notebooks"  # a folder named notebooks: run_all treats what is in it as student notebooks
    folder.mkdir(parents=True, exist_ok=True)
    prepared = []
    for path in STUDENTS:
        target = folder / path.name
        nbformat.write(_with_wrong_first_exercise_and_checks_twice(nbformat.read(path, as_version=4)), target)
        prepared.append(target)
    out = WORK / "out"
    results = run_all.run_notebooks(prepared, out, profile="ci", progress=False, root=ROOT, jobs=1)
    return {Path(r.path).name: (r, nbformat.read(out / r.executed_path, as_version=4)) for r in results}


@pytest.mark.notebooks
@pytest.mark.parametrize("path", STUDENTS, ids=lambda p: p.stem)
def test_student_notebook_runs_top_to_bottom_and_its_verdicts_hold(ran, path):
    result, executed = ran[path.name]
    assert not result.strict
    assert "device discipline" not in (result.device_name or ""), "student notebooks run the plain CPU path"
    assert result.ok, f"{path.name} crashed at cell {result.error_cell}:\n{result.error}"
    checks = [c for c in executed.cells if _is_check(c)]
    assert checks and len(checks) % 2 == 0
    named, not_solved = set(), 0
    for n, (first, again) in enumerate(zip(checks[::2], checks[1::2])):
        v1, v2 = _verdicts(first), _verdicts(again)
        assert v1, f"no verdict printed by:\n{first.source}"
        assert v1 == v2, f"the same check cell said {v1} and then {v2}:\n{first.source}"
        assert all(verdict != "passed" for verdict, _ in v1), f"{v1} for code that is wrong or not written"
        expected = "try again" if n == 0 else "not solved"
        assert any(verdict == expected for verdict, _ in v1), f"expected '{expected}', got {v1}"
        named |= {name for _, name in v1}
        not_solved += sum(verdict == "not solved" for verdict, _ in v1 + v2)
    solution = ROOT / "solutions" / path.name
    assert len(named) == _exercises(solution), f"{_exercises(solution)} exercises, verdicts for {sorted(named)}"
    assert result.unsolved_count == not_solved, "each 'not solved' verdict says 'not implemented yet' once"


@pytest.mark.notebooks
def test_the_students_report_lists_every_lesson(ran):
    text = (WORK / "out" / "report.md").read_text(encoding="utf-8")
    for result, _ in ran.values():
        assert f"`{result.path}`" in text, f"report.md does not name {result.path}"
