"""Execute the course notebooks top to bottom and report what passed: the instructor's main check.

Usage, from the repository root::

    python -m lesson_utils.run_all                          # every solution notebook, strict checkers
    python -m lesson_utils.run_all --profile ci --which both
    python -m lesson_utils.run_all --only 03 --timeout 600 --out runs/lesson03

Each notebook runs in a fresh ``python3`` kernel whose working directory is the notebook's folder and
whose environment has

* ``COURSE_HEADLESS=1`` - the plotting helpers draw static figures;
* ``COURSE_STRICT=1`` for solution notebooks unless ``--no-strict`` - checkers raise instead of printing
  (student notebooks never run strict: the variable is removed from their environment);
* ``COURSE_PROFILE`` when ``--profile`` is given (else the kernel chooses, see ``lesson_utils.env``);
* the repository root (and the checkout this ``lesson_utils`` runs from) first on ``PYTHONPATH`` - the
  checkout's ``lesson_utils`` is the one tested, installed or not;
* this interpreter's folder first on ``PATH`` - the kernel runs the same Python as this command.

Results go to ``OUT`` (default ``runs/<UTC timestamp>-<profile>``)::

    OUT/solutions/NN_name.ipynb    executed notebooks (also when they fail: outputs up to the failure)
    OUT/notebooks/NN_name.ipynb
    OUT/figures/<kind>/<NN_name>/cellCCC_K.png   every PNG the notebook displayed
    OUT/logs/<kind>/NN_name.log    the kernel process's own output (crashes), only when there is any
    OUT/summary.json               one record per notebook (see NotebookResult)

Notebooks report headline numbers by printing lines that start with ``KEY:``; their text is collected,
in order, into ``key_lines`` of the summary, and those of the form ``KEY: name = value`` (e.g.
``KEY: KV bytes per token, OPT-125m fp16 = 36,864 B``) also into the ``key_numbers`` mapping.
In student notebooks the checkers print "... not implemented yet ..." for each unsolved exercise; the
number of those messages is ``unsolved_count``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

KINDS = ("solutions", "notebooks")
LESSON_GLOB = "[0-9][0-9]_*.ipynb"
UNSOLVED_TEXT = "not implemented yet"
KEY_PREFIX = "KEY:"
ERROR_TAIL_LINES = 8

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# Runs in the kernel after the notebook: what profile, device and versions it actually used.
_PROBE = """\
def __course_probe():
    import json
    try:
        from lesson_utils import env
        p = env.get_profile()
        info = {"profile": p.name, "device_name": p.device_name, "versions": env.versions()}
    except Exception as exc:
        info = {"probe_error": f"{type(exc).__name__}: {exc}"}
    print("__COURSE_PROBE__" + json.dumps(info))
__course_probe()
del __course_probe
"""
_PROBE_TAG = "__COURSE_PROBE__"


@dataclass
class NotebookResult:
    """What one notebook run produced (one record of summary.json)."""

    path: str  # the notebook that ran, relative to the repository root when it lies under it
    kind: str  # "solutions" or "notebooks"
    seconds: float  # kernel start plus all cells
    ok: bool
    error: str | None = None  # last lines of the error, ANSI codes stripped
    error_cell: int | None = None  # index of the failing cell
    unsolved_count: int = 0  # "not implemented yet" messages in stream outputs
    profile: str | None = None  # from env.get_profile() in the kernel
    device_name: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    strict: bool = False
    executed_path: str | None = None  # the executed copy under OUT
    figures: list[str] = field(default_factory=list)  # PNGs under OUT/figures
    key_lines: list[str] = field(default_factory=list)  # text of every "KEY: ..." line, in order
    key_numbers: dict[str, str] = field(default_factory=dict)  # those of the form "KEY: name = value"
    probe_error: str | None = None  # why profile/versions are missing, if they are
    kernel_log: str | None = None  # the kernel process's own output under OUT, when it wrote any

    @property
    def name(self) -> str:
        return Path(self.path).name


# --------------------------------------------------------------------------- helpers


def find_notebooks(root: Path | str = ".", which: str = "solutions", only: str | None = None) -> list[Path]:
    """Lesson notebooks of ``which`` ("solutions", "notebooks" or "both"), filtered by substring ``only``."""
    kinds = KINDS if which == "both" else (which,)
    found = []
    for kind in kinds:
        for path in sorted((Path(root) / kind).glob(LESSON_GLOB)):
            if only is None or only in path.name:
                found.append(path)
    return found


def _kind_of(path: Path) -> str:
    return "notebooks" if path.parent.name == "notebooks" else "solutions"


def kernel_env(kind: str, profile: str | None, strict: bool, root: Path | str) -> dict[str, str]:
    """The environment a notebook's kernel starts with."""
    env = dict(os.environ)
    env["COURSE_HEADLESS"] = "1"
    if kind == "solutions" and strict:
        env["COURSE_STRICT"] = "1"
    else:
        env.pop("COURSE_STRICT", None)
    if profile:
        env["COURSE_PROFILE"] = profile
    front = [str(Path(root).resolve())]
    checkout = Path(__file__).resolve().parent.parent  # the checkout this lesson_utils runs from, if any
    if (checkout / "pyproject.toml").exists() and str(checkout) not in front:
        front.append(str(checkout))
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in front]
    env["PYTHONPATH"] = os.pathsep.join(front + rest)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep) if p])
    return env


def _strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text)


def _tail(text: str, lines: int = ERROR_TAIL_LINES) -> str:
    kept = [line for line in _strip_ansi(text).rstrip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _stream_texts(nb):
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if output.get("output_type") == "stream":
                text = output.get("text", "")
                yield index, "".join(text) if isinstance(text, list) else text


def count_unsolved(nb) -> int:
    """Occurrences of "not implemented yet" in the notebook's stream outputs."""
    return sum(text.count(UNSOLVED_TEXT) for _, text in _stream_texts(nb))


def key_lines(nb) -> list[str]:
    """The text after ``KEY:`` of every such line the notebook printed, in order."""
    found = []
    for _, text in _stream_texts(nb):
        for line in text.splitlines():
            line = line.strip()
            if line.startswith(KEY_PREFIX):
                found.append(line[len(KEY_PREFIX):].strip())
    return found


def key_numbers(nb) -> dict[str, str]:
    """The ``KEY: name = value`` lines as {name: value} (lines without '=' are only in key_lines)."""
    found: dict[str, str] = {}
    for body in key_lines(nb):
        name, sep, value = body.partition("=")
        if sep:
            found[name.strip()] = value.strip()
    return found


def save_figures(nb, folder: Path) -> list[Path]:
    """Write every image/png output of ``nb`` to ``folder/cellCCC_K.png``."""
    saved = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        count = 0
        for output in cell.get("outputs", []):
            data = output.get("data", {}) if output.get("output_type") in ("display_data", "execute_result") else {}
            png = data.get("image/png")
            if not png:
                continue
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"cell{index:03d}_{count}.png"
            path.write_bytes(base64.b64decode("".join(png) if isinstance(png, list) else png))
            saved.append(path)
            count += 1
    return saved


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------- running


def run_notebook(
    path: Path | str,
    out_dir: Path | str,
    *,
    root: Path | str = ".",
    profile: str | None = None,
    strict: bool | None = None,
    timeout: int = 1200,
    kernel_name: str = "python3",
) -> NotebookResult:
    """Execute one notebook in a fresh kernel; write the executed copy and its figures under ``out_dir``.

    The kernel process's own stdout/stderr (crash messages, not cell outputs) go to
    ``out_dir/logs/<kind>/<name>.log``, kept only when not empty.
    """
    path, out_dir, root = Path(path), Path(out_dir), Path(root)
    kind = _kind_of(path)
    strict = (kind == "solutions") if strict is None else (strict and kind == "solutions")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        startup_timeout=120,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(path.parent.resolve())}},
        allow_errors=False,
        record_timing=False,
        # the kernel's own log (e.g. "running over TCP without encryption") is noise in this report
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
    result = NotebookResult(path=_rel(path, root), kind=kind, seconds=0.0, ok=True, strict=strict)
    log_path = out_dir / "logs" / kind / f"{path.stem}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    probe = True
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        try:
            with client.setup_kernel(env=kernel_env(kind, profile, strict, root), stdout=log, stderr=log):
                try:
                    for index, cell in enumerate(nb.cells):
                        result.error_cell = index
                        client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                    result.error_cell = None
                except CellTimeoutError as exc:
                    probe = False  # the kernel is still busy with the cell; it is shut down below
                    result.ok = False
                    result.error = f"timed out after {timeout} s per cell\n{_tail(str(exc), 3)}"
                    result.probe_error = "not asked: a cell timed out"
                except DeadKernelError as exc:
                    probe = False
                    result.ok, result.error = False, f"the kernel died: {exc}"
                    result.probe_error = "not asked: the kernel died"
                except CellExecutionError as exc:
                    result.ok = False
                    result.error = _tail(str(exc.traceback or f"{exc.ename}: {exc.evalue}"))
                result.seconds = time.perf_counter() - start
                if probe:
                    _probe(client, nb, result)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not start is a failed notebook, not a crash
            result.ok = False
            result.error = result.error or _tail("".join(traceback.format_exception_only(type(exc), exc)))
            result.seconds = result.seconds or time.perf_counter() - start
    kernel_log = log_path.read_text(encoding="utf-8", errors="replace").strip()
    if kernel_log:
        result.kernel_log = _rel(log_path, out_dir)
        if not result.ok and result.error and result.error.startswith("the kernel died"):
            result.error += "\nkernel log:\n" + _tail(kernel_log)
    else:
        log_path.unlink()
        for folder in (log_path.parent, log_path.parent.parent):
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
    if profile and result.profile is None:
        result.profile = profile

    executed = out_dir / kind / path.name
    executed.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, executed)
    result.executed_path = _rel(executed, out_dir)
    result.figures = [_rel(p, out_dir) for p in save_figures(nb, out_dir / "figures" / kind / path.stem)]
    result.unsolved_count = count_unsolved(nb)
    result.key_lines = key_lines(nb)
    result.key_numbers = key_numbers(nb)
    result.seconds = round(result.seconds, 2)
    return result


def _probe(client: NotebookClient, nb, result: NotebookResult, attempts: int = 2) -> None:
    """Ask the notebook's kernel which profile, device and versions it ran with."""
    info: dict = {"probe_error": "no output"}
    cell_timeout, client.timeout = client.timeout, max(client.timeout or 0, 120)  # importing torch takes a while
    for _ in range(attempts):  # after an interrupted cell the kernel may drop the first request
        cell = nbformat.v4.new_code_cell(_PROBE)
        nb.cells.append(cell)
        try:
            client.execute_cell(cell, len(nb.cells) - 1, store_history=False)
            text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
            line = next((x for x in text.splitlines() if x.startswith(_PROBE_TAG)), None)
            info = json.loads(line[len(_PROBE_TAG):]) if line else {"probe_error": _tail(text or "no output", 3)}
        except Exception as exc:  # noqa: BLE001 - the probe must never fail a notebook
            first = (str(exc).strip().splitlines() or [""])[0]
            info = {"probe_error": f"{type(exc).__name__}: {first}"}
        finally:
            nb.cells.pop()
        if "probe_error" not in info:
            break
    client.timeout = cell_timeout
    result.profile = info.get("profile")
    result.device_name = info.get("device_name")
    result.versions = info.get("versions", {})
    result.probe_error = info.get("probe_error")


def run_notebooks(
    paths,
    out_dir: Path | str,
    profile: str | None = None,
    strict: bool | None = None,
    timeout: int = 1200,
    progress: bool = True,
    root: Path | str = ".",
) -> list[NotebookResult]:
    """Execute ``paths`` one after another; write executed copies, figures and ``out_dir/summary.json``.

    ``strict=None`` means strict for solution notebooks; student notebooks are never strict.
    """
    paths = [Path(p) for p in paths]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[NotebookResult] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(paths), unit="notebook", file=sys.stderr, dynamic_ncols=True)
    try:
        for path in paths:
            if bar is not None:
                bar.set_description(f"{_kind_of(path)}/{path.name}")
            results.append(
                run_notebook(path, out_dir, root=root, profile=profile, strict=strict, timeout=timeout)
            )
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"failed {sum(not r.ok for r in results)}")
    finally:
        if bar is not None:
            bar.close()
    write_summary(
        results,
        out_dir,
        profile_requested=profile,
        strict_solutions=True if strict is None else bool(strict),
        timeout_per_cell=timeout,
    )
    return results


def write_summary(results: list[NotebookResult], out_dir: Path | str, **settings) -> Path:
    """``out_dir/summary.json``: the run's settings and one record per notebook."""
    path = Path(out_dir) / "summary.json"
    data = {
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "settings": {k: v for k, v in settings.items()},
        "passed": sum(r.ok for r in results),
        "failed": sum(not r.ok for r in results),
        "notebooks": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path


def format_table(results: list[NotebookResult]) -> str:
    """Plain-text report: one row per notebook, then the error tail of each failure."""
    rows = [("notebook", "seconds", "result", "unsolved", "profile")]
    for r in results:
        rows.append(
            (
                r.path,
                f"{r.seconds:.1f}",
                "pass" if r.ok else "FAIL",
                str(r.unsolved_count) if r.kind == "notebooks" else "-",
                r.profile or "?",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in results:
        if not r.ok:
            where = f"cell {r.error_cell}" if r.error_cell is not None else "before any cell"
            lines.append("")
            lines.append(f"FAIL {r.path} ({where}):")
            lines.extend("    " + line for line in (r.error or "").splitlines())
    passed = sum(r.ok for r in results)
    lines.append("")
    lines.append(f"{passed}/{len(results)} notebooks passed")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lesson_utils.run_all",
        description="Execute the course notebooks and report which pass.",
    )
    parser.add_argument("--root", default=".", help="repository root (default: the current folder)")
    parser.add_argument("--profile", choices=("gpu", "cpu", "ci"), help="COURSE_PROFILE for the kernels (default: auto)")
    parser.add_argument("--which", choices=("solutions", "notebooks", "both"), default="solutions")
    parser.add_argument("--out", help="output folder (default: runs/<UTC timestamp>-<profile>)")
    parser.add_argument("--only", help="run only notebooks whose file name contains this text")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell (default 1200)")
    parser.add_argument(
        "--strict",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="COURSE_STRICT=1 for solution notebooks (default: on; student notebooks never strict)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    root = Path(args.root)
    paths = find_notebooks(root, args.which, args.only)
    if not paths:
        print(f"no {args.which} notebooks under {root.resolve()} match {args.only!r}", file=sys.stderr)
        return 1
    label = args.profile or os.environ.get("COURSE_PROFILE") or "auto"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out) if args.out else root / "runs" / f"{stamp}-{label}"
    print(f"running {len(paths)} notebook(s), profile {label}, results in {out_dir}")
    results = run_notebooks(
        paths,
        out_dir,
        profile=args.profile,
        strict=args.strict,
        timeout=args.timeout,
        progress=not args.no_progress,
        root=root,
    )
    print(format_table(results))
    print(f"\nexecuted notebooks and summary.json in {out_dir}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
