"""The README's lesson table: its compute-time column is the recorded run it names, not a number typed in."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> dict[str, list[str]]:
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"^\| (\d\d) \|", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in line.strip().strip("|").split("|")]
    return rows


def compute_minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def test_the_compute_column_is_the_recorded_run_it_names():
    readme = (ROOT / "README.md").read_text()
    runs = re.findall(r"docs/recorded_runs/([\w.-]+)/report\.md", readme)
    assert runs, "the README names the recorded runs its compute column comes from"
    measured = {}
    for run in dict.fromkeys(runs):  # a lesson comes from the first run that holds it
        summary = json.loads((ROOT / "docs" / "recorded_runs" / run / "summary.json").read_text())
        for n in summary["notebooks"]:
            if n["kind"] == "solutions":
                measured.setdefault(Path(n["path"]).name[:2], n)
    rows = _rows()
    assert set(rows) == set(measured), f"lessons in the README {sorted(rows)}, in the recorded run {sorted(measured)}"
    for lesson, cells in rows.items():
        n = measured[lesson]
        assert n["ok"] and n["profile"] == "cpu", f"lesson {lesson}: the recorded run must be a passing cpu-profile run"
        assert cells[-1] == compute_minutes(n["seconds"]), (
            f"lesson {lesson}: README says {cells[-1]!r}, the recorded run {compute_minutes(n['seconds'])!r}"
        )
