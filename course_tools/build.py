"""Generate the student notebooks, Colab badges and setup cells from the solution notebooks.

``solutions/NN_name.ipynb`` is the single source of truth for each lesson. This module

* normalizes each solution notebook in place: no outputs or execution counts, no volatile metadata
  (widget state, collapsed/scrolled, timings, Colab bookkeeping), kernelspec ``python3``, deterministic
  cell ids, and the two generated cells: the Colab badge (cell 0) and the setup cell (right after the
  lesson's title cell);
* writes ``notebooks/NN_name.ipynb``, the student copy: every ``### BEGIN SOLUTION`` ... ``### END
  SOLUTION`` region is replaced by a ``raise NotImplementedError`` stub named after the enclosing
  function, and cells whose metadata says ``{"course": "solution_only"}`` are dropped;
* writes ``colab_links.md``, a table of lessons with a badge per student and solution notebook.

The generator owns only the cells it marks with cell metadata ``{"course": "badge"}`` and
``{"course": "setup"}``; edit everything else in the solution notebook, then rebuild.

Usage, from the repository root::

    python -m course_tools.build              # normalize solutions, regenerate notebooks/ and colab_links.md
    python -m course_tools.build --check      # exit 1 if anything on disk differs from what a build writes
    python -m course_tools.build --repo OWNER/NAME --ref BRANCH   # retarget a fork, then rebuild

The repository, ref and package name come from ``course_tools/course.toml``.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course_tools.workspace import WORK_DIR, keep_copy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10 gets tomli from the package dependencies
    import tomli as tomllib

FIX_COMMAND = "python -m course_tools.build"
LESSON_GLOB = "[0-9][0-9]_*.ipynb"
SOLUTIONS_DIR = "solutions"
NOTEBOOKS_DIR = "notebooks"
LINKS_FILE = "colab_links.md"
COURSE_TOML = Path("course_tools") / "course.toml"

BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}

# Cell metadata the build keeps; everything else (collapsed, scrolled, execution timings, Colab ids,
# editor state) is volatile and dropped.
KEPT_CELL_METADATA = ("course", "tags", "editable", "deletable")
# Notebook metadata the build keeps besides what it sets itself (kernelspec, language_info, Colab GPU).
KEPT_NOTEBOOK_METADATA = ("course",)

MARKER_BADGE = "badge"
MARKER_SETUP = "setup"
MARKER_SOLUTION_ONLY = "solution_only"

BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)#+[ \t]*BEGIN SOLUTION\b.*$")
END_RE = re.compile(r"^(?P<indent>[ \t]*)#+[ \t]*END SOLUTION\b.*$")
DEF_RE = re.compile(r"^(?P<indent>[ \t]*)(?:async[ \t]+)?def[ \t]+(?P<name>\w+)[ \t]*\(")
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


class BuildError(Exception):
    """A solution notebook the build cannot turn into a student notebook (message names file and cell)."""


# --------------------------------------------------------------------------- course.toml


@dataclass(frozen=True)
class Course:
    """The repository the notebooks point at (from ``course_tools/course.toml``)."""

    repo: str  # GitHub "owner/name"
    ref: str  # branch, tag or commit
    package: str  # pip distribution name
    colab_gpu: str = "T4"  # Colab accelerator the notebooks request; "" for none

    def colab_url(self, folder: str, name: str) -> str:
        """Colab link that opens ``folder/name`` of this repository at this ref."""
        return f"https://colab.research.google.com/github/{self.repo}/blob/{self.ref}/{folder}/{name}"

    def pip_target(self) -> str:
        return f"{self.package} @ git+https://github.com/{self.repo}@{self.ref}"


def course_toml_path(root: Path | str | None = None) -> Path:
    """``ROOT/course_tools/course.toml``; with no root, the one shipped inside the installed package."""
    if root is None:
        return Path(__file__).with_name("course.toml")
    return Path(root) / COURSE_TOML


def load_course(root: Path | str | None = None) -> Course:
    """Read course.toml under ``root`` (falling back to the package's own copy when root has none)."""
    path = course_toml_path(root)
    if not path.exists():
        path = course_toml_path(None)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    missing = [key for key in ("repo", "ref", "package") if not data.get(key)]
    if missing:
        raise BuildError(f"{path}: missing {', '.join(missing)}")
    return Course(
        repo=str(data["repo"]),
        ref=str(data["ref"]),
        package=str(data["package"]),
        colab_gpu=str(data.get("colab_gpu", "T4")),
    )


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string with only printable ASCII escapes is a TOML basic string


def write_course(root: Path | str, repo: str | None = None, ref: str | None = None) -> Course:
    """Retarget ``ROOT/course_tools/course.toml`` to another repository and/or ref; returns the result."""
    current = load_course(root)
    new = Course(
        repo=repo if repo is not None else current.repo,
        ref=ref if ref is not None else current.ref,
        package=current.package,
        colab_gpu=current.colab_gpu,
    )
    if not REPO_RE.match(new.repo):
        raise BuildError(f"--repo must look like OWNER/NAME, got {new.repo!r}")
    if not new.ref or any(ch.isspace() for ch in new.ref):
        raise BuildError(f"--ref must be a branch, tag or commit, got {new.ref!r}")
    path = course_toml_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    old_text = path.read_text(encoding="utf-8") if path.exists() else ""
    lines = old_text.splitlines() or [
        f"repo = {_toml_string(current.repo)}",
        f"ref = {_toml_string(current.ref)}",
        f"package = {_toml_string(current.package)}",
    ]
    out = []
    for line in lines:  # rewrite only the two values, keeping the comments around them
        key = line.split("=", 1)[0].strip() if "=" in line and not line.lstrip().startswith("#") else ""
        if key == "repo":
            line = f"repo = {_toml_string(new.repo)}"
        elif key == "ref":
            line = f"ref = {_toml_string(new.ref)}"
        out.append(line)
    path.write_text("\n".join(out) + "\n", encoding="utf-8", newline="\n")
    return load_course(root)


# --------------------------------------------------------------------------- generated cells


def badge_source(course: Course, folder: str, name: str) -> str:
    """Markdown of the badge cell: the Colab badge for ``folder/name``."""
    url = course.colab_url(folder, name)
    badge = f'<a href="{url}" target="_parent"><img src="{BADGE_IMAGE}" alt="Open In Colab"/></a>'
    if folder == SOLUTIONS_DIR:
        student = course.colab_url(NOTEBOOKS_DIR, name)
        badge += (
            f"\n\n**Solution notebook**: the exercises are filled in. "
            f'The exercise version is <a href="{student}" target="_parent">{NOTEBOOKS_DIR}/{name}</a>.'
        )
    return badge


SETUP_TEMPLATE = """\
# Setup (generated by course_tools.build - edit the template there, not here).
# In Colab this installs only the course package, at the course's pinned ref and without its
# dependencies: torch, triton and the rest stay Colab's own builds, which match its CUDA.
import importlib.util
import sys

if "google.colab" in sys.modules:
    get_ipython().run_line_magic("pip", 'install --no-deps "{pip_target}"')  # noqa: F821 - IPython's
if importlib.util.find_spec("lesson_utils") is None:
    raise SystemExit("lesson_utils is not installed: from the course folder run `pip install -e .` (see README).")
from lesson_utils.core import env

P = env.setup()  # prints device, profile and versions; warns (never reinstalls) outside the tested range"""


def setup_source(course: Course) -> str:
    """Source of the setup cell (identical in every lesson)."""
    return SETUP_TEMPLATE.replace("{pip_target}", course.pip_target())


def _marker(cell) -> str | None:
    return cell.get("metadata", {}).get("course")


def _badge_cell(course: Course, folder: str, name: str):
    return nbformat.v4.new_markdown_cell(badge_source(course, folder, name), metadata={"course": MARKER_BADGE})


def _setup_cell(course: Course):
    return nbformat.v4.new_code_cell(setup_source(course), metadata={"course": MARKER_SETUP})


# --------------------------------------------------------------------------- normalization


def _clean_cell(cell):
    meta = cell.get("metadata", {})
    kept = {key: copy.deepcopy(meta[key]) for key in KEPT_CELL_METADATA if key in meta}
    if not kept.get("tags"):
        kept.pop("tags", None)
    jupyter = meta.get("jupyter", {})
    if isinstance(jupyter, dict) and jupyter.get("source_hidden"):
        kept["jupyter"] = {"source_hidden": True}
    cell_type = cell["cell_type"]
    source = cell.get("source", "")
    if isinstance(source, list):
        source = "".join(source)
    if cell_type == "code":
        new = nbformat.v4.new_code_cell(source, metadata=kept)
    elif cell_type == "markdown":
        new = nbformat.v4.new_markdown_cell(source, metadata=kept)
        if cell.get("attachments"):
            new["attachments"] = copy.deepcopy(cell["attachments"])
    elif cell_type == "raw":
        new = nbformat.v4.new_raw_cell(source, metadata=kept)
    else:  # pragma: no cover - nbformat 4 has no other cell types
        raise BuildError(f"unknown cell type {cell_type!r}")
    return new


def _cell_id(stem: str, index: int) -> str:
    prefix = re.sub(r"[^A-Za-z0-9_-]+", "-", stem)[:56]
    return f"{prefix}-{index:03d}"


def _finish(cells: list, stem: str, course: Course):
    """A fresh notebook with ``cells``, normalized notebook metadata and deterministic cell ids."""
    nb = nbformat.v4.new_notebook()
    nb.nbformat, nb.nbformat_minor = 4, 5
    for index, cell in enumerate(cells):
        cell["id"] = _cell_id(stem, index)
    nb.cells = cells
    metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    if course.colab_gpu:
        metadata["accelerator"] = "GPU"
        metadata["colab"] = {"gpuType": course.colab_gpu, "provenance": []}
    nb.metadata = nbformat.from_dict(metadata)
    return nb


def normalize_solution(nb, name: str, course: Course):
    """The solution notebook as the build writes it: clean cells, badge at 0, setup after the title."""
    stem = Path(name).stem
    extra_meta = {k: copy.deepcopy(nb.metadata[k]) for k in KEPT_NOTEBOOK_METADATA if k in nb.metadata}
    cells = [_clean_cell(cell) for cell in nb.cells if _marker(cell) != MARKER_BADGE]
    setup_at = [i for i, cell in enumerate(cells) if _marker(cell) == MARKER_SETUP]
    if setup_at:
        cells[setup_at[0]] = _setup_cell(course)
        for i in reversed(setup_at[1:]):
            del cells[i]
    else:
        title = next((i for i, cell in enumerate(cells) if cell.cell_type == "markdown"), None)
        cells.insert(0 if title is None else title + 1, _setup_cell(course))
    cells.insert(0, _badge_cell(course, SOLUTIONS_DIR, name))
    out = _finish(cells, stem, course)
    out.metadata.update(extra_meta)
    return out


def stub_solutions(source: str, where: str = "cell") -> str:
    """Replace each BEGIN/END SOLUTION region of a code cell by a NotImplementedError stub.

    The stub keeps the indentation of the BEGIN marker and names the nearest enclosing ``def``.
    Raises BuildError (mentioning ``where``) on unbalanced or nested markers or a region outside a def.
    """
    lines = source.split("\n")
    out: list[str] = []
    begin: int | None = None
    for number, line in enumerate(lines):
        if BEGIN_RE.match(line):
            if begin is not None:
                raise BuildError(
                    f"{where}: nested BEGIN SOLUTION at line {number + 1} "
                    f"(the one at line {begin + 1} has no END SOLUTION yet)"
                )
            begin = number
            indent = BEGIN_RE.match(line).group("indent")
            name = _enclosing_def(lines, number, indent)
            if name is None:
                raise BuildError(
                    f"{where}: BEGIN SOLUTION at line {number + 1} is not inside a function; "
                    "exercises must be function bodies (def NAME(...):)"
                )
            out.append(f"{indent}# YOUR CODE HERE (exercise: {name})")
            out.append(f"{indent}raise NotImplementedError(\"Exercise '{name}' is not solved yet\")")
        elif END_RE.match(line):
            if begin is None:
                raise BuildError(f"{where}: END SOLUTION at line {number + 1} without a BEGIN SOLUTION")
            begin = None
        elif begin is None:
            out.append(line)
    if begin is not None:
        raise BuildError(f"{where}: BEGIN SOLUTION at line {begin + 1} has no END SOLUTION")
    return "\n".join(out)


def _enclosing_def(lines: list[str], marker_line: int, indent: str) -> str | None:
    width = len(indent.expandtabs(4))
    for line in reversed(lines[:marker_line]):
        match = DEF_RE.match(line)
        if match and len(match.group("indent").expandtabs(4)) < width:
            return match.group("name")
    return None


def make_student(solution_nb, name: str, course: Course):
    """The student notebook generated from a *normalized* solution notebook."""
    stem = Path(name).stem
    cells = []
    for index, cell in enumerate(solution_nb.cells):
        marker = _marker(cell)
        if marker == MARKER_SOLUTION_ONLY:
            continue
        if marker == MARKER_BADGE:
            cells.append(_badge_cell(course, NOTEBOOKS_DIR, name))
            continue
        new = _clean_cell(cell)
        if new.cell_type == "code":
            new.source = stub_solutions(new.source, where=f"{SOLUTIONS_DIR}/{name}, cell {index}")
        cells.append(new)
    out = _finish(cells, stem, course)
    out.metadata.update(
        {k: copy.deepcopy(solution_nb.metadata[k]) for k in KEPT_NOTEBOOK_METADATA if k in solution_nb.metadata}
    )
    return out


def dumps(nb) -> str:
    """Stable JSON text of a notebook: nbformat's indent-1, sorted keys, trailing newline."""
    nbformat.validate(nb)
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


def lesson_title(nb, fallback: str) -> str:
    """The first ``# `` heading of the first markdown cell that is not the badge."""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and _marker(cell) != MARKER_BADGE:
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
            break
    return fallback


def links_markdown(course: Course, lessons: list[tuple[str, str]]) -> str:
    """colab_links.md for ``lessons`` = [(notebook file name, title), ...]."""

    def badge(url: str) -> str:
        return f"[![Open In Colab]({BADGE_IMAGE})]({url})"

    lines = [
        "# Open the lessons in Colab",
        "",
        f"Generated by `{FIX_COMMAND}` from `course_tools/course.toml` "
        f"(repository `{course.repo}`, ref `{course.ref}`); do not edit by hand.",
        "",
        "| # | Lesson | Exercises | Solutions |",
        "|---|---|---|---|",
    ]
    for name, title in lessons:
        number = name[:2]
        # "03 · Paging" -> "Paging": the number has its own column
        cell_title = re.sub(rf"^{number}\s*[·:.\-–—]\s*", "", title).replace("|", "\\|")
        lines.append(
            f"| {number} | {cell_title} | {badge(course.colab_url(NOTEBOOKS_DIR, name))} "
            f"| {badge(course.colab_url(SOLUTIONS_DIR, name))} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- whole-course build


def solution_paths(root: Path | str) -> list[Path]:
    return sorted((Path(root) / SOLUTIONS_DIR).glob(LESSON_GLOB))


def student_paths(root: Path | str) -> list[Path]:
    return sorted((Path(root) / NOTEBOOKS_DIR).glob(LESSON_GLOB))


def read_notebook(path: Path):
    try:
        return nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
    except Exception as exc:  # noqa: BLE001 - any unreadable notebook is a build error
        raise BuildError(f"{path}: cannot read notebook: {exc}") from exc


def build_files(root: Path | str, course: Course | None = None) -> dict[Path, str]:
    """Everything a build writes, in memory: {absolute path: text}."""
    root = Path(root)
    if not (root / SOLUTIONS_DIR).is_dir():
        raise BuildError(
            f"no {SOLUTIONS_DIR}/ folder under {root.resolve()}: run from the repository root or pass --root"
        )
    course = load_course(root) if course is None else course
    files: dict[Path, str] = {}
    lessons = []
    for path in solution_paths(root):
        name = path.name
        solution = normalize_solution(read_notebook(path), name, course)
        student = make_student(solution, name, course)
        files[root / SOLUTIONS_DIR / name] = dumps(solution)
        files[root / NOTEBOOKS_DIR / name] = dumps(student)
        lessons.append((name, lesson_title(solution, fallback=Path(name).stem)))
    files[root / LINKS_FILE] = links_markdown(course, lessons)
    return files


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None


def orphan_students(root: Path | str) -> list[Path]:
    """Student notebooks whose solution notebook is gone (the build never deletes them)."""
    root = Path(root)
    return [p for p in student_paths(root) if not (root / SOLUTIONS_DIR / p.name).exists()]


def build(root: Path | str = ".", quiet: bool = False) -> list[Path]:
    """Write every generated/normalized file that differs from disk; returns the paths written."""
    root = Path(root)
    written, kept = [], []
    for path, text in build_files(root).items():
        on_disk = _read_text(path)
        if on_disk != text:
            if (
                path.parent.name == NOTEBOOKS_DIR
                and on_disk is not None
                and holds_learner_work(on_disk, text, _committed_text(root, path))
            ):
                kept.append((path, keep_copy(root, path)))  # a learner's answers are never lost to a rebuild
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
            written.append(path)
    for path, saved in kept:
        print(f"{_rel(path, root)} held your work (answers or outputs): kept in {_rel(saved, root)}", file=sys.stderr)
    if not quiet:
        for path in written:
            print(f"wrote {_rel(path, root)}")
        if not written:
            print("everything up to date")
        for path in orphan_students(root):
            print(
                f"warning: {_rel(path, root)} has no {SOLUTIONS_DIR}/{path.name}: "
                "delete it (git rm) or add the solution notebook",
                file=sys.stderr,
            )
    return written


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _first_diff(old: str, new: str, label: str, context: int = 3, limit: int = 30) -> str:
    diff = list(
        difflib.unified_diff(
            old.splitlines(), new.splitlines(), f"{label} (on disk)", f"{label} (built)", n=context, lineterm=""
        )
    )
    hunk_starts = [i for i, line in enumerate(diff) if line.startswith("@@")]
    if len(hunk_starts) > 1:
        diff = diff[: hunk_starts[1]]
    if len(diff) > limit:
        diff = diff[:limit] + ["..."]
    return "\n".join(diff)


def holds_learner_work(on_disk: str, built: str, committed: str | None = None) -> bool:
    """Whether a student notebook on disk holds a learner's work. With git, exactly: the file differs from its
    committed version (``committed``; notebooks/ is generated, so nobody else edits it - a note, a new cell, an
    answer beside a kept stub all count). Without git (a downloaded zip): outputs, or an exercise stub of the built
    notebook replaced by something else (an answer)."""
    if committed is not None:
        return on_disk != committed
    if _has_outputs(on_disk):
        return True
    stubs = {line.strip() for line in _code_lines(built) if "raise NotImplementedError(" in line}
    return not stubs <= {line.strip() for line in _code_lines(on_disk)}


def _committed_text(root: Path, path: Path) -> str | None:
    """``path`` as committed at git's HEAD, or None (no git, not a repository, or not committed)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(root), "show", f"HEAD:{_rel(path, root)}"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode("utf-8") if out.returncode == 0 else None


def _code_lines(text: str) -> list[str]:
    try:
        cells = json.loads(text).get("cells", [])
    except json.JSONDecodeError:
        return []
    lines = []
    for cell in cells:
        if cell.get("cell_type") == "code":
            source = cell.get("source", "")
            lines += ("".join(source) if isinstance(source, list) else source).splitlines()
    return lines


def _has_outputs(text: str) -> bool:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return False
    for cell in data.get("cells", []):
        if cell.get("cell_type") == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
            return True
    return False


def check(root: Path | str = ".") -> list[str]:
    """Problems with the files on disk (empty when a build would change nothing). Writes nothing."""
    root = Path(root)
    problems: list[str] = []
    for folder in (SOLUTIONS_DIR, NOTEBOOKS_DIR):
        for path in sorted((root / folder).glob(LESSON_GLOB)):
            text = _read_text(path) or ""
            if folder == NOTEBOOKS_DIR and _has_outputs(text):
                problems.append(
                    f"{_rel(path, root)}: holds outputs - a learner's work? Work in {WORK_DIR}/ (scripts/lab.sh "
                    f"opens it); `{FIX_COMMAND}` keeps a copy of this file in {WORK_DIR}/ before restoring it"
                )
            elif _has_outputs(text):
                problems.append(f"{_rel(path, root)}: has outputs or execution counts (commit notebooks without them)")
            if folder == NOTEBOOKS_DIR and "BEGIN SOLUTION" in text:
                problems.append(f"{_rel(path, root)}: student notebook contains 'BEGIN SOLUTION'")
    for path in orphan_students(root):
        problems.append(
            f"{_rel(path, root)}: exists only in {NOTEBOOKS_DIR}/ (no {SOLUTIONS_DIR}/{path.name}); "
            "delete it or add the solution notebook"
        )
    try:
        files = build_files(root)
    except BuildError as exc:
        problems.append(str(exc))
        return problems
    for path, text in files.items():
        label = _rel(path, root)
        on_disk = _read_text(path)
        if on_disk is None:
            where = f" (exists only in {SOLUTIONS_DIR}/)" if path.parent.name == NOTEBOOKS_DIR else ""
            problems.append(f"{label}: missing{where}")
        elif on_disk != text:
            mine = path.parent.name == NOTEBOOKS_DIR and holds_learner_work(on_disk, text, _committed_text(root, path))
            hint = f" - it holds answers: `{FIX_COMMAND}` keeps a copy in {WORK_DIR}/ first" if mine else ""
            problems.append(f"{label}: differs from what the build writes{hint}\n{_first_diff(on_disk, text, label)}")
    return problems


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_tools.build",
        description="Normalize solutions/, generate notebooks/ and colab_links.md from them.",
    )
    parser.add_argument("--root", default=".", help="repository root (default: the current folder)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a build would change any file")
    parser.add_argument("--repo", help="retarget course.toml to this GitHub OWNER/NAME, then rebuild")
    parser.add_argument("--ref", help="retarget course.toml to this branch/tag/commit, then rebuild")
    args = parser.parse_args(argv)
    root = Path(args.root)

    if args.check and (args.repo or args.ref):
        parser.error("--check cannot be combined with --repo/--ref")
    try:
        if args.check:
            problems = check(root)
            if problems:
                for problem in problems:
                    print(problem)
                print(
                    f"\n{len(problems)} problem(s). To fix: {FIX_COMMAND}"
                    + (f" --root {args.root}" if args.root != "." else "")
                    + " (then commit the result)"
                )
                return 1
            print(f"ok: {len(solution_paths(root))} lesson(s), notebooks and {LINKS_FILE} up to date")
            return 0
        if args.repo or args.ref:
            course = write_course(root, repo=args.repo, ref=args.ref)
            print(f"course.toml: repo {course.repo}, ref {course.ref}")
        build(root)
        return 0
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
