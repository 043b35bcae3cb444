"""A user's model (helpers/user_models.py) pipelines as written under every schedule and trains as in one
process; no rank holds another stage's parameters. So do transformers models whose forwards a pipeline must
follow closely (helpers/hf_cases.py PIPELINE_HF_MODELS: a final norm registered before the layers, blocks that
return tuples or pass each other indices, attribute reads of another stage's embedding)."""

import pytest


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["nanogpt_pp2_gpipe", "nanogpt_pp2_1f1b", "nanogpt_pp2_interleaved",
                                  "nanogpt_pp2_zero_bubble", "llama_style_pp2", "nanogpt_dp2_pp2_zero3"])
def test_a_users_model_trains_as_in_one_process_under_every_schedule(shared_runs, name):
    from helpers.harness import assert_parity, reference_for
    from helpers.hf_cases import AS_WRITTEN_CASES

    case = AS_WRITTEN_CASES[name]
    reference = reference_for(case)
    # SGD (helpers/user_models.py): a parameter's error is about lr x steps x its gradient's rounding error,
    # 0.1 x 3 x ~1e-7 here; 1e-5 leaves a wide margin and a wrong stage or schedule misses it by far.
    assert_parity(shared_runs[name], reference, loss_atol=1e-5, param_atol=1e-5)
    per_rank = shared_runs[name].rank_parameter_bytes
    total = sum(t.nbytes for t in reference.params.values())  # the tied weight counted under both names
    if case.strategy_kwargs["data_parallel_size"] == 1:
        # No rank holds another stage's parameters: the stages' bytes add up to the model, the tied
        # embedding and head once per end.
        assert sum(per_rank) == total, (per_rank, total)
    assert max(per_rank) < 0.75 * total, (per_rank, total)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["hf_opt_pp2", "hf_bloom_pp2", "hf_gpt_neo_pp2", "hf_mpt_pp2", "hf_llama4_text_pp2",
                                  "hf_glm_moe_dsa_pp2"])
def test_transformers_forwards_pipeline_as_written_and_train_as_in_one_process(shared_runs, name):
    from helpers.harness import assert_parity, reference_for
    from helpers.hf_cases import PIPELINE_HF_CASES

    # AdamW with eps 1e-3 (helpers/harness/cases.py): 4 steps stay near 1e-7; OPT with its final norm on the
    # wrong stage logged ln(64) at every step, a stage's output made of zeros.
    assert_parity(shared_runs[name], reference_for(PIPELINE_HF_CASES[name]), loss_atol=1e-5, param_atol=1e-5)
