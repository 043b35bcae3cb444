"""layout="auto" on 4 gloo ranks (helpers/workers/auto_layout_worker.py, one launch): every rank runs the layout
rank 0 chose after calibrating, it trains, and under a memory budget that rules out the free choice the
choice fits the budget -- by the planner's estimate and by the model states each rank holds. A user's own model,
which the planner knows only by measuring it, trains with one process's losses."""

import json

import pytest
import torch

from helpers import WORKERS
from helpers.harness import assert_parity, reference_for
from helpers.launchers import forkrun
from helpers.workers.auto_layout_worker import USER_MODEL
from lightning_3d.planner.calibration import SEPARATELY_TIMED

# A limit is for a hang, not for a loaded machine: the shared launch takes minutes on 2 busy cores.
pytestmark = [pytest.mark.multiprocess, pytest.mark.long_launch, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto_layout")
    forkrun(4, str(WORKERS / "auto_layout_worker.py"), str(out), timeout=1200, rank_files=out)
    return out


@pytest.fixture(scope="module")
def ranks(launched):
    return [json.loads((launched / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_a_users_own_model_trains_under_the_layout_chosen_with_one_processs_losses(launched):
    """StoryLM (tests/helpers/user_models.py) is neither the reference GPT nor a Hugging Face model: layout="auto"
    refused it ("it models the reference GPT and Hugging Face configs"). Measured on fake tensors instead, it is
    planned, and trains under the layout chosen as in one process: losses, gradient norms, parameters."""
    result = torch.load(launched / f"{USER_MODEL.name}.pt", weights_only=False)
    layout = result.layout
    assert layout is not None and layout["dp"] == 1 and layout["tp"] * layout["pp"] == 4, layout
    assert_parity(result, reference_for(USER_MODEL))


def test_the_planners_measured_parameters_are_what_each_rank_of_the_chosen_layout_holds(launched):
    """The parameter bytes the planner counts per rank from the measured model (blocks split as the policy's plan
    splits them, the embedding on the first stage, the final norm and head on the last) against the bytes each
    rank holds after training."""
    from helpers.harness import module_and_data
    from lightning_3d.parallel.config import ParallelConfig
    from lightning_3d.parallel.parallelize import plan_model
    from lightning_3d.planner.layout import Layout
    from lightning_3d.planner.memory import rank_parameters
    from lightning_3d.policies.registry import resolve_policy
    from lightning_3d.strategies.measure_model import measured_model_spec

    result = torch.load(launched / f"{USER_MODEL.name}.pt", weights_only=False)
    module, data = module_and_data(USER_MODEL, USER_MODEL.global_batch_size)
    with torch.device("meta"):
        module.configure_model()
    policy, layout = resolve_policy("auto"), Layout(**result.layout)
    plans = {layout.tp: plan_model(policy, module, ParallelConfig(), layout.tp)} if layout.tp > 1 else {}
    data.setup("fit")
    spec = measured_model_spec(module, plan_model(policy, module, ParallelConfig(), 1), plans,
                               next(iter(data.train_dataloader())), device=torch.device("cpu"), precision="32-true")
    predicted = [4 * rank_parameters(spec, layout, rank // (layout.tp * layout.dp)) for rank in range(4)]
    assert predicted == result.rank_parameter_bytes, (layout, predicted, result.rank_parameter_bytes)


@pytest.mark.parametrize("run", ["free", "budget", "llama"])
def test_every_rank_runs_the_one_layout_chosen_and_trains(ranks, run):
    """"llama": transformers' LlamaForCausalLM from a tiny config, called as users call it. Its decoder makes a
    cache object per call (use_cache), which the calibration's timed block calls once shared and grew: the
    calibration failed with "Trying to backward through the graph a second time" (calibrate._fresh_state)."""
    chosen = [rank[run] for rank in ranks]
    assert all(r["config"] == chosen[0]["config"] and r["dims"] == chosen[0]["dims"] for r in chosen), chosen
    dp, pp, tp = chosen[0]["dims"]
    assert dp * pp * tp == 4
    assert all(r["steps"] == 5 and 0 < r["loss"] < 10 for r in chosen), chosen


def test_a_budget_below_the_free_choice_gives_a_layout_that_fits_it(ranks):
    free, budget = ranks[0]["free"], ranks[0]["budget"]
    assert budget["budget"] == pytest.approx(0.6 * free["predicted_memory"], rel=1e-6)
    assert budget["layout"] != free["layout"]
    assert budget["predicted_memory"] <= budget["budget"]
    assert all(rank["budget"]["states"] <= budget["budget"] for rank in ranks), [r["budget"] for r in ranks]


def test_the_calibration_measured_the_optimizer_the_pipeline_schedules_own_cost_and_the_recompute(ranks):
    """Measured on the ranks, not assumed: an AdamW step per parameter, pp being left to the decision the
    pipeline schedule's own seconds per micro-batch (a two-stage schedule on the world's halves), and the
    recompute being left to it too, what recomputing a block's forward adds to its forward + backward."""
    for rank in ranks:
        calibration = rank["free"]["calibration"]
        assert 0 < calibration["optimizer_seconds_per_parameter"] < 1e-5
        # A sanity bound: milliseconds, idle or on 2 loaded cores; micro-batches of the link probe's message
        # size in bytes instead of the run's (unit/test_calibration_pipeline_probe.py) read 0.3-1 s.
        assert 0 <= calibration["pipeline_microbatch_s"] < 1.0
        assert 0.05 < calibration["recompute_share"] < 3.0


def test_the_calibration_timed_all_gather_and_reduce_scatter_apart_from_the_all_reduce(ranks):
    """ZeRO's and sequence parallelism's collectives, timed on the ranks' groups; on one node dp's group is
    tp's, timed once."""
    for rank in ranks:
        links = rank["free"]["calibration"]["collective_links"]
        assert sorted(links) == sorted(SEPARATELY_TIMED), links
        assert all(speed["latency_s"] >= 0 and speed["bandwidth_bytes_per_s"] > 0 for speed in links.values())
        assert links["dp.reduce_scatter"] == links["tp.reduce_scatter"]
        assert links["dp.reduce_scatter"] != links["dp.all_gather"]


def test_the_calibration_timed_ddps_gradient_synchronization_where_a_layout_may_run_ddp(ranks):
    """The free run may choose dp4 (DistributedDataParallel): DDP's synchronization of the model's own
    parameters was timed, per gradient byte, the same on every rank (the slowest's)."""
    measured = {rank["free"]["calibration"]["ddp_sync_seconds_per_byte"] for rank in ranks}
    assert len(measured) == 1, measured
    assert 0 < measured.pop() < 1e-6  # under a microsecond per byte: a 4-rank gloo all-reduce moves > 1 MB/s


def test_the_calibration_timed_zeros_synchronization_where_a_layout_may_run_zero_over_the_world(ranks):
    """The free run may choose dp4 with ZeRO-2 or ZeRO-3: FSDP2 over the world was timed on a stand-in of the
    model's units, per gradient byte, the same on every rank (the slowest's); ZeRO-3 gathers once more."""
    for name in ("zero2_sync_seconds_per_byte", "zero3_sync_seconds_per_byte"):
        measured = {rank["free"]["calibration"][name] for rank in ranks}
        assert len(measured) == 1, (name, measured)
        assert 0 < measured.pop() < 1e-6, name


def test_the_calibration_timed_zero_bubbles_split_backward_at_two_micro_batch_sizes(ranks):
    measured = [rank["free"]["calibration"]["zero_bubble_split_seconds_per_token"] for rank in ranks]
    assert all(split == measured[0] for split in measured), measured
    assert len(measured[0]) == 2 and all(0 <= seconds < 1e-3 for seconds in measured[0].values()), measured[0]


def test_the_calibration_timed_dtensors_optimizer_cost_replicated_and_sharded(ranks):
    for name in ("optimizer_dtensor_seconds_per_block", "optimizer_dtensor_seconds_per_sharded_block"):
        measured = {rank["free"]["calibration"][name] for rank in ranks}
        assert len(measured) == 1, (name, measured)
        assert 0 <= measured.pop() < 1.0, name


def test_the_calibration_timed_the_optimizer_on_the_blocks_and_on_the_embeddings_shape(ranks):
    """Two figures per parameter, each the same on every rank (the slowest's): a block's (its small tensors)
    and a tensor of the embedding's shape."""
    for name in ("optimizer_seconds_per_parameter", "optimizer_seconds_per_embedding_parameter"):
        measured = {rank["free"]["calibration"][name] for rank in ranks}
        assert len(measured) == 1, (name, measured)
        assert 0 < measured.pop() < 1e-5, name  # AdamW streams > 0.1 M parameters per second on any CPU


def test_the_calibrations_own_process_groups_are_destroyed_after_their_measurement(ranks):
    # Each layout="auto" fit had left the link and pipeline measurements' groups alive: three gloo threads and
    # their sockets each, for the life of the process (a sweep of fits in one process ran hundreds of them). The
    # tp meshes the block and the head are timed split on stayed for the whole run (two groups per tp size; on
    # GPUs an NCCL communicator each and its buffers).
    assert all(rank["groups"]["after_links"] == rank["groups"]["before"] for rank in ranks), [r["groups"] for r in ranks]
    assert all(rank["groups"]["after"] == rank["groups"]["before"] for rank in ranks), [r["groups"] for r in ranks]
    # ... and after the launch's four layout="auto" fits none of the meshes the calibration timed on is alive (their
    # first dimension, named "rest" before, is in no layout's mesh).
    for rank in ranks:
        assert not [desc for desc in rank["groups"]["alive"] if "calibration" in desc or desc == "mesh_rest"], rank
    # ... nor held where the process's group map no longer lists it: the tp-split block was timed on a deep copy,
    # whose DTensors' copied mesh looked the groups up again and kept them (and DTensor's caches the copy): after
    # the four fits here each rank held 12 such groups, 38 gloo work threads for 7 groups alive (one auto fit on 8
    # ranks: 5 groups, 15 threads per rank; on GPUs an NCCL communicator each). gloo runs two work threads per
    # group.
    for rank in ranks:
        threads, alive = rank["groups"]["gloo_threads"], len(rank["groups"]["alive"])
        assert threads is None or threads == 2 * alive, (threads, rank["groups"]["alive"])


def test_a_second_fit_of_a_layout_makes_no_new_process_groups(ranks):
    # Every fit had built its layout's device mesh (a group per dimension) anew, and none was ever destroyed: a
    # notebook or a sweep fitting many times gathered hundreds of gloo groups, three threads each. After the
    # launch's auto fits and the first fixed fit, fits add none.
    for rank in ranks:
        after_auto, after_fixed, after_same_fixed = rank["groups"]["per_fit"]
        assert after_same_fixed == after_fixed >= after_auto, rank["groups"]
