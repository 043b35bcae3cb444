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


def test_the_default_group_comes_with_an_exit_handler_that_ends_every_group_while_the_interpreter_runs(monkeypatch):
    """Left to the interpreter's finalization, gloo's worker threads outlive what they use and a rank can abort
    after all its work ("terminate called without an active exception"; torchrun then reports the job failed):
    8 gloo ranks that made a few device meshes and subgroups and returned aborted in 5 of 12 launches; with
    every group destroyed and the groups made once per process dropped in an exit handler, 0 of 12. The
    strategy's default group registers that handler (once); run, it leaves no group and no cached mesh."""
    import atexit
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_3d.parallel import group_cache
    from lightning_3d.parallel.dims import ParallelDims
    from lightning_3d.strategies import processes

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(processes, "_ENDS_AT_EXIT", [])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    processes.init_process_group(LightningEnvironment(), "gloo", timedelta(seconds=60), torch.device("cpu"))
    ParallelDims(dp=1, pp=1, tp=1).build_mesh("cpu")  # made once per process (group_cache)
    assert group_cache._MADE and registered == [processes._end_process_groups]
    processes.end_process_groups_at_exit()  # a second fit's set-up: still one handler
    assert registered == [processes._end_process_groups]
    registered[0]()  # what the interpreter runs at exit
    assert not dist.is_initialized() and not group_cache._MADE


def test_a_pipeline_built_after_the_process_groups_were_ended_and_started_again_gets_its_results_group():
    """A process that ends its process groups between fits and starts new ones (a sweep that gives each fit a
    world of its own, a notebook): the results group of the pipeline built before went with the old world, and
    building the next one must not try to destroy it again (it raised "Invalid process group specified")."""
    import torch.distributed as dist

    from lightning_3d.parallel import parallelize
    from lightning_3d.parallel.dims import ParallelDims, RankCoords

    dims, coords = ParallelDims(dp=1, pp=1, tp=1), RankCoords(dp=0, pp=0, tp=0)
    for _world in range(2):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        assert dist.get_world_size(parallelize.pipeline_results_group(dims, coords)) == 1
        dist.destroy_process_group()
