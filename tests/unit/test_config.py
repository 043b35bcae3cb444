"""ParallelConfig rejects settings that cannot work, and ParallelDims lays ranks out as dims.py documents."""

import itertools
import json
import re
import socket

import pytest
import torch.distributed as dist

from lightning_3d.parallel import MESH_DIM_NAMES, ParallelConfig, ParallelConfigError, ParallelDims, RankCoords
from lightning_3d.parallel.config import (
    ACTIVATION_CHECKPOINTING, MODEL_INIT, PIPELINE_REDUCE_GRADS, PIPELINE_SCHEDULES, ZERO_STAGES)
from lightning_3d.policies.gpt import GPTPolicy

# ------------------------------------------------------------------------------------------ ParallelConfig


def test_defaults_are_valid_and_leave_dp_to_the_world_size():
    config = ParallelConfig()
    assert config.data_parallel_size == "auto"
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (1, 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tensor_parallel_size", 0),
        ("tensor_parallel_size", -2),
        ("tensor_parallel_size", True),  # bool is an int in Python, but never a size
        ("pipeline_parallel_size", 2.0),
        ("pipeline_parallel_size", "2"),
        ("virtual_pipeline_size", 0),
        ("data_parallel_size", 0),
        ("data_parallel_size", False),
        ("data_parallel_size", "all"),
        ("num_microbatches", 0),
        ("num_microbatches", 1.5),
    ],
)
def test_size_that_is_not_a_positive_int_is_rejected_naming_field_and_value(field, value):
    with pytest.raises(ParallelConfigError, match=re.escape(f"{field} must be a positive integer, got {value!r}")):
        ParallelConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value", "choices"),
    [
        ("pipeline_schedule", "pipedream", PIPELINE_SCHEDULES),
        ("zero_stage", 4, ZERO_STAGES),
        ("activation_checkpointing", "everything", ACTIVATION_CHECKPOINTING),
        ("model_init", "lazy", MODEL_INIT),
        ("pipeline_reduce_grads", "per_block", PIPELINE_REDUCE_GRADS),
    ],
)
def test_unknown_choice_is_rejected_listing_the_choices(field, value, choices):
    with pytest.raises(ParallelConfigError, match=re.escape(f"{field}={value!r} is not supported")) as err:
        ParallelConfig(**{field: value})
    for choice in choices:
        assert repr(choice) in str(err.value)


def test_virtual_pipeline_needs_an_interleaved_schedule():
    with pytest.raises(ParallelConfigError, match="virtual_pipeline_size=2 needs an interleaved schedule") as err:
        ParallelConfig(virtual_pipeline_size=2, pipeline_schedule="1f1b")
    assert "pipeline_schedule='interleaved_1f1b'" in str(err.value)
    ParallelConfig(virtual_pipeline_size=2, pipeline_schedule="interleaved_1f1b")
    ParallelConfig(virtual_pipeline_size=2, pipeline_schedule="zero_bubble")


def test_reducing_gradients_per_microbatch_needs_zero_a_pipeline_and_whole_backwards():
    with pytest.raises(ParallelConfigError, match="zero_stage=0 and pipeline_parallel_size=2"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_reduce_grads="per_microbatch")
    with pytest.raises(ParallelConfigError, match="zero_stage=3 and pipeline_parallel_size=1"):
        ParallelConfig(zero_stage=3, pipeline_reduce_grads="per_microbatch")
    with pytest.raises(ParallelConfigError, match="'zero_bubble' splits it"):
        ParallelConfig(zero_stage=2, pipeline_parallel_size=2, pipeline_schedule="zero_bubble",
                       virtual_pipeline_size=2, pipeline_reduce_grads="per_microbatch")
    ParallelConfig(zero_stage=2, pipeline_parallel_size=2, pipeline_reduce_grads="per_microbatch")


def test_sequence_parallel_needs_tensor_parallel():
    with pytest.raises(ParallelConfigError, match="sequence_parallel=True .* tensor_parallel_size=1"):
        ParallelConfig(sequence_parallel=True)
    ParallelConfig(sequence_parallel=True, tensor_parallel_size=2)


def test_to_dict_is_plain_values_with_a_class_path_for_a_policy_instance():
    config = ParallelConfig(tensor_parallel_size=2, zero_stage=1, policy=GPTPolicy())
    values = config.to_dict()
    assert values["policy"] == "lightning_3d.policies.gpt.GPTPolicy"
    assert values["tensor_parallel_size"] == 2 and values["zero_stage"] == 1
    assert json.loads(json.dumps(values)) == values  # plain data: loggable and YAML/JSON-able
    # The class path is a valid policy spec, so the dict builds the same config back.
    assert ParallelConfig(**values).to_dict() == values


def test_to_dict_keeps_a_policy_name_as_is():
    assert ParallelConfig(policy="gpt").to_dict()["policy"] == "gpt"


def test_to_dict_gives_a_class_path_for_a_policy_class():
    assert ParallelConfig(policy=GPTPolicy).to_dict()["policy"] == "lightning_3d.policies.gpt.GPTPolicy"


# ------------------------------------------------------------------------------------- from_config


def test_product_larger_than_the_world_names_every_factor_and_a_fix():
    config = ParallelConfig(data_parallel_size=8, tensor_parallel_size=8, pipeline_parallel_size=4)
    with pytest.raises(ParallelConfigError) as err:
        ParallelDims.from_config(config, world_size=64)
    message = str(err.value)
    assert "data_parallel_size (8) * pipeline_parallel_size (4) * tensor_parallel_size (8) = 256" in message
    assert "world size is 64" in message
    assert "data_parallel_size='auto' (-> 2)" in message  # tp * pp = 32 divides 64
    assert "launch 256 processes" in message


def test_auto_dp_is_world_size_over_tp_times_pp():
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=4)
    dims = ParallelDims.from_config(config, world_size=64)
    assert (dims.dp, dims.pp, dims.tp) == (8, 4, 2)
    assert dims.world_size == 64
    assert dims.shape == (4, 8, 2)  # MESH_DIM_NAMES order: pp, dp, tp


def test_auto_dp_when_tp_times_pp_does_not_divide_the_world_lists_divisors():
    config = ParallelConfig(tensor_parallel_size=4)
    with pytest.raises(ParallelConfigError, match=re.escape("= 4 does not divide the world size 6")) as err:
        ParallelDims.from_config(config, world_size=6)
    assert "[1, 2, 3, 6]" in str(err.value)


def test_explicit_dp_mismatch_suggests_auto_with_the_resolved_size():
    config = ParallelConfig(data_parallel_size=3, tensor_parallel_size=2)
    with pytest.raises(ParallelConfigError, match=re.escape("data_parallel_size='auto' (-> 4)")):
        ParallelDims.from_config(config, world_size=8)


def test_explicit_dp_mismatch_where_tp_times_pp_does_not_divide_lists_divisors():
    config = ParallelConfig(data_parallel_size=2, tensor_parallel_size=3)
    with pytest.raises(ParallelConfigError, match=re.escape("divisors of 8: [1, 2, 4, 8]")):
        ParallelDims.from_config(config, world_size=8)


def test_explicit_dp_that_fits_the_world_is_kept():
    config = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert ParallelDims.from_config(config, world_size=8) == ParallelDims(dp=2, pp=2, tp=2)


@pytest.mark.parametrize("field", ["dp", "pp", "tp"])
@pytest.mark.parametrize("value", [0, True])
def test_dims_reject_sizes_that_are_not_positive_ints(field, value):
    sizes = {"dp": 1, "pp": 1, "tp": 1, field: value}
    with pytest.raises(ParallelConfigError, match=re.escape(f"{field} must be a positive integer, got {value!r}")):
        ParallelDims(**sizes)


# ------------------------------------------------------------------------------------------ rank layout

LAYOUTS = [(1, 1, 1), (2, 2, 2), (4, 1, 2), (1, 4, 1), (3, 2, 5), (2, 3, 4)]  # (dp, pp, tp)


@pytest.mark.parametrize(("dp", "pp", "tp"), LAYOUTS)
def test_coords_and_rank_round_trip_for_every_rank(dp, pp, tp):
    dims = ParallelDims(dp=dp, pp=pp, tp=tp)
    seen = set()
    for rank in range(dims.world_size):
        coords = dims.coords(rank)
        assert 0 <= coords.dp < dp and 0 <= coords.pp < pp and 0 <= coords.tp < tp
        assert dims.rank(coords) == rank
        seen.add(coords)
    assert len(seen) == dims.world_size  # a bijection: every position holds exactly one rank


@pytest.mark.parametrize(("dp", "pp", "tp"), LAYOUTS)
def test_global_rank_is_megatron_arithmetic_with_tp_fastest(dp, pp, tp):
    dims = ParallelDims(dp=dp, pp=pp, tp=tp)
    for dp_rank, pp_rank, tp_rank in itertools.product(range(dp), range(pp), range(tp)):
        expected = tp_rank + tp * (dp_rank + dp * pp_rank)
        assert dims.rank(RankCoords(dp=dp_rank, pp=pp_rank, tp=tp_rank)) == expected
    # Consecutive ranks share a tensor-parallel group, so TP stays within a node.
    assert dims.group_ranks("tp", 0) == list(range(tp))


def test_docstring_example_of_eight_ranks_at_dp2_pp2_tp2():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    groups = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }
    for dim, dim_groups in groups.items():
        for group in dim_groups:
            for rank in group:
                assert dims.group_ranks(dim, rank) == group, (dim, rank)


def test_class_docstring_example():
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2), world_size=8)
    assert dims.dp == 4
    assert dims.coords(5) == RankCoords(dp=2, pp=0, tp=1)
    assert str(dims) == "dp=4 x pp=1 x tp=2 = 8 ranks"


def test_rank_outside_the_world_and_unknown_dim_are_rejected():
    dims = ParallelDims(dp=2, pp=1, tp=2)
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4 ranks"):
        dims.coords(4)
    with pytest.raises(ValueError, match="rank -1 is outside"):
        dims.coords(-1)
    with pytest.raises(ValueError, match="dim must be one of"):
        dims.group_ranks("sp", 0)


# ------------------------------------------------------------------------------------------ build_mesh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_process_group(monkeypatch):
    """A gloo group of one; conftest's each_test_starts_without_a_process_group ends it after the test."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)


def test_build_mesh_names_dims_pp_dp_tp(one_process_group):
    mesh = ParallelDims(dp=1, pp=1, tp=1).build_mesh("cpu")
    assert mesh.mesh_dim_names == MESH_DIM_NAMES == ("pp", "dp", "tp")
    assert tuple(mesh.shape) == (1, 1, 1)
    assert mesh["tp"].size() == 1


@pytest.mark.parametrize("value", [True, 1.0])
def test_zero_stage_must_be_an_int_choice(value):
    with pytest.raises(ParallelConfigError, match="zero_stage"):
        ParallelConfig(zero_stage=value)


def test_1f1b_needs_a_micro_batch_per_stage():
    with pytest.raises(ParallelConfigError, match=r"num_microbatches=2 < pipeline_parallel_size=4"):
        ParallelConfig(pipeline_parallel_size=4, num_microbatches=2)
    ParallelConfig(pipeline_parallel_size=4, num_microbatches=2, pipeline_schedule="gpipe")  # fine


def test_interleaved_schedules_need_whole_rounds_of_micro_batches():
    with pytest.raises(ParallelConfigError, match=r"num_microbatches=9 is not a multiple of its 2 rounds"):
        ParallelConfig(pipeline_parallel_size=4, num_microbatches=9, pipeline_schedule="interleaved_1f1b",
                       virtual_pipeline_size=2)
    ParallelConfig(pipeline_parallel_size=4, num_microbatches=8, pipeline_schedule="interleaved_1f1b",
                   virtual_pipeline_size=2)
