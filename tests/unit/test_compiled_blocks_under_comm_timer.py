"""CommTimer's recorder on a logged batch leaves ``torch.compile``'d blocks compiled, and records the
collectives their compiled forward and backward call."""

import torch
import torch._dynamo
import torch.distributed as dist

from lightning_3d.callbacks.comm_recorder import Clock, CommRecorder
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.parallel.compile import CompiledForward, apply_compile
from lightning_3d.parallel.tensor_parallel import apply_tensor_parallel
from lightning_3d.policies import PlanOptions
from lightning_3d.policies.gpt import GPTPolicy


def test_a_compiled_tp_block_runs_compiled_under_the_recorder_which_records_its_collectives():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # A 2-rank fake process group: DTensor shards and collectives, no communication (ended by conftest).
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16))
    plan = GPTPolicy().plan(model, PlanOptions(tp=2))
    apply_tensor_parallel(model, plan, mesh)
    report = apply_compile(model, plan, rank=0)
    forward = model.blocks["0"].forward
    assert isinstance(forward, CompiledForward)
    eager_calls = []
    eager = forward.eager
    forward.eager = lambda *args, **kwargs: eager_calls.append(1) or eager(*args, **kwargs)

    def step(recorder) -> tuple[list[str], list[str]]:
        with recorder:
            out = model.blocks["0"](torch.randn(2, 16, 32, requires_grad=True))
            in_forward = [c.op for c in recorder.collectives]
            out.sum().backward()
        return in_forward, [c.op for c in recorder.collectives[len(in_forward):]]

    for _ in range(2):  # compiled on the first logged batch (with the recorder off while dynamo traces), then run
        in_forward, in_backward = step(CommRecorder(Clock()))
        assert report.eager_because is None and eager_calls == []
        # The row-parallel outputs summed over tp in forward, the column-parallel inputs' gradients in backward
        # (inductor calls the in-place collective)
        assert in_forward.count("all_reduce_") == 2 and "all_reduce_" in in_backward, (in_forward, in_backward)
