"""Tensor parallel plans: checked before anything is sharded (communication and memory on ranks:
parity/test_tensor_parallel_on_ranks.py)."""

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_3d.models import GPT, GPTConfig
from lightning_3d.parallel.tensor_parallel import check_tp_plan, match_modules
from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.policies.gpt import GPTPolicy

TINY = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)


def test_patterns_match_one_name_per_star():
    gpt = GPT(GPTConfig(**TINY))
    assert match_modules(gpt, "blocks.*.attn.q_proj") == ["blocks.0.attn.q_proj", "blocks.1.attn.q_proj"]
    assert match_modules(gpt, "blocks.*.q_proj") == []
    assert match_modules(gpt, "lm_head") == ["lm_head"]


def test_gpt_plan_fits_the_gpt_at_tp_2_and_4():
    for tp in (2, 4):
        for sp in (False, True):
            gpt = GPT(GPTConfig(**TINY))
            check_tp_plan(gpt, GPTPolicy().plan(gpt, PlanOptions(tp=tp, sequence_parallel=sp)).tp_plan, tp)


def test_a_pattern_that_matches_nothing_is_named():
    with pytest.raises(PolicyError, match=r"pattern 'blocks\.\*\.attention\.wq' \(ColwiseParallel\) matches no module"):
        check_tp_plan(GPT(GPTConfig(**TINY)), {"blocks.*.attention.wq": ColwiseParallel()}, 2)


def test_a_split_that_does_not_divide_is_named_with_its_sizes():
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8))
    with pytest.raises(PolicyError) as err:
        check_tp_plan(model, {"0": ColwiseParallel(), "1": RowwiseParallel()}, 4)
    assert "0: ColwiseParallel splits out_features=6 over 4 ranks" in str(err.value)
    assert "1: RowwiseParallel splits in_features=6 over 4 ranks" in str(err.value)


def test_a_style_on_a_layer_it_cannot_split_is_named():
    with pytest.raises(PolicyError, match="ColwiseParallel applies to nn.Linear or nn.Embedding, not LayerNorm"):
        check_tp_plan(nn.Sequential(nn.LayerNorm(8)), {"0": ColwiseParallel()}, 2)
    check_tp_plan(nn.Sequential(nn.LayerNorm(8)), {"0": SequenceParallel()}, 2)  # not a split: fine


@pytest.mark.parametrize("sizes, message", [
    (dict(n_head=3, n_embd=24), r"n_head \(3\) is not divisible by tensor_parallel_size \(2\)"),
    (dict(vocab_size=65), r"vocab_size \(65\) is not divisible by tensor_parallel_size \(2\): set vocab_size=66"),
])
def test_gpt_sizes_that_do_not_split_fail_before_sharding(sizes, message):
    gpt = GPT(GPTConfig(**{**TINY, **sizes}))
    with pytest.raises(PolicyError, match=message):
        GPTPolicy().plan(gpt, PlanOptions(tp=2))


def test_sequence_parallel_needs_positions_to_split():
    gpt = GPT(GPTConfig(**{**TINY, "block_size": 15}))
    GPTPolicy().plan(gpt, PlanOptions(tp=2))  # fine without SP
    with pytest.raises(PolicyError, match=r"block_size \(15\) is not divisible"):
        GPTPolicy().plan(gpt, PlanOptions(tp=2, sequence_parallel=True))


def test_an_mlp_width_that_does_not_split_fails_before_sharding():
    gpt = GPT(GPTConfig(**{**TINY, "n_embd": 36, "n_head": 4, "mlp_ratio": 1}))  # hidden 36 % 8 != 0
    with pytest.raises(PolicyError, match="splits out_features=36 over 8 ranks"):
        check_tp_plan(gpt, GPTPolicy().plan(gpt, PlanOptions(tp=4)).tp_plan, 8)


def test_gpt_plan_names_the_dropout_that_acts_on_shards():
    def regions(dropout, sp):
        gpt = GPT(GPTConfig(**TINY, dropout=dropout))
        plan = GPTPolicy().plan(gpt, PlanOptions(tp=2, sequence_parallel=sp))
        assert all(match_modules(gpt, pattern) for pattern in plan.sharded_rng_regions)
        return plan.sharded_rng_regions

    assert regions(0.0, False) == [] and regions(0.0, True) == []  # nothing random: no stream switching
    assert regions(0.1, False) == ["blocks.*.attn"]  # attention dropout acts on this rank's heads
    assert set(regions(0.1, True)) == {"blocks.*.attn", "blocks.*.attn_dropout", "blocks.*.mlp_dropout", "emb_dropout"}
