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
import sys
from pathlib import Path

from course_tools.build_check import check
from course_tools.course_config import BuildError, write_course
from course_tools.notebook_files import (  # noqa: F401 - the build's vocabulary, importable from here as before
    FIX_COMMAND,
    LINKS_FILE,
    NOTEBOOKS_DIR,
    SOLUTIONS_DIR,
    _read_text,
    build_files,
    dumps,
    make_student,
    normalize_solution,
    orphan_students,
    solution_paths,
    student_paths,
)
from course_tools.stubs import stub_solutions  # noqa: F401
from course_tools.workspace import _committed_text, _rel, holds_learner_work, keep_copy


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
