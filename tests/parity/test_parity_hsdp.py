"""HSDP (issue 32): ZeRO within groups of ``data_parallel_shard_size`` dp ranks, replicated across them, matches
one process step by step -- at (dp_replicate 2, dp_shard 2, tp 2) and (replicate 2, shard 2, pp 2), under
ZeRO-1, 2 and 3, with clipping by the global norm, and for Phi-3 and BERT from transformers -- and holds the
model ``dp_replicate`` times over the ranks (plain ZeRO over all of dp holds it once, replicas ``dp`` times):
what tells HSDP from both, since parity alone would hold for them too. One launch of 8 ranks runs every case."""

import pytest

from helpers.harness import SWEEP_STEPS, Case, assert_parity, launch, reference_for

pytestmark = pytest.mark.multiprocess

GPT4 = dict(n_layer=4, n_embd=32, n_head=4, block_size=16)


def hsdp_case(zero: int, pp: int, tp: int, hf: str | None = None, **kwargs) -> Case:
    strategy = dict(data_parallel_size=4, data_parallel_shard_size=2, pipeline_parallel_size=pp,
                    tensor_parallel_size=tp, zero_stage=zero)
    if pp > 1:
        strategy.update(num_microbatches=2)
    name = (f"hsdp_zero{zero}_rep2_shard2_pp{pp}_tp{tp}" + (f"_{hf}" if hf else "")
            + "".join(f"_{k}{v}" for k, v in kwargs.items()))
    if hf:  # a transformers model from a tiny config, split by policy="auto"
        from helpers.hf_cases import AUTO_TP_MODELS

        return Case(name=name, module="hf", dp=4, strategy_kwargs=strategy, steps=SWEEP_STEPS,
                    model=AUTO_TP_MODELS[hf], **kwargs)
    return Case(name=name, dp=4, strategy_kwargs=strategy, steps=SWEEP_STEPS, model=GPT4, learning_rate=3e-3,
                **kwargs)


CASES = [hsdp_case(3, 1, 2), hsdp_case(2, 2, 1), hsdp_case(3, 2, 1, gradient_clip_val=0.3),
         hsdp_case(1, 1, 2, gradient_clip_val=0.3),  # ZeRO-1 (runs as 2) with tp and clipping
         # models this repository did not write: Phi-3's fused qkv and gate|up, BERT's sibling modules
         hsdp_case(3, 1, 2, hf="phi3"), hsdp_case(3, 1, 2, hf="bert")]
BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(CASES, 8, tmp_path_factory.mktemp("parity_hsdp"))


@pytest.mark.parametrize("name", list(BY_NAME))
def test_hsdp_matches_single_process(name, results):
    result, reference = results[name], reference_for(BY_NAME[name])
    assert_parity(result, reference)
    assert max(abs(a - b) for a, b in zip(result.logged, reference.logged)) <= 1e-5, (result.logged, reference.logged)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_hsdp_holds_one_copy_of_the_model_per_replica(name, results):
    result = results[name]
    copies = sum(result.rank_parameter_bytes) / (4 * result.model_parameters)  # fp32
    # 2 replicas; a little more for FSDP2's padding, under the pipeline the tied embedding's second copy, and
    # what tp leaves whole on both its ranks (BERT's position and token-type tables, norms: 2.68 here, where
    # ZeRO over all of dp would give 1.34 and replicas 5.4).
    most = 3.0 if BY_NAME[name].module == "hf" else 2.3
    assert 1.9 <= copies <= most, (copies, result.rank_parameter_bytes, result.model_parameters)
