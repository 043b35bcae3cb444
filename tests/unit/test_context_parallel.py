"""Context parallelism's arithmetic, without processes: which positions a cp rank keeps, where it sits in the
mesh, and what is refused before any collective (the parity runs are in parity/test_parity_context_parallel.py)."""

import pytest
import torch

from lightning_3d.errors import ParallelConfigError
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.context_parallel import check_length, local_positions
from lightning_3d.parallel.dims import ParallelDims


def test_each_rank_keeps_a_head_and_a_tail_chunk():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("length,cp", [(16, 2), (16, 4), (24, 3)])
def test_the_ranks_parts_cover_the_sequence_once(length, cp):
    kept = torch.cat([local_positions(length, cp, rank) for rank in range(cp)])
    assert sorted(kept.tolist()) == list(range(length))


@pytest.mark.parametrize("length,cp", [(16, 2), (32, 4)])
def test_causal_work_is_even_over_the_ranks(length, cp):
    """Under a causal mask a query at position p reads p + 1 keys: every rank reads as many."""
    work = {int(sum(p + 1 for p in local_positions(length, cp, rank).tolist())) for rank in range(cp)}
    assert len(work) == 1


def test_a_length_not_divisible_by_twice_cp_is_refused_with_the_fix():
    check_length(16, 4)
    with pytest.raises(ParallelConfigError, match=r"2 x 3 = 6 chunks, but the sequence length is 16.*divisible by 6"):
        check_length(16, 3)


def test_cp_sits_between_dp_and_tp():
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2, context_parallel_size=2), world_size=8)
    assert (dims.dp, dims.cp, dims.tp, dims.replicas) == (2, 2, 2, 4)
    assert dims.shape == (1, 2, 2, 2)
    assert all(dims.rank(dims.coords(rank)) == rank for rank in range(8))
    assert dims.group_ranks("tp", 0) == [0, 1]
    assert dims.group_ranks("cp", 0) == [0, 2]
    assert dims.group_ranks("dp", 0) == [0, 4]
    assert str(dims) == "dp=2 x pp=1 x cp=2 x tp=2 = 8 ranks"


def test_cp_composes_with_pp_inside_each_stage():
    dims = ParallelDims.from_config(ParallelConfig(pipeline_parallel_size=2, context_parallel_size=2), world_size=8)
    assert (dims.dp, dims.pp, dims.cp, dims.tp, dims.replicas) == (2, 2, 2, 1, 4)
    assert dims.group_ranks("cp", 0) == [0, 1]
    assert dims.group_ranks("pp", 0) == [0, 4]


def test_without_cp_the_layout_is_unchanged():
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2), world_size=8)
    assert (dims.shape, dims.replicas, dims.coords(5)) == ((1, 4, 2), 4, (2, 0, 1, 0))


def test_a_world_that_cp_does_not_divide_is_refused():
    with pytest.raises(ParallelConfigError, match=r"context_parallel_size \(4\) = 8 does not divide the world size 6"):
        ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2, context_parallel_size=4), world_size=6)


def test_what_cp_does_not_combine_with_yet_is_refused_before_launch():
    with pytest.raises(ParallelConfigError, match="HSDP"):
        ParallelDims(dp=4, pp=1, tp=1, cp=2, dp_shard=2)
    with pytest.raises(ParallelConfigError, match="positive integer"):
        ParallelConfig(context_parallel_size=0)
