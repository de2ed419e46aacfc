"""The repository the notebooks point at: ``course_tools/course.toml`` read (:func:`load_course`) and retargeted
(:func:`write_course`, ``python -m course_tools.build --repo OWNER/NAME --ref BRANCH``), and the error a build
raises."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10 gets tomli from the package dependencies
    import tomli as tomllib


COURSE_TOML = Path("course_tools") / "course.toml"


REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


class BuildError(Exception):
    """A solution notebook the build cannot turn into a student notebook (message names file and cell)."""


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
