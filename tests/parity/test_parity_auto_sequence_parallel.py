"""Sequence parallelism from policy="auto" on a user's nanoGPT (helpers/user_models.py) trains as in one
process at (dp, pp, tp) = (1,1,2), (2,1,2) and, through a pipeline of the forward as written, (2,2,2)."""

import pytest


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["nanogpt_tp2_sp", "nanogpt_dp2_tp2_sp", "nanogpt_dp2_pp2_tp2_sp"])
def test_auto_sequence_parallel_trains_as_in_one_process(shared_runs, name):
    from helpers.harness import assert_parity, reference_for
    from helpers.hf_cases import AUTO_SP_CASES

    # SGD (helpers/user_models.py): a parameter's error is about lr x steps x its gradient's rounding error,
    # 0.1 x 3 x ~1e-7; 1e-5 leaves a wide margin, and a wrong split or a missing reduction misses it by far.
    assert_parity(shared_runs[name], reference_for(AUTO_SP_CASES[name]), loss_atol=1e-5, param_atol=1e-5)
