"""Lightning's precision flag under a 3D layout (dp, pp, tp) = (2, 2, 2): bf16-mixed tracks the fp32 loss
curve of one process and keeps fp32 master weights, replicated (zero_stage=0, autocast only) and sharded
(zero_stage=3, FSDP2's bf16 gathers with fp32 reductions); bf16-true trains in bf16."""

import pytest
import torch

from helpers.harness import Case, launch, reference_for

pytestmark = pytest.mark.multiprocess

GPT4 = dict(n_layer=4, n_embd=32, n_head=4, block_size=16)
LAYOUT = dict(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4)
STEPS = 10
# Measured (10 steps, losses 4.18 -> 3.16): the largest per-step gap to the fp32 curve is 0.012 replicated
# (autocast) and 0.008 sharded (FSDP2 bf16 gathers, fp32 reductions) -- ~0.35% of the loss, bf16's rounding
# (8 bits of mantissa). The bound leaves 2.5x room for other machines' kernels.
BF16_MIXED_LOSS_ATOL = 0.03


def precision_case(precision, zero):
    return Case(name=f"{precision}_zero{zero}", dp=2, precision=precision, steps=STEPS, model=GPT4,
                strategy_kwargs=dict(LAYOUT, zero_stage=zero))


CASES = {c.name: c for c in [precision_case("bf16-mixed", 0), precision_case("bf16-mixed", 3),
                             precision_case("bf16-true", 2)]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(list(CASES.values()), 8, tmp_path_factory.mktemp("precision"), timeout=900)


def fp32_reference(case):
    return reference_for(Case(**{**case.__dict__, "precision": "32-true", "strategy_kwargs": {}}))


@pytest.mark.parametrize("name", ["bf16-mixed_zero0", "bf16-mixed_zero3"])
def test_bf16_mixed_tracks_the_fp32_loss_curve_with_fp32_master_weights(name, results):
    result, reference = results[name], fp32_reference(CASES[name])
    gap = max(abs(a - b) for a, b in zip(result.losses, reference.losses))
    print(f"{name}: largest loss gap to fp32 over {STEPS} steps {gap:.4f}\n{result.losses}\n{reference.losses}")
    assert len(result.losses) == STEPS and gap <= BF16_MIXED_LOSS_ATOL
    assert result.losses[-1] < result.losses[0] - 0.3
    assert {t.dtype for t in result.params.values() if t.is_floating_point()} == {torch.float32}


def test_bf16_true_trains_in_bf16(results):
    result = results["bf16-true_zero2"]
    print(f"bf16-true: {result.losses}")
    assert result.losses[-1] < result.losses[0] - 0.3
    assert {t.dtype for t in result.params.values() if t.is_floating_point()} == {torch.bfloat16}
