"""Models that initialize themselves their own way (helpers/user_models.py: nanoGPT's ``_init_weights``, a
Llama) start from the weights they were written to have at dp=2, tp=2 and pp=2: first-step loss and initial
weights equal one process's. Under model_init="fast" every layout's initial weights equal one process's under
"fast", and they are a draw of their own: not the exact route's numbers."""

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


@pytest.mark.multiprocess
@pytest.mark.parametrize("module", ["user_nanogpt", "user_llama"])
@pytest.mark.parametrize("layout", ["2_1_1", "1_2_1", "1_1_2", "1_2_2"])
def test_fast_init_gives_every_layout_the_weights_of_one_process_under_fast(shared_runs, module, layout):
    from helpers.harness import assert_parity, reference_for
    from helpers.hf_cases import FAST_INIT_CASES

    one = shared_runs[f"{module}_fast_1_1_1"]
    assert_parity(shared_runs[f"{module}_fast_{layout}"], one, loss_atol=1e-5, param_atol=0.0)
    exact = reference_for(FAST_INIT_CASES[f"{module}_fast_1_1_1"])  # the build as written, one stream
    differ = [n for n, t in one.params.items() if not t.equal(exact.params[n])]
    drawn = [n for n, t in exact.params.items() if t.dim() == 2]
    assert set(drawn) <= set(differ)  # every weight matrix drawn apart
    for name in drawn:  # from the distributions the model was written to draw from
        assert abs(one.params[name].std() - exact.params[name].std()) <= 0.2 * exact.params[name].std(), name
    assert abs(one.losses[0] - exact.losses[0]) < 0.1  # an init's loss, near ln(vocabulary)
