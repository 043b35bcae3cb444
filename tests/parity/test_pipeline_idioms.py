"""A LightningModule written the ordinary Lightning way (helpers/idioms.py: torchmetrics, reduce_fx, on_epoch,
sync_dist, a dict with extra keys, attribute access on the model, MLM-style masking, a step-interval LR
scheduler, ModelCheckpoint / EarlyStopping / LearningRateMonitor, clipping, accumulation and validation
inside an accumulation window, a last validation batch of another size) ends with one process's
``trainer.callback_metrics`` at pp=2 and dp2 x pp2; steps the pipeline cannot run fail at step 1, on every
rank, naming the pattern. One launch per world size."""

import json

import pytest

from helpers import WORKERS
from helpers.idioms import run_conformance
from helpers.launchers import forkrun

pytestmark = pytest.mark.multiprocess

LAUNCHES = {2: ["conformance_pp2", "model_called_twice", "collective_in_step"], 4: ["conformance_dp2_pp2"]}
MASK_RATE = {"conformance_pp2": 0.15, "conformance_dp2_pp2": 0.0}  # a dp run draws other masks (as DDP does)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("idioms")
    for nprocs, names in LAUNCHES.items():
        forkrun(nprocs, str(WORKERS / "idioms_worker.py"), str(out), *names, timeout=400)
    return {name: json.loads((out / f"{name}.json").read_text()) for names in LAUNCHES.values() for name in names}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = tmp_path_factory.mktemp("idioms_reference")
    return {rate: run_conformance("auto", 1, 1, out / str(rate), rate) for rate in set(MASK_RATE.values())}


def _close(a: float, b: float, rel: float = 1e-4) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(b))


@pytest.mark.parametrize("name", list(MASK_RATE))
def test_callback_metrics_match_one_process(name, results, references):
    ours, reference = results[name], references[MASK_RATE[name]]
    expected = dict(reference["metrics"])
    if name == "conformance_dp2_pp2":
        # A Metric's step value is the rank's own batch under data parallelism, in DDP too (its epoch value is
        # synced): not one process's.
        expected.pop("train_acc_step")
        ours["metrics"].pop("train_acc_step")
    assert ours["metrics"].keys() == expected.keys()
    differ = {k: (ours["metrics"][k], v) for k, v in expected.items() if not _close(ours["metrics"][k], v)}
    assert not differ, differ
    # What on_train_batch_end got of the step's dict, the learning rate per batch, the checkpoint's best score.
    assert ours["correct"] == reference["correct"] and ours["preds_sum"] == reference["preds_sum"]
    assert ours["lr"] == reference["lr"]
    assert _close(ours["best_val_loss"], reference["best_val_loss"])
    assert ours["global_step"] == reference["global_step"] == 4


def test_last_smaller_validation_batch_gives_one_process_val_loss(results, references):
    # 22 samples in batches of 8: 8, 8, 6 at pp=2 (2 micro-batches); 8 and 3 per rank at dp=2 (3: one micro-batch).
    for name, rate in MASK_RATE.items():
        for key in ("val_loss", "val_acc"):
            assert _close(results[name]["metrics"][key], references[rate]["metrics"][key], rel=1e-5), (name, key)


@pytest.mark.parametrize("name, says", [
    ("model_called_twice", "called self.model(...) 2 times in one step"),
    ("collective_in_step", "runs a collective (allgather_) over ranks [0, 1], which include other stages"),
])
def test_unsupported_step_fails_at_the_first_step(name, says, results):
    error = results[name]["error"]
    assert error is not None and error.startswith("StepPatternError") and says in error, error
    assert "pipeline_parallel_size=1" in error  # what to do
    assert results[name]["global_step"] == 0 and results[name]["batch"] == 1
