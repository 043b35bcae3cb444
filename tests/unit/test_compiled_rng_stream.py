"""The tp-rank random stream (``parallel/rng.py``) inside ``torch.compile``'d blocks: no graph break, and the
compiled block draws the masks the eager one draws."""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.utils import counters

from lightning_3d.models import GPT, GPTConfig
from lightning_3d.parallel.compile import apply_compile
from lightning_3d.parallel.rng import ShardedRNG, apply_sharded_rng
from lightning_3d.parallel.tensor_parallel import apply_tensor_parallel
from lightning_3d.policies import PlanOptions
from lightning_3d.policies.gpt import GPTPolicy

CONFIG = GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16, dropout=0.5)


@pytest.fixture
def fake_tp_mesh():
    """A 2-rank fake process group in this process: DTensor shards, no communication (ended by conftest)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    return torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_tp_block_with_dropout_compiles_without_a_graph_break(fake_tp_mesh, sp):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    plan = GPTPolicy().plan(model, PlanOptions(tp=2, sequence_parallel=sp))
    assert plan.sharded_rng_regions  # dropout > 0: the attention (and, with SP, every dropout) is a region
    apply_tensor_parallel(model, plan, fake_tp_mesh)
    apply_sharded_rng(model, plan.sharded_rng_regions, ShardedRNG(2718, torch.device("cpu")))
    breaks = sum(counters["graph_break"].values())
    report = apply_compile(model, plan, rank=0)
    model(torch.randint(0, CONFIG.vocab_size, (2, 16))).float().sum().backward()
    assert report.eager_because is None, report.eager_because
    assert sum(counters["graph_break"].values()) == breaks
    assert int(report.line().split(" graphs")[0].rsplit(" ", 1)[-1]) >= 1  # the block did run compiled


def test_compiled_block_draws_the_eager_masks_on_both_streams():
    """The attention dropout from the tp-rank stream, the residual dropouts from the default one, as in eager
    mode: equal outputs and input gradients, and both streams left where the eager block leaves them (the
    compiled backward does not switch them again)."""
    torch._dynamo.reset()
    x = torch.randn(2, 16, CONFIG.n_embd)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(CONFIG)
        plan = GPTPolicy().plan(model, PlanOptions(tp=2))
        plan.blocks = ["blocks.0"]
        rng = ShardedRNG(2718, torch.device("cpu"))
        apply_sharded_rng(model, plan.sharded_rng_regions, rng)
        if compiled:
            report = apply_compile(model, plan, rank=0)
        torch.manual_seed(1)
        outputs = []
        for _ in range(2):
            inputs = x.clone().requires_grad_()
            out = model.blocks["0"](inputs)
            out.sum().backward()
            outputs += [out.detach(), inputs.grad]
        results.append((outputs, torch.rand(3), rng.state_dict()["state"][0]))
    assert report.eager_because is None
    (eager, eager_next, eager_stream), (compiled, compiled_next, compiled_stream) = results
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)  # float32 kernels fused differently: close, not bitwise
    assert torch.equal(eager_next, compiled_next) and torch.equal(eager_stream, compiled_stream)
