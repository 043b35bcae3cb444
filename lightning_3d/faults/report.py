"""What a rank is doing right now, read from its main thread's Python stack: for hang reports.

A rank stuck in a collective is blocked inside a C++ call with the interpreter lock released, so another
thread can read the main thread's frames (``sys._current_frames``). From them: the innermost
``torch.distributed`` call it waits in and the first frame of ours or the user's above it, the pipeline
action being run (a ``torch.distributed.pipelining`` schedule keeps it in a local named ``action``; a stage
method has its micro-batch id), and the whole stack.
"""

from __future__ import annotations

import sys
import threading
import traceback
from types import FrameType

_TORCH_DISTRIBUTED = ("torch/distributed/", "torch\\distributed\\")
_STAGE_METHODS = {"forward_one_chunk": "forward", "backward_one_chunk": "backward",
                  "backward_weight_one_chunk": "weight-gradient"}


def main_thread_report() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "  (the main thread has no Python frame)"
    frames = _outermost_first(frame)
    lines = []
    waiting = _waiting_in(frames)
    if waiting:
        lines.append(f"  waiting in: {waiting}")
    action = _pipeline_action(frames)
    if action:
        lines.append(f"  pipeline action: {action}")
    lines.append("  Python stack of the main thread (most recent call last):")
    lines.extend("    " + line.rstrip().replace("\n", "\n    ") for line in traceback.format_stack(frame))
    return "\n".join(lines)


def _outermost_first(frame: FrameType) -> list[FrameType]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def _waiting_in(frames: list[FrameType]) -> str | None:
    for i in range(len(frames) - 1, -1, -1):
        if _in_torch_distributed(frames[i]):
            # The innermost run of torch.distributed frames: where it waits, the API entered, and our caller.
            j = i
            while j > 0 and _in_torch_distributed(frames[j - 1]):
                j -= 1
            entered = f" inside {frames[j].f_code.co_name}" if j != i else ""
            caller = f" called from {_short(frames[j - 1])}" if j > 0 else ""
            return f"{frames[i].f_code.co_name} ({_short(frames[i])}){entered}{caller}"
    return None


def _in_torch_distributed(frame: FrameType) -> bool:
    return any(part in frame.f_code.co_filename for part in _TORCH_DISTRIBUTED)


def _pipeline_action(frames: list[FrameType]) -> str | None:
    for frame in reversed(frames):
        name = frame.f_code.co_name
        if name in _STAGE_METHODS:
            stage = getattr(frame.f_locals.get("self"), "stage_index", "?")
            chunk = frame.f_locals.get("fwd_chunk_id", frame.f_locals.get("bwd_chunk_id", "?"))
            return f"stage {stage} {_STAGE_METHODS[name]} of micro-batch {chunk}"
        action = frame.f_locals.get("action")
        if action is not None and type(action).__name__ == "_Action":
            return f"schedule action {action} (stage, F/B/W, micro-batch)"
        if "fwd_mb_index" in frame.f_locals:  # single-stage schedules count micro-batches in these locals
            return (f"{frame.f_code.co_name}: {frame.f_locals['fwd_mb_index']} micro-batches forward and"
                    f" {frame.f_locals.get('bwd_mb_index', '?')} backward done")
    return None


def _short(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    for marker in ("site-packages/", "lightning_3d/"):
        if marker in path:
            path = path[path.index(marker) + (len(marker) if marker == "site-packages/" else 0):]
            break
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
