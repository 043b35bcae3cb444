"""layout='auto' times the pipeline schedule's own cost per micro-batch on micro-batches of the run's size: the
smallest micro-batch the layouts may take, in tokens (sequences x the sequence length), not the link probe's
message sizes in bytes that ``measure`` computes beside them (65,536 sequences per micro-batch: terabytes at a
real model's width)."""

import torch
from torch import nn

from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.planner.model import ModelSpec
from lightning_3d.strategies import calibrate, calibrate_links, calibrate_optimizer, measure

CPU = torch.device("cpu")


class Model(nn.Module):
    """Two blocks and an embedding; its training step is not run (the block's call capture is stubbed)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks = nn.Embedding(32, 8), nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def training_step(self, batch, batch_idx):
        raise AssertionError("not called")


def test_the_pipeline_probe_runs_micro_batches_of_the_smallest_size_the_layouts_take(monkeypatch):
    taken = {}

    def pipeline_microbatch_seconds(world_size, hidden_size, micro_tokens, *_args, **_kwargs):
        taken.update(hidden_size=hidden_size, micro_tokens=micro_tokens)
        return 0.0

    per_size = lambda *args, **_kwargs: {size: 1e-6 for size in args[3]}  # noqa: E731 (the sizes timed)
    monkeypatch.setattr(calibrate, "capture_block_call", lambda *_args: None)
    monkeypatch.setattr(calibrate, "block_seconds_per_token", per_size)
    monkeypatch.setattr(calibrate, "tp_block_seconds_per_token", lambda *_args, **_kwargs: {})
    monkeypatch.setattr(calibrate, "head_seconds_per_token", lambda *_args, **_kwargs: 1e-6)
    monkeypatch.setattr(calibrate, "tp_head_seconds_per_token", lambda *_args, **_kwargs: {})
    monkeypatch.setattr(calibrate, "recompute_share", lambda *_args, **_kwargs: 0.3)
    monkeypatch.setattr(calibrate, "zero_bubble_split_seconds_per_token", lambda *_args, **_kwargs: {})
    for name in ("optimizer_seconds_per_parameter", "embedding_optimizer_seconds_per_parameter",
                 "dtensor_optimizer_seconds_per_block"):
        monkeypatch.setattr(calibrate_optimizer, name, lambda *_args, **_kwargs: 1e-9)
    monkeypatch.setattr(calibrate_links, "pipeline_microbatch_seconds", pipeline_microbatch_seconds)
    spec = ModelSpec(num_layers=2, hidden_size=8, num_heads=1, vocab_size=32, seq_length=16)
    with torch.device("meta"):
        module = Model()
    measure.measure(ParallelConfig(layout="auto"), module=module, spec=spec, blocks=["blocks.0", "blocks.1"],
                    tp_plans={}, batch=torch.zeros(8, 16, dtype=torch.long), batch_size=8, world_size=1,
                    per_node=1, device=CPU)
    assert taken == {"hidden_size": 8, "micro_tokens": 1 * 16}  # one sequence of 16 tokens
