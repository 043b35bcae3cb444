"""Expert parallelism matches one process, step by step: tiny Mixtral, Qwen3-MoE and OLMoE from transformers as
users configure them for training (``use_cache=False``, grouped-query attention, top-2 of 8 experts), planned
by ``policy="auto"``, at ep2 and ep4, and composed with tensor parallelism, pipeline parallelism, and data
parallelism (ep borrowed from dp) with ZeRO-1 and ZeRO-3; Qwen2-MoE (a shared expert beside the routed ones) and
gpt-oss (experts stored transposed, with biases) at ep2, and gpt-oss at ep2 x tp2. The "_aux" cases train on
the model's own loss with the router's load-balancing term (``output_router_logits``; "_aux_mask" with a padding
mask), which is the global batch's under dp, with ep or without (ep1).

One launch per world size runs every case of that size."""

import pytest

from helpers.harness import Case, assert_parity, launch, reference_for
from helpers.hf_cases import MOE_MODELS, MORE_MOE_MODELS

pytestmark = pytest.mark.multiprocess


# The router's load-balancing loss on, as trained (transformers' output_router_logits), at a weight where a
# per-rank value would show: the model's own loss (labels=), with a padding mask in the "_mask" cases.
BALANCING_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.05)


def ep_case(model, ep, dp, tp=1, pp=1, aux=None, **strategy):
    kwargs = dict(expert_parallel_size=ep, data_parallel_size=dp, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp, **strategy)
    if pp > 1:
        kwargs.setdefault("num_microbatches", 2)
    tag = f"{model}_dp{dp}_ep{ep}" + (f"_tp{tp}" if tp > 1 else "") + (f"_pp{pp}" if pp > 1 else "") + (
        f"_zero{strategy['zero_stage']}" if strategy.get("zero_stage") else "") + (f"_{aux}" if aux else "")
    config = {**MOE_MODELS, **MORE_MOE_MODELS}[model]
    module = {None: "hf", "aux": "hf_labels", "aux_mask": "hf_labels_padded"}[aux]
    return Case(name=tag, module=module, strategy_kwargs=kwargs, dp=dp, steps=4,
                model={**config, **BALANCING_LOSS} if aux else config)


WORLD_2 = [ep_case(model, 2, 2) for model in {**MOE_MODELS, **MORE_MOE_MODELS}] + [
    ep_case("mixtral", 2, 2, aux="aux"), ep_case("olmoe", 1, 2, aux="aux_mask"),  # (ep1: plain dp)
    ep_case("qwen2_moe", 2, 2, aux="aux_mask"), ep_case("gpt_oss", 2, 2, aux="aux")]
WORLD_4 = [ep_case(model, 4, 4) for model in MOE_MODELS] + [
    ep_case("qwen3_moe", 2, 4, zero_stage=3, aux="aux_mask"), ep_case("mixtral", 2, 2, tp=2, aux="aux")] + [
    ep_case(model, 2, 2, tp=2) for model in {**MOE_MODELS, "gpt_oss": None}] + [
    ep_case(model, 2, 2, pp=2) for model in MOE_MODELS] + [
    ep_case(model, 2, 4, zero_stage=zero) for model in MOE_MODELS for zero in (1, 3)]
WORLD_8 = [ep_case(model, 2, 2, tp=2, pp=2) for model in MOE_MODELS]
CASES = {c.name: c for c in WORLD_2 + WORLD_4 + WORLD_8}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity_ep")
    return {**launch(WORLD_2, 2, out / "world2"), **launch(WORLD_4, 4, out / "world4"),
            **launch(WORLD_8, 8, out / "world8")}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(name, results):
    assert_parity(results[name], reference_for(CASES[name]))


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_its_share_of_the_experts(name, results):
    """Counted on the ranks: 1/ep of every layer's experts, of those 1/tp of each expert's features (gpt-oss'
    down-projection bias, added once, is whole over tp), of the layers of its pipeline stage, and under ZeRO its
    dp_mod_ep shard of them."""
    case, kwargs = CASES[name], CASES[name].strategy_kwargs
    ep, tp, pp, dp = (kwargs[k] for k in ("expert_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
                                          "data_parallel_size"))
    split = ep * pp * (dp // ep if kwargs.get("zero_stage") else 1)
    share = sum(t.numel() // (split * (1 if n.endswith("down_proj_bias") else tp))
                for n, t in reference_for(case).params.items() if ".experts." in n)
    assert results[name].expert_elements == [share] * (dp * tp * pp)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith(("mixtral", "olmoe"))])
def test_the_token_load_callback_counts_what_one_process_counts(name, results):
    """ExpertLoadMonitor's min / max / mean tokens per expert, per layer and batch, equal one process's (every
    layer of every stage, each token counted once over dp, ep and tp)."""
    loads, expected = results[name].expert_loads, reference_for(CASES[name]).expert_loads
    assert len(expected) == CASES[name].steps and len(expected[0]) == 3 * 4  # min, max, mean of 4 layers
    assert loads == expected
