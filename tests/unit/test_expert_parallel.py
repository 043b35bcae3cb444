"""Expert parallelism without processes: where the ep ranks sit in the layout, which modules are routed, and what
is refused before any collective (the parity runs are in parity/test_parity_expert_parallel.py)."""

import pytest
import torch
from torch import nn

from lightning_3d.errors import ParallelConfigError
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.dims import ParallelDims
from lightning_3d.parallel.expert_parallel import check_expert_parallel
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.base import Plan, PlanOptions

transformers = pytest.importorskip("transformers")

_SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              use_cache=False)
MOE = {
    "mixtral": dict(_SIZES, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(_SIZES, head_dim=8, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "olmoe": dict(_SIZES, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    # shared experts beside the routed ones: only the routed ones are split by expert
    "qwen2_moe": dict(_SIZES, intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=32),
}


def causal_lm(model_type, **sizes):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_ep_groups_are_consecutive_dp_ranks_and_dp_mod_ep_the_rest():
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2), world_size=8)
    assert (dims.dp, dims.ep, dims.dp_mod_ep, dims.tp) == (4, 2, 2, 2)
    assert [dims.group_ranks("ep", r) for r in (0, 1, 4, 5)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [dims.group_ranks("dp_mod_ep", r) for r in (0, 1, 2, 3)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_ranks("dp", 0) == [0, 2, 4, 6]  # what every non-expert weight reads, unchanged
    assert dims.coords(6) == (3, 0, 0, 0)
    assert str(dims) == "dp=4 (experts over ep=2 of them) x pp=1 x tp=2 = 8 ranks"


def test_ep_adds_no_ranks_and_must_divide_dp():
    dims = ParallelDims.from_config(ParallelConfig(pipeline_parallel_size=2, expert_parallel_size=2), world_size=4)
    assert (dims.dp, dims.pp, dims.ep, dims.world_size) == (2, 2, 2, 4)
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size=4 .* does not divide dp=2.* among \[1, 2\]"):
        ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2, expert_parallel_size=4), world_size=4)


def test_what_ep_does_not_combine_with_yet_is_refused_before_launch():
    with pytest.raises(ParallelConfigError, match="context_parallel_size=2 is not supported yet"):
        ParallelDims(dp=2, pp=1, tp=1, cp=2, ep=2)
    with pytest.raises(ParallelConfigError, match="HSDP"):
        ParallelDims(dp=4, pp=1, tp=1, dp_shard=2, ep=2)
    with pytest.raises(ParallelConfigError, match="expert_parallel_size must be a positive integer"):
        ParallelConfig(expert_parallel_size=0)


@pytest.mark.parametrize("model_type", list(MOE))
def test_auto_finds_the_routed_experts_of_every_layer_by_structure(model_type):
    model = causal_lm(model_type, **MOE[model_type])
    for tp in (1, 2):
        plan = AutoPolicy().plan(model, PlanOptions(tp=tp))
        assert plan.experts == [f"model.layers.{i}.mlp.experts" for i in range(2)], tp


def test_a_dense_model_has_no_experts_and_ep_is_refused_naming_the_fix():
    model = causal_lm("llama", **_SIZES, intermediate_size=64)
    plan = AutoPolicy().plan(model, PlanOptions())
    assert plan.experts == []
    with pytest.raises(ParallelConfigError, match="names no experts module.*Set expert_parallel_size=1"):
        check_expert_parallel(model, plan, 2)


def test_experts_that_ep_does_not_divide_are_refused_with_the_sizes_that_do():
    model = causal_lm("mixtral", **{**MOE["mixtral"], "num_local_experts": 6})
    plan = AutoPolicy().plan(model, PlanOptions())
    check_expert_parallel(model, plan, 3)
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size=4 does not divide the 6 experts of"
                                                  r" model.layers.0.mlp.experts.* among \[1, 2, 3, 6\]"):
        check_expert_parallel(model, plan, 4)


def test_experts_written_as_a_module_list_are_refused_naming_the_module():
    class Experts(nn.Module):  # a user's MoE for one device: a list of MLPs
        def __init__(self):
            super().__init__()
            self.mlps = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    root = nn.Module()
    root.experts = Experts()
    with pytest.raises(ParallelConfigError, match=r"experts \(Experts\) is not a transformers experts module"):
        check_expert_parallel(root, Plan(experts=["experts"]), 2)


@pytest.mark.multiprocess
def test_a_rank_whose_experts_get_no_token_gives_zero_gradients_and_the_others_one_processs(tmp_path):
    """ep2 on 2 ranks, each with half the tokens: where every choice falls on one rank's experts, the other
    rank's experts run on no pair, and their gradients are zeros (present, so data parallelism reduces them),
    while outputs and the busy rank's gradients stay one process's; under each experts implementation
    (eager's loop over the experts that have tokens touches no weight when none has)."""
    import json

    from helpers import WORKERS
    from helpers.launchers import forkrun

    forkrun(2, str(WORKERS / "dispatch_worker.py"), str(tmp_path), rank_files=tmp_path, timeout=180)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert len(reports[0]) == 3 * 3  # eager, grouped_mm, batched_mm x the routings
    for case in reports[0]:
        for rank, report in enumerate(reports):
            found = report[case]
            assert found["grads_exist"], (case, rank)
            assert found["output"] < 1e-5 and found["grad"] < 1e-6, (case, rank, found)
    assert reports[1]["eager/rank_1_gets_none"]["pairs_here"] == 0 == reports[0]["eager/rank_0_gets_none"]["pairs_here"]
