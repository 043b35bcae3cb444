"""Entry point of one idioms launch: every rank runs each named case; rank 0 writes ``NAME.json``.

    python -m torch.distributed.run --standalone --nproc-per-node N idioms_worker.py OUT_DIR NAME [NAME ...]

Names: "conformance_LAYOUT_ROUTE" with LAYOUT "pp2" or "dp2_pp2" and ROUTE a key of ``idioms.ROUTES``
(``idioms.run_conformance``), or a key of ``idioms.UNSUPPORTED`` (at pp=2).
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from helpers.idioms import ROUTES, UNSUPPORTED, run_conformance, run_unsupported
from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy

LAYOUTS = {"pp2": dict(dp=1, mask_rate=0.15), "dp2_pp2": dict(dp=2, mask_rate=0.0)}
"""Layout -> its dp size (pp=2) and masking rate (a dp run draws other masks, as DDP does)."""


def conformance_case(name: str) -> tuple[str, str] | None:
    """("pp2", "gpt") for "conformance_pp2_gpt"; None for another name."""
    for layout in LAYOUTS:
        for route in ROUTES:
            if name == f"conformance_{layout}_{route}":
                return layout, route
    return None


def main(out_dir: str, names: list[str]) -> None:
    for name in names:
        case_dir = Path(out_dir) / name
        if conformance_case(name):
            layout, route = conformance_case(name)
            dp = LAYOUTS[layout]["dp"]
            strategy = ThreeDStrategy(data_parallel_size=dp, pipeline_parallel_size=2, num_microbatches=2,
                                      policy=ROUTES[route][1])
            result = run_conformance(strategy, 2 * dp, dp, case_dir, LAYOUTS[layout]["mask_rate"], route)
        else:
            assert name in UNSUPPORTED, name
            result = run_unsupported(name, ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=2))
        if dist.get_rank() == 0:
            (Path(out_dir) / f"{name}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
