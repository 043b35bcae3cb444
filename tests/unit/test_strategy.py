"""ThreeDStrategy as Lightning sees it: registration and construction checks (bad configurations on every rank:
faults/test_bad_configs.py)."""

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

from lightning_3d import ParallelConfigError, ThreeDStrategy


def test_import_registers_the_3d_strategy():
    assert "3d" in StrategyRegistry
    trainer = L.Trainer(strategy="3d", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ThreeDStrategy)
    assert trainer.strategy.parallel_config.tensor_parallel_size == 1


def test_constructor_keywords_reach_the_config():
    strategy = ThreeDStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=8, policy="gpt")
    config = strategy.parallel_config
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.num_microbatches) == (2, 2, 8)
    assert config.data_parallel_size == "auto" and config.policy == "gpt"


def test_bad_values_fail_at_construction():
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size must be a positive integer, got 0"):
        ThreeDStrategy(tensor_parallel_size=0)
    with pytest.raises(ParallelConfigError, match="pipeline_schedule='pipedream'"):
        ThreeDStrategy(pipeline_schedule="pipedream")


def test_layout_is_unknown_before_setup():
    with pytest.raises(RuntimeError, match="set up its environment"):
        ThreeDStrategy().parallel_dims


def test_a_layout_the_devices_cannot_hold_fails_at_trainer_construction():
    """Lightning's launcher would start 64 processes for a layout of 256: Trainer(...) refuses it first."""
    strategy = ThreeDStrategy(data_parallel_size=8, tensor_parallel_size=8, pipeline_parallel_size=4)
    with pytest.raises(ParallelConfigError, match=r"\(8\) = 256, but the world size is 64"):
        L.Trainer(strategy=strategy, accelerator="cpu", devices=64, logger=False)
