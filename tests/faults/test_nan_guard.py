"""NaNGuard on real ranks (helpers/workers/nan_worker.py): a NaN gradient names the rank it came from and every
rank raises, skips the same step, or rolls back to the newest checkpoint at a lower learning rate -- at dp=2
and under ZeRO, tp and a pipeline."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun
from helpers.workers.nan_worker import parse_layout


def _nan_run(tmp_path, action):
    forkrun(2, str(WORKERS / "nan_worker.py"), str(tmp_path), action, rank_files=tmp_path)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.multiprocess
def test_nan_guard_names_the_rank_of_origin_and_every_rank_raises(tmp_path):
    for result in _nan_run(tmp_path, "raise"):
        # Raised at the next step (3), which reads step 2's flag: no step waits for its own check.
        assert result["error"] is not None and result["steps"] == 3
        assert "NaN/Inf gradient at step 2 on rank 1 (dp=1, pp=0, tp=0): first at model." in result["error"]
        assert "first non-finite activation in model.blocks.1" in result["error"]  # where it was born
        assert "rank 0" not in result["error"]  # its gradients only became NaN in the all-reduce


@pytest.mark.multiprocess
def test_nan_guard_skips_the_same_step_on_every_rank_and_training_goes_on(tmp_path):
    results = _nan_run(tmp_path, "skip")
    for result in results:
        assert result["error"] is None and result["skipped"] == [2] and result["steps"] == 5
        assert result["finite"] and result["warnings"] == []  # every gradient was seen before the all-reduce
    assert results[0]["checksum"] == results[1]["checksum"]  # the replicas did not drift apart


@pytest.mark.multiprocess
def test_nan_guard_rolls_back_to_the_newest_checkpoint_with_a_lower_learning_rate(tmp_path):
    import torch

    from lightning_3d.checkpoint import consolidate

    results = _nan_run(tmp_path, "rollback")
    checkpoint = str(tmp_path / "checkpoints" / "epoch=0-step=2.ckpt")
    consolidate(checkpoint, tmp_path / "step2.pt")
    at_step_2 = float(sum(t.double().sum() for t in torch.load(tmp_path / "step2.pt").values()))
    for result in results:
        assert result["error"] is None and result["skipped"] == [] and result["steps"] == 5
        assert result["rollbacks"] == [[3, checkpoint]]
        assert result["after_checksum"] == pytest.approx(at_step_2, abs=1e-9)  # the weights of step 2 again
        assert result["after_lr"] == pytest.approx(0.5 * result["base_lr"])
        assert result["finite"]
    assert results[0]["checksum"] == results[1]["checksum"]


def _layouts_run(tmp_path, layouts: list[str]) -> list[dict]:
    """nan_worker.py's fits, one per "dp,pp,tp,zero_stage[,dp_shard][,bf16]" layout (same world size), in one
    launch."""
    dp, pp, tp, *_ = parse_layout(layouts[0])
    forkrun(dp * pp * tp, str(WORKERS / "nan_worker.py"), str(tmp_path), "layouts", *layouts,
            rank_files=tmp_path)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(dp * pp * tp)]


def _assert_skipped_then_rolled_back(tmp_path, results: list[dict], layout: str) -> None:
    """nan_worker.py's layout fit: replica 1's NaN at step 1 (no checkpoint yet) is skipped, the one at step 3
    rolls back to step 2's checkpoint; the reports name replica 1's ranks only, each with a parameter it holds."""
    import re

    from lightning_3d import ParallelDims

    dp, pp, tp, _, *shard = parse_layout(layout)
    dims = ParallelDims(dp=dp, pp=pp, tp=tp, dp_shard=shard[0] if shard else 0)
    checkpoint = str(tmp_path / layout / "checkpoints" / "epoch=0-step=2.ckpt")
    for rank, result in enumerate(r[layout] for r in results):
        weights = result["at_start"]  # this rank's shards, at the start of each step
        assert result["error"] is None and result["steps"] == 5, result
        assert result["warnings"] == []  # every gradient was seen before the dp reduction
        assert result["skipped"] == [1] and weights["1"] == weights["2"]  # the NaN step changed nothing
        assert result["rollbacks"] == [[3, checkpoint]]
        assert weights["3"] != weights["2"] and result["after_checksum"] == weights["2"]  # step 2's weights again
        assert result["after_lr"] == pytest.approx(0.5 * result["base_lr"])
        assert result["finite"], f"rank {rank} has non-finite parameters at the end"
    printed = results[0][layout]["printed"]
    assert [line.split(":")[0] for line in printed] == [
        "NaNGuard skipped step 1 (no checkpoint to roll back to yet)", f"NaNGuard rolled back to {checkpoint} at step 3 (learning rates x 0.5)"]
    replica_1 = {rank for rank in range(dims.world_size) if dims.coords(rank).dp == 1}
    for line in printed:
        named = {int(r): ((int(d), int(p), int(t)), (h and (int(h), int(s))), param)
                 for r, d, h, s, p, t, param in re.findall(
                     r"rank (\d+) \(dp=(\d+)(?: \(replica (\d+), shard (\d+)\))?, pp=(\d+), tp=(\d+)\): first at ([\w.]+)",
                     line)}
        assert named.keys() == replica_1, line  # replica 0's gradients only turned NaN in the dp reduction
        for rank, (coords, hsdp, param) in named.items():
            c = dims.coords(rank)
            assert coords == (c.dp, c.pp, c.tp), line
            assert hsdp == (dims.replica_and_shard(rank) if dims.hsdp else ""), line  # HSDP: named in full
            assert param in results[rank][layout]["names"], (rank, param)
        assert line.count("first non-finite activation in model.blocks.1") == tp  # born in the last stage's block


@pytest.mark.multiprocess
def test_nan_guard_skips_and_rolls_back_under_zero_1_with_tp_and_zero_3_with_a_pipeline(tmp_path):
    # dp,pp,tp,zero_stage: fully_shard on (dp, tp); fully_shard per stage; the same under bf16-mixed, where
    # FSDP2 moves each micro-batch's gradient into an fp32 sum of its own until the stage reduces it
    layouts = ["2,1,2,1", "2,2,1,3", "2,2,1,3,bf16"]
    results = _layouts_run(tmp_path, layouts)
    for layout in layouts:
        _assert_skipped_then_rolled_back(tmp_path, results, layout)


@pytest.mark.multiprocess
def test_nan_guard_skips_and_rolls_back_at_dp2_pp2_tp2(tmp_path):
    results = _layouts_run(tmp_path, ["2,2,2,0"])  # FSDP2's replicate over dp, per stage, on DTensors
    _assert_skipped_then_rolled_back(tmp_path, results, "2,2,2,0")


@pytest.mark.multiprocess
def test_nan_guard_names_the_replica_and_the_shard_under_hsdp(tmp_path):
    layout = "4,1,1,2,2"  # dp 4 = 2 replicas x 2 shards, ZeRO-2: the NaN on dp rank 1 is replica 0's shard 1
    _assert_skipped_then_rolled_back(tmp_path, _layouts_run(tmp_path, [layout]), layout)
