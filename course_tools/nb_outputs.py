"""What :mod:`course_tools.run_all` reads out of an executed notebook: its result record
(:class:`NotebookResult`), the ``KEY:`` lines and numbers it printed, the unsolved-exercise messages, its figures,
which long cells showed no progress while a learner waited, and (a probe cell run at the end, then removed) the
profile, device and versions its kernel ran with."""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient

KINDS = ("solutions", "notebooks")


def _kind_of(path: Path) -> str:
    return "notebooks" if path.parent.name == "notebooks" else "solutions"


UNSOLVED_TEXT = "not implemented yet"


KEY_PREFIX = "KEY:"


SILENT_S = 5.0  # a cell that runs longer than this shows moving progress (a tqdm bar), or the report names it


ERROR_TAIL_LINES = 8


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


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
    still_stretches: list[str] = field(default_factory=list)  # cells in which nothing moved for over SILENT_S seconds

    @property
    def name(self) -> str:
        return Path(self.path).name


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


# What a learner sees change while a cell runs: printed text, a figure or table, a progress bar's redraw (a widget
# update), an error. The kernel's busy/idle status is not among them.
VISIBLE_MESSAGES = frozenset(
    {"stream", "display_data", "update_display_data", "execute_result", "error", "clear_output", "comm_msg"}
)


def longest_still_stretch(start: float, stamps: list[float], end: float) -> tuple[float, float]:
    """``(seconds, where)``: the longest time between a cell's start, each visible message's arrival (``stamps``,
    sorted) and its end, and how far into the cell that stretch began."""
    points = [start, *stamps, end]
    gaps = [(b - a, a - start) for a, b in zip(points, points[1:])]
    return max(gaps) if gaps else (0.0, 0.0)


def still_stretch(cell, stretch_s: float, at_s: float) -> str | None:
    """``"22.0 s with nothing moving, 31.5 s into the cell: first line"`` when a code cell showed nothing new for over
    :data:`SILENT_S` seconds at a stretch (a bar that ticks too seldom counts), else None."""
    if cell.get("cell_type") != "code" or stretch_s <= SILENT_S:
        return None
    lines = [line for line in cell.get("source", "").splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return f"{stretch_s:.1f} s with nothing moving, {at_s:.1f} s into the cell: `{(lines[0] if lines else '').strip()[:80]}`"


class WatchedClient(NotebookClient):
    """A notebook client that notes when each visible message of the running cell arrives, so the report can name
    the stretches in which a learner would have seen nothing move."""

    stamps: list[float] = []

    def process_message(self, msg, cell, cell_index):
        if msg.get("msg_type") in VISIBLE_MESSAGES:
            self.stamps.append(time.perf_counter())
        return super().process_message(msg, cell, cell_index)

    def run_watched(self, cell, index: int) -> tuple[str | None, str | None]:
        """Execute one cell; its :func:`silent_cell` and :func:`still_stretch` notes (None where it has none)."""
        self.stamps = []
        start = time.perf_counter()
        self.execute_cell(cell, index, execution_count=self.code_cells_executed + 1)
        end = time.perf_counter()
        return silent_cell(cell, end - start), still_stretch(cell, *longest_still_stretch(start, self.stamps, end))


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
