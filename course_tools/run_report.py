"""What :mod:`course_tools.run_all` writes and prints about a run: ``summary.json`` (one record per notebook),
``report.md`` (the same for people: header, then per lesson each notebook's result, wall time, KEY lines and
figures), a recorded run copied into ``docs/``, and the comparison with a previous run's summary."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from datetime import datetime, timezone
from itertools import zip_longest
from pathlib import Path

import nbformat

from course_tools.nb_outputs import KINDS, SILENT_S, NotebookResult


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
        if r.still_stretches:
            lines += ["", f"**Still stretches** (cells in which nothing moved for over {SILENT_S:.0f} s at a time)", ""]
            lines += [f"- {c}" for c in r.still_stretches]
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
    results = [NotebookResult(**record) for record in summary["notebooks"]]
    for (
        r
    ) in results:  # a notebook recorded again: its earlier figures go, so the folder holds only what its report shows
        shutil.rmtree(dest / "figures" / r.kind / Path(r.path).stem, ignore_errors=True)
    if (run_dir / "figures").is_dir():
        shutil.copytree(run_dir / "figures", dest / "figures", dirs_exist_ok=True)
    shutil.copy2(run_dir / "summary.json", dest / "summary.json")
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
