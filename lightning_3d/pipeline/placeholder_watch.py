"""What a stage cannot run as written, found at its first call: code that uses values the stage does not have.

A stage runs the model's forward (``pipeline.as_written``) with placeholders for what other stages hold:
:class:`~lightning_3d.pipeline.placeholders.Shell` s return zeros for the embeddings or the head (and zeros
for their parameters, where the forward reads one), the
:class:`~lightning_3d.pipeline.placeholders.PassThroughBlock` s hand their input on, and the placeholder of
the block where the previous stage ends returns what that stage sent. What the forward computes from the
placeholders is meaningless, which does no harm as long as nothing the stage sends or returns is made of it.
Three kinds of pattern would turn it into a silently wrong result; each raises :class:`StepPatternError`
instead, on the stage's first call (step 1), on the rank that finds it (the fault watch takes the job down
with its name):

* **Control flow on values the stage does not have** -- an early exit (``if x.abs().max() > limit: break``),
  a branch on ``x.isnan().any()``, ``.item()`` of an activation: the stage would decide on zeros what one
  process decides on the real activation. :class:`PlaceholderWatch` follows every tensor computed from a
  placeholder and stops at its first conversion to a Python value.
* **An output made of placeholders, of values from inside the blocks, or not of the activation received**
  -- a module the plan put on another stage but which the forward uses on this one (a final norm registered
  before the blocks and called after them, an embedding's weight read again as the head's), a block called a
  second time: the stage would send or return what the placeholder gave; a value collected from within the
  blocks (the router logits of an auxiliary loss, gathered by hooks): one process gathers it from every
  block, a stage only from its own. :class:`PlaceholderWatch` checks that the stage's output derives from no
  placeholder, from nothing inside a block but what the block returns, and, after the first stage, from the
  activation it received.
* **Code that changes the activation where the pipeline cuts** -- ``x = x * scale`` between the last block
  of one stage and the first of the next: the previous stage sends its last block's output before that line
  runs, and neither stage would run it. :class:`Handover` checks that the first block's input is what the
  block before it returned.

What derives from what is followed through every torch function, and through the calls of the modules the
stage holds of the plan's (blocks, embeddings, head: their outputs derive from their inputs), so the tensor
parallel and FSDP hooks on those, which wrap and unwrap tensors outside torch functions, keep the trail. A
module that only reads its input's dtype or device (a rotary embedding) does not pass a label on. All of it runs
once per stage (the first call), so the steps after it pay nothing.
"""

from __future__ import annotations

import traceback
import weakref
from typing import Any

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_3d.pipeline.placeholders import Shell
from lightning_3d.pipeline.step_checks import StepPatternError

# Tensor methods that hand a tensor's values to Python, where control flow can branch on them.
HOST_CONVERSIONS = frozenset({"__bool__", "__int__", "__float__", "__complex__", "__index__", "item", "tolist",
                              "numpy"})
_LIBRARY_FILES = ("/torch/", "/lightning_3d/", "/lightning/", "/contextlib.py")
RECEIVED = "<received>"
"""The label of the activation the stage received from the previous one, and of what derives from it."""
_INSIDE = "<inside "


def _inside(block: str) -> str:
    """The label of what a block computes before it returns (its output gets its inputs' labels instead)."""
    return f"{_INSIDE}{block}>"


class PlaceholderWatch(TorchFunctionMode):
    """Active while a stage runs the forward for the first time: labels the outputs of the placeholders (by
    the placeholder's name) and the received activation, carries the labels to everything computed from
    them, and raises :class:`StepPatternError` when a placeholder's value is converted to a Python value or
    reaches the stage's output (:meth:`check_output`). Values computed from the model's inputs (masks,
    positions) are the real ones, on every stage, and carry no label.

    ``placeholders``: name in the stage -> the placeholder; ``holders``: name -> which stage holds the module
    it stands for, in words ("stage 0"); ``units``: name -> the modules of the plan the stage holds (blocks,
    embeddings, head); ``blocks``: the names of its blocks, in order; ``handed_by``: the placeholder whose
    first call returns what the previous stage sent (None on the first stage)."""

    def __init__(self, stage: nn.Module, placeholders: dict[str, nn.Module], holders: dict[str, str],
                 units: dict[str, nn.Module], blocks: list[str], stage_id: int, handed_by: str | None) -> None:
        super().__init__()
        self.handed_by = handed_by
        self.stage_name, self.first_block, self.stage_id = type(stage).__name__, blocks[0], stage_id
        self.holders, self.blocks = holders, set(blocks)
        self.labels: dict[int, tuple[weakref.ref, frozenset[str]]] = {}
        self.where: dict[str, str] = {}  # placeholder name -> where the forward last used it
        self.running: list[tuple[str, frozenset[str]]] = []  # the units running and their inputs' labels
        self.handles = [h for name, p in placeholders.items() for h in
                        (p.register_forward_hook(self._placeholder_output(name)),
                         *([p.watch_reads(self._placeholder_output(name))] if isinstance(p, Shell) else []))]
        self.handles += [h for name, m in units.items() for h in (
            m.register_forward_pre_hook(self._enter(name), prepend=True, with_kwargs=True),
            m.register_forward_hook(self._leave, always_call=True))]
        self.gives = {name: "gives zeros" if isinstance(p, Shell) else "hands its input on"
                      for name, p in placeholders.items()}

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)

    def received(self, tensors: tuple[Tensor, ...]) -> None:
        """``tensors`` are what the previous stage sent."""
        self._label(tensors, frozenset({RECEIVED}))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_CONVERSIONS and args and self._of_placeholders(self.labels_of(args[0])):
            raise StepPatternError(self._conversion_message(name))
        output = func(*args, **kwargs)
        labels = self.labels_of((args, kwargs))
        block = next((unit for unit, _ in reversed(self.running) if unit in self.blocks), None)
        if labels and block is not None:  # only the block's output leaves it as such (see _leave)
            labels |= {_inside(block)}
        if labels:
            self._label(output, labels)
        return output

    def check_output(self, output: Any) -> None:
        """Raise if ``output`` (what the stage sends or returns) derives from a placeholder, from a value
        computed inside one of its blocks other than what the block returned, or, after the first stage, not
        from what the stage received."""
        labels = self.labels_of(output)
        inside = sorted(label for label in labels if label.startswith(_INSIDE))
        used = sorted(self._of_placeholders(labels))
        if used:
            raise StepPatternError(self._placeholder_message(used[0]))
        if inside:
            raise StepPatternError(self._inside_message(inside[0][len(_INSIDE):-1]))
        if self.stage_id > 0 and RECEIVED not in labels:
            raise StepPatternError(
                f"The output of stage {self.stage_id} of the pipeline does not depend on the activation it"
                f" receives, which {self.stage_name}'s forward gives block {self.first_block!r}: the forward"
                f" computes that output from something else. Each stage must continue from the previous"
                f" stage's last block: make the forward pass each block's output to the next block, or train"
                f" with pipeline_parallel_size=1."
            )

    def labels_of(self, value: Any) -> frozenset[str]:
        found: frozenset[str] = frozenset()
        for x in tree_flatten(value)[0]:
            entry = self.labels.get(id(x)) if isinstance(x, Tensor) else None
            if entry is not None and entry[0]() is x:
                found |= entry[1]
        return found

    def _placeholder_output(self, name: str):
        def label(*hook_args: Any) -> None:
            if name == self.handed_by:  # its first call returns what the previous stage sent: real values
                self.handed_by = None
                return
            self.where[name] = _user_line()
            self._label(hook_args[-1], frozenset({name}))
        return label

    def _enter(self, name: str):
        def enter(module: nn.Module, args: Any, kwargs: dict) -> None:
            self.running.append((name, self.labels_of((args, kwargs))))
        return enter

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.running:
            return
        name, labels = self.running.pop()
        if name in self.blocks:  # what the block returns derives from its inputs, not from "inside" it
            labels |= frozenset(label for label in self.labels_of(output) if not label.startswith(_INSIDE))
            for x in tree_flatten(output)[0]:
                if isinstance(x, Tensor):
                    self.labels[id(x)] = (weakref.ref(x), labels)
        elif labels:
            self._label(output, labels)

    def _label(self, value: Any, labels: frozenset[str]) -> None:
        for x in tree_flatten(value)[0]:
            if isinstance(x, Tensor):
                self.labels[id(x)] = (weakref.ref(x), labels | self.labels_of(x))

    @staticmethod
    def _of_placeholders(labels: frozenset[str]) -> frozenset[str]:
        return frozenset(label for label in labels if label != RECEIVED and not label.startswith(_INSIDE))

    def _inside_message(self, block: str) -> str:
        return (
            f"The output of stage {self.stage_id} of the pipeline derives from a value computed inside block"
            f" {block!r} other than what the block returns: a value the forward or a hook collects from within"
            f" the blocks, such as the router logits of an auxiliary load-balancing loss. One process collects"
            f" it from every block; stage {self.stage_id} runs only its own blocks, so the result would differ."
            f" Leave such a term out (transformers: output_router_logits=False), compute it in the step from"
            f" values every block returns, or train with pipeline_parallel_size=1."
        )

    def _conversion_message(self, conversion: str) -> str:
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

    def _placeholder_message(self, name: str) -> str:
        return (
            f"The output of stage {self.stage_id} of the pipeline is computed from {name!r}, which"
            f" {self.holders.get(name, 'another stage')} holds: on stage {self.stage_id} a placeholder stands for"
            f" it and {self.gives[name]}{self.where.get(name, '')}. The forward uses {name!r} where this stage runs"
            f" (its blocks start at {self.first_block!r}), not only where the stage that holds it does."
            f" policy='auto' gives the first stage the modules the forward uses before the blocks and the last"
            f" stage those it uses after them (found by running the forward on the meta device, else by the"
            f" order the modules are registered in); a module used on both sides or among the blocks, or a"
            f" block called twice, fits neither. Register a policy that names Plan.before and Plan.after, give"
            f" a module used on both sides a second module that shares its weight (as a head tied to the"
            f" embedding: lm_head.weight = embed.weight), or train with pipeline_parallel_size=1."
        )


class Handover:
    """Checks that this stage's first block gets, as its input activation, what the block before it returned
    -- on this stage a placeholder returning what the previous stage sent. Anything else means code between
    those two blocks changed or skipped it, which no stage would run."""

    def __init__(self, previous: nn.Module, previous_name: str, first: nn.Module, first_name: str,
                 stage_id: int) -> None:
        self.previous_name, self.first_block, self.stage_id = previous_name, first_name, stage_id
        self.returned: Any = None
        self.handles = [previous.register_forward_hook(self._record),
                        first.register_forward_pre_hook(self._check, with_kwargs=True, prepend=True)]

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self.returned = output

    def _check(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        given = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
        # A block returning a tuple is indexed by the forward (``x = block(x)[0]``): the first block gets the
        # first tensor of what its placeholder returned.
        returned = next((x for x in tree_flatten(self.returned)[0] if isinstance(x, Tensor)), None)
        if given is returned and returned is not None:
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
        for handle in self.handles:
            handle.remove()


def _user_line() -> str:
    """`` at file:line: code`` of the innermost frame outside the libraries (the user's forward), or ""."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(part in frame.filename for part in _LIBRARY_FILES):
            return f" at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return ""
