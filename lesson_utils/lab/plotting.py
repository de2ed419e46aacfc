"""One plot style for the whole course, device-labelled titles, and widgets that survive headless runs.

* :func:`use_course_style` - fonts, grid and a fixed colour for each kind of memory, so "token states" is
  the same green in every lesson.
* :func:`measured_title` - every plot of a *measurement* names the device and profile that produced it.
* :func:`interactive` - core ipywidgets ``interact`` in a live notebook; when executed headless
  (``COURSE_HEADLESS=1``, set by the course's runner) it draws once with the default values instead, so
  executed notebooks and CI keep a picture.
"""

from __future__ import annotations

from typing import Any, Callable

import matplotlib

from lesson_utils.core.env import is_headless  # noqa: F401 - re-exported: the course's one headless test
from lesson_utils.core.types import SlotKind

# The four kinds of KV-cache memory (lesson 02) and a few more, one colour each across the course.
COLORS = {
    SlotKind.TOKEN: "#2e7d32",  # green: K/V of real tokens
    SlotKind.RESERVED: "#f9a825",  # amber: reserved for tokens still to be generated
    SlotKind.INTERNAL: "#e64a19",  # red-orange: over-provisioned, never used
    "external fragmentation": "#9e9e9e",  # grey: free, but in holes
    SlotKind.FREE: "#eceff1",
    "paged": "#1565c0",
    "naive": "#e64a19",
    "paper": "#6a1b9a",
}


def use_course_style() -> None:
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.figsize": (8, 4),
            "figure.dpi": 100,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titlesize": 11,
            "axes.titleweight": "bold",
            "legend.frameon": False,
            "font.size": 10,
        }
    )


def measured_title(text: str, profile=None) -> str:
    """``text`` plus a second line naming the device and profile that measured it."""
    from lesson_utils.core.env import get_profile

    p = profile or get_profile()
    return f"{text}\nmeasured on {p.label()}"


def simulated_title(text: str) -> str:
    """Titles of exact byte-accounting experiments: they hold on any device."""
    return f"{text}\nsimulated (exact memory accounting at T4 scale; no model was run)"


def _default_of(control: Any) -> Any:
    """The value ``interact`` would start with for an abbreviation or widget."""
    if hasattr(control, "value"):
        return control.value
    if isinstance(control, tuple) and len(control) in (2, 3) and all(isinstance(x, (int, float)) for x in control):
        low, high = control[0], control[1]
        mid = (low + high) / 2
        return int(mid) if all(isinstance(x, int) for x in control) else mid
    if isinstance(control, (list, tuple)):
        first = control[0]
        return first[1] if isinstance(first, tuple) else first
    return control


def _start_values(fn: Callable[..., Any], controls: dict[str, Any]) -> dict[str, Any]:
    """The values the controls start at, as ``interact`` picks them: the function's own default for a parameter
    when it has one (a slider ``moment=(0, 9, 1)`` on ``def f(moment=9)`` starts at 9), else the control's."""
    import inspect

    params = inspect.signature(fn).parameters
    start = {}
    for name, control in controls.items():
        default = params[name].default if name in params else inspect.Parameter.empty
        start[name] = _default_of(control) if default is inspect.Parameter.empty else default
    return start


def interactive(fn: Callable[..., Any], **controls: Any) -> None:
    """``ipywidgets.interact(fn, **controls)`` live; one static call with the start values when headless. The
    static picture shows the moment the controls start at (:func:`_start_values`), so a saved notebook's figure is
    the one the caption describes."""
    defaults = _start_values(fn, controls)
    if is_headless():
        fn(**defaults)
        print("(Executed headless: drawn once with the default values. Open the notebook to use the controls.)")
        return
    try:
        from ipywidgets import interact
    except ImportError:  # pragma: no cover - ipywidgets is a dependency
        fn(**defaults)
        return
    # A static picture of the default view first: widgets do not survive saving and reopening a notebook
    # ("Error displaying widget: model not found"), this image does.
    fn(**defaults)
    print(
        "Above: the default view, kept when the notebook is saved. Below: the same figure with controls "
        "(after reopening the notebook, run this cell again to get them back)."
    )
    interact(fn, **controls)


def show(fig=None) -> None:
    """Show a figure (inline in notebooks, nothing in a plain script run with a non-GUI backend)."""
    import matplotlib.pyplot as plt

    if matplotlib.get_backend().lower() == "agg":
        plt.close(fig) if fig is not None else plt.close("all")
        return
    plt.show()


def draw_visibility(ax, query_pos, key_pos, context_len: int, *, title: str, query_labels=None) -> None:
    """A grid of which keys each query may use in causal attention over a ``context_len``-token sequence: one row
    per query position in ``query_pos``, one column per key position in ``key_pos`` (positions past the sequence
    are drawn as "no key"). ``query_labels`` replaces the row labels (lesson 08's first picture hides the
    positions: working them out is the exercise)."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    q = np.asarray(query_pos)[:, None]
    k = np.asarray(key_pos)[None, :]
    grid = np.where(k >= context_len, 2, np.where(k <= q, 1, 0))
    ax.imshow(grid, cmap=ListedColormap(["#ffffff", COLORS["paged"], "#d0d0d0"]), vmin=0, vmax=2, aspect="equal")
    ax.set_xticks(range(len(key_pos)), [str(p) for p in key_pos], fontsize=8)
    labels = query_labels if query_labels is not None else [str(p) for p in query_pos]
    ax.set_yticks(range(len(query_pos)), labels, fontsize=8)
    ax.set_xticks(np.arange(-0.5, len(key_pos)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(query_pos)), minor=True)
    ax.grid(which="minor", color="black", lw=0.5)
    ax.grid(which="major", visible=False)
    ax.tick_params(which="minor", length=0)
    ax.set_title(title, fontsize=9)
