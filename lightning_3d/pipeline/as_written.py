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
* a pre-hook on the stage's first block replaces that block's input with the activation received from the
  previous stage, and on every stage but the last a hook on its last block ends the forward there: the stage
  sends that block's output on, followed by the model's inputs (token ids, masks), which every stage needs to
  run the forward as written (positions, masks and rotary tables are made by the model, on each stage).

Whatever the forward computes around the blocks on a stage that does not hold them (an embedding sum, a
mask) is thrown away at the swap, so it costs a little and changes nothing. :class:`InputSpec` carries the
structure of the model call (``args``/``kwargs``) from the engine, which captures it on every rank, to the
stages that rebuild it from the tensors they receive. What would make that swap wrong -- control flow on the
placeholders' values, an output made of them, code that changes the activation where two stages meet -- is
refused at each stage's first call (``pipeline.placeholder_watch``). The last stage returns the tensors of what
the forward returned (PyTorch's ``PipelineStage`` takes tensors only); an object holding them (a Hugging Face
``ModelOutput`` with its logits and cache) is rebuilt for the user's step by :meth:`StageForward.model_output`.
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
        if self.is_first:
            args, activation = received, None
        else:  # the previous stage's output, then the model's inputs (see the module doc)
            activation, *leaves = received
            args, kwargs = tree_unflatten(leaves, self.inputs.spec)
        # The modules in the blocks' slots now (activation checkpointing may have wrapped them since the split).
        first, last = self.stage.get_submodule(self.first_block), self.stage.get_submodule(self.last_block)
        handover, watch = self._first_call_checks()
        handles = []
        if activation is not None:  # first, before any other pre-hook (FSDP's casts the input it gets)
            handles.append(first.register_forward_pre_hook(_ReplaceInput(activation, handover, watch),
                                                           with_kwargs=True, prepend=True))
        if not self.is_last:  # last, after FSDP's post-forward hook has run
            handles.append(last.register_forward_hook(_end_stage))
        try:
            with watch or nullcontext():
                output = type(self.stage).forward(self.stage, *args, **kwargs)
            sent, result = output, self._tensors_of(output)
        except _StageEnd as end:
            sent, result = end.output, (end.output, *[x for x in tree_flatten((args, kwargs))[0]
                                                      if isinstance(x, Tensor)])
        finally:
            for handle in handles:
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
        placeholders = {name: m for name, m in self.stage.named_modules()
                        if isinstance(m, (PassThroughBlock, Shell))}
        handover = None if self.is_first else Handover(self.stage.get_submodule(self.previous_block),
                                                       self.previous_block, self.first_block, self.stage_id)
        units = {name: self.stage.get_submodule(name) for name in self.units}
        return handover, PlaceholderWatch(self.stage, placeholders, self.holders, units, self.blocks, self.stage_id)


class _ReplaceInput:
    def __init__(self, activation: Tensor, handover: Handover | None, watch: PlaceholderWatch | None) -> None:
        self.activation, self.handover, self.watch = activation, handover, watch

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        name = None if args else next(k for k, v in kwargs.items() if isinstance(v, Tensor))
        if self.handover is not None:
            self.handover.check(args[0] if args else kwargs[name])
        if self.watch is not None:
            self.watch.received(self.activation)
        if args:
            return (self.activation, *args[1:]), kwargs
        return args, {**kwargs, name: self.activation}


class _StageEnd(Exception):
    def __init__(self, output: Tensor) -> None:
        super().__init__("the stage's last block has run")
        self.output = output


def _end_stage(module: nn.Module, args: Any, output: Any) -> None:
    tensors = [x for x in tree_flatten(output)[0] if isinstance(x, Tensor)]
    if not tensors:
        raise TypeError(f"{type(module).__name__} returned {type(output).__name__}; under pipeline parallelism a"
                        " block must return its output activation as a tensor (or a tuple starting with it).")
    raise _StageEnd(tensors[0])
