"""Lightning callbacks that watch a 3D run. Each runs its collectives on every rank or on none."""

from lightning_3d.callbacks.comm_timer import CommTimer
from lightning_3d.callbacks.expert_load import ExpertLoadMonitor
from lightning_3d.callbacks.grad_norm import GradNormMonitor
from lightning_3d.callbacks.nan_guard import NaNGuard
from lightning_3d.callbacks.pipeline_monitor import PipelineMonitor
from lightning_3d.callbacks.throughput import ThroughputMonitor

__all__ = ["CommTimer", "ExpertLoadMonitor", "GradNormMonitor", "NaNGuard", "PipelineMonitor", "ThroughputMonitor"]
