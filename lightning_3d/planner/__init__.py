"""The planner: which layout (dp, tp, pp, schedule, micro-batches, ZeRO stage, recompute) fits a model on a
cluster, and how fast each runs, from a written cost model (docs/planner.md).

Example::

    from lightning_3d.planner import Cluster, ModelSpec, plan

    model = ModelSpec(num_layers=24, hidden_size=2048, num_heads=16, vocab_size=50304, seq_length=2048)
    result = plan(model, Cluster.preset("h100", nodes=1), global_batch_size=256)
    print(result.table())          # ranked layouts: memory per GPU, step time, tokens/s, MFU
    print(result.to_yaml())        # a config for `lightning-3d fit` (the best layout)

With speeds measured on the devices (what ``layout="auto"`` does at launch)::

    result = plan(model, Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=2**31), global_batch_size=32,
                  calibration=Calibration.from_measurements({1: 2e-6}, 1e-6, links), fixed={"tp": 1})
    print(result.summary(3))       # the top three and why the first won
"""

from lightning_3d.planner.calibration import Calibration
from lightning_3d.planner.links import LinkSpeed, latency_steps, wire_bytes
from lightning_3d.planner.cluster import GPUS, Cluster
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import PRECISIONS, MemoryEstimate, Precision, estimate_memory, zero_model_state_bytes
from lightning_3d.planner.model import ModelSpec, PlannerError
from lightning_3d.planner.report import Candidate, LayoutPlan, why_best
from lightning_3d.planner.search import NoLayoutFits, evaluate, plan
from lightning_3d.planner.time import StepTime, estimate_step_time

__all__ = ["Calibration", "Candidate", "Cluster", "GPUS", "Layout", "LinkSpeed", "MemoryEstimate", "ModelSpec",
           "NoLayoutFits", "LayoutPlan", "PlannerError", "PRECISIONS", "Precision", "StepTime", "estimate_memory",
           "estimate_step_time", "evaluate", "latency_steps", "plan", "why_best", "wire_bytes", "zero_model_state_bytes"]
