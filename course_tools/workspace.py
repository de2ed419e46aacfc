"""The learner's working copy: ``my_notebooks/``, made from ``notebooks/`` once and never overwritten.

JupyterLab saves an opened notebook by itself. If that notebook were the course's own ``notebooks/NN_*.ipynb``, the
learner's answers and outputs would sit in files the course regenerates and checks (``course_tools.build``), and
the README's test command would fail on them. ``scripts/lab.sh`` therefore opens the copy in ``my_notebooks/``
(git-ignored): a lesson is copied there when it is missing - a new lesson after ``git pull`` appears - and a file
already there is never touched again, whatever the course's version says.

    python -m course_tools.workspace        # make or complete my_notebooks/, print what it did
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

WORK_DIR = "my_notebooks"
NOTEBOOKS_DIR = "notebooks"
LESSON_GLOB = "[0-9][0-9]_*.ipynb"


def ensure_workspace(root: Path | str = ".") -> list[Path]:
    """Copy every lesson of ``notebooks/`` that ``my_notebooks/`` lacks; returns the copies made (none are replaced)."""
    root = Path(root)
    work = root / WORK_DIR
    work.mkdir(exist_ok=True)
    made = []
    for src in sorted((root / NOTEBOOKS_DIR).glob(LESSON_GLOB)):
        dst = work / src.name
        if not dst.exists():
            shutil.copyfile(src, dst)
            made.append(dst)
    return made


def keep_copy(root: Path | str, path: Path) -> Path:
    """Save ``path`` (a notebook holding a learner's work) into ``my_notebooks/`` before the course replaces it: under
    its own name when that is free, else with ``.kept-N`` before the suffix. Returns where it went."""
    work = Path(root) / WORK_DIR
    work.mkdir(exist_ok=True)
    dst, n = work / path.name, 1
    while dst.exists():
        dst = work / f"{path.stem}.kept-{n}{path.suffix}"
        n += 1
    shutil.copyfile(path, dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.workspace", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=".", help="repository root (default: the current folder)")
    args = parser.parse_args(argv)
    made = ensure_workspace(args.root)
    have = len(list((Path(args.root) / WORK_DIR).glob(LESSON_GLOB)))
    print(
        f"{WORK_DIR}/: your working copy ({have} lessons"
        + (f", {len(made)} new: {', '.join(p.name for p in made)}" if made else "")
        + "); your answers stay there - nothing the course runs overwrites them"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())


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


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)
