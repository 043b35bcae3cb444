"""layout='auto' calibrates in the run's precision (issue 53): under "bf16-mixed" the block and the head are
timed forward under autocast to bf16 on fp32 weights, as Lightning's MixedPrecision runs a step; under
"bf16-true" on bf16 weights and inputs, and the optimizer steps bf16 parameters. One process, no group."""

import pytest
import torch
from torch import nn

from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.planner.model import ModelSpec
from lightning_3d.strategies import auto_layout, calibrate, calibrate_optimizer
from lightning_3d.strategies.calibrate_timing import RunPrecision

CPU = torch.device("cpu")


class Seen(nn.Module):
    """A block that records, at each call, whether autocast is on, its dtype, and the dtypes of its weight and
    input and of its matmul's output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.calls: list[tuple] = []

    def forward(self, hidden):
        out = self.proj(hidden)
        self.calls.append((torch.is_autocast_enabled(CPU.type), torch.get_autocast_dtype(CPU.type),
                           self.proj.weight.dtype, hidden.dtype, out.dtype))
        return hidden + out


def timed_block(precision: str) -> set:
    with torch.device("meta"):
        block = Seen()
    call = ((torch.empty(2, 4, 8, device="meta"),), {})
    seen = []
    real_materialized = calibrate.materialized

    def spy(*args, **kwargs):  # the timed copy's calls are the ones that count
        timed = real_materialized(*args, **kwargs)
        seen.append(timed)
        return timed

    calibrate.materialized = spy
    try:
        calibrate.block_seconds_per_token(block, call, 2, [2], CPU, repeat_s=0.001,
                                          precision=RunPrecision.of(precision))
    finally:
        calibrate.materialized = real_materialized
    return {c for timed in seen for c in timed.calls}


def test_lightnings_precision_flags_read_as_timing_precisions():
    assert RunPrecision.of("bf16-mixed") == RunPrecision(autocast_dtype=torch.bfloat16)
    assert RunPrecision.of("16-mixed") == RunPrecision(autocast_dtype=torch.float16)
    assert RunPrecision.of("bf16-true") == RunPrecision(param_dtype=torch.bfloat16)
    assert RunPrecision.of("32-true") == RunPrecision()


def test_a_bf16_mixed_runs_block_is_timed_under_autocast_on_fp32_weights():
    assert timed_block("bf16-mixed") == {(True, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)}
    assert {c[0] for c in timed_block("32-true")} == {False}


def test_a_bf16_true_runs_block_is_timed_on_bf16_weights_and_inputs_without_autocast():
    assert timed_block("bf16-true") == {(False, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16)}


@pytest.mark.parametrize("precision, expected", [("bf16-mixed", (True, torch.float32)),
                                                 ("bf16-true", (False, torch.bfloat16)),
                                                 ("32-true", (False, torch.float32))])
def test_the_head_is_timed_in_the_runs_precision(monkeypatch, precision, expected):
    seen = set()
    real_linear = torch.nn.functional.linear

    def linear(x, weight, *args):
        seen.add((torch.is_autocast_enabled(CPU.type), weight.dtype))
        return real_linear(x, weight, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    calibrate.head_seconds_per_token(8, 32, 16, CPU, repeat_s=0.001, precision=RunPrecision.of(precision))
    assert seen == {expected}


def test_a_bf16_true_runs_optimizer_steps_bf16_parameters(monkeypatch):
    dtypes = set()
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: dtypes.update(
        p.dtype for p in self.param_groups[0]["params"]) or real_step(self, *a, **k))
    with torch.device("meta"):
        block = nn.Linear(8, 8)
    bf16 = RunPrecision.of("bf16-true")
    calibrate_optimizer.optimizer_seconds_per_parameter(block, CPU, repeat_s=0.001, precision=bf16)
    calibrate_optimizer.embedding_optimizer_seconds_per_parameter(32, 8, CPU, repeat_s=0.001, precision=bf16)
    assert dtypes == {torch.bfloat16}


def test_the_decision_calibrates_in_the_trainers_precision(monkeypatch):
    taken = {}

    class Stop(Exception):
        pass

    def measure(*_args, precision, **_kwargs):
        taken["precision"] = precision
        raise Stop

    monkeypatch.setattr(auto_layout, "measure", measure)
    spec = ModelSpec(num_layers=2, hidden_size=8, num_heads=1, vocab_size=32, seq_length=4)
    with pytest.raises(Stop):
        auto_layout.decide(ParallelConfig(layout="auto"), module=None, spec=spec, blocks=["b"], tp_plans={},
                           batch=torch.zeros(2, 4), precision_name="bf16-mixed", world_size=1, per_node=1,
                           device=CPU)
    assert taken["precision"] == RunPrecision(autocast_dtype=torch.bfloat16)


def test_the_block_and_head_split_over_tp_are_timed_under_autocast_too(monkeypatch):
    """The DTensor paths (a one-rank tp mesh): autocast casts the DTensor weights, the vocab-parallel loss runs
    on the bf16 logits' fp32 cast."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_3d.policies.base import Plan

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # ended by conftest
    bf16 = RunPrecision.of("bf16-mixed")
    seen = set()
    real_linear = torch.nn.functional.linear

    def linear(x, weight, *args):
        seen.add(torch.is_autocast_enabled(CPU.type))
        return real_linear(x, weight, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    times = calibrate.tp_head_seconds_per_token(8, 32, 4, [1], [1], CPU, repeat_s=0.001, precision=bf16)
    assert times[1][1] > 0 and seen == {True}
    with torch.device("meta"):
        block = Seen()
    plan = Plan(blocks=["block"], tp_plan={"block.proj": ColwiseParallel()})
    seen.clear()
    times = calibrate.tp_block_seconds_per_token("block", block, {1: plan}, ((torch.empty(2, 4, 8, device="meta"),),
                                                 {}), 2, [2], CPU, repeat_s=0.001, precision=bf16)
    assert times[1][2] > 0 and seen == {True}
