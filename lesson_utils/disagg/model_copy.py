"""The model copy lesson 09's workers load: a temporary folder that does not outlive its use.

Each worker process loads the model from disk (the real Hugging Face path), so the notebook saves it once to a
temporary folder - about 0.5 GB for OPT-125m in fp32. Invariants:

* at most one copy per process exists: making a new one removes the earlier ones this process made;
* a copy is removed by :meth:`ModelCopy.remove` (also as a context manager), by the next copy this process
  makes, or when the process exits normally (``weakref.finalize`` runs at exit);
* a copy left by a process that is gone (a kernel killed before it could clean up) is removed the next time
  any process makes a copy: each folder's name carries the pid that made it. Copies made before names carried
  a pid (``course-opt-XXXXXXXX``, never removed by the course's earlier versions) are removed once they are an
  hour old.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

PREFIX = "course-opt-"
LEGACY_AGE_S = 3600.0  # a copy without a pid in its name is stale once it is this old

_made: list["ModelCopy"] = []  # this process's live copies


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, and not ours to judge
        return True
    return True


def _owner(folder: Path) -> int | None:
    """The pid in ``course-opt-PID-xxxx``, or None for a name without one."""
    rest = folder.name[len(PREFIX) :]
    pid, dash, _ = rest.partition("-")
    return int(pid) if dash and pid.isdigit() else None


def _is_legacy(folder: Path) -> bool:
    """``course-opt-`` and mkdtemp's 8 characters, no pid: what the course's earlier versions left behind."""
    rest = folder.name[len(PREFIX) :]
    return len(rest) == 8 and "-" not in rest


def remove_stale(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the copies in ``root`` (default: the system's temporary folder) whose process is gone, and legacy
    copies over an hour old; returns them. Copies of live processes, this one included, are left alone."""
    removed = []
    now = time.time()
    for folder in sorted(Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*")):
        if not folder.is_dir():
            continue
        pid = _owner(folder)
        dead = pid is not None and pid != os.getpid() and not _pid_alive(pid)
        old_legacy = pid is None and _is_legacy(folder) and now - folder.stat().st_mtime > LEGACY_AGE_S
        if dead or old_legacy:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class ModelCopy:
    """``model`` saved with ``save_pretrained`` into a fresh temporary folder (module docstring: its lifetime)."""

    def __init__(self, model, root: str | os.PathLike | None = None):
        remove_stale(root)
        for earlier in list(_made):
            earlier.remove()
        self._path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._path), ignore_errors=True)
        try:
            model.save_pretrained(self._path)
        except BaseException:
            self.remove()
            raise
        _made.append(self)

    @property
    def path(self) -> str:
        """The folder, for ``DisaggConfig.model_dir``; a clear error once the copy has been removed."""
        if not self._finalizer.alive:
            raise FileNotFoundError(
                f"the model copy {self._path} was removed (at the end of the cell that last used it): run the cell "
                "that saves it again"
            )
        return str(self._path)

    @property
    def size_bytes(self) -> int:
        """The bytes of the files in the copy."""
        return sum(f.stat().st_size for f in Path(self.path).rglob("*") if f.is_file())

    @property
    def exists(self) -> bool:
        return self._finalizer.alive and self._path.is_dir()

    def remove(self) -> None:
        """Delete the folder now (idempotent)."""
        self._finalizer()
        if self in _made:
            _made.remove(self)

    def __enter__(self) -> "ModelCopy":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"ModelCopy({str(self._path)!r}{'' if self._finalizer.alive else ', removed'})"
