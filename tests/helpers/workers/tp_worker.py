"""Run under torchrun with 4 ranks: measure tensor-parallel communication and parameter memory.

For tp in (2, 4) (dp fills the rest) and with/without sequence parallelism it applies the GPT policy's plan
to GPTs of 1 and 2 blocks, runs one forward and backward under PyTorch's ``CommDebugMode`` and records the
collectives of each phase; the difference between the 2-block and 1-block models is one block's cost. It also
records the local parameter bytes per rank, and (tp=2) what the default and tp-rank random streams drew,
the replicated parameters after training with dropout, and every parameter after the same training eager and
with compiled blocks. Each rank writes a JSON file.

    python -m torch.distributed.run --nproc-per-node 4 tp_worker.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

from helpers.launchers import end_process_group
from lightning_3d import ParallelConfig, ParallelDims
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.parallel.compile import apply_compile
from lightning_3d.parallel.loss import vocab_parallel_cross_entropy
from lightning_3d.parallel.rng import SHARDED_SEED_OFFSET, ShardedRNG, apply_sharded_rng
from lightning_3d.parallel.tensor_parallel import apply_tensor_parallel, reduce_partial_grads
from lightning_3d.policies import PlanOptions
from lightning_3d.policies.gpt import GPTPolicy
from torch.distributed.tensor.parallel import loss_parallel


def counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def one_step(tp: int, sp: bool, n_layer: int, mesh) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_embd=64, n_head=4, block_size=16))
    plan = GPTPolicy().plan(model, PlanOptions(tp=tp, sequence_parallel=sp))
    apply_tensor_parallel(model, plan, mesh["tp"])
    tokens = torch.randint(0, 64, (2, 16))
    with CommDebugMode() as forward:
        loss = vocab_parallel_cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    with CommDebugMode() as backward, loss_parallel():
        loss.backward()
    with CommDebugMode() as grad_sync:
        reduce_partial_grads(model)
    assert not any(x.is_partial() for p in model.parameters() if isinstance(p.grad, DTensor) for x in p.grad.placements)
    sharded = [p for p in model.parameters() if isinstance(p, DTensor) and any(isinstance(x, Shard) for x in p.placements)]
    return {
        "forward": counts(forward), "backward": counts(backward), "grad_sync": counts(grad_sync),
        "sharded_local_bytes": sum(p.to_local().nbytes for p in sharded),
        "sharded_full_bytes": sum(p.numel() * p.element_size() for p in sharded),
        "local_bytes": sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters()),
        "full_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


class Probe(torch.nn.Module):
    def forward(self, x):
        return torch.rand(4)


class ProbeNet(torch.nn.Module):
    """Draws from the default stream (``shared``) and, once hooked, from the tp-rank stream (``private``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.private = Probe(), Probe()

    def forward(self, x):
        return self.shared(x), self.private(x), self.shared(x)


def random_streams(mesh) -> dict:
    torch.manual_seed(7)
    net = ProbeNet()
    apply_sharded_rng(net, ["private"], ShardedRNG(7 + SHARDED_SEED_OFFSET + mesh["tp"].get_local_rank(), torch.device("cpu")))
    first, private, second = net(None)
    torch.manual_seed(7)
    unhooked_first, unhooked_second = torch.rand(4), torch.rand(4)  # the default stream alone
    return {"shared": first.tolist() + second.tolist(), "private": private.tolist(),
            "default_stream_untouched": torch.equal(first, unhooked_first) and torch.equal(second, unhooked_second)}


def dropout_training(mesh, sp: bool, compiled: bool | None = None) -> dict:
    """Three SGD steps of a GPT with dropout 0.5; returns the replicated (non-sharded) parameters, or with
    ``compiled`` set (its blocks ``torch.compile``'d if True) every parameter's local piece."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, dropout=0.5))
    plan = GPTPolicy().plan(model, PlanOptions(tp=2, sequence_parallel=sp))
    apply_tensor_parallel(model, plan, mesh["tp"])
    apply_sharded_rng(model, plan.sharded_rng_regions, ShardedRNG(SHARDED_SEED_OFFSET + mesh["tp"].get_local_rank(), torch.device("cpu")))
    if compiled:
        report = apply_compile(model, plan, dist.get_rank())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 16))
        loss = vocab_parallel_cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        with loss_parallel():
            loss.backward()
        reduce_partial_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    if compiled is not None:
        assert not compiled or report.eager_because is None, report.eager_because
        return {name: (p.to_local() if isinstance(p, DTensor) else p).flatten().tolist()
                for name, p in model.named_parameters()}
    return {name: (p.to_local() if isinstance(p, DTensor) else p).flatten()[:8].tolist()
            for name, p in model.named_parameters()
            if not (isinstance(p, DTensor) and any(isinstance(x, Shard) for x in p.placements))}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    for tp in (2, 4):
        mesh = ParallelDims.from_config(ParallelConfig(tensor_parallel_size=tp), dist.get_world_size()).build_mesh("cpu")
        for sp in (False, True):
            for n_layer in (1, 2):
                results[f"tp{tp}_sp{int(sp)}_layers{n_layer}"] = one_step(tp, sp, n_layer, mesh)
        if tp == 2:
            results["rng"] = random_streams(mesh)
            results["dropout_replicated_params"] = {sp: dropout_training(mesh, sp) for sp in ("sp0", "sp1")}
            results["dropout_compiled_and_eager"] = {
                kind: dropout_training(mesh, False, compiled=kind == "compiled") for kind in ("eager", "compiled")}
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
