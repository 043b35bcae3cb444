"""Checkpoints as full tensors under single-device names, written by rank 0 (until sharded DCP checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from typing_extensions import override


class FullStateCheckpoints:
    """Strategy hooks (mixed into ``ThreeDStrategy``): shards (DTensors) and pipeline stages gathered into
    the single-device state dict on save, and redistributed to any layout on load."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Shards (DTensors) are gathered into the single-device tensors under their single-device names.
        return get_model_state_dict(self.lightning_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.lightning_module, checkpoint["state_dict"], options=options)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap Lightning's LightningOptimizer
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            set_optimizer_state_dict(self.lightning_module, optimizer, state,
                                     options=StateDictOptions(full_state_dict=True))
