"""A check's verdict depends only on the learner's code: running a check cell again gives the same verdict.

Every student notebook is executed (nbclient, through ``run_all.run_notebook``) with its first exercise
answered wrongly (each stub's ``raise NotImplementedError`` replaced by ``return None``), the others left
unsolved, and every check cell run twice in a row. Both runs of the first check must say "try again", both
runs of the others "not solved", and no run may say "passed". (A check cell that rebound the exercise's own
name to the reference made the second run pass the reference.) The notebook runs up to its last check cell.
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


def _with_wrong_first_exercise_and_checks_twice(nb):
    nb = copy.deepcopy(nb)
    exercises = [c for c in nb.cells if c.cell_type == "code" and STUB.search(c.source)]
    exercises[0].source = STUB.sub("return None", exercises[0].source)
    cells, checks = [], []
    for cell in nb.cells:
        cells.append(cell)
        if cell.cell_type == "code" and "checks.check_" in cell.source and ".use" in cell.source:
            twin = copy.deepcopy(cell)
            twin.id = f"{cell.id}-again"
            cells.append(twin)
            checks.append((cell, twin))
    last = max(i for i, c in enumerate(cells) if checks and c is checks[-1][1])
    nb.cells = cells[: last + 1]  # a verdict depends only on the cells above it: the measurements after the last
    return nb, checks  # check are not run here (the notebooks' own tests run them)


def _verdicts(cell) -> list[str]:
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    return re.findall(r"\[(passed|try again|not solved)\] Exercise '([^']+)'", text)


@pytest.mark.notebooks
@pytest.mark.parametrize("path", STUDENTS, ids=lambda p: p.stem)
def test_rerunning_a_check_cell_gives_the_same_verdict(path, tmp_path):
    nb, checks = _with_wrong_first_exercise_and_checks_twice(nbformat.read(path, as_version=4))
    folder = tmp_path / "notebooks"
    folder.mkdir()
    target = folder / path.name
    nbformat.write(nb, target)
    result = run_all.run_notebook(target, tmp_path / "out", root=ROOT, profile="ci", strict=False)
    assert result.ok, f"{path.name} crashed at cell {result.error_cell}:\n{result.error}"
    executed = nbformat.read(tmp_path / "out" / result.executed_path, as_version=4)
    check_cells = [
        c for c in executed.cells if c.cell_type == "code" and "checks.check_" in c.source and ".use" in c.source
    ]
    assert len(check_cells) == 2 * len(checks)
    for n, (first, again) in enumerate(zip(check_cells[::2], check_cells[1::2])):
        v1, v2 = _verdicts(first), _verdicts(again)
        assert v1, f"no verdict printed by:\n{first.source}"
        assert v1 == v2, f"the same check cell said {v1} and then {v2}:\n{first.source}"
        assert all(verdict != "passed" for verdict, _ in v1), f"{v1} for code that is wrong or not written"
        expected = "try again" if n == 0 else "not solved"
        assert any(verdict == expected for verdict, _ in v1), f"expected '{expected}', got {v1}"
