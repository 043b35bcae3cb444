"""Context parallelism matches one process, step by step: the reference GPT, nanoGPT as written (it calls
``F.scaled_dot_product_attention`` itself and adds learned positions) and a transformers Llama (rotary tables
passed to every block, grouped-query attention through its "sdpa" interface, with a padding mask too), at cp2 and cp4, and composed
with tensor (and sequence) parallelism, pipeline parallelism (1F1B and interleaved), data parallelism and ZeRO-3,
each layout on the three (dp2 x cp2 x tp2 of the reference GPT: tests/parity/test_checkpoints.py).

One launch per world size runs every case of that size."""

import pytest

from helpers.harness import Case, assert_parity, launch, reference_for
from helpers.hf_cases import AUTO_TP_MODELS, LLAMA

pytestmark = pytest.mark.multiprocess

NANOGPT = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)


def cp_case(name, cp, dp=1, tp=1, module="gpt", model=None, **strategy):
    kwargs = dict(context_parallel_size=cp, tensor_parallel_size=tp, data_parallel_size=dp, **strategy)
    extra = {"model": model} if model is not None else {}
    return Case(name=name, dp=dp, module=module, strategy_kwargs=kwargs, steps=4, **extra)


LLAMA_SDPA = dict(LLAMA, attn_implementation="sdpa", use_cache=False)
WORLD_2 = [
    cp_case("cp2", 2),
    cp_case("cp2_nanogpt", 2, module="user_nanogpt", model=NANOGPT),
    cp_case("cp2_full_recompute", 2, activation_checkpointing="full"),  # a recomputed block cuts its inputs again
    cp_case("cp2_llama", 2, module="hf", model=LLAMA_SDPA),
    # a padding mask: transformers passes the attention an explicit mask, cut to each rank's query rows
    cp_case("cp2_llama_padded", 2, module="hf_padded", model=LLAMA_SDPA),
    # another transformers model as trained: Phi-3's fused q|k|v with grouped-query attention, no cache
    cp_case("cp2_phi3_gqa", 2, module="hf", model=dict(AUTO_TP_MODELS["phi3_gqa"], attn_implementation="sdpa")),
]
WORLD_4 = [
    cp_case("cp4", 4),
    cp_case("cp4_llama", 4, module="hf", model=LLAMA_SDPA),
    cp_case("cp2_tp2_sp", 2, tp=2, sequence_parallel=True),
    cp_case("cp2_tp2_llama", 2, tp=2, module="hf", model=LLAMA_SDPA),
    cp_case("dp2_cp2", 2, dp=2),
    cp_case("dp2_cp2_zero3", 2, dp=2, zero_stage=3),
    cp_case("cp2_zero3_nanogpt", 2, dp=2, zero_stage=3, module="user_nanogpt", model=NANOGPT),
    # Under a pipeline each stage's blocks run on the rank's part; the part travels between stages.
    cp_case("cp2_pp2", 2, pipeline_parallel_size=2, num_microbatches=2),
    cp_case("cp2_pp2_interleaved", 2, model=dict(n_layer=4, n_embd=32, n_head=4, block_size=16),
            pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2,
            num_microbatches=4),
    cp_case("cp2_pp2_nanogpt", 2, module="user_nanogpt", model=NANOGPT, pipeline_parallel_size=2,
            num_microbatches=2),
    cp_case("cp2_pp2_llama", 2, module="hf", model=LLAMA_SDPA, pipeline_parallel_size=2, num_microbatches=2),
    # every layout on the three routes: nanoGPT and Llama where the lines above have the reference GPT only
    cp_case("cp4_nanogpt", 4, module="user_nanogpt", model=NANOGPT),
    # nanoGPT's plan is policy="auto"'s: the sequence is sliced over tp entering the first block and gathered
    # leaving the last, inside the blocks' cp cut and gather
    cp_case("cp2_tp2_sp_nanogpt", 2, tp=2, sequence_parallel=True, module="user_nanogpt", model=NANOGPT),
    cp_case("cp2_tp2_sp_llama", 2, tp=2, sequence_parallel=True, module="hf", model=LLAMA_SDPA),
    cp_case("cp2_zero3_llama", 2, dp=2, zero_stage=3, module="hf", model=LLAMA_SDPA),
]
WORLD_8 = [  # (dp, cp, tp) = (2, 2, 2), the reference GPT's in tests/parity/test_checkpoints.py; cp x pp x tp
    cp_case("dp2_cp2_tp2_nanogpt", 2, dp=2, tp=2, module="user_nanogpt", model=NANOGPT),
    cp_case("dp2_cp2_tp2_llama", 2, dp=2, tp=2, module="hf", model=LLAMA_SDPA),
    cp_case("cp2_pp2_tp2_sp_nanogpt", 2, tp=2, sequence_parallel=True, module="user_nanogpt", model=NANOGPT,
            pipeline_parallel_size=2, num_microbatches=2),
]
CASES = {c.name: c for c in WORLD_2 + WORLD_4 + WORLD_8}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity_cp")
    return {**launch(WORLD_2, 2, out / "world2"), **launch(WORLD_4, 4, out / "world4"),
            **launch(WORLD_8, 8, out / "world8")}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(name, results):
    assert_parity(results[name], reference_for(CASES[name]))
