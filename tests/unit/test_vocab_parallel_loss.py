"""The vocabulary-parallel loss is a tensor of its own, not a view of the DTensor loss.

Where FSDP2 wraps the LightningModule itself (dp > 1 with tensor parallelism or ZeRO) it hooks its backward
onto what the step returns, and an in-place change of a view (``loss /= n``) drops that hook silently:
``DTensor.to_local`` hands back a view, and FSDP2 warned of it on every step of those layouts."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_3d.parallel.loss import vocab_parallel_cross_entropy, vocab_parallel_loss


def test_the_loss_is_not_a_view_whose_in_place_change_would_cut_fsdp2s_backward_hook():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # ended by conftest
    mesh = init_device_mesh("cpu", (1,))
    logits, targets = torch.randn(6, 10), torch.randint(0, 10, (6,))
    sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    loss = vocab_parallel_cross_entropy(sharded, targets)
    assert not isinstance(loss, type(sharded)) and not loss._is_view()
    assert torch.allclose(loss, F.cross_entropy(logits, targets))
    loss /= 2  # as a step may, before returning it
    with vocab_parallel_loss():  # as the strategy holds it over the step's backward
        loss.backward()
    assert sharded.grad is not None
