"""A single-file checkpoint that plain Lightning wrote in one process (``ModelCheckpoint`` mid-epoch, its
optimizer state keyed by position) resumes under ThreeDStrategy at layouts that split the model over ranks --
pipeline stages (each rank's optimizer holds part of the parameters), tensor shards, ZeRO -- and trains on as
one process resuming from that file does (plain Lightning starts that epoch's batches over: a plain
DataLoader has no position to restore). Before: every pp layout failed (unexpected keys in the state dict on
every stage; positions matched against a stage's part of the parameters)."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.harness import Case, LossRecorder, ReferenceDataModule, module_and_data
from helpers.harness.training import trainer_for
from helpers.workers.ckpt_worker import launch_jobs

pytestmark = pytest.mark.multiprocess

MODEL = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)

LAYOUTS = {
    "pp2_tp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2),
    "dp2_pp2": dict(data_parallel_size=2, pipeline_parallel_size=2),
    "dp2_tp2_zero1": dict(data_parallel_size=2, tensor_parallel_size=2, zero_stage=1),
    "dp4_zero3": dict(data_parallel_size=4, zero_stage=3),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_file")
    # One process, plain Lightning, the reference's first 3 steps; ModelCheckpoint writes one file at step 3.
    case = Case(name="save", model=MODEL, steps=3)
    module, data = module_and_data(case, case.global_batch_size, ReferenceDataModule)
    trainer = trainer_for(case, "auto", 1, LossRecorder())
    trainer.callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1))
    trainer.fit(module, data)
    saved = root / "epoch=0-step=3.ckpt"
    assert saved.is_file()
    jobs = [dict(name=name, layout=layout, model=MODEL, steps=6, resume=str(saved)) for name, layout in LAYOUTS.items()]
    results = launch_jobs(4, jobs, root / "runs")
    # The reference: the same file resumed in one process by plain Lightning (its own hyper-parameter types:
    # weights_only=False, as Lightning documents for a trusted file).
    case = Case(name="resume", model=MODEL, steps=6)
    module, data = module_and_data(case, case.global_batch_size, ReferenceDataModule)
    recorder = LossRecorder()
    trainer_for(case, "auto", 1, recorder).fit(module, data, ckpt_path=str(saved), weights_only=False)
    reference = {"losses": recorder.losses, "params": {k: v.detach().clone() for k, v in module.state_dict().items()}}
    return results, reference


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_one_process_checkpoint_file_resumes_and_trains_on_as_one_process(name, resumed):
    results, reference = resumed
    losses = results[name]["losses"]
    assert results[name]["global_step"] == 6 and len(losses) == len(reference["losses"]) == 3  # steps 4-6
    assert max(abs(a - b) for a, b in zip(reference["losses"], losses)) <= 1e-5, (reference["losses"], losses)
    for key, tensor in reference["params"].items():
        assert torch.allclose(results[name]["params"][key], tensor, atol=1e-5, rtol=0), key
