"""Entry point of one compile launch (``compile=True``): every rank runs every case, as parity_worker.py does;
rank 0 saves each case's result, and every rank writes what the run told it: its compile log lines and the
warnings of lightning_3d.parallel.compile, per case (``rank{N}.json``).

    forkrun.py --nproc-per-node N compile_worker.py CASES.json OUT_DIR

Case ``module="gpt_graph_break"`` is the reference GPT whose blocks dynamo cannot trace as one graph
(:class:`GraphBreakGPTModule`): the run must fall back to eager, warn once per rank, and train as eager does.
"""

import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from helpers.harness import Case, run_distributed
from helpers.harness.modules import MODULES
from helpers.launchers import end_process_group
from lightning_3d.models import GPTLightningModule
from lightning_3d.models.gpt import Block

COMPILE_LINE = "torch.compile on rank"
"""What the rank's compile log line contains (lightning_3d.parallel.compile.CompileReport.line)."""
FALLBACK_WARNING = "lightning_3d: torch.compile could not compile"


class DataDependentBlock(Block):
    """A block with a Python branch on a tensor's value: dynamo cannot put ``.item()`` in a graph, so with
    ``fullgraph=True`` it refuses the block. The branch is never taken, so the block computes what Block does."""

    def forward(self, x):
        if x.abs().sum().item() < 0:  # never: a sum of absolute values
            x = -x
        return super().forward(x)


class GraphBreakGPTModule(GPTLightningModule):
    """The reference GPT with :class:`DataDependentBlock` blocks (same parameters, same init, same numbers)."""

    def configure_model(self) -> None:
        super().configure_model()
        for block in self.model.blocks.values():
            block.__class__ = DataDependentBlock


MODULES["gpt_graph_break"] = GraphBreakGPTModule


class Lines(logging.Handler):
    """The compile log lines this rank logged."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if COMPILE_LINE in record.getMessage():
            self.lines.append(record.getMessage())


def main(cases_file: str, out_dir: str) -> None:
    lines = Lines()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(lines)
    seen = {}
    for raw in json.loads(Path(cases_file).read_text()):
        case = Case(**raw)
        lines.lines = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", FALLBACK_WARNING)  # recorded; any other warning of ours still fails
            result = run_distributed(case)
        seen[case.name] = {"lines": lines.lines,
                           "warnings": [str(w.message) for w in caught if FALLBACK_WARNING in str(w.message)]}
        if result is not None:
            torch.save(result, Path(out_dir) / f"{case.name}.pt")
            print(f"[compile] {case.name}: losses {['%.6f' % x for x in result.losses]}", flush=True)
    rank = int(os.environ["RANK"])
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(seen))
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
