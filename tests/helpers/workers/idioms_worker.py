"""Entry point of one idioms launch: every rank runs each named case; rank 0 writes ``NAME.json``.

    python -m torch.distributed.run --standalone --nproc-per-node N idioms_worker.py OUT_DIR NAME [NAME ...]

Names: "conformance_LAYOUT_ROUTE" with LAYOUT a key of :data:`LAYOUTS` and ROUTE one of its routes
(:func:`routes_of`; ``idioms.run_conformance``), or a key of ``idioms.UNSUPPORTED`` (at pp=2).
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from helpers.idioms import ROUTES, UNSUPPORTED, run_conformance, run_unsupported
from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy

LAYOUTS = {"pp2": dict(dp=1, pp=2, tp=1, mask_rate=0.15), "dp2_pp2": dict(dp=2, pp=2, tp=1, mask_rate=0.0),
           "tp2": dict(dp=1, pp=1, tp=2, mask_rate=0.15), "cp2": dict(dp=1, pp=1, tp=1, cp=2, mask_rate=0.15),
           "cp2_pp2": dict(dp=1, pp=2, tp=1, cp=2, mask_rate=0.15)}
"""Layout -> its sizes and masking rate (a dp run draws other masks, as DDP does)."""
TP_ROUTES = ["gpt", "as_written", "hf"]
"""The routes with a tensor-parallel plan: the gpt and llama policies (logits sharded over the vocabulary,
which torchmetrics, argmax and the step's returned dict must see whole) and auto's plan of nanoGPT."""


CP_ROUTES = ["gpt", "as_written", "hf"]
"""The routes context parallelism takes: blocks that compute attention with F.scaled_dot_product_attention (the
reference GPT, nanoGPT as written, transformers' Llama through its "sdpa" interface)."""


def routes_of(layout: str) -> list[str]:
    if LAYOUTS[layout].get("cp", 1) > 1:
        return CP_ROUTES
    return TP_ROUTES if LAYOUTS[layout]["tp"] > 1 else list(ROUTES)


def conformance_case(name: str) -> tuple[str, str] | None:
    """("pp2", "gpt") for "conformance_pp2_gpt"; None for another name."""
    for layout in LAYOUTS:
        for route in routes_of(layout):
            if name == f"conformance_{layout}_{route}":
                return layout, route
    return None


def main(out_dir: str, names: list[str]) -> None:
    for name in names:
        case_dir = Path(out_dir) / name
        if conformance_case(name):
            layout, route = conformance_case(name)
            sizes = LAYOUTS[layout]
            cp = sizes.get("cp", 1)
            strategy = ThreeDStrategy(data_parallel_size=sizes["dp"], pipeline_parallel_size=sizes["pp"],
                                      tensor_parallel_size=sizes["tp"], context_parallel_size=cp,
                                      num_microbatches=2 if sizes["pp"] > 1 else None, policy=ROUTES[route][1])
            result = run_conformance(strategy, sizes["dp"] * sizes["pp"] * sizes["tp"] * cp, sizes["dp"], case_dir,
                                     sizes["mask_rate"], route)
        else:
            assert name in UNSUPPORTED, name
            result = run_unsupported(name, ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=2))
        if dist.get_rank() == 0:
            (Path(out_dir) / f"{name}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
