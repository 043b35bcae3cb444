"""Dense bf16 tensor-core peaks of the GPUs lightning-3d knows: the one table that ``ThroughputMonitor``'s MFU,
the planner's GPU kinds (``lightning-3d plan --gpu``) and ``benchmarks/gpu_smoke.py`` read.

Datasheet figures without structured sparsity, in TFLOP/s. Boards of one chip differ by clock and power: an
H100 PCIe card peaks at 756, an H100 NVL at 835, the SXM module at 989.
"""

from __future__ import annotations

DENSE_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
)
"""(fragment of the device name, peak): the first fragment the name contains gives the peak, so each board
comes before the chip's shorter name."""


def dense_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the device ``torch.cuda.get_device_name()`` calls ``device_name``, in TFLOP/s;
    None for a device the table does not know.

    Example::

        dense_bf16_tflops("NVIDIA H100 80GB HBM3")  # 989.0
        dense_bf16_tflops("NVIDIA H100 PCIe")  # 756.0
    """
    return next((tflops for fragment, tflops in DENSE_BF16_TFLOPS if fragment in device_name), None)
