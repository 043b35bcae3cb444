"""The reference a case must match: the case in this process on one device with plain Lightning, no
lightning_3d strategy involved, with the global batch in the order Lightning's distributed sampler deals it."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from helpers.harness.cases import SEED, Case, Result
from helpers.harness.modules import module_and_data
from helpers.harness.training import LossRecorder, model_parameters, trainer_for
from lightning_3d.models import SyntheticDataModule


class ReferenceDataModule(SyntheticDataModule):
    """One process, whole global batches, in the order Lightning's (shuffling) distributed sampler uses."""

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=sampler, drop_last=True)


def run_reference(case: Case) -> Result:
    """The case in this process on one device with plain Lightning (no lightning_3d strategy)."""
    module, data = module_and_data(case, case.global_batch_size, ReferenceDataModule)
    recorder = LossRecorder()
    trainer = trainer_for(case, "auto", 1, recorder)
    if case.reference_weights:
        trainer.callbacks.append(LoadWeights(case.reference_weights))
    trainer.fit(module, data)
    result = Result(recorder.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}, recorder.logged,
                    recorder.grad_norms, model_parameters(trainer))
    result.expert_loads = recorder.expert_loads
    return result


class LoadWeights(L.Callback):
    """The plain single-device way to start from a state dict: ``load_state_dict(strict=True)``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.model.load_state_dict(torch.load(self.path), strict=True)


_REFERENCES: dict[tuple, Result] = {}


def reference_for(case: Case) -> Result:
    """The one-process run that ``case`` must match: same module, global batch, accumulation, steps (cached)."""
    key = (case.module, case.global_batch_size, case.accumulate_grad_batches, case.steps, repr(case.model),
           case.learning_rate,
           case.gradient_clip_val, case.gradient_clip_algorithm, case.reference_weights, case.precision,
           case.sanity_steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_reference(case)
    return _REFERENCES[key]
