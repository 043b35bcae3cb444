"""Under "bf16-true" gradients are reduced over dp in fp32 by default (``ParallelConfig.reduce_dtype``), as
torchtitan and Megatron-LM do: FSDP2's ``reduce_dtype`` where it shards or replicates, a DDP communication hook
where DDP replicates. Here in one process (a gloo group of one rank); the policies FSDP2 takes are checked
as data."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_3d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_3d.parallel.data_parallel import apply_data_parallel
from lightning_3d.parallel.precision import mixed_precision_policy


class Plugin:
    def __init__(self, precision):
        self.precision = precision


def test_bf16_true_reduces_in_fp32_by_default_and_in_bf16_when_asked():
    assert ParallelConfig().reduce_dtype == "float32"
    assert mixed_precision_policy(Plugin("bf16-true")).reduce_dtype == torch.float32
    assert mixed_precision_policy(Plugin("bf16-true"), "bfloat16").reduce_dtype == torch.bfloat16
    # bf16-mixed: bf16 gathers and compute, fp32 reductions, whatever reduce_dtype says (its gradients are fp32).
    mixed = mixed_precision_policy(Plugin("bf16-mixed"), "bfloat16")
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy(Plugin("32-true")).reduce_dtype is None


def test_an_unknown_reduce_dtype_is_refused_with_the_choices():
    with pytest.raises(ParallelConfigError, match="reduce_dtype.*float32"):
        ParallelConfig(reduce_dtype="float16")


def test_ddp_averages_bf16_gradients_in_fp32(monkeypatch):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    reduced = []
    all_reduce = dist.all_reduce

    def watched(tensor, *args, **kwargs):  # what the communication hook hands the collective
        reduced.append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", watched)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    ddp = apply_data_parallel(model, [], mesh, torch.device("cpu"),
                              mp_policy=mixed_precision_policy(Plugin("bf16-true")))
    ddp(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    assert reduced == [torch.float32]
    assert model.weight.grad.dtype == torch.bfloat16
    assert torch.equal(model.weight.grad, torch.full((4, 4), 2.0, dtype=torch.bfloat16))  # the sum over 2 rows
