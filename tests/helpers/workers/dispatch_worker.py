"""Run with 2 ranks: expert parallelism's dispatch (lightning_3d.parallel.expert_parallel) on a transformers
experts module at ep2, with routings that leave one rank's experts without any token, against one process.

Each rank takes every other token of one batch (as data parallelism gives them), routes them as one process
routes all of them, and writes rank{r}.json: per experts implementation and routing, the largest difference of its outputs from one
process's rows, and of its local experts' gradients (times ep, which the dispatch's 1/ep scaling takes away)
from one process's (relative to their largest), and whether every local gradient exists.

    python forkrun.py --nproc-per-node 2 dispatch_worker.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

from lightning_3d.parallel.expert_parallel import apply_expert_parallel

EXPERTS, HIDDEN, TOKENS = 4, 8, 12
ROUTINGS = {  # the experts of each token's two choices
    "spread": lambda g: torch.randint(0, EXPERTS, (TOKENS, 2), generator=g),
    "rank_1_gets_none": lambda g: torch.randint(0, EXPERTS // 2, (TOKENS, 2), generator=g),  # experts 0, 1 only
    "rank_0_gets_none": lambda g: torch.randint(EXPERTS // 2, EXPERTS, (TOKENS, 2), generator=g),
}


IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")  # transformers' experts_implementation


def experts_module(implementation: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=16, num_local_experts=EXPERTS,
                                        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=16, use_cache=False,
                                        experts_implementation=implementation)
    module = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp.experts
    for param in module.parameters():
        torch.nn.init.normal_(param)
    return module


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1.0)).item()


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    report = {}
    for implementation, (name, routing) in [(i, r) for i in IMPLEMENTATIONS for r in ROUTINGS.items()]:
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(TOKENS, HIDDEN, generator=g)
        choices = routing(g)
        weights = torch.rand(TOKENS, 2, generator=g)
        reference = experts_module(implementation)
        expected = reference(hidden, choices, weights)
        expected.square().sum().backward()

        root = torch.nn.ModuleDict({"experts": experts_module(implementation)})
        apply_expert_parallel(root, ["experts"], {}, mesh)
        mine = slice(rank, None, 2)
        out = root["experts"](hidden[mine], choices[mine], weights[mine])
        out.square().sum().backward()
        local = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
        params = dict(root["experts"].named_parameters())
        report[f"{implementation}/{name}"] = {
            "output": (out - expected[mine]).abs().max().item(),
            "grads_exist": all(p.grad is not None for p in params.values()),
            "grad": max(_relative(p.grad.to_local() * 2, reference.get_parameter(n).grad[local])
                        for n, p in params.items() if p.grad is not None),
            "pairs_here": int(((choices >= local.start) & (choices < local.stop)).sum()),
        }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
