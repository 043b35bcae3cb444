"""What a step sees of logits sharded over the vocabulary (lightning_3d.parallel.sharded_logits), on a
one-rank tp mesh: the rules of each call, against the same calls on a plain tensor. Across two ranks, through
the policies and torchmetrics: parity/test_pipeline_idioms.py (layout tp2)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torchmetrics.classification import MulticlassAccuracy

from lightning_3d.errors import StepPatternError
from lightning_3d.parallel.loss import vocab_parallel_loss
from lightning_3d.parallel.sharded_logits import is_sharded_logits, mark_logits_of, whole

V = 16


@pytest.fixture
def mesh():
    """A gloo group of one; conftest's each_test_starts_without_a_process_group ends it after the test."""
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))


class Head(nn.Module):
    """Returns its input as a DTensor sharded on the last dimension, as the head's tp style does."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x):
        return DTensor.from_local(x, self.mesh, [Shard(x.ndim - 1)])  # differentiable, unlike distribute_tensor


def _logits(mesh):
    torch.manual_seed(0)
    full = torch.randn(2, 5, V, requires_grad=True)
    head = Head(mesh)
    mark_logits_of(head)
    return full, head(full)


def test_calls_other_than_the_loss_see_one_devices_tensor(mesh):
    targets = torch.randint(0, V, (2, 5))
    with vocab_parallel_loss():  # the head runs inside the step, as in a strategy's step
        full, logits = _logits(mesh)
        assert is_sharded_logits(logits)
        preds = logits.argmax(-1)
        masked = logits.masked_fill(targets[..., None] == 0, -1.0)  # a plain mask
        picked = logits.log_softmax(-1).gather(-1, targets[..., None])  # a plain index
        accuracy = MulticlassAccuracy(num_classes=V, average="micro")(logits.flatten(0, 1), targets.flatten())
        mean = logits.mean()
    for ours, expected in [(preds, full.argmax(-1)), (masked, full.masked_fill(targets[..., None] == 0, -1.0)),
                           (picked, full.log_softmax(-1).gather(-1, targets[..., None])), (mean, full.mean())]:
        assert type(ours) is torch.Tensor and torch.allclose(ours, expected)
    assert accuracy == MulticlassAccuracy(num_classes=V, average="micro")(full.flatten(0, 1), targets.flatten())


def test_calls_that_keep_the_layout_stay_sharded_so_the_loss_never_gathers(mesh):
    targets = torch.randint(0, V, (2, 4))
    with vocab_parallel_loss():
        full, logits = _logits(mesh)
        shifted = (logits[:, :-1] / 2.0).float().flatten(0, 1)
        assert is_sharded_logits(shifted)
        loss = F.cross_entropy(shifted, targets.flatten())
        assert type(loss) is torch.Tensor
        loss.backward()
    expected = F.cross_entropy((full.detach()[:, :-1] / 2.0).flatten(0, 1), targets.flatten())
    assert torch.allclose(loss, expected) and full.grad is not None and full.grad[:, -1].abs().sum() == 0


def test_an_in_place_change_that_would_touch_only_a_gathered_copy_is_refused_with_the_spelling(mesh):
    mask = torch.zeros(2, 5, V, dtype=torch.bool)
    with vocab_parallel_loss(), pytest.raises(StepPatternError, match=r"logits = logits.masked_fill\(\.\.\.\)"):
        _, logits = _logits(mesh)
        logits.detach().masked_fill_(mask, 0.0)


def test_logits_returned_from_a_step_reach_lightning_whole(mesh):
    full, logits = _logits(mesh)
    out = whole({"loss": torch.tensor(1.0), "logits": logits, "other": [logits]})
    assert type(out["logits"]) is torch.Tensor and torch.equal(out["logits"], full)
    assert type(out["other"][0]) is torch.Tensor and not isinstance(out["other"][0], DTensor)
