"""Strategy hooks that run Lightning's steps and backward through the layout: the pipeline engine under
pp > 1; else through the data-parallel wrapper's forward, inside the vocabulary-parallel loss context."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

from lightning.pytorch.overrides.distributed import prepare_for_backward
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_3d.parallel.loss import vocab_parallel_loss
from lightning_3d.parallel.tensor_parallel import reduce_partial_grads


class StepHooks:
    """Mixed into ``ThreeDStrategy``: training/validation/test/predict steps, backward and the
    accumulation hooks. Each step marks progress for the hang watchdog (``lightning_3d.faults``)."""

    def _step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        phase = method.removesuffix("_step")  # "training", "validation", ...: the hang watchdog's phase
        self._progress(f"{method} started", phase)  # (lightning_3d.faults), limited by hang_timeout
        output = self._run_step(method, *args, **kwargs)
        self._progress(f"{method} done", phase)
        return output

    def _run_step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._engine is not None:
            if method != "training_step":
                return self._engine.run(method, *args, train=False, **kwargs)
            return self._engine.training_step(
                *args, accumulate_grad_batches=self.lightning_module.trainer.accumulate_grad_batches,
                sync_grads=self._gradient_sync, finish_grads=self._finish_pipeline_grads, **kwargs)
        # Data parallel hooks run in the called module's forward (DDP's, or FSDP2's on the module itself):
        # Lightning's forward redirection sends the call through that forward into `method`.
        with self._loss_context():
            if self.model is not self.lightning_module or isinstance(self.model, FSDPModule):
                return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)
            return getattr(self.lightning_module, method)(*args, **kwargs)

    def _finish_pipeline_grads(self, module) -> None:
        """After the schedule's backward: sums left pending across tp ranks, then tied weights' copies."""
        if self.parallel_dims.tp > 1:
            reduce_partial_grads(module)
        if self._tied_gradients is not None:
            self._tied_gradients()

    def _loss_context(self):
        # Around steps and backward (both happen inside the schedule under pipeline parallelism).
        tp_loss = self.parallel_dims.tp > 1 and self.parallel_config.vocab_parallel_loss
        return vocab_parallel_loss() if tp_loss else nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._engine is not None:  # the schedule ran backward inside training_step: add its gradients
            self._engine.add_step_grads()
            return closure_loss
        # The backward of a vocabulary-parallel cross-entropy only exists inside PyTorch's loss_parallel().
        with self._loss_context():
            loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.parallel_dims.tp > 1 and self._gradient_sync:
            reduce_partial_grads(self.lightning_module)
        return loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # Manual optimization calls backward inside DDP's forward; DDP must be told what to reduce.
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this for all but the last micro-step of gradient accumulation.
        self._gradient_sync = False
        try:
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    self.model.set_requires_gradient_sync(True)
            else:
                with super().block_backward_sync():
                    yield
        finally:
            self._gradient_sync = True
