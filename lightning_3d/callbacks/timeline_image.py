"""Draw one pipeline step as an RGB image: a row per pipeline rank, time left to right, one bar per action.

With matplotlib installed (``pip install lightning-3d[plots]``) the picture is labelled: stage names, the
micro-batch number on each bar, a time axis in ms, a legend and a title. Without it, the same bars are drawn
pixel by pixel with torch, unlabelled, so the callback works on a bare install.
"""

from __future__ import annotations

import torch

from lightning_3d.pipeline.timeline import Action

# Forward blue, backward green, weight gradient (zero-bubble schedules) orange; idle stays white.
COLORS = {"F": (66, 133, 244), "B": (52, 168, 83), "W": (251, 140, 0)}
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
BACKGROUND, EDGE = 255, (40, 40, 40)
ROW_HEIGHT, ROW_GAP, MARGIN = 24, 6, 4
# The labelled picture: 100 dpi, so a figure's inches times 100 are its pixels.
DPI, FIGURE_ROW_PX, FIGURE_FRAME_PX = 100, 40, 110


def draw_timeline(rows: list[list[Action]], width: int = 800, ranks: list[int] | None = None,
                  title: str = "") -> torch.Tensor:
    """``rows[r]``: the actions of the ``r``-th stage's rank (stage order, top to bottom), ``ranks[r]`` its global
    rank (default ``r``). Returns ``(H, W, 3)`` uint8 (TensorBoard's ``add_image(..., dataformats="HWC")``):
    :func:`timeline_figure` rendered, or :func:`draw_timeline_pixels` where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401  (only to learn whether it is there)
    except ImportError:
        return draw_timeline_pixels(rows, width)
    return render_rgb(timeline_figure(rows, width, ranks, title))


def figure_height(num_rows: int) -> int:
    """Pixels of the labelled picture of ``num_rows`` rows: the rows plus the title, axis and legend."""
    return FIGURE_FRAME_PX + num_rows * FIGURE_ROW_PX


def timeline_figure(rows: list[list[Action]], width: int = 800, ranks: list[int] | None = None, title: str = ""):
    """A matplotlib ``Figure`` (not attached to pyplot: no global state, no window) of ``width`` x
    ``figure_height(len(rows))`` pixels. Row ``r`` is labelled "stage s (rank g)" ("stages 0, 2 (rank g)"
    with virtual stages); each bar carries its micro-batch number where it is wide enough to read; x is ms
    from the step's first action."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = list(range(len(rows))) if ranks is None else ranks
    fig = Figure(figsize=(width / DPI, figure_height(len(rows)) / DPI), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    actions = [a for row in rows for a in row]
    t0 = min((a.start for a in actions), default=0.0)
    span_ms = max((a.end for a in actions), default=t0) * 1e3 - t0 * 1e3
    # A bar narrower than about two digits would carry an unreadable number; ~90% of the width is the axes.
    min_label_ms = span_ms * 16 / (0.9 * width)
    for r, row in enumerate(rows):
        virtual = virtual_index(row)
        spans = [((a.start - t0) * 1e3, (a.end - a.start) * 1e3) for a in row]
        # One collection per row: a bar artist per action takes seconds for a few hundred actions.
        ax.broken_barh(spans, (r - 0.4, 0.8), linewidth=0.3, edgecolor=tuple(c / 255 for c in EDGE),
                       facecolors=[tuple(c / 255 for c in shade(a, virtual[a.stage])) for a in row])
        for a, (left, length) in zip(row, spans):
            if length >= min_label_ms:
                ax.text(left + length / 2, r, str(a.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [row_label(row, rank) for row, rank in zip(rows, ranks)])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # stage 0 on top, as in every pipeline diagram
    ax.set_xlim(0, max(span_ms, 1e-6))
    ax.set_xlabel("ms since the step's first action")
    kinds = [k for k in COLORS if any(a.kind == k for a in actions)]
    ax.legend(handles=[Patch(color=tuple(c / 255 for c in COLORS[k]), label=KIND_NAMES[k]) for k in kinds],
              loc="lower left", bbox_to_anchor=(1.0, 0.0), fontsize=7, frameon=False)
    ax.set_title(title, fontsize=9)
    return fig


def row_label(row: list[Action], rank: int) -> str:
    stages = sorted({a.stage for a in row})
    if not stages:  # a rank that recorded nothing
        return f"rank {rank}"
    if len(stages) == 1:
        return f"stage {stages[0]} (rank {rank})"
    return f"stages {', '.join(map(str, stages))} (rank {rank})"


def render_rgb(fig) -> torch.Tensor:
    """Draw ``fig`` with the non-interactive Agg canvas: ``(H, W, 3)`` uint8."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return torch.from_numpy(np.array(canvas.buffer_rgba())[..., :3])


def draw_timeline_pixels(rows: list[list[Action]], width: int = 800) -> torch.Tensor:
    """The unlabelled picture, plain torch. Successive micro-batches alternate between a full and a lighter
    shade, later virtual stages of a rank are darker, and each block starts with a dark edge, so neighbouring
    blocks stay apart; blank space is the bubble."""
    height = 2 * MARGIN + len(rows) * ROW_HEIGHT + (len(rows) - 1) * ROW_GAP
    image = torch.full((height, width, 3), BACKGROUND, dtype=torch.uint8)
    actions = [a for row in rows for a in row]
    if not actions:
        return image
    t0, t1 = min(a.start for a in actions), max(a.end for a in actions)
    scale = (width - 2 * MARGIN - 1) / max(t1 - t0, 1e-12)
    for r, row in enumerate(rows):
        top = MARGIN + r * (ROW_HEIGHT + ROW_GAP)
        virtual = virtual_index(row)
        for a in row:
            left = MARGIN + round((a.start - t0) * scale)
            right = max(left + 1, MARGIN + round((a.end - t0) * scale))
            image[top:top + ROW_HEIGHT, left:right] = torch.tensor(shade(a, virtual[a.stage]))
            image[top:top + ROW_HEIGHT, left] = torch.tensor(EDGE, dtype=torch.uint8)
    return image


def virtual_index(row: list[Action]) -> dict[int, int]:
    """Stage -> its place among its rank's stages (0 for the first): stages ``r, r + pp, ...`` under the looped
    placement, so the stage number minus the first would be a multiple of pp, not the place."""
    return {stage: i for i, stage in enumerate(sorted({a.stage for a in row}))}


def shade(action: Action, virtual: int) -> tuple[int, int, int]:
    color = torch.tensor(COLORS.get(action.kind, (128, 128, 128)), dtype=torch.float32)
    if action.microbatch % 2:
        color = color + (255 - color) * 0.35  # lighter
    color = color * (0.75 ** virtual)  # darker for a rank's later (virtual) stages
    return tuple(int(c) for c in color.clamp(0, 255).round().tolist())
