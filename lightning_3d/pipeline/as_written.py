"""Pipeline stages that run the model's own forward, unchanged (``Plan.forward_as_written``).

For a model no policy was written for -- blocks in an ``nn.ModuleList`` and ``for block in self.blocks: x =
block(x)`` -- every stage calls the pipeline root's own ``forward`` with the model's own inputs. In a stage
(a copy of the root, ``pipeline.split``):

* the blocks other stages hold are :class:`~lightning_3d.pipeline.placeholders.PassThroughBlock` placeholders
  that return their first input (in the structure the block returns: ``(input, None)`` for a block that
  returns ``(hidden, attn_weights)``);
* the modules before the blocks (embeddings) on later stages, and after them (final norm, head) on earlier
  stages, are :class:`~lightning_3d.pipeline.placeholders.Shell` s: they hold no parameters, work out the
  shape of their output on a meta-device copy and return zeros of that shape;
* on every stage but the last a hook on its last block ends the forward there: the stage sends the tensors
  that block returned (its activation, and what else it passes the next block), followed by the model's
  inputs (token ids, masks), which every stage needs to run the forward as written (positions, masks and
  rotary tables are made by the model, on each stage); on the next stage the placeholder of that block
  returns what was sent, so the forward hands it to the stage's first block as one process does.

Whatever the forward computes around the blocks on a stage that does not hold them (an embedding sum, a
mask) is dropped where the placeholder returns what was sent, so it costs a little and changes nothing.
:class:`InputSpec` carries the structure of the model call (``args``/``kwargs``) from the engine, which
captures it on every rank, to the stages that rebuild it from the tensors they receive. What would make this
wrong -- control flow on the placeholders' values, an output made of them, code that changes the activation
where two stages meet -- is refused at each stage's first call (``pipeline.placeholder_watch``). The last
stage returns the tensors of what the forward returned (PyTorch's ``PipelineStage`` takes tensors only); an
object holding them (a Hugging Face ``ModelOutput`` with its logits and cache) is rebuilt for the user's step
by :meth:`StageForward.model_output`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_3d.pipeline.placeholder_watch import Handover, PlaceholderWatch
from lightning_3d.pipeline.placeholders import PassThroughBlock, Shell

__all__ = ["InputSpec", "PassThroughBlock", "Shell", "StageForward"]


class InputSpec:
    """The structure of the model call's ``(args, kwargs)`` in the current step, tensors as leaves (set by
    the engine on every rank, read by this rank's stages)."""

    def __init__(self) -> None:
        self.spec: TreeSpec | None = None


class StageForward:
    """``forward`` of one stage: the pipeline root's own, between this stage's first and last block."""

    def __init__(self, stage: nn.Module, blocks: list[str], *, stage_id: int, previous_block: str | None,
                 is_last: bool, inputs: InputSpec, units: list[str], holders: dict[str, str]) -> None:
        self.stage, self.blocks, self.first_block, self.last_block = stage, blocks, blocks[0], blocks[-1]
        self.stage_id, self.previous_block, self.is_last, self.inputs = stage_id, previous_block, is_last, inputs
        self.is_first = previous_block is None
        self.units = units  # the plan's modules (blocks, embeddings, head) this stage holds
        self.holders = holders  # the plan's other modules -> the stage that holds each, in words
        self.checked = False  # every stage checks its first call (pipeline.placeholder_watch)
        self._output: tuple[TreeSpec, dict[int, Any]] | None = None  # the last call's output, less its tensors

    def __call__(self, *received: Tensor, **kwargs: Any) -> Any:
        handed: tuple[Tensor, ...] = ()
        if self.is_first:
            args = received
        else:  # what the previous stage's last block returned, then the model's inputs (see the module doc)
            split = len(received) - self.inputs.spec.num_leaves
            handed, args, kwargs = received[:split], *tree_unflatten(list(received[split:]), self.inputs.spec)
            # The placeholder of that block returns it, so the forward hands it to this stage's first block.
            self.stage.get_submodule(self.previous_block).hand_over(handed)
        handover, watch = self._first_call_checks()
        if watch is not None:
            watch.received(handed)
        # The module in the last block's slot now (activation checkpointing may have wrapped it since the split).
        last = self.stage.get_submodule(self.last_block)
        handle = None if self.is_last else last.register_forward_hook(_end_stage)  # after FSDP's post-forward
        try:
            with watch or nullcontext():
                output = type(self.stage).forward(self.stage, *args, **kwargs)
            sent, result = output, self._tensors_of(output)
        except _StageEnd as end:
            inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)]
            # gloo sends contiguous tensors only (what else a block returns may be a view: xLSTM's states)
            sent, result = end.tensors, tuple(t.contiguous() for t in (*end.tensors, *inputs))
        finally:
            if handle is not None:
                handle.remove()
            if handover is not None:
                handover.remove()
        if watch is not None:
            watch.check_output(sent)
        return result

    def _tensors_of(self, output: Any) -> Any:
        """The last stage's output as ``PipelineStage`` takes it: a tensor or a tuple of tensors as they are;
        of anything else its tensors, the rest kept for :meth:`model_output`."""
        if isinstance(output, Tensor) or (isinstance(output, tuple) and all(isinstance(x, Tensor) for x in output)):
            self._output = None
            return output
        leaves, spec = tree_flatten(output)
        self._output = spec, {i: x for i, x in enumerate(leaves) if not isinstance(x, Tensor)}
        return tuple(x for x in leaves if isinstance(x, Tensor))

    def model_output(self, tensors: Any) -> Any:
        """What the model's forward returned, rebuilt from the tensors this stage returned for it (schedules
        compute the loss right after each forward of the last stage, so the rest is that call's). Forgets
        the rest: a cache's keys and values live no longer than in one process."""
        if self._output is None:
            return tensors
        (spec, others), self._output = self._output, None
        received = iter(tensors)
        return tree_unflatten([others[i] if i in others else next(received) for i in range(spec.num_leaves)], spec)

    def _first_call_checks(self) -> tuple[Handover | None, PlaceholderWatch | None]:
        if self.checked:
            return None, None
        self.checked = True
        placeholders = {name: m for name, m in self.stage.named_modules() if isinstance(m, (PassThroughBlock, Shell))}
        handover = None if self.is_first else Handover(self.stage.get_submodule(self.previous_block),
                                                       self.previous_block, self.stage.get_submodule(self.first_block),
                                                       self.first_block, self.stage_id)
        units = {name: self.stage.get_submodule(name) for name in self.units}
        return handover, PlaceholderWatch(self.stage, placeholders, self.holders, units, self.blocks, self.stage_id,
                                          handed_by=self.previous_block)


class _StageEnd(Exception):
    def __init__(self, tensors: tuple[Tensor, ...]) -> None:
        super().__init__("the stage's last block has run")
        self.tensors = tensors


def _end_stage(module: nn.Module, args: Any, output: Any) -> None:
    tensors = tuple(x for x in tree_flatten(output)[0] if isinstance(x, Tensor))
    if not tensors:
        raise TypeError(f"{type(module).__name__} returned {type(output).__name__}; under pipeline parallelism a"
                        " block must return its output activation as a tensor (or a tuple starting with it).")
    raise _StageEnd(tensors)
