"""Draw one pipeline step as an RGB image: a row per pipeline rank, time left to right, one block per action.

Plain torch (no plotting library): the picture is a few hundred filled rectangles.
"""

from __future__ import annotations

import torch

from lightning_3d.pipeline.timeline import Action

# Forward blue, backward green, weight gradient (zero-bubble schedules) orange; idle stays white.
COLORS = {"F": (66, 133, 244), "B": (52, 168, 83), "W": (251, 140, 0)}
BACKGROUND, EDGE = 255, (40, 40, 40)
ROW_HEIGHT, ROW_GAP, MARGIN = 24, 6, 4


def draw_timeline(rows: list[list[Action]], width: int = 800) -> torch.Tensor:
    """``rows[r]``: the actions of pipeline rank ``r`` (stage order, top to bottom). Returns ``(H, W, 3)``
    uint8 (TensorBoard's ``add_image(..., dataformats="HWC")``). Successive micro-batches alternate between a
    full and a lighter shade, later virtual stages of a rank are darker, and each block starts with a dark
    edge, so neighbouring blocks stay apart; blank space is the bubble."""
    height = 2 * MARGIN + len(rows) * ROW_HEIGHT + (len(rows) - 1) * ROW_GAP
    image = torch.full((height, width, 3), BACKGROUND, dtype=torch.uint8)
    actions = [a for row in rows for a in row]
    if not actions:
        return image
    t0, t1 = min(a.start for a in actions), max(a.end for a in actions)
    scale = (width - 2 * MARGIN - 1) / max(t1 - t0, 1e-12)
    first_stage = {r: min(a.stage for a in row) for r, row in enumerate(rows) if row}
    for r, row in enumerate(rows):
        top = MARGIN + r * (ROW_HEIGHT + ROW_GAP)
        for a in row:
            left = MARGIN + round((a.start - t0) * scale)
            right = max(left + 1, MARGIN + round((a.end - t0) * scale))
            image[top:top + ROW_HEIGHT, left:right] = torch.tensor(_shade(a, a.stage - first_stage[r]))
            image[top:top + ROW_HEIGHT, left] = torch.tensor(EDGE, dtype=torch.uint8)
    return image


def _shade(action: Action, virtual: int) -> tuple[int, int, int]:
    color = torch.tensor(COLORS.get(action.kind, (128, 128, 128)), dtype=torch.float32)
    if action.microbatch % 2:
        color = color + (255 - color) * 0.35  # lighter
    color = color * (0.75 ** virtual)  # darker for a rank's later (virtual) stages
    return tuple(int(c) for c in color.clamp(0, 255).round().tolist())
