"""Nothing the strategy hands a collective sits on the host when the rank's device is not the host (issue 28).
No GPU here: the meta device stands in for one -- a tensor made without naming a device lands on the host,
whatever the parameters' device, so these fail where the code forgets the device."""

import torch
from torch import nn

from lightning_3d.parallel.clip import grad_square_terms
from lightning_3d.parallel.dims import ParallelDims
from lightning_3d.pipeline.random_replay import RandomState, state_bytes, state_tensor
from lightning_3d.strategies.processes import backend_for

DIMS = ParallelDims(dp=1, pp=1, tp=1)


def test_a_rank_without_gradients_joins_the_norm_all_reduce_with_zeros_on_its_device():
    frozen = [nn.Parameter(torch.empty(3, device="meta"))]  # no .grad: a frozen stage
    share, local = grad_square_terms(frozen, DIMS)
    assert share.device.type == local.device.type == "meta"


def test_random_state_is_plain_bytes_and_restores_exactly():
    torch.manual_seed(3)
    state = RandomState.now(torch.device("cpu"))
    assert isinstance(state.host, bytes) and state.device is None
    first = torch.rand(4)
    state.restore(torch.device("cpu"))
    assert torch.equal(torch.rand(4), first)
    assert torch.equal(state_tensor(state_bytes(torch.get_rng_state())), torch.get_rng_state())


def test_nccl_on_cuda_gets_gloo_next_to_it_for_host_tensors():
    # Every NCCL run, offloaded or not: a host tensor in a collective is served, not refused.
    assert backend_for(torch.device("cuda", 0), "nccl") == "cuda:nccl,cpu:gloo"
    assert backend_for(torch.device("cpu"), "gloo") == "gloo"
    assert backend_for(torch.device("cuda", 0), "gloo") == "gloo"  # what the user chose on purpose stays


def test_float64_gradients_have_their_norm_taken_in_float64():
    # Trainer(precision="64-true"): the norm of double gradients, which a float32 norm refused as narrowing
    layer = nn.Linear(3, 2).double()
    layer(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    share, local = grad_square_terms(layer.parameters(), DIMS)
    expected = sum(p.grad.square().sum() for p in layer.parameters())
    assert local.dtype == torch.float32 and torch.allclose(local.double(), expected)
    assert torch.allclose(share.double(), expected)
