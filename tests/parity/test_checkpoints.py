"""Sharded checkpoints (lightning_3d.checkpoint): exact resume, resharding to other layouts, atomic writes,
export to one file, and clear errors for checkpoints that do not fit."""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from helpers import WORKERS
from helpers.harness import Case, reference_for
from helpers.hf_cases import AUTO_TP_MODELS, MOE_MODELS
from helpers.workers.ckpt_worker import launch_jobs
from lightning_3d.checkpoint import consolidate
from lightning_3d.checkpoint.safetensors_io import SafetensorsReader
from lightning_3d.models import GPT, GPTConfig

MODEL = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)
L222 = dict(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2)
HSDP = dict(data_parallel_size=4, data_parallel_shard_size=2, tensor_parallel_size=2, zero_stage=3)
CP8 = dict(data_parallel_size=2, context_parallel_size=2, tensor_parallel_size=2)  # (dp, cp, tp) = (2, 2, 2)
CP_PP8 = dict(data_parallel_size=2, context_parallel_size=2, pipeline_parallel_size=2)  # (dp, cp, pp) = (2, 2, 2)
TP2 = dict(tensor_parallel_size=2, policy="auto")
PHI3_GQA = dict(module="hf", model=AUTO_TP_MODELS["phi3_gqa"], steps=6)
MIXTRAL = dict(module="hf", model=MOE_MODELS["mixtral"], steps=6)


def _step3(directory: Path) -> str:
    return str(directory / "epoch=0-step=3.ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of 8 ranks at (dp, pp, tp) = (2, 2, 2) and the layouts it reshards to; then 2 ranks; then 1.
    The checkpoint is written with zero_stage=0; (4, 1, 2) reads it with ZeRO-2, (2, 1, 1) with ZeRO-3, HSDP
    (4 = 2 replicas x 2 shards, 1, 2) with ZeRO-3; and (2, 2, 2) reads one that HSDP wrote."""
    root = tmp_path_factory.mktemp("ckpt")
    dropout, plain, hsdp, cp, cp_pp = root / "dropout", root / "plain", root / "hsdp", root / "cp", root / "cp_pp"
    phi3_single, phi3_tp2, ep2 = root / "phi3_single", root / "phi3_tp2", root / "ep2"
    big = dict(MODEL, dropout=0.1)
    results = launch_jobs(8, [
        dict(name="dropout_through", layout=L222, model=big, steps=6, save_every=3, ckpt_dir=str(dropout)),
        dict(name="dropout_resumed", layout=L222, model=big, steps=6, resume=_step3(dropout)),
        dict(name="plain_through", layout=L222, model=MODEL, steps=6, save_every=3, ckpt_dir=str(plain)),
        dict(name="plain_again", layout=L222, model=MODEL, steps=6),
        dict(name="to_4_1_2", layout=dict(data_parallel_size=4, tensor_parallel_size=2, zero_stage=2), model=MODEL,
             steps=6, resume=_step3(plain)),
        dict(name="to_1_2_4", layout=dict(pipeline_parallel_size=2, tensor_parallel_size=4,
                                          pipeline_schedule="gpipe"), model=MODEL, steps=6, resume=_step3(plain)),
        # HSDP (2 replicas x 2 shards, tp 2) reads the plain checkpoint; a plain layout reads an HSDP one.
        dict(name="to_hsdp", layout=HSDP, model=MODEL, steps=6, resume=_step3(plain)),
        dict(name="hsdp_through", layout=HSDP, model=MODEL, steps=6, save_every=3, ckpt_dir=str(hsdp)),
        dict(name="hsdp_to_2_2_2", layout=L222, model=MODEL, steps=6, resume=_step3(hsdp)),
        # Context parallel: (dp, cp, tp) = (2, 2, 2) reads the plain checkpoint under ZeRO-3, and writes one
        # that one process reads.
        dict(name="to_cp", layout=dict(CP8, zero_stage=3), model=MODEL, steps=6, resume=_step3(plain)),
        dict(name="cp_through", layout=CP8, model=MODEL, steps=6, save_every=3, ckpt_dir=str(cp)),
        # ... and (dp, cp, pp) = (2, 2, 2), whose pipeline stages send each rank's part of the sequence
        dict(name="cp_pp_through", layout=CP_PP8, model=MODEL, steps=6, save_every=3, ckpt_dir=str(cp_pp)),
        # Expert parallelism: Mixtral's experts split over ep2 (of dp8) are saved under their single-device names,
        # expert e at index e, and read back at ep4 (of dp8) and, below, in one process.
        dict(MIXTRAL, name="ep2_through", layout=dict(data_parallel_size=8, expert_parallel_size=2), save_every=3,
             ckpt_dir=str(ep2)),
        dict(MIXTRAL, name="ep2_to_ep4", layout=dict(data_parallel_size=8, expert_parallel_size=4, zero_stage=3),
             resume=_step3(ep2)),
    ], root / "eight")
    results.update(launch_jobs(1, [
        dict(name="to_1_1_1", layout={}, model=MODEL, steps=6, resume=_step3(plain)),
        dict(PHI3_GQA, name="phi3_gqa_single", layout={}, save_every=3, ckpt_dir=str(phi3_single)),
        dict(name="cp_to_1_1_1", layout={}, model=MODEL, steps=6, resume=_step3(cp)),
        dict(name="cp_pp_to_1_1_1", layout={}, model=MODEL, steps=6, resume=_step3(cp_pp)),
        dict(MIXTRAL, name="ep2_to_ep1", layout={}, resume=_step3(ep2)),
    ], root / "one"))
    results.update(launch_jobs(2, [
        dict(name="to_2_1_1", layout=dict(data_parallel_size=2, zero_stage=3), model=MODEL, steps=6,
             resume=_step3(plain)),
        # A fused q|k|v of unequal parts is stored in rank order at tp=2; its checkpoint (the optimizer's
        # moments too) is in single-device order both ways.
        dict(PHI3_GQA, name="phi3_gqa_tp2", layout=TP2, save_every=3, ckpt_dir=str(phi3_tp2)),
        dict(PHI3_GQA, name="phi3_gqa_tp2_to_dp2", layout=dict(data_parallel_size=2), resume=_step3(phi3_tp2)),
        dict(PHI3_GQA, name="phi3_gqa_single_to_tp2", layout=TP2, resume=_step3(phi3_single)),
        dict(name="other_model", layout=dict(data_parallel_size=2), model=dict(MODEL, n_embd=48), steps=6,
             resume=_step3(plain), expect_error=True),
        dict(name="missing", layout=dict(data_parallel_size=2), model=MODEL, steps=6,
             resume=str(root / "nowhere.ckpt"), expect_error=True),
    ], root / "two"))
    return root, results


@pytest.mark.multiprocess
def test_resume_on_the_same_layout_continues_exactly_as_if_never_stopped(runs):
    _, results = runs
    through, resumed = results["dropout_through"]["losses"], results["dropout_resumed"]["losses"]
    assert len(resumed) == 3  # steps 4, 5, 6: it started at step 3, mid-epoch, with dropout on tp shards
    assert max(abs(a - b) for a, b in zip(through[3:], resumed)) <= 1e-6, (through, resumed)
    for name, tensor in results["dropout_through"]["params"].items():
        assert torch.allclose(tensor, results["dropout_resumed"]["params"][name], atol=1e-6, rtol=0), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["cp_through", "cp_pp_through"])
def test_dp2_cp2_tp2_and_dp2_cp2_pp2_train_as_one_process(runs, run):
    _, results = runs
    reference = reference_for(Case(name="reference", model=MODEL, steps=6))
    assert max(abs(a - b) for a, b in zip(reference.losses, results[run]["losses"])) <= 1e-5
    for name, tensor in reference.params.items():
        assert torch.allclose(results[run]["params"][name], tensor, atol=1e-5, rtol=0), name


@pytest.mark.multiprocess
def test_the_same_seed_and_layout_give_bit_identical_losses(runs):
    _, results = runs
    assert results["plain_again"]["losses"] == results["plain_through"]["losses"]  # exactly, at (2, 2, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["to_1_1_1", "to_2_1_1", "to_4_1_2", "to_1_2_4", "to_hsdp", "hsdp_to_2_2_2",
                                    "to_cp", "cp_to_1_1_1", "cp_pp_to_1_1_1"])
def test_a_checkpoint_of_2_2_2_reshards_to_another_layout_and_trains_on_as_one_process(runs, target):
    _, results = runs
    _assert_resumed_as(reference_for(Case(name="reference", model=MODEL, steps=6)), results[target])


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["phi3_gqa_tp2_to_dp2", "phi3_gqa_single_to_tp2"])
def test_a_fused_projection_of_unequal_parts_reshards_both_ways(runs, target):
    _, results = runs
    reference = reference_for(Case(name="reference_phi3_gqa", **PHI3_GQA))
    assert max(abs(a - b) for a, b in zip(reference.losses, results["phi3_gqa_tp2"]["losses"])) <= 1e-5
    _assert_resumed_as(reference, results[target])


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["ep2_to_ep4", "ep2_to_ep1"])
def test_an_expert_parallel_checkpoint_reshards_to_other_ep_sizes(runs, target):
    _, results = runs
    reference = reference_for(Case(name="reference_mixtral", **MIXTRAL))
    assert max(abs(a - b) for a, b in zip(reference.losses, results["ep2_through"]["losses"])) <= 1e-5
    _assert_resumed_as(reference, results[target])


def _assert_resumed_as(reference, resumed: dict) -> None:
    """A run resumed at step 3 of 6 trained steps 4 to 6 as one process did, to the same parameters."""
    losses = resumed["losses"]
    assert resumed["global_step"] == 6 and len(losses) == 3
    assert max(abs(a - b) for a, b in zip(reference.losses[3:], losses)) <= 1e-5, (reference.losses, losses)
    for name, tensor in reference.params.items():
        assert torch.allclose(resumed["params"][name], tensor, atol=1e-5, rtol=0), name


@pytest.mark.multiprocess
def test_a_checkpoint_that_does_not_fit_fails_naming_the_key_and_both_shapes(runs):
    _, results = runs
    error = results["other_model"]["error"]
    assert error.startswith("CheckpointError: model.") and "(64, 32) in the checkpoint" in error, error
    assert "(64, 48) in the model" in error and "(dp, pp, tp) = (2, 2, 2)" in error, error
    assert results["missing"]["error"].startswith("FileNotFoundError: No checkpoint at"), results["missing"]


@pytest.mark.multiprocess
def test_replicated_tensors_are_written_once(runs):
    root, _ = runs
    checkpoint = _step3(root / "plain")
    metadata = FileSystemReader(checkpoint).read_metadata()
    files = sum(os.path.getsize(f) for f in glob.glob(f"{checkpoint}/*.distcp"))
    assert files == sum(info.length for info in metadata.storage_data.values())  # nothing unreferenced
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    raw = sum(v.size.numel() * v.properties.dtype.itemsize for v in tensors.values())
    chunks = [info.length for index, info in metadata.storage_data.items() if index.fqn in tensors]
    # Each tp shard of each tensor once, though dp=2 holds two replicas of it, plus DCP's framing per shard.
    assert raw <= sum(chunks) <= raw + 1600 * len(chunks), (raw, sum(chunks), len(chunks))


@pytest.mark.multiprocess
def test_convert_writes_one_file_that_loads_strictly_into_the_single_device_model(runs, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    root, _ = runs
    checkpoint = _step3(root / "plain")
    layout = consolidate(checkpoint, tmp_path / "gpt.safetensors", strip_prefix="model.")
    consolidate(checkpoint, tmp_path / "gpt.pt", strip_prefix="model.")
    from_package = safetensors_torch.load_file(str(tmp_path / "gpt.safetensors"))
    from_torch = torch.load(tmp_path / "gpt.pt")
    ours = SafetensorsReader(tmp_path / "gpt.safetensors")
    assert sorted(from_package) == sorted(from_torch) == sorted(ours.keys()) == sorted(layout)
    model = GPT(GPTConfig(**MODEL))
    model.load_state_dict(from_package, strict=True)
    after_3 = reference_for(Case(name="reference", model=MODEL, steps=3)).params
    for name, tensor in from_package.items():
        assert torch.equal(tensor, from_torch[name]) and torch.equal(tensor, ours.read(name)), name
        assert torch.allclose(tensor, after_3[f"model.{name}"], atol=1e-5, rtol=0), name
    cli = subprocess.run([sys.executable, "-m", "lightning_3d", "convert", checkpoint, str(tmp_path / "cli.safetensors")],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and f"wrote {len(layout) } tensors" in cli.stdout, cli.stderr[-2000:]


@pytest.mark.multiprocess
def test_a_job_killed_mid_save_leaves_the_previous_checkpoint_whole_and_last_resumes_from_it(tmp_path):
    directory = tmp_path / "checkpoints"
    job = dict(layout=dict(data_parallel_size=2), model=MODEL, steps=6, save_every=2, ckpt_dir=str(directory))
    # Saves: 1 = step=2, 2 = last (step 2), 3 = step=4, 4 = last (step 4): rank 1 dies in the 4th, shards written.
    launch_jobs(2, [dict(job, name="killed", kill_rank_during_save=1, kill_at_save=4)], tmp_path / "killed",
            expect_failure=True)
    assert (directory / ".last.ckpt.partial").is_dir()  # the unfinished save, never loaded
    assert torch.load(directory / "last.ckpt" / "lightning_3d.meta.pt", weights_only=False)["global_step"] == 2
    resumed = launch_jobs(2, [dict(job, name="resumed", resume="last")], tmp_path / "resumed")["resumed"]
    reference = reference_for(Case(name="reference", model=MODEL, steps=6))
    assert resumed["global_step"] == 6 and len(resumed["losses"]) == 4  # steps 3..6, from the step-2 checkpoint
    assert max(abs(a - b) for a, b in zip(reference.losses[2:], resumed["losses"])) <= 1e-5
