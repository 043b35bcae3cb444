"""The stage split: blocks per stage, names kept, bad splits named (single process, meta device)."""

import logging

import pytest
import torch

from lightning_3d.models import GPTConfig, GPTLightningModule
from lightning_3d.pipeline import assign_blocks, split_batch, split_stages
from lightning_3d.pipeline.split import stage_ids_of
from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.parallel.config import ParallelConfigError
from lightning_3d.policies.gpt import GPTPolicy

BLOCKS = [f"model.blocks.{i}" for i in range(7)]


def test_uneven_counts_are_split_not_dropped(caplog):
    caplog.set_level(logging.INFO, logger="lightning_3d.pipeline.split")
    stages = assign_blocks(BLOCKS, 3)
    assert [len(s) for s in stages] == [3, 2, 2]
    assert [b for s in stages for b in s] == BLOCKS
    assert "blocks per stage [3, 2, 2]" in caplog.text


def test_too_few_blocks_for_the_stages_is_an_error():
    with pytest.raises(PolicyError, match=r"7 blocks but the pipeline has pipeline_parallel_size x"
                                          r" virtual_pipeline_size = 8 stages"):
        assign_blocks(BLOCKS, 8)


def test_an_explicit_split_must_cover_every_block_once():
    assert assign_blocks(BLOCKS, 2, [BLOCKS[:2], BLOCKS[2:]]) == [BLOCKS[:2], BLOCKS[2:]]
    with pytest.raises(PolicyError, match="List every block exactly once"):
        assign_blocks(BLOCKS, 2, [BLOCKS[:2], BLOCKS[3:]])


def test_interleaved_stages_loop_over_the_ranks():
    assert stage_ids_of(0, 2, 2) == [0, 2] and stage_ids_of(1, 2, 2) == [1, 3]


def _meta_module(n_layer=4):
    module = GPTLightningModule(config=GPTConfig(n_layer=n_layer, n_embd=32, n_head=4, block_size=16))
    with torch.device("meta"):
        module.configure_model()
    return module


def test_each_rank_keeps_its_stages_under_single_device_names():
    full = {n for n, _ in _meta_module().named_parameters()}
    plan_module = _meta_module()
    plan = GPTPolicy().plan(plan_module, PlanOptions())
    per_stage = assign_blocks(plan.blocks, 4)
    seen = set()
    for rank in range(2):  # pp=2, two virtual stages each
        module = _meta_module()
        stages = split_stages(module, plan, per_stage, stage_ids_of(rank, 2, 2))
        names = {n for n, _ in module.named_parameters()}
        assert names <= full and not names & seen
        seen |= names
        # each stage module holds exactly its own blocks; embeddings on stage 0, head on the last
        held = [sorted(s.blocks.keys()) for s in stages]
        assert held == ([["0"], ["2"]] if rank == 0 else [["1"], ["3"]])
        assert (stages[0].tok_emb is not None) == (rank == 0) and (stages[-1].lm_head is not None) == (rank == 1)
        # the module's union shares the very objects the stages run
        for stage in stages:
            for key, block in stage.blocks.items():
                assert module.model.blocks[key] is block
    assert seen == full


def test_a_batch_that_micro_batches_do_not_divide_is_named():
    batch = (torch.zeros(6, 4), torch.zeros(6, 4))
    assert [mb[0].shape[0] for mb in split_batch(batch, 3)] == [2, 2, 2]
    with pytest.raises(ParallelConfigError, match="6 samples per data-parallel rank, which num_microbatches=4"):
        split_batch(batch, 4)


def test_a_split_by_parameters_gives_the_head_stage_fewer_blocks():
    module = _meta_module(n_layer=6)
    module.model.lm_head = torch.nn.Linear(32, 4096, bias=False, device="meta")  # a big head: 131k parameters
    plan = GPTPolicy().plan(module, PlanOptions())
    from lightning_3d.pipeline.split import split_options
    stages = assign_blocks(plan.blocks, 2, **split_options(module, plan, "params"))
    assert [len(s) for s in stages] == [5, 1] and [b for s in stages for b in s] == plan.blocks
    assert [len(s) for s in assign_blocks(plan.blocks, 2, **split_options(module, plan, "blocks"))] == [3, 3]
