"""Models that initialize themselves their own way (helpers/user_models.py: nanoGPT's ``_init_weights``, a
Llama) start from the weights they were written to have at dp=2, tp=2 and pp=2: first-step loss and initial
weights equal one process's."""

import pytest


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["user_nanogpt_2_1_1", "user_nanogpt_1_1_2", "user_nanogpt_1_2_1",
                                  "user_llama_2_1_1", "user_llama_1_1_2", "user_llama_1_2_1"])
def test_first_step_loss_and_initial_weights_equal_one_process(shared_runs, name):
    from helpers.harness import assert_parity, reference_for
    from helpers.hf_cases import USER_INIT_CASES

    case = USER_INIT_CASES[name]
    # Learning rate 0: the parameters after the step are the initial ones, copied, not computed: equal exactly.
    # The loss is computed, on shards under tp: 1e-5 as every parity case (a wrong init moves it by ~0.1).
    assert_parity(shared_runs[name], reference_for(case), loss_atol=1e-5, param_atol=0.0)
