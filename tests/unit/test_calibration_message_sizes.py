"""layout='auto' times the links at the run's own message sizes (issue 53): the bandwidth is fitted at the
largest message a layout of the run sends -- an FSDP unit's gather, a DDP bucket, the batch's activations --
between 4 MiB and 256 MiB, not at a fixed 4 MiB that fast links do not reach their peak at."""

import torch
import torch.distributed as dist
from torch import nn

from lightning_3d.planner.model import ModelSpec
from lightning_3d.planner.time import DDP_BUCKET_BYTES
from lightning_3d.strategies import calibrate_links
from lightning_3d.strategies.measure import largest_message_bytes

MIB = 2**20


def test_the_bandwidth_is_timed_at_the_runs_largest_message_within_bounds():
    assert calibrate_links.message_sizes(1 * MIB) == (64 * 1024, 4 * MIB)  # a small run: as before
    assert calibrate_links.message_sizes(96 * MIB) == (64 * 1024, 96 * MIB)
    assert calibrate_links.message_sizes(10 * 2**30) == (64 * 1024, calibrate_links.LARGEST_MESSAGE_BYTES)


def test_the_runs_largest_message_is_its_largest_fsdp_unit_ddp_bucket_or_activation():
    spec = ModelSpec(num_layers=2, hidden_size=1024, num_heads=8, vocab_size=32, seq_length=16)
    with torch.device("meta"):
        model = nn.ModuleDict({"embed": nn.Embedding(32, 1024), "blocks": nn.ModuleList(
            [nn.Linear(1024, 4096, bias=False) for _ in range(2)])})
    block = 4 * 1024 * 4096  # 16 MiB of fp32 per block, 32 MiB of gradients: a DDP bucket is 25 MiB
    assert largest_message_bytes(model, ["blocks.0", "blocks.1"], 1, spec) == max(block, DDP_BUCKET_BYTES)
    assert largest_message_bytes(model, ["blocks.0", "blocks.1"], 4096, spec) == 4 * 4096 * 16 * 1024


def test_a_collective_is_timed_at_the_sizes_it_is_given(monkeypatch):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # ended by conftest
    timed = []

    def median_seconds(call, *_args, **_kwargs):
        nbytes = call.args[0].numel() * 4
        timed.append(nbytes)
        return 1e-4 + nbytes / 1e10  # 100 us per call, 10 GB/s

    monkeypatch.setattr(calibrate_links, "median_seconds", median_seconds)
    monkeypatch.setattr(calibrate_links, "wire_bytes", lambda _collective, nbytes, _k: nbytes)  # (one rank: 0)
    monkeypatch.setattr(calibrate_links, "latency_steps", lambda _collective, _k: 1)
    sizes = (64 * 1024, 96 * MIB)
    speed = calibrate_links._collective_speed("all_reduce", dist.group.WORLD, torch.device("cpu"), sizes)
    assert timed == list(sizes)
    assert abs(speed.bandwidth_bytes_per_s - 1e10) < 1e3 and abs(speed.latency_s - 1e-4) < 1e-9
