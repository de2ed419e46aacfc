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
In student notebooks the checkers print "... not implemented yet ..." for each unsolved exercise; the
number of those messages is ``unsolved_count``.

``--jobs N`` executes up to N notebooks at once (each in its own kernel process; results stay in input
order). ``--compare PREVIOUS/summary.json`` prints, per notebook, the previous run's wall time and KEY lines
next to this run's - e.g. a class machine beside the last recorded run.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from itertools import zip_longest
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

KINDS = ("solutions", "notebooks")
LESSON_GLOB = "[0-9][0-9]_*.ipynb"
UNSOLVED_TEXT = "not implemented yet"
KEY_PREFIX = "KEY:"
SILENT_S = 5.0  # a cell that runs longer than this shows moving progress (a tqdm bar), or the report names it
ERROR_TAIL_LINES = 8

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LOG_DIRS = threading.Lock()  # creating and removing OUT/logs/<kind>/, from several threads with --jobs

# Runs in the kernel after the notebook: what profile, device and versions it actually used.
_PROBE = """\
def __course_probe():
    import json
    try:
        from lesson_utils.core import env
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
    silent_cells: list[str] = field(default_factory=list)  # cells over SILENT_S seconds that showed no progress bar

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
                found.append(line[len(KEY_PREFIX) :].strip())
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
    discipline: bool = False,
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
                        t_cell = time.perf_counter()
                        client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                        silent = silent_cell(cell, time.perf_counter() - t_cell)
                        if silent:
                            result.silent_cells.append(f"cell {index}: {silent}")
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


def shows_progress(cell) -> bool:
    """Whether a cell's outputs hold a progress bar: a tqdm widget, or tqdm's text bar in a stream."""
    for out in cell.get("outputs", []):
        if "application/vnd.jupyter.widget-view+json" in out.get("data", {}):
            return True
        text = out.get("text", "")
        if out.get("output_type") == "stream" and re.search(
            r"\d+%\|", "".join(text) if isinstance(text, list) else text
        ):
            return True
    return False


def silent_cell(cell, seconds: float) -> str | None:
    """``"12.3 s: first line"`` for a code cell that ran over :data:`SILENT_S` without a progress bar, else None."""
    if cell.get("cell_type") != "code" or seconds <= SILENT_S or shows_progress(cell):
        return None
    lines = [line for line in cell.get("source", "").splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return f"{seconds:.1f} s without a progress bar: `{(lines[0] if lines else '').strip()[:80]}`"


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
            info = json.loads(line[len(_PROBE_TAG) :]) if line else {"probe_error": _tail(text or "no output", 3)}
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


def _lesson_of(result: NotebookResult) -> str:
    """The lesson a notebook belongs to: its file stem ("02_measuring_fragmentation")."""
    return Path(result.path).stem


def _lesson_order(results: list[NotebookResult]) -> list[NotebookResult]:
    """By lesson file name (NN_ first), the solution before the student notebook of a lesson."""
    rank = {kind: i for i, kind in enumerate(KINDS)}
    return sorted(results, key=lambda r: (_lesson_of(r), rank.get(r.kind, len(KINDS)), r.path))


def _title_of(result: NotebookResult, out_dir: Path) -> str | None:
    """The notebook's first Markdown heading ("# 02 · Measuring ..."), read from its executed copy, or from the
    notebook itself where no copy is kept (a recorded run)."""
    candidates = ([out_dir / result.executed_path] if result.executed_path else []) + [Path(result.path)]
    nb = None
    for candidate in candidates:
        try:
            nb = nbformat.read(candidate, as_version=4)
            break
        except Exception:  # noqa: BLE001 - a title is a nicety
            continue
    if nb is None:
        return None
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return None


def _distinct(values) -> list[str]:
    seen: list[str] = []
    for value in values:
        if value and value not in seen:
            seen.append(value)
    return seen


def _versions_text(versions: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items()) or "unknown"


def write_report(results: list[NotebookResult], out_dir: Path | str, *, wall_seconds: float | None = None) -> Path:
    """``out_dir/report.md``: the run for people, to keep with the executed notebooks and figures.

    A header (UTC time, profile, device, versions, as the kernels reported them), a table of every
    notebook, then one section per lesson in lesson order: for each of its notebooks the kind, pass/fail,
    wall time, device and profile, the ``KEY:`` lines as bullets and every figure as an image link
    (paths relative to ``out_dir``, so the report renders next to its ``figures/`` folder).
    """
    out_dir = Path(out_dir)
    path = out_dir / "report.md"
    ordered = _lesson_order(results)
    profiles = _distinct(r.profile for r in results) or ["unknown"]
    devices = _distinct(r.device_name for r in results) or ["unknown"]
    version_sets = _distinct(_versions_text(r.versions) for r in results if r.versions) or ["unknown"]
    passed = sum(r.ok for r in results)
    lines = [
        "# Course run report",
        "",
        f"- **When**: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M:%S')} UTC",
        f"- **Profile**: {', '.join(profiles)}",
        f"- **Device**: {'; '.join(devices)}",
        f"- **Versions**: {' | '.join(version_sets)}",
        f"- **Result**: {passed}/{len(results)} notebooks passed"
        + (f" in {wall_seconds:.0f} s of wall time" if wall_seconds is not None else ""),
        "",
        "Every number below was computed in this run, by the notebooks' own `KEY:` lines; machine-readable: "
        "`summary.json`. "
        + (
            "Executed notebooks: `solutions/` and `notebooks/` next to this file."
            if any(r.executed_path and (out_dir / r.executed_path).exists() for r in results)
            else "The executed notebooks are not kept with this report (rerun `python -m course_tools.run_all` to get them)."
        ),
        "",
        "| notebook | kind | result | wall time (s) | unsolved |",
        "|---|---|---|---:|---:|",
    ]
    for r in ordered:
        unsolved = str(r.unsolved_count) if r.kind == "notebooks" else "-"
        lines.append(f"| `{r.path}` | {r.kind} | {'pass' if r.ok else '**FAIL**'} | {r.seconds:.1f} | {unsolved} |")
    current = None
    for r in ordered:
        lesson = _lesson_of(r)
        if lesson != current:
            current = lesson
            title = _title_of(r, out_dir)
            lines += ["", f"## {lesson}" + (f": {title}" if title else "")]
        where = f"cell {r.error_cell}" if r.error_cell is not None else "before any cell"
        lines += [
            "",
            f"### `{r.path}`",
            "",
            f"- **Kind**: {r.kind}" + (" (strict checkers)" if r.strict else ""),
            f"- **Result**: {'pass' if r.ok else f'**FAIL** ({where})'}"
            + (f"; {r.unsolved_count} exercise(s) reported unsolved" if r.kind == "notebooks" else ""),
            f"- **Wall time**: {r.seconds:.1f} s",
            f"- **Device / profile**: {r.device_name or 'unknown'} / {r.profile or 'unknown'}",
        ]
        if r.executed_path and (out_dir / r.executed_path).exists():  # a recorded run keeps no notebooks: no dead link
            lines.append(f"- **Executed notebook**: [{r.executed_path}]({r.executed_path})")
        if r.kernel_log and (out_dir / r.kernel_log).exists():
            lines.append(f"- **Kernel log**: [{r.kernel_log}]({r.kernel_log})")
        if not r.ok and r.error:
            lines += ["", "```text", *r.error.splitlines(), "```"]
        if r.silent_cells:
            lines += ["", f"**Silent cells** (over {SILENT_S:.0f} s without a progress bar)", ""]
            lines += [f"- {c}" for c in r.silent_cells]
        lines += ["", "**Key findings**", ""]
        lines += [f"- {line}" for line in r.key_lines] or ["- (none printed)"]
        lines += ["", "**Figures**", ""]
        figures = [f for f in r.figures if (out_dir / f).exists()]
        if figures:
            lines += [f"![{Path(f).stem}]({f})" for f in figures]
        else:
            lines.append("(none)")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def record_run(run_dir: Path | str, dest: Path | str) -> Path:
    """Copy a finished run into ``dest`` for ``docs/recorded_runs/``: its ``summary.json`` and ``figures/``, and a
    ``report.md`` written anew there, so that it links only to files that are in ``dest`` (the executed notebooks
    and kernel logs stay behind: megabytes per run). Returns the new report's path."""
    run_dir, dest = Path(run_dir), Path(dest)
    summary = load_summary(run_dir)
    dest.mkdir(parents=True, exist_ok=True)
    if (run_dir / "figures").is_dir():
        shutil.copytree(run_dir / "figures", dest / "figures", dirs_exist_ok=True)
    shutil.copy2(run_dir / "summary.json", dest / "summary.json")
    results = [NotebookResult(**record) for record in summary["notebooks"]]
    return write_report(results, dest, wall_seconds=summary.get("settings", {}).get("wall_seconds"))


def load_summary(path: Path | str) -> dict:
    """A previous run's summary.json (``path`` may also be the run's folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    return json.loads(path.read_text(encoding="utf-8"))


def format_comparison(results: list[NotebookResult], previous: dict, previous_name: str = "previous run") -> str:
    """Per notebook: this run's and the previous run's wall time and KEY lines, side by side.

    ``previous`` is a loaded summary.json. KEY lines are paired in order (the notebooks print them in a
    fixed order); identical pairs are printed once.
    """
    before = {record["path"]: record for record in previous.get("notebooks", [])}
    ours = {r.path for r in results}

    def about(records) -> str:
        profiles = ", ".join(_distinct(r.get("profile") for r in records)) or "?"
        devices = "; ".join(_distinct(r.get("device_name") for r in records)) or "?"
        return f"profile {profiles}, {devices}"

    lines = [
        f"this run:     {about([asdict(r) for r in results])}",
        f"{previous_name}: {about(list(before.values()))}, created {previous.get('created', '?')}",
    ]
    for r in _lesson_order(results):
        old = before.get(r.path)
        now = f"{r.seconds:7.1f} s {'pass' if r.ok else 'FAIL'}"
        lines.append("")
        if old is None:
            lines.append(f"{r.path}: this run {now}; not in the {previous_name}")
            lines.extend(f"    now:    {line}" for line in r.key_lines)
            continue
        then = f"{old.get('seconds', 0.0):7.1f} s {'pass' if old.get('ok') else 'FAIL'}"
        lines.append(f"{r.path}: this run {now} | {previous_name} {then}")
        for new_line, old_line in zip_longest(r.key_lines, old.get("key_lines", [])):
            if new_line == old_line:
                lines.append(f"    same:   {new_line}")
            else:
                lines.append(f"    now:    {new_line if new_line is not None else '(missing)'}")
                lines.append(f"    before: {old_line if old_line is not None else '(missing)'}")
    missing = [p for p in before if p not in ours]
    if missing:
        lines += ["", f"in the {previous_name} only: " + ", ".join(missing)]
    return "\n".join(lines)


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
        lines.append(
            "  ".join(cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths)))
        )
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
