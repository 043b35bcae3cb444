"""What the planner knows about the machines: devices per node, nodes, memory, speed and bandwidths."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from lightning_3d.common import is_positive_int
from lightning_3d.device_peaks import dense_bf16_tflops
from lightning_3d.errors import PlannerError

GIB = 2**30



def gib(nbytes: float) -> str:
    """Bytes as GiB to read: one decimal from 1 GiB up, three significant digits below (small CPU models)."""
    value = nbytes / GIB
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


CPU_MEMORY_BANDWIDTH_GBS = 10.0
"""Assumed DRAM bandwidth per CPU rank (a host's 50-100 GB/s shared by about 8 ranks): it times only the
optimizer step of a CPU plan, and only when the calibration has not measured it."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines a layout runs on. Bandwidths are per GPU, one direction, in GB/s (1e9 bytes/s).

    Example::

        Cluster.preset("h100", nodes=2)  # 16 x H100 80GB
        Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=2 * 2**30)  # speeds from a Calibration
    """

    gpus_per_node: int = 8
    """GPUs in one node, joined by NVLink (tensor parallelism stays inside a node)."""
    nodes: int = 1
    """Nodes; the world size is nodes * gpus_per_node."""
    memory_gib: float = 80.0
    """Memory of one GPU (GiB)."""
    usable_fraction: float = 0.9
    """Share of that memory a plan may fill; the rest is the CUDA context, NCCL buffers, allocator slack."""
    peak_tflops: float | None = dense_bf16_tflops("H100 SXM")
    """Dense bf16 peak of one GPU, TFLOP/s (MFU is reported against it; ``lightning_3d.device_peaks``). None:
    no datasheet peak (CPU ranks); step times then need a :class:`~lightning_3d.planner.calibration.Calibration`."""
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
    device: Literal["gpu", "cpu"] = "gpu"
    """What one rank runs on; it names the ranks in reports and the accelerator of a planned config."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise PlannerError(f"Cluster.{name} must be a positive integer, got {value!r}.")
        for name in ("memory_gib", "hbm_bandwidth_gbs", "intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs"):
            if not getattr(self, name) > 0:
                raise PlannerError(f"Cluster.{name} must be positive, got {getattr(self, name)!r}.")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise PlannerError(f"Cluster.peak_tflops must be positive or None, got {self.peak_tflops!r}.")
        if self.device not in ("gpu", "cpu"):
            raise PlannerError(f"Cluster.device must be 'gpu' or 'cpu', got {self.device!r}.")
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

    @property
    def rank_name(self) -> str:
        """What reports call one rank: "GPU" or "rank" (CPU)."""
        return "GPU" if self.device == "gpu" else "rank"

    @classmethod
    def cpu(cls, *, ranks_per_node: int, memory_bytes_per_rank: float, nodes: int = 1,
            memory_bandwidth_gbs: float = CPU_MEMORY_BANDWIDTH_GBS) -> "Cluster":
        """``nodes`` hosts of ``ranks_per_node`` CPU ranks, each allowed ``memory_bytes_per_rank`` (all of it
        usable: the budget is already what a rank may fill). There is no datasheet peak: step times need a
        :class:`~lightning_3d.planner.calibration.Calibration`. ``memory_bandwidth_gbs`` per rank only times
        the optimizer step when the calibration does not.

        Example::

            Cluster.cpu(ranks_per_node=8, memory_bytes_per_rank=2 * 2**30)
        """
        if not memory_bytes_per_rank > 0:
            raise PlannerError(f"memory_bytes_per_rank must be positive, got {memory_bytes_per_rank!r}.")
        return cls(device="cpu", gpus_per_node=ranks_per_node, nodes=nodes, memory_gib=memory_bytes_per_rank / GIB,
                   usable_fraction=1.0, peak_tflops=None, hbm_bandwidth_gbs=memory_bandwidth_gbs)

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
    # Datasheet memory, dense bf16 peak (lightning_3d.device_peaks) and HBM bandwidth; collective bandwidths as
    # NCCL reaches them.
    "a100-40gb": Cluster(memory_gib=40, peak_tflops=dense_bf16_tflops("A100"), hbm_bandwidth_gbs=1555,
                         intra_node_bandwidth_gbs=230),
    "a100-80gb": Cluster(memory_gib=80, peak_tflops=dense_bf16_tflops("A100"), hbm_bandwidth_gbs=2039,
                         intra_node_bandwidth_gbs=230),
    "h100": Cluster(memory_gib=80, peak_tflops=dense_bf16_tflops("H100 SXM"), hbm_bandwidth_gbs=3350,
                    intra_node_bandwidth_gbs=360, inter_node_bandwidth_gbs=50, gemm_efficiency=H100_GEMM_EFFICIENCY),
    "h200": Cluster(memory_gib=141, peak_tflops=dense_bf16_tflops("H200"), hbm_bandwidth_gbs=4800,
                    intra_node_bandwidth_gbs=360, inter_node_bandwidth_gbs=50, gemm_efficiency=H100_GEMM_EFFICIENCY),
}
"""GPU kinds by name (``--gpu`` of ``lightning-3d plan``)."""
