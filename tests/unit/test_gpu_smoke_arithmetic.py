"""The FLOP and MFU arithmetic of ``benchmarks/gpu_smoke.py`` (the script itself needs a GPU and is not run
here): by hand for its ~1B configuration, and against the weights a real GPT multiplies with."""

import importlib.util
import sys
from pathlib import Path

import pytest
from torch import nn

from lightning_3d.models import GPT, GPTConfig


def _load_gpu_smoke():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("gpu_smoke", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


gpu_smoke = _load_gpu_smoke()


def test_matmul_weights_are_the_weights_of_the_models_linear_layers():
    sizes = gpu_smoke.Sizes(n_layer=3, n_embd=32, n_head=4, vocab_size=96, seq_len=16, batch_size=2)
    model = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=4, vocab_size=96, block_size=16))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert gpu_smoke.matmul_weights(sizes) == linear == 3 * 12 * 32 ** 2 + 32 * 96


def test_flops_per_token_of_the_1b_configuration_by_hand():
    s = gpu_smoke.GPU_SIZES
    # 16 blocks of q, k, v, o (4 * 2048^2) and an MLP (2 * 4 * 2048^2), the head 2048 x 50304:
    weights = 16 * 12 * 2048 ** 2 + 2048 * 50304
    assert weights == 908_328_960
    # 6 per weight; attention 2 x 2 * T * C per layer forward, x3 with backward, T = 2048:
    assert gpu_smoke.train_flops_per_token(s) == 6 * weights + 12 * 16 * 2048 * 2048 == 6_255_280_128
    parameters = GPTConfig(n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head, vocab_size=s.vocab_size,
                           block_size=s.seq_len).num_parameters()
    assert 0.95e9 < parameters < 1.1e9  # "a ~1B GPT"


def test_mfu_is_model_flops_per_second_over_the_table_peak():
    flops_per_step = 6_255_280_128 * 8 * 2048
    half_of_h200 = flops_per_step / (0.5 * 989e12)  # the step time that uses half the peak
    peak = gpu_smoke.peak_flops("NVIDIA H200", None)
    assert gpu_smoke.mfu(flops_per_step, half_of_h200, peak) == pytest.approx(0.5)
    assert gpu_smoke.mfu(flops_per_step, half_of_h200, None) is None


@pytest.mark.parametrize("name, override, tflops", [
    ("NVIDIA H200", None, 989), ("NVIDIA H100 80GB HBM3", None, 989), ("NVIDIA H100 PCIe", None, 756),
    ("NVIDIA A100-SXM4-80GB", None, 312), ("NVIDIA A100-SXM4-80GB", 250.0, 250), ("Tesla T4", None, None),
])
def test_peak_is_looked_up_by_device_name_and_the_override_wins(name, override, tflops):
    peak = gpu_smoke.peak_flops(name, override)
    assert peak == (None if tflops is None else tflops * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL", "NVIDIA H200",
                                  "NVIDIA A100-SXM4-40GB", "NVIDIA L40S", "Tesla T4"])
def test_the_throughput_callback_the_planner_and_the_benchmark_read_one_peak(name, monkeypatch):
    """One table of device peaks (lightning_3d.device_peaks): the MFU ThroughputMonitor logs on that device, the
    benchmark's, and the planner's GPU kinds all use its figure (an H100 PCIe card peaks at 756, not the SXM 989)."""
    import torch

    from lightning_3d.callbacks import ThroughputMonitor
    from lightning_3d.device_peaks import dense_bf16_tflops
    from lightning_3d.planner.cluster import GPUS

    tflops = dense_bf16_tflops(name)
    monitor = ThroughputMonitor()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(ThroughputMonitor, "_whole_model_parameters", lambda self, trainer, module: 1)
    monitor.on_train_start(None, type("Module", (), {"device": torch.device("cuda", 0)})())
    assert monitor.peak_flops == gpu_smoke.peak_flops(name, None) == (None if tflops is None else tflops * 1e12)
    kind = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA A100-SXM4-40GB": "a100-40gb"}.get(name)
    if kind:
        assert GPUS[kind].peak_tflops == tflops
