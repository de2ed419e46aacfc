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
