"""``python -m course_tools.build --check``: whether everything on disk is what a build writes - solutions
normalized, student notebooks and ``colab_links.md`` current - and, where a student notebook differs, whether
that is the learner's own work (kept by a rebuild) or a stale copy."""

from __future__ import annotations

import difflib
from pathlib import Path

from course_tools.course_config import BuildError
from course_tools.notebook_files import (
    FIX_COMMAND,
    LESSON_GLOB,
    NOTEBOOKS_DIR,
    SOLUTIONS_DIR,
    _read_text,
    build_files,
    orphan_students,
)
from course_tools.workspace import WORK_DIR, _committed_text, _has_outputs, _rel, holds_learner_work


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
