"""Data parallel (tp = pp = 1) matches one process and Lightning's DDPStrategy, step by step.

One launch per world size runs every case of that size (start-up is paid once)."""

import pytest

from helpers.harness import Case, assert_parity, launch, reference_for

pytestmark = pytest.mark.multiprocess

WORLD_2 = [
    Case(name="3d_dp2", dp=2),
    Case(name="ddp_dp2", strategy="ddp", dp=2),
    Case(name="3d_dp2_accumulate2", dp=2, accumulate_grad_batches=2),
    Case(name="3d_dp2_eager_init", dp=2, module="gpt_eager"),
    Case(name="3d_dp2_calls_self", dp=2, module="gpt_self"),
    Case(name="3d_dp2_explicit_sizes", dp=2, strategy_kwargs=dict(data_parallel_size=2, policy="gpt")),
]
WORLD_4 = [
    Case(name="3d_dp4", dp=4),
    Case(name="ddp_dp4", strategy="ddp", dp=4),
]
CASES = {c.name: c for c in WORLD_2 + WORLD_4}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity_dp")
    return {**launch(WORLD_2, 2, out / "world2"), **launch(WORLD_4, 4, out / "world4")}


@pytest.mark.parametrize("name", [c.name for c in WORLD_2 + WORLD_4])
def test_matches_single_process(name, results):
    assert_parity(results[name], reference_for(CASES[name]))


@pytest.mark.parametrize("dp", [2, 4])
def test_matches_lightning_ddp(dp, results):
    assert_parity(results[f"3d_dp{dp}"], results[f"ddp_dp{dp}"], loss_atol=1e-6, param_atol=1e-6)


def test_loss_falls(results):
    losses = results["3d_dp2"].losses
    assert losses[-1] < losses[0] - 0.05, losses
