"""When a pipeline stage reduces its gradients over dp.

``torch.distributed.pipelining`` runs each micro-batch's backward with FSDP2's gradient sync off and
reduces (all-reduce under ``replicate``, reduce-scatter under ``fully_shard``) once, after the schedule's
last backward (``PipelineStage.perform_reduce_grad``). Two things that leaves out:

* **Gradient accumulation.** Lightning asks for no sync on all but the last micro-step of an optimizer step
  (``block_backward_sync``), but the stage turns sync back on at the end of every schedule step: each
  micro-step would reduce over dp. :class:`GradSyncStage` skips the reduction while ``sync_grads`` is False
  and keeps the unreduced gradients in FSDP2 (gathered, on its unsharded parameters) for the next one.
* **Memory under ZeRO.** Deferring the reduce-scatter holds the stage's whole (unsharded) gradients from
  the first backward to the end of the step. With ``reduce_per_microbatch`` FSDP2 reduce-scatters each
  block's gradient as that block's backward ends, in every micro-batch: at most about one block's whole
  gradient at a time, for ``num_microbatches`` times the reduce-scatter bytes.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward

from lightning_3d.pipeline.reduction_checks import run_before_reduction


class GradSyncStage(PipelineStage):
    """A ``PipelineStage`` that reduces its gradients over dp once per optimizer step (``sync_grads``, set by
    the engine before each schedule step) and, with ``reduce_per_microbatch``, per block in each micro-batch."""

    def __init__(self, *args: Any, reduce_per_microbatch: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reduce_per_microbatch = reduce_per_microbatch
        self.sync_grads = True
        """False on an accumulation micro-step: gradients stay unreduced until a step with True."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if not (self.reduce_per_microbatch and backward_type == "full" and isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # Sync on: FSDP2's post-backward hook of each block reduce-scatters its gradient into the sharded one
        # (accumulating over micro-batches). The parameters stay gathered for the next micro-batch; the
        # end-of-backward work (waiting for reductions, freeing) waits for perform_reduce_grad.
        self.submod.set_requires_gradient_sync(True)
        self.submod.set_reshard_after_backward(False)
        self.submod.set_is_last_backward(False)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if not self.has_backward:
            # A forward-only (evaluation) step: the schedule still ends with this, which would scale -- and
            # under FSDP2 reduce -- the gradients that training accumulated so far (validation inside an
            # accumulation window: val_check_interval=3, accumulate_grad_batches=2). Of its work only the
            # reshard is wanted: FSDP2 leaves parameters gathered after a forward (for the backward that would
            # follow), and the gathered Parameter objects would stay registered: the next training step's
            # gradients would land on those, not on the sharded parameters the optimizer steps, and the first
            # step after an evaluation would update nothing.
            for module in self.submod.modules():  # each FSDP2 unit (blocks, the stage) reshards only its own
                if isinstance(module, FSDPModule):
                    module.reshard()
            return None
        run_before_reduction(self.submod)  # what the micro-batches accumulated, before dp spreads it
        if self.sync_grads or not isinstance(self.submod, FSDPModule):
            return super().perform_reduce_grad(grad_scale_factor)
        # An accumulation micro-step: what the parent does, with sync off -- each FSDP2 group ends its backward
        # (frees the gathered parameters, keeps the unreduced gradients), then the root's final callback. Like
        # the parent, this reaches FSDP2's per-group state: FSDP2 has no public call for a backward that ran
        # outside its autograd hooks' reach, and the schedule's backwards do.
        module = self.submod
        module.set_requires_gradient_sync(False)
        module.set_reshard_after_backward(True)
        module.set_is_last_backward(True)
        for group in fsdp_param_groups(module):
            group.post_backward()
        _fsdp_state(module)._root_post_backward_final_callback()
        # Scaling is linear: gradients reduced by a later step are scaled there; per-micro-batch ones now.
        self.scale_grads(grad_scale_factor)


def fsdp_param_groups(module: nn.Module) -> list:
    """FSDP2's parameter groups under ``module``, a stage wrapped by ``fully_shard`` or ``replicate`` (the root:
    its state knows every group's); none for a module FSDP2 does not wrap."""
    if not isinstance(module, FSDPModule):
        return []
    return [group for state in _fsdp_state(module)._state_ctx.all_states for group in state._fsdp_param_groups]


def gradients_held_apart(module: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """The running sums of gradients FSDP2 keeps in a buffer of its own while their reduction waits, as (module,
    parameter name in it, sum). Under a reduce dtype other than the parameters' (``bf16-mixed``: fp32), each
    backward with gradient sync off moves the gradient out of the module's tensor into that buffer: a look at
    the modules' tensors before the reduction would not find it."""
    held = []
    for group in fsdp_param_groups(module):
        for param in group.fsdp_params:
            if param.unsharded_accumulated_grad is not None:
                info = param._module_info
                held.append((info.module, info.param_name, param.unsharded_accumulated_grad))
    return held


def _fsdp_state(module: FSDPModule) -> Any:
    return replicate.state(module) if isinstance(module, ReplicateModule) else fully_shard.state(module)
