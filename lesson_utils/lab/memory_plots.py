"""Pictures of KV-cache memory: an arena's slots by kind, a memory map over time, breakdown bars."""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from lesson_utils.core.types import SlotKind
from lesson_utils.lab.plotting import COLORS

KIND_COLORS = [COLORS[k] for k in SlotKind]
KIND_CMAP = ListedColormap(KIND_COLORS)
FREE_LABEL = "free (external fragmentation while requests wait)"


def legend_patches() -> list[Patch]:
    labels = [k.value for k in SlotKind][:3] + [FREE_LABEL]
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


def draw_memory_map(
    ax, maps: list[tuple[int, np.ndarray]], stride: int, title: str = "", step_time_s: float | None = None
):
    """Time (down) x address (across): every recorded step's slots by kind."""
    image = np.stack([m for _, m in maps])
    steps = [s for s, _ in maps]
    y0, y1 = steps[0], steps[-1]
    if step_time_s:
        y0, y1 = y0 * step_time_s, y1 * step_time_s
    ax.imshow(
        image,
        aspect="auto",
        cmap=KIND_CMAP,
        vmin=0,
        vmax=3,
        interpolation="nearest",
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
    for i, kind in enumerate(SlotKind):
        values = np.array([rows[n].get(kind, 0.0) for n in names])
        ax.barh(
            names,
            values,
            left=left,
            color=KIND_COLORS[i],
            edgecolor="white",
            label=kind.value if kind is not SlotKind.FREE else "external fragmentation & free",
        )
        for y, (x0, v) in enumerate(zip(left, values)):
            if v >= 6:
                ax.text(
                    x0 + v / 2,
                    y,
                    f"{v:.1f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if i in (0, 2) else "black",
                )
        left += values
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the KV-cache budget (%)")
    ax.invert_yaxis()
    ax.grid(False)
    if title:
        ax.set_title(title)


REQUEST_COLORS = ["#1565c0", "#e64a19", "#2e7d32", "#6a1b9a", "#f9a825", "#00838f", "#ad1457", "#5d4037"]


def block_snapshot(manager, label: str = "") -> dict:
    """What :func:`draw_block_tables` needs from a BlockManager, copied (so later steps don't change it)."""
    view = manager.view
    return {
        "label": label,
        "num_blocks": view.num_blocks,
        "block_size": view.block_size,
        "tables": view.tables_now(),
        "ref_counts": [view.ref_count(b) for b in range(view.num_blocks)] if view.can_fork else None,
        "cached": set(view.cached_blocks()),
    }


def draw_block_tables(ax_logical, ax_physical, snap: dict, names: dict | None = None) -> None:
    """Top: each request's logical blocks (labelled with the physical block they map to).
    Bottom: the physical blocks, coloured by owner, filled as far as they hold tokens."""
    from matplotlib.patches import Rectangle

    bs, nb = snap["block_size"], snap["num_blocks"]
    names = names or {}
    owners = {}
    for row, (sid, (blocks, ntok)) in enumerate(sorted(snap["tables"].items())):
        color = REQUEST_COLORS[sid % len(REQUEST_COLORS)]
        for i, b in enumerate(blocks):
            fill = min(bs, ntok - i * bs) / bs
            ax_logical.add_patch(Rectangle((i, -row - 0.9), 0.95, 0.8, facecolor="white", edgecolor=color, lw=1.5))
            ax_logical.add_patch(Rectangle((i, -row - 0.9), 0.95 * fill, 0.8, facecolor=color, alpha=0.35))
            ax_logical.text(i + 0.47, -row - 0.5, f"→{b}", ha="center", va="center", fontsize=8)
            owners[b] = (color, fill, names.get(sid, f"req {sid}"))
        ax_logical.text(
            -0.2, -row - 0.5, names.get(sid, f"req {sid}"), ha="right", va="center", fontsize=9, color=color
        )
    rows = max(1, len(snap["tables"]))
    ax_logical.set_xlim(-1.5, max([len(b) for b, _ in snap["tables"].values()] + [4]) + 0.5)
    ax_logical.set_ylim(-rows - 0.2, 0.2)
    ax_logical.set_title(f"logical blocks of each request (→ physical block id)   {snap['label']}")
    ax_logical.axis("off")
    per_row = min(nb, 16)
    for b in range(nb):
        x, y = b % per_row, -(b // per_row)
        color, fill, _ = owners.get(b, ("#cfd8dc", 0.0, ""))
        refs = snap.get("ref_counts")
        shared = refs is not None and refs[b] > 1
        ax_physical.add_patch(
            Rectangle(
                (x, y - 0.9),
                0.95,
                0.8,
                facecolor="white",
                edgecolor="black" if shared else "#90a4ae",
                lw=2 if shared else 1,
            )
        )
        ax_physical.add_patch(
            Rectangle((x, y - 0.9), 0.95 * fill, 0.8, facecolor=color, alpha=0.8, hatch="///" if shared else None)
        )
        text = str(b) if refs is None or refs[b] == 0 else f"{b}\n×{refs[b]}"
        if refs is not None and refs[b] == 0 and b in snap.get("cached", ()):
            text = f"{b}\ncached"
        ax_physical.text(x + 0.47, y - 0.5, text, ha="center", va="center", fontsize=7)
    ax_physical.set_xlim(-0.2, per_row + 0.2)
    ax_physical.set_ylim(-(nb + per_row - 1) // per_row - 0.2, 0.2)
    extra = "; ×n = reference count, hatched = shared" if snap.get("ref_counts") is not None else ""
    ax_physical.set_title(f"physical blocks ({bs} slots each; shading = slots holding tokens{extra})")
    ax_physical.axis("off")
