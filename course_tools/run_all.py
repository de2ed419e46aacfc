"""Execute the course notebooks top to bottom and report what passed: the instructor's main check.

Usage, from the repository root::

    python -m course_tools.run_all                          # every solution notebook, strict checkers
    python -m course_tools.run_all --profile ci --which both
    python -m course_tools.run_all --only 03 --timeout 600 --out runs/lesson03
    python -m course_tools.run_all --which both --jobs 2   # two notebooks at a time (one kernel each)
    python -m course_tools.run_all --compare runs/2025-01-10-gpu/summary.json   # beside the last recorded run

Each notebook runs in a fresh ``python3`` kernel whose working directory is the notebook's folder and
whose environment has

* ``COURSE_HEADLESS=1`` - the plotting helpers draw static figures;
* ``COURSE_STRICT=1`` for solution notebooks unless ``--no-strict`` - checkers raise instead of printing
  (student notebooks never run strict: the variable is removed from their environment);
* ``COURSE_PROFILE`` when ``--profile`` is given (else the kernel chooses, see ``lesson_utils.core.env``);
* ``COURSE_DEVICE_DISCIPLINE=1`` for the kinds ``--device-discipline`` names (CI: the solutions) - on a CPU,
  tensors made on the wrong device then fail as they would on a GPU (``lesson_utils.core.device_discipline``);
* the repository root (and the checkout this ``lesson_utils`` runs from) first on ``PYTHONPATH`` - the
  checkout's ``lesson_utils`` is the one tested, installed or not;
* this interpreter's folder first on ``PATH`` - the kernel runs the same Python as this command.

Results go to ``OUT`` (default ``runs/<UTC timestamp>-<profile>``)::

    OUT/solutions/NN_name.ipynb    executed notebooks (also when they fail: outputs up to the failure)
    OUT/notebooks/NN_name.ipynb
    OUT/figures/<kind>/<NN_name>/cellCCC_K.png   every PNG the notebook displayed
    OUT/logs/<kind>/NN_name.log    the kernel process's own output (crashes), only when there is any
    OUT/summary.json               one record per notebook (see NotebookResult)
    OUT/report.md                  the same for people: header (time, profile, device, versions), then per
                                   lesson each notebook's result, wall time, KEY lines and figures

Notebooks report headline numbers by printing lines that start with ``KEY:``; their text is collected,
in order, into ``key_lines`` of the summary, and those of the form ``KEY: name = value`` (e.g.
``KEY: KV bytes per token, OPT-125m fp16 = 36,864 B``) also into the ``key_numbers`` mapping.
Student notebooks' checkers print "... not implemented yet ..." per unsolved exercise: ``unsolved_count``.

``--jobs N`` executes up to N notebooks at once (each in its own kernel; results stay in input order).
``--compare PREVIOUS/summary.json`` prints each notebook's previous wall time and KEY lines beside this run's
(what is read out of a notebook: :mod:`course_tools.nb_outputs`; what is written: ``run_report``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from course_tools.nb_outputs import (
    KINDS,
    NotebookResult,
    WatchedClient,
    _kind_of,
    _probe,
    _tail,
    count_unsolved,
    key_lines,
    key_numbers,
    save_figures,
)
from course_tools.run_report import (
    format_comparison,
    format_table,
    load_summary,
    record_run,
    write_report,
    write_summary,
)

LESSON_GLOB = "[0-9][0-9]_*.ipynb"

_LOG_DIRS = threading.Lock()  # creating and removing OUT/logs/<kind>/, from several threads with --jobs


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


def kernel_env(
    kind: str, profile: str | None, strict: bool, root: Path | str, discipline: bool = False
) -> dict[str, str]:
    """The environment a notebook's kernel starts with."""
    env = dict(os.environ)
    env["COURSE_HEADLESS"] = "1"
    if discipline:
        env["COURSE_DEVICE_DISCIPLINE"] = "1"
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
    discipline: bool = False,
) -> NotebookResult:
    """Execute one notebook in a fresh kernel; write the executed copy and its figures under ``out_dir``.

    The kernel process's own stdout/stderr (crash messages, not cell outputs) go to
    ``out_dir/logs/<kind>/<name>.log``, kept only when not empty.

    Long on purpose: every way a notebook's run can end (a cell error, a timeout, a dead kernel) is recorded here."""
    path, out_dir, root = Path(path), Path(out_dir), Path(root)
    kind = _kind_of(path)
    strict = (kind == "solutions") if strict is None else (strict and kind == "solutions")
    nb = nbformat.read(path, as_version=4)
    client = WatchedClient(
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
    with _LOG_DIRS:  # with --jobs, another notebook may be removing the empty log folder right now
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "wb")
    probe = True
    start = time.perf_counter()
    with log:
        try:
            with client.setup_kernel(env=kernel_env(kind, profile, strict, root, discipline), stdout=log, stderr=log):
                try:
                    for index, cell in enumerate(nb.cells):
                        result.error_cell = index
                        silent, still = client.run_watched(cell, index)
                        if silent:
                            result.silent_cells.append(f"cell {index}: {silent}")
                        if still:
                            result.still_stretches.append(f"cell {index}: {still}")
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
    try:
        kernel_log = log_path.read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:  # another run writing into the same OUT removed it: a log is never worth a crash
        kernel_log = ""
    if kernel_log:
        result.kernel_log = _rel(log_path, out_dir)
        if not result.ok and result.error and result.error.startswith("the kernel died"):
            result.error += "\nkernel log:\n" + _tail(kernel_log)
    else:
        with _LOG_DIRS:
            log_path.unlink(missing_ok=True)
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


def run_notebooks(
    paths,
    out_dir: Path | str,
    profile: str | None = None,
    strict: bool | None = None,
    timeout: int = 1200,
    progress: bool = True,
    root: Path | str = ".",
    jobs: int = 1,
    discipline: tuple[str, ...] = (),
) -> list[NotebookResult]:
    """Execute ``paths``; write executed copies, figures, ``out_dir/summary.json`` and ``out_dir/report.md``.

    ``strict=None`` means strict for solution notebooks; student notebooks are never strict. Notebooks of the
    kinds in ``discipline`` ("solutions", "notebooks") run in the device-discipline mode.
    ``jobs`` notebooks run at once (threads, each driving its own kernel process); the results come back
    in the order of ``paths`` whatever order they finish in.
    """
    paths = [Path(p) for p in paths]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(int(jobs), len(paths) or 1))
    results: list[NotebookResult | None] = [None] * len(paths)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(paths), unit="notebook", file=sys.stderr, dynamic_ncols=True)

    def run(path: Path) -> NotebookResult:
        return run_notebook(
            path,
            out_dir,
            root=root,
            profile=profile,
            strict=strict,
            timeout=timeout,
            discipline=_kind_of(path) in discipline,
        )

    def finished(index: int, result: NotebookResult) -> None:
        results[index] = result
        if bar is not None:
            bar.update(1)
            done = [r for r in results if r is not None]
            bar.set_postfix_str(f"failed {sum(not r.ok for r in done)}")

    start = time.perf_counter()
    try:
        if jobs == 1:
            for index, path in enumerate(paths):
                if bar is not None:
                    bar.set_description(f"{_kind_of(path)}/{path.name}")
                finished(index, run(path))
        else:
            if bar is not None:
                bar.set_description(f"{jobs} at a time")
            with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="run_all") as pool:
                futures = {pool.submit(run, path): index for index, path in enumerate(paths)}
                for future in as_completed(futures):
                    finished(futures[future], future.result())
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - start
    done = [r for r in results if r is not None]
    write_summary(
        done,
        out_dir,
        profile_requested=profile,
        strict_solutions=True if strict is None else bool(strict),
        timeout_per_cell=timeout,
        jobs=jobs,
        wall_seconds=round(elapsed, 2),
    )
    write_report(done, out_dir, wall_seconds=elapsed)
    return done


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_tools.run_all",
        description="Execute the course notebooks and report which pass.",
    )
    parser.add_argument("--root", default=".", help="repository root (default: the current folder)")
    parser.add_argument(
        "--profile", choices=("gpu", "cpu", "ci"), help="COURSE_PROFILE for the kernels (default: auto)"
    )
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
    parser.add_argument(
        "--device-discipline",
        choices=("solutions", "notebooks", "both"),
        help="run these notebooks with COURSE_DEVICE_DISCIPLINE=1: on a CPU, a tensor made on the wrong device "
        "fails as it would on a GPU (what CI does for the solutions)",
    )
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="run up to N notebooks at once (default 1)")
    parser.add_argument(
        "--record",
        metavar="DIR",
        help="also copy the run's summary, figures and a report that links only to them into DIR (for docs/recorded_runs/)",
    )
    parser.add_argument(
        "--compare",
        metavar="PREVIOUS_SUMMARY_JSON",
        help="print the wall time and KEY lines of a previous run (its summary.json or folder) next to this run's",
    )
    args = parser.parse_args(argv)

    root = Path(args.root)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    previous = None
    if args.compare:  # read it first: a wrong path should fail before an hour of notebooks, not after
        try:
            previous = load_summary(args.compare)
        except (OSError, ValueError) as exc:
            parser.error(f"--compare: cannot read {args.compare}: {exc}")
    paths = find_notebooks(root, args.which, args.only)
    if not paths:
        print(f"no {args.which} notebooks under {root.resolve()} match {args.only!r}", file=sys.stderr)
        return 1
    label = args.profile or os.environ.get("COURSE_PROFILE") or "auto"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out) if args.out else root / "runs" / f"{stamp}-{label}"
    print(f"running {len(paths)} notebook(s), profile {label}, {args.jobs} at a time, results in {out_dir}")
    results = run_notebooks(
        paths,
        out_dir,
        profile=args.profile,
        strict=args.strict,
        timeout=args.timeout,
        progress=not args.no_progress,
        root=root,
        jobs=args.jobs,
        discipline={None: (), "both": ("solutions", "notebooks")}.get(
            args.device_discipline, (args.device_discipline,)
        ),
    )
    print(format_table(results))  # run_notebooks has written summary.json and report.md
    if previous is not None:
        print(f"\n--- compared with {args.compare} ---")
        print(format_comparison(results, previous, "previous run"))
    print(f"\nexecuted notebooks, summary.json and report.md in {out_dir}")
    if args.record:
        print(f"recorded (summary, figures, report) in {record_run(out_dir, args.record).parent}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
