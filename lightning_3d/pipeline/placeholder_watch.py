"""What a stage cannot run as written, found at its first call: code that uses the values before its blocks.

A stage that does not hold the first blocks runs the model's forward (``pipeline.as_written``) on
placeholders up to its first block: :class:`~lightning_3d.pipeline.as_written.Shell` s return zeros for the
embeddings, :class:`~lightning_3d.pipeline.as_written.PassThroughBlock` s hand their input on, and the first
block's input is then swapped for the activation the previous stage sent. What the forward computes from the
placeholders is meaningless, which does no harm as long as only that swapped input is made of it. Two patterns
would turn it into a silently wrong result; both raise :class:`StepPatternError` instead, on the stage's first
call (step 1), on the rank that finds them (the fault watch takes the job down with its name):

* **Control flow on values the stage does not have** -- an early exit (``if x.abs().max() > limit: break``),
  a branch on ``x.isnan().any()``, ``.item()`` of an activation: the stage would decide on zeros what one
  process decides on the real activation. :class:`PlaceholderWatch` follows every tensor computed from a
  placeholder and stops at its first conversion to a Python value.
* **Code that changes the activation where the pipeline cuts** -- ``x = x * scale`` between the last block
  of one stage and the first of the next: the previous stage sends its last block's output before that line
  runs, and the swap drops what the line computed on this one. :class:`Handover` checks that the first
  block's input is what the block before it returned.

Both run once per stage (the first call), so the steps after it pay nothing.
"""

from __future__ import annotations

import traceback
import weakref
from typing import Any

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_3d.pipeline.step_checks import StepPatternError

# Tensor methods that hand a tensor's values to Python, where control flow can branch on them.
HOST_CONVERSIONS = frozenset({"__bool__", "__int__", "__float__", "__complex__", "__index__", "item", "tolist",
                              "numpy"})
_LIBRARY_FILES = ("/torch/", "/lightning_3d/", "/lightning/", "/contextlib.py")


class PlaceholderWatch(TorchFunctionMode):
    """Active while a stage runs the forward for the first time: marks the outputs of the placeholders (and
    everything computed from them) and raises :class:`StepPatternError` when one of them is converted to a
    Python value. Values computed from the model's inputs (masks, positions) or from the received activation
    are the real ones, on every stage, and stay unmarked."""

    def __init__(self, stage: nn.Module, placeholders: list[nn.Module], first_block: str, stage_id: int) -> None:
        super().__init__()
        self.stage_name, self.first_block, self.stage_id = type(stage).__name__, first_block, stage_id
        self.marked: dict[int, weakref.ref] = {}
        self.handles = [p.register_forward_hook(self._mark_output) for p in placeholders]

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_CONVERSIONS and args and self._is_marked(args[0]):
            raise StepPatternError(self._message(name))
        output = func(*args, **kwargs)
        if any(self._is_marked(x) for x in tree_flatten((args, kwargs))[0]):
            self._mark(output)
        return output

    def _mark_output(self, module: nn.Module, args: Any, output: Any) -> None:
        self._mark(output)

    def _mark(self, value: Any) -> None:
        for x in tree_flatten(value)[0]:
            if isinstance(x, Tensor):
                self.marked[id(x)] = weakref.ref(x)

    def _is_marked(self, x: Any) -> bool:
        ref = self.marked.get(id(x)) if isinstance(x, Tensor) else None
        return ref is not None and ref() is x

    def _message(self, conversion: str) -> str:
        return (
            f"The forward of {self.stage_name} reads the value of a tensor computed before block"
            f" {self.first_block!r} ({conversion}){_user_line()}. Stage {self.stage_id} of the pipeline does"
            f" not have those values: the blocks before it run on other stages, so it would decide on"
            f" placeholders what one process decides on the real activation (whether or not that decision"
            f" would change this stage's result, it cannot be told here). Control flow between blocks that"
            f" depends on activation values (an early exit, a branch on x.isnan().any(), .item()) cannot be"
            f" pipelined as written: move it into a block (each block runs on the stage that holds it), or"
            f" train with pipeline_parallel_size=1."
        )


class Handover:
    """Checks that the activation the previous stage sends replaces exactly the value the forward hands this
    stage's first block: the output of the block before it (a placeholder here). Anything else means code
    between those two blocks changed or skipped it, which no stage would run."""

    def __init__(self, previous: nn.Module, previous_name: str, first_block: str, stage_id: int) -> None:
        self.previous_name, self.first_block, self.stage_id = previous_name, first_block, stage_id
        self.returned: Any = None
        self.handle = previous.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self.returned = output

    def check(self, given: Any) -> None:
        returned = self.returned
        # A block returning a tuple is indexed by the forward (``x = block(x)[0]``); its placeholder returns
        # the tensor itself, so the first block gets a view of it.
        if given is returned or (isinstance(given, Tensor) and given._base is returned and returned is not None):
            return
        what = ("is never called before it" if returned is None
                else "returned something else than the first block gets")
        raise StepPatternError(
            f"Block {self.previous_name!r}, where stage {self.stage_id - 1} of the pipeline ends, {what}: the"
            f" forward changes or skips the activation between {self.previous_name!r} and {self.first_block!r}"
            f"{_user_line()}. Stage {self.stage_id - 1} sends {self.previous_name!r}'s output as it is, so that"
            f" code would run on neither stage. Move it into a block (each block runs whole on its stage), or"
            f" train with pipeline_parallel_size=1."
        )

    def remove(self) -> None:
        self.handle.remove()


def _user_line() -> str:
    """`` at file:line: code`` of the innermost frame outside the libraries (the user's forward), or ""."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(part in frame.filename for part in _LIBRARY_FILES):
            return f" at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return ""
