"""layout="auto" on the ranks (tests/parity/test_auto_layout_on_ranks.py): one run that decides freely, one
with a memory budget of 60% of what the first choice needs, one of a model from transformers (Llama from a tiny
config, called as users call it: its cache object included), and the parity harness's case of a user's own model
(:data:`USER_MODEL`, measured for the planner); each rank writes what it ran and what it held, rank 0 the case's
result.

    python -m torch.distributed.run --nproc-per-node 4 auto_layout_worker.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import lightning as L

import torch

from helpers.harness import Case, run_distributed
from helpers.launchers import end_process_group
from helpers.user_models import UserLlamaModule
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule
from lightning_3d.parallel.memory import memory_report

USER_MODEL = Case(name="auto_user_story_lm", module="user_story_lm",
                  strategy_kwargs={"layout": "auto", "data_parallel_size": 1, "layout_check_steps": 1000},
                  model=dict(n_layer=4, n_embd=32, n_head=4, block_size=16))
"""A user's own model (``StoryLM``: no config the planner reads, its own init) under layout="auto". dp is held at 1
so that the per-rank batch the harness deals (the global batch over dp) is known before the decision: the
planner chooses the rest (tp x pp = 4, schedule, micro-batches, recompute)."""

DECIDED = ("tensor_parallel_size", "pipeline_parallel_size", "pipeline_schedule", "num_microbatches", "zero_stage",
           "activation_checkpointing", "virtual_pipeline_size")


def run(module_class=GPTLightningModule, **strategy_kwargs) -> dict:
    L.seed_everything(0, verbose=False)
    module = module_class(config=GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16, vocab_size=64))
    data = SyntheticDataModule(vocab_size=64, seq_len=16, batch_size=8, num_train_samples=8 * 16)
    # (the measured-against-predicted check is tested in unit/test_auto_layout.py; tiny steps here are mostly
    # fixed overhead, which the planner does not model)
    strategy = ThreeDStrategy(layout="auto", layout_check_steps=1000, **strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=5,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    decision = strategy.layout_decision
    held = memory_report(module, trainer.optimizers)
    return {"config": {name: getattr(strategy.parallel_config, name) for name in DECIDED},
            "dims": [strategy.parallel_dims.dp, strategy.parallel_dims.pp, strategy.parallel_dims.tp],
            "layout": decision.layout.describe(), "predicted_memory": decision.predicted_memory_bytes,
            "budget": decision.memory_per_rank, "states": sum(held.values()),
            "loss": float(trainer.callback_metrics["train_loss"]), "steps": trainer.global_step,
            "calibration": decision.calibration.to_dict()}


def measurement_groups() -> dict:
    """Process groups alive before and after the calibration's link and pipeline measurements and its timing of
    the head split over tp meshes, which make groups of their own (they must leave none behind: gloo keeps three
    threads per group, NCCL a communicator and its device buffers)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from lightning_3d.strategies import calibrate, calibrate_links

    before = len(_world.pg_map)
    cpu = torch.device("cpu")
    links = calibrate_links.link_speeds(dist.get_world_size(), dist.get_world_size(), cpu)
    calibrate_links.pipeline_microbatch_seconds(dist.get_world_size(), 16, 16, cpu, links["pp"], repeat_s=0.001)
    after_links = len(_world.pg_map)
    calibrate.tp_head_seconds_per_token(16, 64, 16, [1], [2, 4], cpu, repeat_s=0.001)
    return {"before": before, "after_links": after_links, "after": len(_world.pg_map)}


def groups_per_fit() -> list[int]:
    """Process groups alive after this launch's layout="auto" fits (run before this), then after each of two
    fits of the same fixed layout (its mesh is made once per process, parallel/group_cache.py)."""
    from torch.distributed.distributed_c10d import _world

    counts = [len(_world.pg_map)]
    for strategy in (ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=2),
                     ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=2)):
        module = GPTLightningModule(config=GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16, vocab_size=64))
        data = SyntheticDataModule(vocab_size=64, seq_len=16, batch_size=8, num_train_samples=8 * 4)
        L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=2,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0, num_sanity_val_steps=0).fit(module, data)
        counts.append(len(_world.pg_map))
    return counts


def alive_groups() -> list[str]:
    """The descriptions of this rank's process groups alive after every fit and measurement above ("mesh_" and a
    dimension's name for a device mesh's)."""
    from torch.distributed.distributed_c10d import _world

    return sorted(group.group_desc for group in _world.pg_map)


def gloo_threads() -> int | None:
    """This rank's gloo work threads (``pt_gloo_runloop``: two per gloo group alive, torch's default), where the
    platform names its threads (Linux), once the objects left in reference cycles are collected (a finished
    fit's, which may hold a group destroyed since)."""
    import gc

    gc.collect()
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir() if (task / "comm").exists()]
    return sum(name.startswith("pt_gloo_runloop") for name in names)


def main(out_dir: str) -> None:
    free = run()
    budgeted = run(max_memory_per_device=int(0.6 * free["predicted_memory"]))
    llama = run(UserLlamaModule)
    user_model = run_distributed(USER_MODEL)
    if user_model is not None:
        torch.save(user_model, Path(out_dir) / f"{USER_MODEL.name}.pt")
    groups = {**measurement_groups(), "per_fit": groups_per_fit(), "alive": alive_groups(),
              "gloo_threads": gloo_threads()}
    (Path(out_dir) / f"rank{os.environ['RANK']}.json").write_text(
        json.dumps({"free": free, "budget": budgeted, "llama": llama, "groups": groups}))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
