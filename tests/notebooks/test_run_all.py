"""course_tools.run_all on two tiny notebooks: one passes, one raises. Also the report, --jobs and --compare."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from course_tools import run_all

# a 1x1 PNG, displayed the way matplotlib's inline backend does
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def _nb(*sources: str):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Tiny")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    good = _nb(
        "import os, pathlib, time\n"
        "time.sleep(1)  # finishes after the bad one: --jobs must still return results in input order\n"
        "print('headless', os.environ.get('COURSE_HEADLESS'))\n"
        "print('strict', os.environ.get('COURSE_STRICT'))\n"
        "print('profile', os.environ.get('COURSE_PROFILE'))\n"
        "print('cwd', pathlib.Path.cwd().name)",
        "print('KEY: kv_bytes_per_token = 36864')\nprint('check 2: not implemented yet (kv_bytes)')\n"
        "print('  KEY: free text: 22.4 %')",
        f"from IPython.display import Image, display\nimport base64\ndisplay(Image(data=base64.b64decode('{PNG}')))",
    )
    bad = _nb(
        "import os\nprint('strict', os.environ.get('COURSE_STRICT'))\n"
        "print('check: not implemented yet'); print('again: not implemented yet')",
        "def f():\n    raise ValueError('boom from the lesson')\nf()",
        "print('never runs')",
    )
    paths = [root / "solutions" / "01_good.ipynb", root / "notebooks" / "02_bad.ipynb"]
    for path, nb in zip(paths, [good, bad]):
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, path)
    out = root / "runs" / "test"
    from course_tools import nb_outputs

    silent_s, nb_outputs.SILENT_S = nb_outputs.SILENT_S, 0.9  # the first cell's one-second sleep is a still stretch
    try:
        results = run_all.run_notebooks(paths, out, profile="ci", timeout=60, progress=False, root=root)
    finally:
        nb_outputs.SILENT_S = silent_s
    return root, out, results


def _stdout(nb, index: int) -> str:
    return "".join(o.get("text", "") for o in nb.cells[index].outputs if o.output_type == "stream")


def test_pass_and_fail(ran):
    root, out, results = ran
    good, bad = results
    assert (good.path, good.kind, good.ok, good.error) == ("solutions/01_good.ipynb", "solutions", True, None)
    assert (bad.path, bad.kind, bad.ok, bad.error_cell) == ("notebooks/02_bad.ipynb", "notebooks", False, 2)
    assert "ValueError: boom from the lesson" in bad.error
    assert "\x1b[" not in bad.error
    for r in results:
        assert 0 < r.seconds < 60


def test_kernel_environment(ran):
    root, out, results = ran
    good = nbformat.read(out / "solutions" / "01_good.ipynb", as_version=4)
    text = _stdout(good, 1)
    assert "headless 1" in text
    assert "strict 1" in text  # solutions run strict by default
    assert "profile ci" in text
    assert "cwd solutions" in text  # the kernel runs in the notebook's folder
    bad = nbformat.read(out / "notebooks" / "02_bad.ipynb", as_version=4)
    assert "strict None" in _stdout(bad, 1)  # student notebooks never strict
    assert bad.cells[3].outputs == []  # stopped at the failing cell


def test_outputs_and_summary(ran):
    root, out, results = ran
    good, bad = results
    assert good.unsolved_count == 1 and bad.unsolved_count == 2
    assert good.key_numbers == {"kv_bytes_per_token": "36864"}
    assert good.key_lines == ["kv_bytes_per_token = 36864", "free text: 22.4 %"]
    assert good.figures == ["figures/solutions/01_good/cell003_0.png"]
    assert (out / good.figures[0]).read_bytes().startswith(b"\x89PNG")

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["passed"], summary["failed"]) == (1, 1)
    records = {r["path"]: r for r in summary["notebooks"]}
    assert set(records) == {"solutions/01_good.ipynb", "notebooks/02_bad.ipynb"}
    for record in records.values():
        for key in ("path", "kind", "seconds", "ok", "error", "unsolved_count", "profile", "device_name", "versions"):
            assert key in record
        assert record["profile"] == "ci"
        # the kernel reports what lesson_utils.core.env saw (the repository root is on its PYTHONPATH)
        assert record["probe_error"] is None, record["probe_error"]
        assert record["device_name"] and record["versions"].get("python")
    assert records["notebooks/02_bad.ipynb"]["ok"] is False

    table = run_all.format_table(results)
    assert "FAIL notebooks/02_bad.ipynb (cell 2)" in table and "1/2 notebooks passed" in table


def test_find_notebooks(tmp_path: Path):
    for folder in ("solutions", "notebooks"):
        (tmp_path / folder).mkdir()
        for name in ("01_a.ipynb", "02_b.ipynb", "scratch.ipynb"):
            (tmp_path / folder / name).write_text("{}")
    names = lambda paths: [p.parent.name + "/" + p.name for p in paths]  # noqa: E731
    assert names(run_all.find_notebooks(tmp_path)) == ["solutions/01_a.ipynb", "solutions/02_b.ipynb"]
    assert names(run_all.find_notebooks(tmp_path, "both", only="02")) == [
        "solutions/02_b.ipynb",
        "notebooks/02_b.ipynb",
    ]


def test_kernel_env_strictness(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("COURSE_STRICT", "1")
    assert "COURSE_STRICT" not in run_all.kernel_env("notebooks", None, True, tmp_path)
    assert "COURSE_STRICT" not in run_all.kernel_env("solutions", None, False, tmp_path)
    env = run_all.kernel_env("solutions", "cpu", True, tmp_path)
    assert env["COURSE_STRICT"] == "1" and env["COURSE_PROFILE"] == "cpu" and env["COURSE_HEADLESS"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path.resolve())


def test_kernel_env_device_discipline(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("COURSE_DEVICE_DISCIPLINE", raising=False)
    assert run_all.kernel_env("solutions", "ci", True, tmp_path, discipline=True)["COURSE_DEVICE_DISCIPLINE"] == "1"
    assert "COURSE_DEVICE_DISCIPLINE" not in run_all.kernel_env("solutions", "ci", True, tmp_path)


def test_report_lists_every_notebook_with_key_lines_and_figures(ran):
    root, out, results = ran
    text = (out / "report.md").read_text(encoding="utf-8")
    good, bad = results
    # header: when, and what the kernels reported
    assert text.startswith("# Course run report")
    assert " UTC" in text and "**Profile**: ci" in text
    assert good.device_name in text and f"python {good.versions['python']}" in text
    for r in results:
        assert f"### `{r.path}`" in text
        for line in r.key_lines:
            assert f"- {line}\n" in text
        for figure in r.figures:
            assert f"]({figure})" in text and (out / figure).is_file()  # relative to OUT: renders in place
    assert "## 01_good: Tiny" in text and "## 02_bad: Tiny" in text  # one section per lesson, with its title
    assert "**FAIL** (cell 2)" in text and "ValueError: boom from the lesson" in text
    assert "2 exercise(s) reported unsolved" in text


def test_report_sections_follow_lesson_order(ran, tmp_path):
    root, out, results = ran
    text = run_all.write_report(list(reversed(results)), tmp_path).read_text(encoding="utf-8")
    assert text.index("### `solutions/01_good.ipynb`") < text.index("### `notebooks/02_bad.ipynb`")


def test_jobs_give_the_same_results_in_input_order(ran, tmp_path):
    root, out, results = ran
    paths = [root / r.path for r in results]
    again = run_all.run_notebooks(paths, tmp_path / "jobs2", profile="ci", timeout=60, progress=True, root=root, jobs=2)
    fields = (
        "path",
        "kind",
        "ok",
        "error",
        "error_cell",
        "unsolved_count",
        "profile",
        "device_name",
        "strict",
        "executed_path",
        "figures",
        "key_lines",
        "key_numbers",
        "probe_error",
    )
    assert [[getattr(r, f) for f in fields] for r in again] == [[getattr(r, f) for f in fields] for r in results]
    summary = json.loads((tmp_path / "jobs2" / "summary.json").read_text())
    assert summary["settings"]["jobs"] == 2 and [r["path"] for r in summary["notebooks"]] == [r.path for r in results]
    assert (tmp_path / "jobs2" / "report.md").is_file()


def test_cli_compare_prints_both_runs(ran, tmp_path, capsys):
    root, out, results = ran
    previous = json.loads((out / "summary.json").read_text())
    previous["notebooks"][0]["seconds"] = 123.4  # the "last recorded run" was slower ...
    previous["notebooks"][0]["key_lines"][0] = "kv_bytes_per_token = 99999"  # ... and found another number
    (tmp_path / "previous").mkdir()
    (tmp_path / "previous" / "summary.json").write_text(json.dumps(previous))
    now = tmp_path / "now"
    rc = run_all.main(
        [
            "--root",
            str(root),
            "--profile",
            "ci",
            "--only",
            "01_good",
            "--out",
            str(now),
            "--timeout",
            "60",
            "--no-progress",
            "--jobs",
            "2",
            "--compare",
            str(tmp_path / "previous" / "summary.json"),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("solutions/01_good.ipynb: this run"))
    assert line.endswith("| previous run   123.4 s pass"), line  # both wall times on one line
    assert "now:    kv_bytes_per_token = 36864" in text and "before: kv_bytes_per_token = 99999" in text
    assert "same:   free text: 22.4 %" in text
    assert "in the previous run only: notebooks/02_bad.ipynb" in text
    assert (now / "report.md").is_file() and (now / "summary.json").is_file()


def test_cli_compare_with_a_missing_summary_fails_before_running(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_all.main(["--root", str(tmp_path), "--compare", str(tmp_path / "nope" / "summary.json")])
    assert exc.value.code == 2 and "--compare" in capsys.readouterr().err


def test_recorded_runs_are_complete_and_comparable():
    """Every run kept in docs/recorded_runs loads for --compare and passed, its report's figures are there (an
    instructor compares a class machine against these), and together they cover every lesson's solution notebook
    (a lesson added after a full run is recorded in a run of its own, and the README names both)."""
    root = Path(__file__).resolve().parents[2]
    lessons = {p.name for p in (root / "solutions").glob("[0-9][0-9]_*.ipynb")}
    recorded = sorted(p for p in (root / "docs" / "recorded_runs").iterdir() if p.is_dir())
    assert recorded, "no recorded run in docs/recorded_runs"
    covered = set()
    for folder in recorded:
        summary = run_all.load_summary(folder / "summary.json")
        ran = {Path(nb["path"]).name for nb in summary["notebooks"] if nb["kind"] == "solutions"}
        assert ran and ran <= lessons, f"{folder.name}: records notebooks that are not lessons: {sorted(ran - lessons)}"
        covered |= ran
        assert all(nb["device_name"] for nb in summary["notebooks"] if nb["ok"])  # (a timed-out kernel is not asked)
        failed = [Path(nb["path"]).name[:2] for nb in summary["notebooks"] if not nb["ok"]]
        if failed:  # a run kept for what it found (the first GPU run): its notes.md says why each one failed
            notes = (folder / "notes.md").read_text(encoding="utf-8") if (folder / "notes.md").is_file() else ""
            assert all(f"| {lesson} |" in notes for lesson in failed), f"{folder.name}: failures {failed} unexplained"
        assert summary["failed"] == len(failed)
        for nb in summary["notebooks"]:
            for fig in nb["figures"]:
                assert (folder / fig).is_file(), f"{folder.name}: figure {fig} is missing"
        assert (folder / "report.md").is_file()
        assert _dead_links(folder / "report.md") == [], f"{folder.name}: its report links to files it does not hold"
    assert covered == lessons, f"lessons in no recorded run: {sorted(lessons - covered)}"


def _dead_links(report: Path) -> list[str]:
    import re

    targets = re.findall(r"\]\(([^)]+)\)", report.read_text(encoding="utf-8"))
    return [t for t in targets if "://" not in t and not (report.parent / t).exists()]


def test_a_recorded_run_links_only_to_what_it_keeps(ran, tmp_path):
    _, out, _ = ran
    report = run_all.record_run(out, tmp_path / "recorded")
    assert _dead_links(out / "report.md") == []  # the run itself keeps its executed notebooks
    assert "Executed notebook" in (out / "report.md").read_text()
    text = report.read_text()
    assert _dead_links(report) == [] and "Executed notebook" not in text and "not kept with this report" in text
    assert (tmp_path / "recorded" / "summary.json").is_file() and "![" in text  # figures came along
    assert run_all.load_summary(tmp_path / "recorded")["notebooks"] == run_all.load_summary(out)["notebooks"]
    stale = tmp_path / "recorded" / "figures" / "solutions" / "01_good" / "cell099_0.png"  # from an earlier recording
    stale.write_bytes(b"old")
    again = run_all.record_run(out, tmp_path / "recorded")
    assert not stale.exists() and _dead_links(again) == [] and "![" in again.read_text()


def test_a_stretch_with_nothing_moving_is_named(ran):
    root, out, results = ran
    good = results[0]
    assert any(
        s.startswith("cell 1: ") and "with nothing moving, 0.0 s into the cell: `import os, pathlib, time`" in s
        for s in good.still_stretches
    ), good.still_stretches
    assert "Still stretches" in (out / "report.md").read_text(encoding="utf-8")


def test_the_longest_still_stretch_counts_from_the_start_to_the_end():
    from course_tools.nb_outputs import longest_still_stretch, still_stretch

    assert longest_still_stretch(10.0, [11.0, 11.5, 19.0], 20.0) == (7.5, 1.5)  # 11.5 -> 19.0
    assert longest_still_stretch(10.0, [], 16.0) == (6.0, 0.0)  # nothing at all
    assert longest_still_stretch(10.0, [10.1], 10.2)[0] == pytest.approx(0.1)
    cell = nbformat.v4.new_code_cell("# why\nserve()")
    assert still_stretch(cell, 7.5, 1.5) == "7.5 s with nothing moving, 1.5 s into the cell: `serve()`"
    assert still_stretch(cell, 4.0, 0.0) is None
    assert still_stretch(nbformat.v4.new_markdown_cell("x"), 60.0, 0.0) is None


def test_a_long_cell_without_a_progress_bar_is_named_as_silent():
    import nbformat

    from course_tools import nb_outputs

    cell = nbformat.v4.new_code_cell("# a comment\nslow_thing()\nmore()")
    assert nb_outputs.silent_cell(cell, 4.0) is None  # short enough
    assert nb_outputs.silent_cell(cell, 12.3) == "12.3 s without a progress bar: `slow_thing()`"
    widget = {"application/vnd.jupyter.widget-view+json": {"model_id": "x"}, "text/plain": "  0%|"}
    cell.outputs = [nbformat.v4.new_output("display_data", data=widget)]
    assert nb_outputs.silent_cell(cell, 60.0) is None
    cell.outputs = [nbformat.v4.new_output("stream", name="stderr", text="serving:  40%|####      | 4/10")]
    assert nb_outputs.silent_cell(cell, 60.0) is None
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="done: 40% of the blocks")]
    assert nb_outputs.silent_cell(cell, 60.0) is not None  # a percentage is not a bar
    assert nb_outputs.silent_cell(nbformat.v4.new_markdown_cell("text"), 60.0) is None
