"""The lessons themselves, executed as CI and an instructor would: every solution notebook strictly
(checkers raise), in the CI profile. Also: the generated notebooks have not drifted from their sources. (Every
student notebook runs top to bottom in ``tests/checkers/test_check_verdicts.py``, whose one run also checks that
verdicts depend only on the learner's code.)

Every solution notebook runs ONCE, through the instructor's own command (``run_all.run_notebooks``), in the
module-scoped fixture ``ran``; the tests below only read its results. Under ``pytest -n 2`` pyproject.toml's
``--dist loadfile`` sends all of this file's tests to one worker. The notebook tests also carry the xdist
group "notebooks", which does the same under ``--dist loadgroup`` - except with pytest 9.2 and
pytest-xdist 3.8, where loadgroup silently stops grouping (pytest-xdist#1386): the fixture would then
run on both workers, into the same folder.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import nbformat
import pytest

from course_tools import build_check, run_all

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob(run_all.LESSON_GLOB))
STUDENTS = sorted((ROOT / "notebooks").glob(run_all.LESSON_GLOB))
OUT = ROOT / "runs" / "ci-tests"  # git-ignored; executed notebooks, figures, summary.json and report.md


def test_every_lesson_has_both_notebooks():
    assert SOLUTIONS, "no lessons found"
    assert [p.name for p in SOLUTIONS] == [p.name for p in STUDENTS]


def test_generated_notebooks_have_not_drifted():
    problems = build_check.check(ROOT)
    assert not problems, "run `python -m course_tools.build`:\n" + "\n".join(map(str, problems))


@pytest.fixture(scope="module")
def ran():
    """Every solution notebook, executed once, strictly, in the device-discipline mode, so a tensor made on the
    wrong device fails here as it would on a T4. Returns (started, {relative path: result})."""
    started = time.time()
    results = run_all.run_notebooks(
        SOLUTIONS, OUT, profile="ci", progress=False, root=ROOT, jobs=1, discipline=("solutions",)
    )
    return started, {r.path: r for r in results}


def _result(ran, path: Path) -> run_all.NotebookResult:
    return ran[1][path.relative_to(ROOT).as_posix()]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
@pytest.mark.notebooks
@pytest.mark.xdist_group("notebooks")
def test_solution_executes_strictly(ran, path):
    result = _result(ran, path)
    assert result.strict, "solutions run with COURSE_STRICT=1"
    assert "device discipline" in (result.device_name or ""), "solutions run in the device-discipline mode"
    assert result.ok, f"{path.name} failed at cell {result.error_cell}:\n{result.error}"
    assert result.unsolved_count == 0
    assert result.key_lines, "a lesson ends with key findings computed in the run (KEY: lines)"
    assert result.figures, "a lesson shows figures"


# a float that is not a number as Python prints it ('inf', '-inf', 'nan'), where a number goes: before a unit, a ratio's
# x, punctuation or the end of a line ('infx', 'inf/s', 'nan %', '= inf)'); not in quotes (a kernel listing's
# float("-inf")) nor in prose ('NaN, inf and -inf are refused')
UNDEFINED = re.compile(
    r"""(?<![\w"'.])-?(inf|nan)(?=x\b|/s|\s?%|\s?(ms|µs|s|GB|MB|tok)\b|[),;:]|[ \t]*$)""", re.MULTILINE
)


@pytest.mark.notebooks
@pytest.mark.xdist_group("notebooks")
def test_no_undefined_number_reaches_a_printed_line(ran):
    """Every printed line of every solution: an undefined rate, ratio or fit is said in words, never 'inf' or 'nan'."""
    found = []
    for result in ran[1].values():
        nb = nbformat.read(OUT / result.executed_path, as_version=4)
        for index, cell in enumerate(nb.cells):
            for out in cell.get("outputs", []):
                text = out.get("text", "") + out.get("data", {}).get("text/plain", "")
                found += [
                    f"{result.path} cell {index}: ...{text[max(0, m.start() - 60) : m.end() + 20]}..."
                    for m in UNDEFINED.finditer(text)
                ]
    assert not found, "\n".join(found)


def _cell_with(nb, text):
    return next(c for c in nb.cells if c.cell_type == "code" and text in c.source)


@pytest.mark.notebooks
@pytest.mark.xdist_group("notebooks")
def test_lesson02_draws_stacked_bars_and_memory_map(ran):
    result = _result(ran, ROOT / "solutions" / "02_measuring_fragmentation.ipynb")
    assert result.ok, result.error
    nb = nbformat.read(OUT / result.executed_path, as_version=4)
    for marker in ("draw_breakdown_bars(", "plotting.interactive(show_map"):
        cell = _cell_with(nb, marker)
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"no figure from the cell with {marker}"
    summary = json.loads((OUT / "summary.json").read_text())
    record = next(r for r in summary["notebooks"] if r["path"] == result.path)
    assert record["device_name"]


@pytest.mark.notebooks
@pytest.mark.xdist_group("notebooks")
def test_results_report_lists_every_lesson(ran):
    """The results report is produced by the headless command in CI and lists every lesson."""
    started, results = ran
    report = OUT / "report.md"
    assert report.is_file(), "run_notebooks writes report.md next to summary.json"
    assert report.stat().st_mtime >= started - 1, "report.md is left over from an earlier run"
    text = report.read_text(encoding="utf-8")
    for path in SOLUTIONS:
        assert f"`{path.relative_to(ROOT).as_posix()}`" in text, f"report.md does not name {path.name}"
    for result in results.values():
        for line in result.key_lines:
            assert line in text
        for figure in result.figures:
            assert f"]({figure})" in text


def test_editing_a_real_lesson_without_regenerating_fails_the_check(tmp_path):
    import shutil

    for folder in ("solutions", "notebooks", "course_tools"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "colab_links.md", tmp_path / "colab_links.md")
    assert build_check.check(tmp_path) == []
    path = tmp_path / "solutions" / SOLUTIONS[0].name
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and "## " in c.source)
    cell.source += "\n\nA sentence added to the lesson, and nobody regenerated the student notebook."
    nbformat.write(nb, path)
    problems = build_check.check(tmp_path)
    assert any(SOLUTIONS[0].name in str(p) for p in problems), problems
