"""What the planner knows about the machines: GPUs per node, nodes, memory, speed and bandwidths."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_3d.common import is_positive_int
from lightning_3d.errors import PlannerError

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines a layout runs on. Bandwidths are per GPU, one direction, in GB/s (1e9 bytes/s).

    Example::

        Cluster.preset("h100", nodes=2)  # 16 x H100 80GB
    """

    gpus_per_node: int = 8
    """GPUs in one node, joined by NVLink (tensor parallelism stays inside a node)."""
    nodes: int = 1
    """Nodes; the world size is nodes * gpus_per_node."""
    memory_gib: float = 80.0
    """Memory of one GPU (GiB)."""
    usable_fraction: float = 0.9
    """Share of that memory a plan may fill; the rest is the CUDA context, NCCL buffers, allocator slack."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of one GPU, TFLOP/s (MFU is reported against it)."""
    gemm_efficiency: float = 0.7
    """Share of the datasheet peak that a training step's matrix multiplications and attention reach. 0.7 fits
    A100 runs (Megatron-LM, torchtitan; docs/planner.md); the H100 presets take 0.6. Measure yours (a step's
    time of a model that fits one GPU) and set it."""
    hbm_bandwidth_gbs: float = 3350.0
    """GPU memory bandwidth; the non-matmul work (norms, activations, softmax, adds) is bound by it."""
    intra_node_bandwidth_gbs: float = 200.0
    """What a collective inside a node achieves per GPU (NCCL bus bandwidth over NVLink)."""
    inter_node_bandwidth_gbs: float = 25.0
    """What a collective across nodes achieves per GPU (one 200 Gb/s InfiniBand port per GPU: 25 GB/s)."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise PlannerError(f"Cluster.{name} must be a positive integer, got {value!r}.")
        for name in ("memory_gib", "peak_tflops", "hbm_bandwidth_gbs", "intra_node_bandwidth_gbs",
                     "inter_node_bandwidth_gbs"):
            if not getattr(self, name) > 0:
                raise PlannerError(f"Cluster.{name} must be positive, got {getattr(self, name)!r}.")
        for name in ("usable_fraction", "gemm_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise PlannerError(f"Cluster.{name} must be in (0, 1], got {getattr(self, name)!r}.")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_bytes(self) -> float:
        return self.memory_gib * GIB * self.usable_fraction

    def bandwidth(self, group_span: int) -> float:
        """Bytes/s per GPU of a collective over ranks that lie ``group_span`` consecutive global ranks apart
        at most: inside one node it rides NVLink, else the network."""
        gbs = self.intra_node_bandwidth_gbs if group_span <= self.gpus_per_node else self.inter_node_bandwidth_gbs
        return gbs * 1e9

    @classmethod
    def preset(cls, gpu: str, **overrides) -> "Cluster":
        """A cluster of one GPU kind from ``GPUS`` (datasheet numbers), with any field overridden."""
        if gpu not in GPUS:
            raise PlannerError(f"gpu={gpu!r} is not known; choose one of {sorted(GPUS)} or give the numbers.")
        return replace(GPUS[gpu], **overrides)


# An H100 reaches a smaller share of its datasheet peak than an A100 does of its own: Megatron-LM reports
# 52-57 % of peak on A100 and 41-48 % MFU on H100, Llama 3 405B ran at 38-43 % (docs/planner.md, "Published
# runs"); 0.6 reproduces the Llama 3 rows where 0.7 over-predicts them by up to 20 %.
H100_GEMM_EFFICIENCY = 0.6

GPUS = {
    # Datasheet memory, dense bf16 peak and HBM bandwidth; collective bandwidths as NCCL reaches them.
    "a100-40gb": Cluster(memory_gib=40, peak_tflops=312, hbm_bandwidth_gbs=1555, intra_node_bandwidth_gbs=230),
    "a100-80gb": Cluster(memory_gib=80, peak_tflops=312, hbm_bandwidth_gbs=2039, intra_node_bandwidth_gbs=230),
    "h100": Cluster(memory_gib=80, peak_tflops=989, hbm_bandwidth_gbs=3350, intra_node_bandwidth_gbs=360,
                    inter_node_bandwidth_gbs=50, gemm_efficiency=H100_GEMM_EFFICIENCY),
    "h200": Cluster(memory_gib=141, peak_tflops=989, hbm_bandwidth_gbs=4800, intra_node_bandwidth_gbs=360,
                    inter_node_bandwidth_gbs=50, gemm_efficiency=H100_GEMM_EFFICIENCY),
}
"""GPU kinds by name (``--gpu`` of ``lightning-3d plan``)."""
