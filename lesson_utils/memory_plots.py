"""Pictures of KV-cache memory: an arena's slots by kind, a memory map over time, breakdown bars."""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from .plotting import COLORS
from .reservation import KIND_NAMES

KIND_COLORS = [COLORS["token states"], COLORS["reserved"], COLORS["internal fragmentation"], COLORS["free"]]
KIND_CMAP = ListedColormap(KIND_COLORS)
FREE_LABEL = "free (external fragmentation while requests wait)"


def legend_patches() -> list[Patch]:
    labels = list(KIND_NAMES[:3]) + [FREE_LABEL]
    return [Patch(facecolor=c, edgecolor="#555", label=l) for c, l in zip(KIND_COLORS, labels)]


def draw_arena(ax, kinds: np.ndarray, title: str = "", boundaries: list[int] | None = None) -> None:
    """One row of slots coloured by kind; ``boundaries`` marks where reservations start."""
    ax.imshow(kinds[None, :], aspect="auto", cmap=KIND_CMAP, vmin=0, vmax=3, interpolation="nearest")
    for b in boundaries or []:
        ax.axvline(b - 0.5, color="black", lw=1)
    ax.set_yticks([])
    ax.set_xlabel("slot")
    ax.grid(False)
    if title:
        ax.set_title(title)


def draw_memory_map(ax, maps: list[tuple[int, np.ndarray]], stride: int, title: str = "", step_time_s: float | None = None):
    """Time (down) x address (across): every recorded step's slots by kind."""
    image = np.stack([m for _, m in maps])
    steps = [s for s, _ in maps]
    y0, y1 = steps[0], steps[-1]
    if step_time_s:
        y0, y1 = y0 * step_time_s, y1 * step_time_s
    ax.imshow(
        image, aspect="auto", cmap=KIND_CMAP, vmin=0, vmax=3, interpolation="nearest",
        extent=(0, image.shape[1] * stride, y1, y0),
    )
    ax.set_xlabel("slot (address in the KV arena)")
    ax.set_ylabel("time (s)" if step_time_s else "step")
    ax.grid(False)
    if title:
        ax.set_title(title)


def draw_breakdown_bars(ax, rows: dict[str, dict[str, float]], title: str = "") -> None:
    """Stacked horizontal bars: one row per system, shares (%) of the four kinds."""
    names = list(rows)
    left = np.zeros(len(names))
    for i, kind in enumerate(("token states", "reserved", "internal fragmentation", "free")):
        values = np.array([rows[n].get(kind, 0.0) for n in names])
        ax.barh(names, values, left=left, color=KIND_COLORS[i], edgecolor="white",
                label=KIND_NAMES[i] if kind != "free" else "external fragmentation & free")
        for y, (x0, v) in enumerate(zip(left, values)):
            if v >= 6:
                ax.text(x0 + v / 2, y, f"{v:.1f}", ha="center", va="center", fontsize=8,
                        color="white" if i in (0, 2) else "black")
        left += values
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the KV-cache budget (%)")
    ax.invert_yaxis()
    ax.grid(False)
    if title:
        ax.set_title(title)
